"""What a replay covered: the idle windows it was expected to observe and did, and the requests the engines ignored. Runs in: frontend process.

A verdict must say what it covered. Before a run, every gap between two arrivals of
the shaped trace at least idle_threshold_s long (and the tail) is a candidate; the
forecast of these engines (the virtual clock: the same EngineCore, the mock runner and its
step cost, calibrated for this machine with --calibration, no lag by construction)
says which candidates become idle windows:
those where its requests have all ended at least idle_threshold_s before the next
arrival. Those are the EXPECTED windows. After the run each candidate is
- "observed": the run saw an idle window there;
- "busy": the forecast itself is busy through the gap (the trace's own work fills it),
  so it was never a window to check;
- "missed": expected, but the run's requests were still in flight (the run lagged
  the forecast by `lag_s`: the client, when its sends were late by half of it or more,
  else the engines), so the drain was never tested there. A missed window makes the
  run inconclusive, never verified.
- "unreached": expected, but the replay stopped (interrupted) before the gap ended:
  also inconclusive, and said so rather than blamed on lag.
A gap the run missed as a whole may still hold an engine's own idle window, judged there
(windows.py: a P idle while D still decodes): the gap names the engines judged in it
(judged_on), and is observed when every engine was.
Under the virtual clock the run is the forecast, so every expected window is observed.

Ignored requests: the scheduler finishes a request it can never run at once
(FINISHED_IGNORED, reported as finish reason "length" with no tokens and the cause in
its error, as vLLM does; over HTTP, replay/target/client.py records the cause kvdrain's
front sends, else "ignored by the server"); a share of them above max_ignored_share
makes the run inconclusive (the trace was not replayed as written) unless allowed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from replay.verify import windows
from replay.verify.timeline import RequestRecord, Timeline
from replay.verify.windows import EngineWindow

# "unobservable": the run saw no engine's KV usage at all (no --metrics over HTTP), so no
# window was observed, whatever the requests' gaps were (the reason is the run's: outcome).
COVERAGE_STATES = ("observed", "busy", "missed", "unreached", "unobservable")
IGNORED_CAUSES = {  # a substring of the scheduler's reason -> the cause's name
    "max_model_len": "prompt longer than max_model_len",
    "KV blocks; the pool has": "can never fit the KV pool",
    "ignored by the server": "ignored by the server",  # HTTP: "length", no token, no cause
}


@dataclass(frozen=True, slots=True)
class ExpectedWindow:
    """One candidate gap of the shaped trace and what the forecast says of it."""

    start: float  # the arrival before the gap (replay seconds)
    end: float  # the next arrival; math.inf for the tail
    is_tail: bool
    forecast_quiet_from: float | None  # when the forecast's requests sent before `end` ended
    is_expected: bool  # the forecast has an idle window here (True without a forecast)


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowCoverage:
    """One candidate after the run."""

    start: float
    end: float | None  # None for the tail
    is_tail: bool
    state: str  # one of COVERAGE_STATES
    quiet_from: float | None  # when the run's requests sent before `end` had ended; None: never
    lag_s: float | None  # quiet_from - the forecast's quiet_from (None: no forecast)
    engine: str = ""  # "": a gap of the whole trace; else that engine's own window (windows.py)
    # The client's part of it: the latest send among the requests still in flight when the
    # forecast was quiet (None: none were, or no forecast). Late sends are the client's lag.
    send_lateness_s: float | None = None
    judged_on: tuple[
        str, ...
    ] = ()  # a missed gap: the engines judged in their own window inside it


def candidate_gaps(arrivals: Sequence[float], idle_threshold_s: float) -> list[tuple[float, float]]:
    """(previous arrival, next arrival) of every gap at least idle_threshold_s long."""
    ordered = sorted(arrivals)
    return [(a, b) for a, b in zip(ordered, ordered[1:]) if b - a >= idle_threshold_s]


def quiet_from(requests: Sequence[RequestRecord], ends: Sequence[float]) -> list[float]:
    """For each time in `ends`: when every request that arrived before it had ended (inf: never)."""
    if not ends:
        return []
    ordered = sorted(requests, key=lambda r: r.arrival_t)
    arrivals = [r.arrival_t for r in ordered]
    running, prefix = -math.inf, []
    for r in ordered:
        running = max(running, math.inf if r.end_t is None else r.end_t)
        prefix.append(running)
    out = []
    for end in ends:
        i = bisect.bisect_left(arrivals, end)
        out.append(prefix[i - 1] if i > 0 else -math.inf)
    return out


def expected_windows(
    arrivals: Sequence[float], idle_threshold_s: float, forecast: Timeline | None
) -> tuple[ExpectedWindow, ...]:
    """The candidates and which of them the forecast (a virtual-clock timeline, or None)
    makes windows."""
    gaps = candidate_gaps(arrivals, idle_threshold_s)
    out = []
    if forecast is None:
        out = [ExpectedWindow(a, b, False, None, True) for a, b in gaps]
    else:
        quiet = quiet_from(forecast.requests, [b for _, b in gaps])
        out = [
            ExpectedWindow(a, b, False, q, b - q >= idle_threshold_s)
            for (a, b), q in zip(gaps, quiet)
        ]
    if arrivals:
        last = max(arrivals)
        tail_quiet = None if forecast is None else quiet_from(forecast.requests, [math.inf])[0]
        out.append(
            ExpectedWindow(
                last, math.inf, True, tail_quiet, forecast is None or tail_quiet < forecast.end_t
            )
        )
    return tuple(out)


def cover(
    expected: Sequence[ExpectedWindow],
    timeline: Timeline,
    observed: Sequence[tuple[float, float, bool]],
) -> tuple[WindowCoverage, ...]:
    """Each candidate's state after the run, from the run's own (start, end, is_tail) windows."""
    ends = {round(end, 9) for _, end, is_tail in observed if not is_tail}
    has_tail = any(is_tail for _, _, is_tail in observed)
    quiet = quiet_from(timeline.requests, [w.end for w in expected])
    last_sent = max(timeline.arrivals, default=-math.inf)
    lateness = client_latenesses(expected, timeline.requests, quiet)
    out = []
    for w, q, late in zip(expected, quiet, lateness):
        seen = has_tail if w.is_tail else round(w.end, 9) in ends
        state = "observed" if seen else "missed" if w.is_expected else "busy"
        if state == "observed" and not timeline.samples:
            state = "unobservable"
        if w.is_expected and _unreached(w, timeline, last_sent):
            state = "unreached"
        q_or_none = None if math.isinf(q) else q
        lag = (
            None
            if w.forecast_quiet_from is None or q_or_none is None
            else q - w.forecast_quiet_from
        )
        out.append(
            WindowCoverage(
                start=w.start,
                end=None if w.is_tail else w.end,
                is_tail=w.is_tail,
                state=state,
                quiet_from=q_or_none,
                lag_s=lag,
                send_lateness_s=late,
            )
        )
    return tuple(out)


def cover_engine_windows(
    expected: Sequence[EngineWindow], run: Sequence[EngineWindow], timeline: Timeline
) -> tuple[WindowCoverage, ...]:
    """Each engine window the forecast expected, after the run: observed, missed or unreached."""
    out = []
    for w in expected:
        state = (
            "observed"
            if windows.observed(w, run)
            else "unreached"
            if w.start >= timeline.end_t
            else "missed"
        )
        out.append(
            WindowCoverage(
                start=w.start,
                end=None if w.is_tail else w.end,
                is_tail=w.is_tail,
                state=state,
                quiet_from=None,
                lag_s=None,
                engine=w.engine,
            )
        )
    return tuple(out)


def credit_engine_windows(
    coverage: Sequence[WindowCoverage],
    judged: Sequence[tuple[str, tuple[float, float, bool]]],
    engines: Sequence[str],
) -> tuple[WindowCoverage, ...]:
    """Each missed gap of the whole trace with the engines judged in a window of their own
    inside it (judged: (engine, window) of every window the verdict judged); observed when
    that is every engine."""
    out = []
    for c in coverage:
        if c.state == "missed" and not c.engine:
            end = math.inf if c.end is None else c.end
            on = tuple(sorted({e for e, (s, e_end, _) in judged if s < end and c.start < e_end}))
            if on:
                c = replace(
                    c, judged_on=on, state="observed" if set(engines) <= set(on) else "missed"
                )
        out.append(c)
    return tuple(out)


def client_lateness(w: ExpectedWindow, requests: Sequence[RequestRecord]) -> float | None:
    """How late the client sent the requests that kept the run busy past the forecast's quiet
    (the definition; client_latenesses answers it for every window at once)."""
    if w.forecast_quiet_from is None:
        return None
    late = [
        r.send_lateness_s
        for r in requests
        if r.arrival_t < w.end and (r.end_t is None or r.end_t > w.forecast_quiet_from)
    ]
    return max(late, default=None)


def client_latenesses(
    expected: Sequence[ExpectedWindow],
    requests: Sequence[RequestRecord],
    busy_until: Sequence[float] | None = None,
) -> list[float | None]:
    """client_lateness of each window, in O((windows + requests) log requests): the windows
    by end, the requests that arrived before it added to a max-tree over end times. A window
    whose earlier requests had all ended by the forecast's quiet (busy_until: quiet_from of the
    windows' ends, if the caller has it) has none: None, without the tree (every window of a
    run that is its own forecast)."""
    out: list[float | None] = [None] * len(expected)
    if busy_until is None:
        busy_until = quiet_from(requests, [w.end for w in expected])
    order = sorted(
        (
            i
            for i, w in enumerate(expected)
            if w.forecast_quiet_from is not None and busy_until[i] > w.forecast_quiet_from
        ),
        key=lambda i: expected[i].end,
    )
    if not order:
        return out
    ends = sorted({math.inf if r.end_t is None else r.end_t for r in requests})
    tree: list[float | None] = [None] * (len(ends) + 1)  # prefix max over ends, latest first
    by_arrival = sorted(requests, key=lambda r: r.arrival_t)
    added = 0
    for i in order:
        w = expected[i]
        while added < len(by_arrival) and by_arrival[added].arrival_t < w.end:
            r = by_arrival[added]
            added += 1
            j = len(ends) - bisect.bisect_left(ends, math.inf if r.end_t is None else r.end_t)
            while j <= len(ends):  # rank j counts from the latest end (1)
                if tree[j] is None or tree[j] < r.send_lateness_s:
                    tree[j] = r.send_lateness_s
                j += j & -j
        j, late = len(ends) - bisect.bisect_right(ends, w.forecast_quiet_from), None
        while j > 0:  # the ends after the forecast's quiet: ranks 1..j
            if tree[j] is not None and (late is None or tree[j] > late):
                late = tree[j]
            j -= j & -j
        out[i] = late
    return out


def _unreached(w: ExpectedWindow, timeline: Timeline, last_sent: float) -> bool:
    """The replay stopped (interrupted) before this window could happen. Times compare at
    the nanosecond, as the model's windows come off the virtual clock's integer clock."""
    if w.is_tail:
        return round(w.start, 9) > round(last_sent, 9)
    return round(w.end, 9) > round(timeline.end_t, 9)


def missed_reason(w: WindowCoverage, idle_threshold_s: float) -> str:
    """One line: which expected window was not observed, and why."""
    where = "the tail" if w.is_tail else f"the idle gap {w.start:.3f}-{w.end:.3f} s"
    if w.engine:
        where = f"{w.engine}'s own idle window from {w.start:.3f} s" + (
            " (its tail)" if w.is_tail else f" to {w.end:.3f} s"
        )
        if w.state == "missed":
            return (
                f"expected window not observed: {where}: the engine was not idle there in this run"
            )
    if w.state == "unreached":
        return f"expected window not reached: {where}: the replay stopped before it ended"
    if w.quiet_from is None:
        busy = "requests still in flight when the replay stopped"
    else:
        busy = f"requests in flight until {w.quiet_from:.3f} s"
        if not w.is_tail:
            busy += (
                f", leaving {max(w.end - w.quiet_from, 0):.3f} s < the idle threshold "
                f"{idle_threshold_s:g} s"
            )
    on = ""
    if w.judged_on:
        on = (
            f" on every engine: observed on {', '.join(w.judged_on)} alone (in its own idle window "
            f"inside it, judged there), not on the others"
        )
    return f"expected window not observed{on}: {where}: {busy}{_who_lagged(w)}"


def _who_lagged(w: WindowCoverage) -> str:
    """The client when its late sends account for half the lag or more, else the engines."""
    if w.lag_s is None or w.lag_s <= 0:
        return ""
    late = w.send_lateness_s or 0.0
    if late >= w.lag_s / 2:
        return (
            f"; the client lagged: it sent requests up to {late:.3f} s late (the run lagged "
            f"the forecast by {w.lag_s:.3f} s): a busy or slow client, not the engines"
        )
    return f"; the engines lagged the forecast by {w.lag_s:.3f} s" + (
        f" (the client sent up to {late:.3f} s late)" if late >= 0.001 else ""
    )


def ignored_cause(record: RequestRecord) -> str | None:
    """Why the engines ignored this request, or None if they did not."""
    if record.finish_reason not in ("ignored", "length") or record.num_output_tokens:
        return None
    if record.error is None:
        return None
    for needle, cause in IGNORED_CAUSES.items():
        if needle in record.error:
            return cause
    return "other"


def ignored_by_cause(requests: Sequence[RequestRecord]) -> dict[str, int]:
    """Counts of ignored requests by cause, largest first."""
    counts: dict[str, int] = {}
    for record in requests:
        cause = ignored_cause(record)
        if cause is not None:
            counts[cause] = counts.get(cause, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
