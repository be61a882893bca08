"""Idle windows: the whole trace's, and each engine's own (no request in flight on it, whatever the others do). Runs in: frontend process.

A window of the whole trace: nothing in flight from the client's view and the next arrival
at least the idle threshold away (or the tail, after the last request ended). An engine is
judged in its own windows where each request's way is known (a local router's), else in
the trace's (a serve's or an HTTP server's routing is its own). Over HTTP an engine's own
windows come from its metrics (scraped_idle_windows), cut by the requests that may be on
it: where kvdrain's proxy named each request's way (its X-Kvdrain-Route header, in
RequestRecord.stages), only the requests it sent to that engine's upstream; behind any
other server, every request of the engine's role (which engine had it is unknown).

The delayed-free leak is per engine: under a prefix-aware router a prefill engine whose
prefixes stop arriving idles while the rest of the system is busy, and no idle gap of the
whole trace shows it. A request is in flight on an engine from when the router gave it
there (RequestRecord.stages) until its KV left it: for a prefill engine, when the decode
engine's first token came (D has read the blocks by then) or the request ended; for the
last engine of its way, when it ended. An engine's idle window is a stretch of at least the
idle threshold between two of its requests (or after its last: its tail).

Coverage: coverage.py says which of the trace's gaps the run was expected to observe; the
engine windows that hold none of those gaps (an engine idle while others are busy) are
expected from the forecast of the run (the virtual clock) too, and the run observes one when
it has an idle window on that engine overlapping it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from replay.verify.timeline import RequestRecord, Timeline, engine_role

Window = tuple[float, float, bool]  # (start, end, is_tail), as idle_windows gives them
EPS_S = 1e-9
QUEUE_GAUGES = "queue_gauges"  # Timeline.meta: the scraped engines whose /metrics count requests
QUEUE_GAUGE = "vllm:num_requests_running"  # (with vllm:num_requests_waiting)


@dataclass(frozen=True, slots=True)
class EngineWindow:
    """One engine's idle window that no window of the whole trace holds."""

    engine: str
    start: float
    end: float
    is_tail: bool

    @property
    def window(self) -> Window:
        return self.start, self.end, self.is_tail


def idle_windows(timeline: Timeline, idle_threshold_s: float) -> list[tuple[float, float, bool]]:
    """(start, end, is_tail) of every client-side idle window, in time order."""
    requests = sorted(timeline.requests, key=lambda r: r.arrival_t)
    windows, quiet_from = [], float("-inf")
    for i, record in enumerate(requests):
        quiet_from = max(quiet_from, float("inf") if record.end_t is None else record.end_t)
        next_arrival = requests[i + 1].arrival_t if i + 1 < len(requests) else None
        if next_arrival is None:
            if quiet_from < timeline.end_t:
                windows.append((quiet_from, timeline.end_t, True))
        elif next_arrival - quiet_from >= idle_threshold_s:
            windows.append((quiet_from, next_arrival, False))
    return windows


def observable_engines(timeline: Timeline) -> set[str]:
    """The engines whose own idle windows the run can show: all of kvdrain's own; over HTTP,
    those whose metrics carry the queue gauges (an engine not scraped shows none)."""
    return (
        set(timeline.meta.get(QUEUE_GAUGES) or ())
        if timeline.is_scraped()
        else set(timeline.engines)
    )


def expected_engine_windows(
    forecast: Timeline | None, idle_threshold_s: float
) -> list[EngineWindow] | None:
    """The engines' own windows the forecast (a virtual-clock timeline) finds; None: no
    forecast."""
    if forecast is None:
        return None
    return engine_only_windows(forecast, idle_threshold_s, idle_windows(forecast, idle_threshold_s))


def intervals(record: RequestRecord) -> list[tuple[str, float, float]]:
    """(engine, since, until) of each stage of the request's way; until is inf if it never left."""
    stages = record.stages
    if not stages:
        return []
    end = math.inf if record.end_t is None else record.end_t
    out = []
    if len(stages) > 1:  # every stage but the last: until the KV left it
        kv_left = end if record.first_token_t is None else min(record.first_token_t, end)
        out = [(engine, since, max(kv_left, since)) for engine, since in stages[:-1]]
    engine, since = stages[-1]
    out.append((engine, since, end))
    return out


def scraped_idle_windows(timeline: Timeline, idle_threshold_s: float) -> dict[str, list[Window]]:
    """Over HTTP, each engine's idle windows from its own metrics: runs of readings with no
    request running or waiting there, from the first such reading's answer to the last's
    (the engine was idle in between for sure; nothing is claimed beyond), less the time the
    client had a request that may be on it and the time before the first send, at least the
    idle threshold long. The requests that may be on it: those routed to its upstream
    (routed_spans) when the proxy named that upstream in the ways, else every request of its
    role (client_spans: a source named otherwise, or no proxy that says). Only engines whose
    /metrics carry the queue gauges (meta QUEUE_GAUGES)."""
    out = {}
    engines = list(timeline.meta.get(QUEUE_GAUGES) or ())
    named = {upstream for r in timeline.requests for upstream, _ in r.stages}
    first_send = min((min(r.send_t, r.arrival_t) for r in timeline.requests), default=None)
    for engine in engines:
        prefill = is_prefill(engine)
        if any(
            on_upstream(engine, upstream) for upstream in named
        ):  # its own requests, all cut out
            spans, alone = routed_spans(timeline.requests, engine), True
        else:
            alone = prefill or sum(is_prefill(e) == prefill for e in engines) == 1
            spans = client_spans(timeline.requests, "prefill" if prefill else "decode")
        if (
            first_send is not None
        ):  # before the first send (pre-flight scrapes) nothing was under test
            spans.insert(0, (-math.inf, first_send))
        out[engine] = [
            w
            for run in _idle_runs(timeline, engine)
            for w in _less(run, spans, alone)
            if w[1] - w[0] >= idle_threshold_s
        ]
    return out


def _idle_runs(timeline: Timeline, engine: str) -> list[Window]:
    """(first, last, is_tail) of each run of the engine's readings with no request running or waiting."""
    runs, first, last = [], None, None
    for sample in timeline.samples_for(engine):
        if sample.num_running + sample.num_waiting == 0:
            first, last = (sample.t if first is None else first), sample.t
            continue
        if first is not None:
            runs.append((first, last, False))
        first = None
    if first is not None:
        runs.append((first, last, True))
    return runs


def on_upstream(engine: str, upstream: str) -> bool:
    """The scraped engine is one of the upstream's: its only series (named after it) or one
    of several (NAME:label, replay/metrics/scrape.py engine_name)."""
    return engine == upstream or engine.startswith(upstream + ":")


def routed_spans(requests: Sequence[RequestRecord], engine: str) -> list[tuple[float, float]]:
    """(since, until) of each request as it may be on the scraped engine: a request whose way
    the proxy named, while it was on the engine's upstream (intervals); one whose way is not
    known (an answer without the header), as client_spans has it for the engine's role."""
    role = "prefill" if is_prefill(engine) else "decode"
    out = []
    for r in requests:
        if r.stages:
            out += [
                (since, until)
                for upstream, since, until in intervals(r)
                if on_upstream(engine, upstream)
            ]
        else:
            out += client_spans([r], role)
    return sorted(out)


def is_prefill(engine: str) -> bool:
    """A prefill engine by its name (P, P0, kv:P, prefill, ...: timeline.engine_role); any
    other engine is a decode engine here (D, Dn, E or a user's name: a request's last)."""
    return engine_role(engine) == "P"


def client_spans(requests: Sequence[RequestRecord], role: str) -> list[tuple[float, float]]:
    """(since, until) of each request as it may be on an engine of `role`, the client's view:
    a prefill engine from the send until the first token came (a real P's metrics count a
    prefilled request neither running nor waiting while it holds the KV for D, and a
    prefill between two readings is not seen), the last engine until the request ended."""
    out = []
    for r in requests:
        end = math.inf if r.end_t is None else r.end_t
        until = (
            min(r.first_token_t, end) if role == "prefill" and r.first_token_t is not None else end
        )
        out.append((min(r.send_t, r.arrival_t), until))
    return sorted(out)


def _less(run: Window, spans: list[tuple[float, float]], alone: bool) -> list[Window]:
    """The run without the spans. A prefill engine, an engine alone in its role, or one
    whose own requests the spans are (alone), loses every span: a P's metrics cannot show
    the requests it holds KV for, and which P had a request is the server's routing, unknown
    over HTTP unless the proxy said. Among several decode engines, whose metrics count their
    requests, only a span under way at the run's start is cut out (the engine may still
    hold its KV)."""
    start, end, is_tail = run
    out, cur = [], start
    for since, until in spans:
        if not alone and since >= start:
            break
        if until <= cur or since >= end:
            continue
        if since > cur:
            out.append((cur, since, False))
        cur = max(cur, until)
        if cur >= end:
            return out
    if cur < end:
        out.append((cur, end, is_tail))
    return out


def idle_windows_by_engine(timeline: Timeline, idle_threshold_s: float) -> dict[str, list[Window]]:
    """Every engine's idle windows from its own requests; engines that had none are left out."""
    return {
        engine: _gaps(sorted(spans), timeline.end_t, idle_threshold_s)
        for engine, spans in spans_by_engine(timeline.requests).items()
    }


def spans_by_engine(requests: Sequence[RequestRecord]) -> dict[str, list[tuple[float, float]]]:
    """(since, until) of every stage on each engine: intervals() of every request, inlined
    (one pass over every request, on every verify)."""
    by_engine: dict[str, list[tuple[float, float]]] = {}
    inf = math.inf
    for record in requests:
        stages = record.stages
        if not stages:
            continue
        end = inf if record.end_t is None else record.end_t
        if len(stages) > 1:
            first_token_t = record.first_token_t
            kv_left = end if first_token_t is None or first_token_t > end else first_token_t
            for engine, since in stages[:-1]:
                by_engine.setdefault(engine, []).append(
                    (since, since if since > kv_left else kv_left)
                )
        engine, since = stages[-1]
        by_engine.setdefault(engine, []).append((since, end))
    return by_engine


def _gaps(spans: list[tuple[float, float]], end_t: float, idle_threshold_s: float) -> list[Window]:
    """The idle windows between sorted, non-empty spans, and the tail after the last."""
    windows, quiet_from = [], spans[0][1]
    for since, until in itertools.islice(spans, 1, None):
        if since - quiet_from >= idle_threshold_s:
            windows.append((quiet_from, since, False))
        if until > quiet_from:
            quiet_from = until
    if quiet_from < end_t:
        windows.append((quiet_from, end_t, True))
    return windows


def engine_only_windows(
    timeline: Timeline,
    idle_threshold_s: float,
    trace_windows: Sequence[Window],
    by_engine: dict[str, list[Window]] | None = None,
) -> list[EngineWindow]:
    """Each engine's idle windows that neither hold a window of the whole trace nor lie
    inside one (that window judges the engine there), nor are an engine's tail where the
    trace's tail judges it, in time order (scraped: from the engines' own metrics,
    scraped_idle_windows). by_engine: the engines' windows if the caller has them already."""
    out, holds, inside = [], _Holds(trace_windows), _Inside(trace_windows)
    tail_start = min((s for s, _, is_tail in trace_windows if is_tail), default=math.inf)
    if by_engine is None:
        by_engine = (
            scraped_idle_windows(timeline, idle_threshold_s)
            if timeline.is_scraped()
            else idle_windows_by_engine(timeline, idle_threshold_s)
        )
    for engine, windows in by_engine.items():  # the trace's tail judges every engine's tail
        out += [
            EngineWindow(engine, *w)
            for w in windows
            if not holds(w) and not inside(w) and not (w[2] and w[1] > tail_start)
        ]
    return sorted(out, key=lambda w: (w.start, w.engine))


class _Inside:
    """inside_any against fixed trace windows, by bisection: of the windows that start
    early enough, the one that ends last (a prefix maximum) decides."""

    def __init__(self, trace_windows: Sequence[Window]) -> None:
        ordered = sorted((s, e) for s, e, _ in trace_windows)
        self.starts = [s for s, _ in ordered]
        self.max_end = list(itertools.accumulate((e for _, e in ordered), max))

    def __call__(self, window: Window) -> bool:
        start, end, _ = window
        i = bisect.bisect_right(self.starts, start + EPS_S) - 1
        return i >= 0 and end <= self.max_end[i] + EPS_S


class _Holds:
    """holds_any against fixed trace windows, by bisection: of the windows that start
    late enough, the one that ends first (a suffix minimum) decides."""

    def __init__(self, trace_windows: Sequence[Window]) -> None:
        ordered = sorted((s, e) for s, e, _ in trace_windows)
        self.starts = [s for s, _ in ordered]
        self.min_end = [e for _, e in ordered] + [math.inf]
        for i in range(len(ordered) - 1, -1, -1):
            self.min_end[i] = min(self.min_end[i], self.min_end[i + 1])

    def __call__(self, window: Window) -> bool:
        start, end, _ = window
        i = bisect.bisect_left(self.starts, start - EPS_S)
        while i > 0 and start <= self.starts[i - 1] + EPS_S:  # rounding at the bound
            i -= 1
        while i < len(self.starts) and not start <= self.starts[i] + EPS_S:
            i += 1
        return self.min_end[i] <= end + EPS_S


def holds_any(window: Window, trace_windows: Sequence[Window]) -> bool:
    """The window holds one of the trace's windows (the definition, beside _Holds)."""
    start, end, _ = window
    return any(start <= s + EPS_S and e <= end + EPS_S for s, e, _ in trace_windows)


def inside_any(window: Window, trace_windows: Sequence[Window]) -> bool:
    """The window lies inside one of the trace's windows (the definition, beside _Inside)."""
    start, end, _ = window
    return any(s <= start + EPS_S and end <= e + EPS_S for s, e, _ in trace_windows)


def observed(expected: EngineWindow, run: Sequence[EngineWindow]) -> bool:
    """The run had an idle window on the expected window's engine overlapping it."""
    return any(
        w.engine == expected.engine and w.start < expected.end and expected.start < w.end
        for w in run
    )
