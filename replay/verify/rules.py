"""Verification of a replay timeline: conservation, drain in idle windows, recorded snapshots. Runs in: frontend process.

Pure functions of a Timeline (from either replay driver) and the trace's snapshots.
- conservation: at every sample used + free == num_usable_blocks.
- idle windows, from the client's view: after every request sent so far has ended,
  until the next arrival, when that is at least idle_threshold_s away; plus the tail
  after the last request until the timeline ends. In each window every engine must
  drain: used blocks (held by requests; ref-0 cached blocks count as free) reach 0
  within drain_deadline_s and stay 0 until the window ends. A blip that is gone by
  the deadline is fine (a step still running when the client gave up publishes its
  blocks late); blocks taken later are a leak. A window shorter than the deadline
  that ends undrained is "undecided", not a violation; when no observed candidate gap
  overlaps it, it is too short to judge and does not make the run inconclusive either
  (too_short). Engine stats hold their value until the next sample (a parked engine
  publishes nothing); a scraped timeline's samples (Timeline.is_scraped: a server's
  /metrics) say nothing between scrapes, and each reading was taken somewhere between
  its scrape's sending and its answer (EngineSample.send_t .. t), so there only
  readings taken for sure after the deadline and before the window ended are evidence:
  one that saw blocks held is a leak; all zero is "drained" only if the drain is
  proven by the deadline (time_to_drain, from the answer of the first zero reading
  after the last that saw blocks, is an upper bound: never under-reported); otherwise
  (no evidence, evidence too late, a drain not proven in time) "undecided".
- contracts: blocks P holds for an unread request (P answered, D never read) are due by
  what the deployment's release promises (contract.py: the lease and one extension, at
  once, or held while a pre-#43433 P idles), judged from P's answer across the windows
  that follow: a window that ends before that deadline with blocks held is undecided
  ("held within its contract"), not counted when a later window reaching the deadline
  judges them. Any window that ends before its deadline with usage still falling is
  undecided, "still draining", not a leak.
- snapshots: the nearest sample at or before each recorded snapshot matches its used,
  free (and cached, when recorded) counts within snapshot_tolerance_blocks. A recorded
  idle state (queues all empty, as `serve --record` writes them: settled, see
  replay/serve/recorder.py) that this replay reached with requests still in flight was not
  reached (it lagged the recording): not compared, and the run is inconclusive.
- a request that never ended is a violation too ("unfinished").
- corrupt KV: blocks freed before D read them (safety.py: a request's record, the
  connector's reads after expiry, vLLM's counters and log) or an output that differs from
  a single engine's ("output_mismatch", when the replay computed the expected outputs:
  replay/verify/outputs.py).
The status (replay/verify/verdict.py's table): "fault" when an engine or connector
worker died or stalled, or a server restarted (the driver's faults, in the timeline's meta;
a leak in a window that ends after one is a "fault_leak", named by it; a window that held
an engine's restart is never drained: undecided, said apart); else "violation" when any of the above
failed; else "inconclusive" when the run does not cover what it should
(replay/verify/coverage.py: an expected idle window not observed, too many requests
ignored; an undecided window), with the reasons; else "verified".
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from replay.trace.reader import TraceSnapshot
from replay.verify.contract import Contract, UnreadIndex, WindowContract
from replay.verify.coverage import (
    ExpectedWindow,
    WindowCoverage,
    cover,
    cover_engine_windows,
    credit_engine_windows,
    ignored_by_cause,
    missed_reason,
    quiet_from,
)
from replay.verify.safety import freed_before_read
from replay.verify.timeline import EngineSample, RequestRecord, Timeline
from replay.verify.units import seconds
from replay.verify.verdict import exit_code_for
from replay.verify.windows import (
    EPS_S,
    EngineWindow,
    engine_only_windows,
    idle_windows,
    idle_windows_by_engine,
    observable_engines,
)

VIOLATION_KINDS = (
    "conservation",
    "leak",
    "fault_leak",
    "snapshot",
    "unfinished",
    "read_after_expiry",
    "freed_before_read",
    "output_mismatch",
)
STILL_DRAINING = "still draining when the window ended"


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    idle_threshold_s: float = 1.0
    drain_deadline_s: float = 0.5
    snapshot_tolerance_blocks: int = 0  # 0 for the virtual clock
    max_ignored_share: float = 0.01  # more ignored requests than this: inconclusive
    allow_ignored: bool = False  # --allow-ignored: any share is fine (still counted)
    # --min-coverage: the share of expected windows that is enough when every observed one
    # drained and the rest were lost to lag (a partial-coverage pass); None: all are needed
    min_coverage: float | None = None

    def __post_init__(self) -> None:
        if not self.idle_threshold_s > 0:
            raise ValueError(f"idle_threshold_s: must be > 0, got {self.idle_threshold_s!r}")
        for name in ("drain_deadline_s", "snapshot_tolerance_blocks", "max_ignored_share"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if self.min_coverage is not None and not 0 <= self.min_coverage <= 1:
            raise ValueError(f"min_coverage: must be in [0, 1], got {self.min_coverage!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class IdleWindow:
    """One engine over one idle window."""

    engine: str
    start: float
    end: float
    is_tail: bool
    num_used_at_start: int
    time_to_drain: float | None  # seconds from start until used blocks stay 0; None: never
    verdict: str  # "drained" | "leak" | "undecided"
    num_blocks_held: int  # used blocks at the last sample that had any (0 if none did)
    # What judged it (contract.py): seconds from its start by which the blocks held then
    # were due, and why ("drain deadline 0.5 s", "1 unread request, lease 30 s + ...").
    deadline_s: float | None = None
    contract: str = ""
    num_unread: int = 0  # unread requests P still held for D at its start
    # Why an undecided window is: STILL_DRAINING, or held within its contract when it
    # ended (a later window judges those blocks); "": neither.
    note: str = ""

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str  # one of VIOLATION_KINDS
    engine: str  # "" when it concerns no one engine
    t: float
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    windows: tuple[IdleWindow, ...]
    violations: tuple[Violation, ...]
    coverage: tuple[WindowCoverage, ...] = ()  # every candidate gap; empty: not computed
    reasons: tuple[str, ...] = ()  # why inconclusive (empty: it is not)
    ignored: dict[str, int] | None = None  # ignored requests by cause
    # Engines or connector workers that died or stalled (replay/wall/faults.py Fault as
    # dicts: t, engine, kind, cause, end_t), first seen first.
    faults: tuple[dict, ...] = ()
    partial: str = ""  # a pass on partial coverage (--min-coverage): what was and was not observed
    # Per window (windows' order): undecided, shorter than the drain deadline and over no
    # observed candidate gap, so not judged (too_short); empty: none is known to be.
    too_short: tuple[bool, ...] = ()
    contract: Contract | None = None  # what judged the unread requests' blocks (contract.py)

    @property
    def ok(self) -> bool:
        """No violation (a run can still be inconclusive: see status)."""
        return not self.violations

    @property
    def status(self) -> str:
        """verified | violation | inconclusive | fault (replay/verify/verdict.py): a fault
        wins, since what the engines did after one says nothing about liveness."""
        if self.faults:
            return "fault"
        return "violation" if self.violations else "inconclusive" if self.reasons else "verified"

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.status)

    @property
    def num_too_short(self) -> int:
        return sum(self.too_short)

    def num_covered(self) -> tuple[int, int]:
        """(observed, expected) idle windows, the tail included."""
        expected = [c for c in self.coverage if c.state != "busy"]
        return sum(c.state == "observed" for c in expected), len(expected)

    def to_dict(self) -> dict:
        observed, expected = self.num_covered()
        return {
            "ok": self.status == "verified",
            "status": self.status,
            "exit_code": self.exit_code,
            "reasons": list(self.reasons),
            "num_expected_windows": expected,
            "num_observed_windows": observed,
            "coverage": [asdict(c) for c in self.coverage],
            "ignored": dict(self.ignored or {}),
            "windows": [
                dict(asdict(w), length=w.length, too_short=short)
                for w, short in zip(
                    self.windows, self.too_short or [False] * len(self.windows), strict=True
                )
            ],
            "violations": [asdict(v) for v in self.violations],
            "faults": [dict(f) for f in self.faults],
            "num_too_short_windows": self.num_too_short,
            **({"partial_coverage": self.partial} if self.partial else {}),
            **({"contract": self.contract.to_dict()} if self.contract is not None else {}),
        }


@dataclass(frozen=True, slots=True)
class EngineSeries:
    """One engine's samples in time order, with their times for bisection."""

    engine: str
    samples: list[EngineSample]
    times: list[float]

    @staticmethod
    def of(timeline: Timeline, engine: str) -> EngineSeries:
        samples = timeline.samples_for(engine)
        return EngineSeries(engine, samples, [s.t for s in samples])

    @staticmethod
    def of_all(timeline: Timeline) -> dict[str, EngineSeries]:
        """EngineSeries.of every engine (timeline.engines' order), in one pass over the samples."""
        by_engine: dict[str, list[EngineSample]] = {engine: [] for engine in timeline.engines}
        elsewhere: list[EngineSample] = []  # a sample of no listed engine: of none of them
        for sample in timeline.samples:
            by_engine.get(sample.engine, elsewhere).append(sample)
        return {
            engine: EngineSeries(engine, samples, [s.t for s in samples])
            for engine, samples in by_engine.items()
        }


def check_window(
    series: EngineSeries,
    window: tuple[float, float, bool],
    deadline_s: float,
    scraped: bool = False,
    judge_by: WindowContract | None = None,
) -> IdleWindow:
    """Judge one engine over one (start, end, is_tail) window.

    It drained at the first sample from which used blocks stay 0 until the window
    ends (the sample at or before `start` counts as the window's first), by the drain
    deadline, or by judge_by's later deadline (an unread request's contract: contract.py).
    scraped: _scraped_window judges it (only readings taken inside the window are evidence).
    """
    (start, end, is_tail), samples, times = window, series.samples, series.times
    if judge_by is None:
        judge_by = WindowContract(
            deadline_t=start + deadline_s, num_unread=0, text=f"drain deadline {deadline_s:g} s"
        )
    judged = {
        "deadline_s": judge_by.deadline_t - start,
        "contract": judge_by.text,
        "num_unread": judge_by.num_unread,
    }
    if not times or times[0] > end:  # nothing known about this engine in the window
        return IdleWindow(
            engine=series.engine,
            start=start,
            end=end,
            is_tail=is_tail,
            num_used_at_start=0,
            time_to_drain=None,
            verdict="undecided",
            num_blocks_held=0,
            **judged,
        )
    lo, hi = bisect.bisect_right(times, start), bisect.bisect_left(times, end)
    at_start = samples[lo - 1].num_used_blocks if lo > 0 else 0
    inside = samples[max(lo - 1, 0) : hi]
    held_on = judge_by.num_unread > 0 and judge_by.deadline_t > end  # due after it ends
    if scraped:
        verdict, drained_at, held = _scraped_window(
            samples[lo:hi], start, end, judge_by.deadline_t, held_on
        )
    else:
        verdict, drained_at, held = _stats_window(inside, start, end, judge_by.deadline_t - start)
    time_to_drain = None if drained_at is None or verdict == "undecided" else drained_at - start
    note, seen = "", samples[lo:hi] if scraped else inside
    if verdict == "undecided" and seen and seen[-1].num_used_blocks:
        if is_falling(seen, start, end, deadline_s):
            note = STILL_DRAINING
        elif held_on:
            note = (
                f"held within its contract when the window ended (due "
                f"{seconds(judge_by.deadline_t)}): a later window judges them"
            )
    return IdleWindow(
        engine=series.engine,
        start=start,
        end=end,
        is_tail=is_tail,
        num_used_at_start=at_start,
        time_to_drain=time_to_drain,
        verdict=verdict,
        num_blocks_held=held,
        **judged,
        note=note,
    )


def is_falling(
    samples: Sequence[EngineSample], start: float, end: float, drain_deadline_s: float
) -> bool:
    """Usage still falling as the window ended: the last change of used blocks among its
    samples was a decrease, seen within its last drain deadline or last third."""
    recent_from = end - max(drain_deadline_s, (end - start) / 3)
    for before, after in zip(reversed(samples[:-1]), reversed(samples[1:])):
        if after.num_used_blocks != before.num_used_blocks:
            return after.num_used_blocks < before.num_used_blocks and after.t >= recent_from
    return False


def _stats_window(
    samples: Sequence[EngineSample], start: float, end: float, deadline_s: float
) -> tuple[str, float | None, int]:
    """Engine stats (each value holds until the next sample): (verdict, drained_at, held)."""
    drained_at, held = _drained_at(samples, start)
    if drained_at is not None and drained_at - start <= deadline_s:
        return "drained", drained_at, held
    verdict = "undecided" if drained_at is None and end - start < deadline_s else "leak"
    return verdict, drained_at, held


def _drained_at(samples: Sequence[EngineSample], start: float) -> tuple[float | None, int]:
    """(when used blocks fell to 0 for good, or start if no sample held any; None: they
    never did) and the used blocks of the last sample that held some (0: none did)."""
    last_held = next(
        (i for i in range(len(samples) - 1, -1, -1) if samples[i].num_used_blocks), None
    )
    if last_held is None:
        return start, 0
    drained_at = samples[last_held + 1].t if last_held + 1 < len(samples) else None
    return drained_at, samples[last_held].num_used_blocks


def _scraped_window(
    answered: Sequence[EngineSample],
    start: float,
    end: float,
    deadline_t: float,
    due_later: bool = False,
) -> tuple[str, float | None, int]:
    """Scraped readings answered inside a window: (verdict, drained_at, held).

    A reading was taken in [send_t, t]; evidence is a reading taken for sure after the
    deadline (sent after it) and before the window ended (answered before its end:
    `answered` holds only those). Blocks held in any evidence: a leak. Otherwise drained
    only if some evidence exists and the drain is proven by the deadline: drained_at is
    the answer time of the first reading taken for sure inside the window (sent after
    its start) after the last reading that saw blocks held: an upper bound on the drain.
    due_later: the blocks held were due after the window ended (an unread request's
    contract), so readings that end at zero prove the drain in time.
    """
    evidence = [s for s in answered if _sent(s) > deadline_t]
    last_held = next(
        (i for i in range(len(answered) - 1, -1, -1) if answered[i].num_used_blocks), -1
    )
    held = answered[last_held].num_used_blocks if last_held >= 0 else 0
    drained_at = next((s.t for s in answered[last_held + 1 :] if _sent(s) >= start), None)
    if any(s.num_used_blocks for s in evidence):
        return "leak", drained_at, held
    if evidence and drained_at is not None and drained_at <= deadline_t:
        return "drained", drained_at, held
    if due_later and drained_at is not None:
        return "drained", drained_at, held
    return "undecided", drained_at, held


def _sent(sample: EngineSample) -> float:
    """When the reading's scrape was sent (the reading was taken at or after it)."""
    return sample.t if sample.send_t is None else sample.send_t


def _window_violation(w: IdleWindow, faults: Sequence[dict] = ()) -> Violation:
    """A leak; one in a window that ends after a fault was seen is the fault's ("fault_leak",
    its cause named), not the liveness policy's."""
    where = "tail" if w.is_tail else "idle window"
    if w.time_to_drain is None:  # the two counts are two samples': each said as what it is
        detail = (
            f"never drained: {where} of {w.length:.3f} s: {w.num_used_at_start} blocks used "
            f"at its start, {w.num_blocks_held} at its last sample that had any"
        )
    else:
        past = "the drain deadline" if not w.num_unread else "its deadline"
        detail = (
            f"late drain: {where}: {w.num_blocks_held} blocks held until {w.time_to_drain:.3f} s "
            f"after its start, past {past}"
        )
    if w.num_unread:  # an unread request's contract judged it: say which, and its deadline
        detail += f" (due {w.deadline_s:.3f} s in: {w.contract})"
    cause = next((f for f in faults if f["t"] <= w.end), None)
    if cause is None:
        return Violation("leak", w.engine, w.start, detail)
    who = f"{cause['engine']}: " if cause["engine"] else ""
    return Violation(
        "fault_leak",
        w.engine,
        w.start,
        f"{detail}; caused by a fault at {cause['t']:.3f} s ({who}{cause['cause']})",
    )


def _check_conservation(timeline: Timeline) -> list[Violation]:
    out = []
    for s in timeline.samples:
        total = timeline.num_usable_blocks.get(s.engine)
        if (
            s.num_used_blocks + s.num_free_blocks != s.num_usable_blocks
            or s.num_usable_blocks != total
        ):
            out.append(
                Violation(
                    "conservation",
                    s.engine,
                    s.t,
                    f"used {s.num_used_blocks} + free {s.num_free_blocks} != "
                    f"{total} blocks (sample says {s.num_usable_blocks})",
                )
            )
    return out


def _check_snapshot(
    snap: TraceSnapshot, by_engine: dict[str, EngineSeries], tolerance: int
) -> list[Violation]:
    out = []
    for engine, counts in sorted(snap.kv.items()):
        if engine not in by_engine:
            out.append(Violation("snapshot", engine, snap.t, "no such engine in the replay"))
            continue
        series = by_engine[engine]
        at = bisect.bisect_right(series.times, snap.t) - 1
        if at < 0:
            out.append(Violation("snapshot", engine, snap.t, "no sample at or before it"))
            continue
        sample = series.samples[at]
        got = {
            "used": sample.num_used_blocks,
            "free": sample.num_free_blocks,
            "cached": sample.num_cached_blocks,
        }
        bad = [
            f"{k} {got[k]} != recorded {v}"
            for k, v in sorted(counts.items())
            if abs(got[k] - v) > tolerance
        ]
        if bad:
            out.append(
                Violation(
                    "snapshot",
                    engine,
                    snap.t,
                    f"sample at {seconds(sample.t)} (line {snap.line}): "
                    + ", ".join(bad)
                    + f" (tolerance {tolerance})",
                )
            )
    return out


IN_FLIGHT_QUEUES = ("waiting", "skipped_waiting", "waiting_for_remote_kvs", "running")


def _snapshots_not_reached(
    snapshots: Sequence[TraceSnapshot], timeline: Timeline, drain_deadline_s: float
) -> list[TraceSnapshot]:
    """Recorded snapshots of an idle state (every engine's queues recorded, nothing in them:
    `serve --record` takes its snapshots so) that this replay had not been quiet for a
    drain deadline by: it lagged the recording there (a request just ended may still hold
    blocks its engine has not been told to free), so the counts say nothing either way."""
    idle = [
        s
        for s in snapshots
        if s.queues
        and set(s.queues) == set(s.kv)
        and all(q.get(k, 0) == 0 for q in s.queues.values() for k in IN_FLIGHT_QUEUES)
    ]
    busy_until = quiet_from(timeline.requests, [s.t for s in idle])
    return [s for s, quiet in zip(idle, busy_until) if quiet + drain_deadline_s > s.t]


def verify(
    timeline: Timeline,
    trace_snapshots: Iterable[TraceSnapshot],
    options: VerifyOptions = VerifyOptions(),
    expected: Sequence[ExpectedWindow] | None = None,
    expected_engine: Sequence[EngineWindow] | None = None,
    contract: Contract | None = None,
) -> Verdict:
    """Check conservation, idle-window drain and recorded snapshots, then what was covered.

    expected: the candidate windows (replay/verify/coverage.py expected_windows), computed
    before the run; None checks only the windows the run observed. expected_engine: the
    engines' own windows the forecast found (windows.py); None: no forecast. contract: what
    the deployment promises for an unread request's blocks (contract.py); None: every
    window by the drain deadline.
    """
    violations = _check_conservation(timeline)
    faults = tuple(sorted(timeline.meta.get("faults", ()), key=lambda f: f["t"]))
    by_engine = EngineSeries.of_all(timeline)
    windows = []
    observed = idle_windows(timeline, options.idle_threshold_s)
    # {}: no engine's way known; over HTTP the ways name upstreams, and their engines' own
    # windows come from their metrics (engine_only_windows, below)
    own = (
        {} if timeline.is_scraped() else idle_windows_by_engine(timeline, options.idle_threshold_s)
    )
    run_own = None  # the run's engine-only windows, where needed: over HTTP, or forecast
    if timeline.is_scraped() or expected_engine is not None:
        run_own = engine_only_windows(
            timeline, options.idle_threshold_s, observed, None if timeline.is_scraped() else own
        )
    cut = timeline.meta.get("interrupted") is not None  # Ctrl-C, q or SIGTERM cut its tail short:
    judged = [
        (series, window)
        for series in by_engine.values()  # that window is not judged
        for window in own.get(series.engine, observed)
        if not (cut and window[2])
    ]
    if timeline.is_scraped():  # a server's own routing: its engines' metrics say when each idled
        judged += [(by_engine[w.engine], w.window) for w in run_own if w.engine in by_engine]
    shared = list(timeline.meta.get("shared", ()))
    shared_from = min((s["t"] for s in shared), default=math.inf)  # a serve is shared whole
    unread = UnreadIndex(timeline.requests, contract) if contract is not None else None
    for series, window in sorted(judged, key=lambda sw: sw[1][0]):  # stable: engines in order
        judge_by = (
            unread.judge_by(series.engine, window[0], window[1], options.drain_deadline_s)
            if unread
            else None
        )
        w = check_window(series, window, options.drain_deadline_s, timeline.is_scraped(), judge_by)
        if w.verdict == "drained" and restart_inside(w, faults) is not None:
            w = replace(w, verdict="undecided", time_to_drain=None)  # freed, not drained
        windows.append(w)
        if w.verdict == "leak" and w.end < shared_from:
            violations.append(_window_violation(w, faults))
    snapshots = list(trace_snapshots)
    unreached = _snapshots_not_reached(snapshots, timeline, options.drain_deadline_s)
    for snap in snapshots:
        if snap not in unreached:
            violations += _check_snapshot(snap, by_engine, options.snapshot_tolerance_blocks)
    unfinished = [r for r in timeline.requests if r.end_t is None]
    starved = timeline.meta.get("starved", ())
    if not (cut or starved):  # else it is no evidence: the run stopped, or the engine starved
        violations += [
            Violation("unfinished", "", r.arrival_t, f"request {r.req_id!r} never ended")
            for r in unfinished
        ]
    violations += _check_kv_integrity(timeline)
    decided = [(w.engine, (w.start, w.end, w.is_tail)) for w in windows if w.verdict != "undecided"]
    coverage = (
        ()
        if expected is None
        else credit_engine_windows(cover(expected, timeline, observed), decided, timeline.engines)
    )
    if expected_engine is not None:  # expected only where the run could show it
        seen = observable_engines(timeline)
        coverage += cover_engine_windows(
            [w for w in expected_engine if w.engine in seen], run_own, timeline
        )
    ignored = ignored_by_cause(timeline.requests)
    # no coverage computed: no window is known to be spare
    spare = [
        expected is not None and is_too_short(w, options.drain_deadline_s, coverage)
        for w in windows
    ]
    restarted = [
        w for w in windows if w.verdict == "undecided" and restart_inside(w, faults) is not None
    ]
    later = judged_later(windows)
    counted = [
        w
        for w, is_spare in zip(windows, spare)
        if not is_spare and w not in restarted and not later(w)
    ]
    reasons = _inconclusive_reasons(coverage, counted, ignored, len(timeline.requests), options)
    reasons += restart_reasons(restarted, faults)
    reasons += starved_reasons(starved)
    reasons += shared_reasons(shared)
    if unfinished and (cut or starved):
        reasons.append(unfinished_reason(unfinished, cut))
    reasons += [
        f"recorded snapshot not reached: t={s.t:.3f} s (line {s.line}): nothing was in flight "
        f"in the recording there, requests still were in this replay (it lagged the "
        f"recording), so its counts were not compared"
        for s in unreached
    ]
    partial = _partial_coverage(coverage, counted, reasons, options)
    if partial:
        reasons = [r for r in reasons if not r.startswith(MISSED_PREFIX)]
    elif any(r.startswith(MISSED_PREFIX) for r in reasons):
        reasons.append(LAG_ADVICE)
    return Verdict(
        windows=tuple(windows),
        violations=tuple(violations),
        coverage=coverage,
        reasons=tuple(reasons),
        ignored=ignored,
        faults=faults,
        partial=partial,
        too_short=tuple(spare),
        contract=contract,
    )


def judged_later(windows: Sequence[IdleWindow]) -> Callable[[IdleWindow], bool]:
    """A predicate: an undecided window whose blocks a later window of the same engine
    judges, since they were an unread request's, due after it ended (contract.py), and a
    later decided window (drained or leak) reaches that deadline."""
    decided: dict[str, list[IdleWindow]] = {}
    for w in windows:
        if w.verdict != "undecided":
            decided.setdefault(w.engine, []).append(w)
    for ws in decided.values():
        ws.sort(key=lambda w: w.start)
    starts = {engine: [w.start for w in ws] for engine, ws in decided.items()}
    reach = {  # per engine, from each decided window on: the latest end among them
        engine: list(itertools.accumulate((w.end for w in reversed(ws)), max))[::-1]
        for engine, ws in decided.items()
    }

    def later(w: IdleWindow) -> bool:
        if w.verdict != "undecided" or not w.num_unread or w.deadline_s is None:
            return False
        i = bisect.bisect_left(starts.get(w.engine, []), w.end - EPS_S)
        return i < len(starts.get(w.engine, [])) and (
            reach[w.engine][i] >= w.start + w.deadline_s - EPS_S
        )

    return later


def restart_inside(w: IdleWindow, faults: Sequence[dict]) -> tuple[float, float] | None:
    """The (since, t) of a restart of w's engine that may lie inside w (replay/metrics/
    restarts.py: it came after `since` and before `t`); None: none did."""
    for f in faults:
        if f.get("kind") == "restarted" and f["engine"] == w.engine:
            for since, t in f.get("spans", ((f["t"], f["t"]),)):
                if since < w.end and t > w.start:
                    return since, t
    return None


def restart_reasons(restarted: Sequence[IdleWindow], faults: Sequence[dict]) -> list[str]:
    """The windows a restart fell in, in one line (none: no line)."""
    if not restarted:
        return []
    w = restarted[0]
    since, t = restart_inside(w, faults)
    n = len(restarted)
    return [
        f"{n} idle window{'s' if n != 1 else ''} not judged drained: the engine restarted "
        f"inside (first: {w.engine} at {w.start:.3f} s, restarted between {since:.3f} s and "
        f"{t:.3f} s); a restart frees blocks without draining them"
    ]


def is_too_short(window: IdleWindow, deadline_s: float, coverage: Sequence[WindowCoverage]) -> bool:
    """An undecided window shorter than the drain deadline that overlaps no observed candidate
    gap: no drain can be proven or disproven in it (blocks may still be freed in time after it
    ends), and no window the verdict claims rests on it, so it makes the run neither a
    violation nor inconclusive (an engine's own window, P idle for a moment while D decodes)."""
    if window.verdict != "undecided" or window.length >= deadline_s:
        return False
    return not any(
        c.state == "observed"
        and c.start < window.end
        and window.start < (math.inf if c.end is None else c.end)
        for c in coverage
    )


MISSED_PREFIX = "expected window not observed"
LAG_ADVICE = (
    "to cover the windows the engines' lag swallowed: measure this machine's step costs "
    "(`kvdrain calibrate -o FILE`, then --calibration FILE), replay on the virtual clock "
    "(--clock virtual), give the engines CPU, widen the gaps (--max-gap, or a larger "
    "--idle-threshold), or accept what was observed with --min-coverage F"
)


def _partial_coverage(
    coverage: Sequence[WindowCoverage],
    windows: Sequence[IdleWindow],
    reasons: Sequence[str],
    options: VerifyOptions,
) -> str:
    """The partial-coverage pass, in words, when --min-coverage is met: the only reasons are
    windows not observed (lag), every judged window drained; else ""."""
    if options.min_coverage is None or not any(r.startswith(MISSED_PREFIX) for r in reasons):
        return ""
    if any(not r.startswith(MISSED_PREFIX) for r in reasons):
        return ""
    expected = [c for c in coverage if c.state != "busy"]
    observed = sum(c.state == "observed" for c in expected)
    if not expected or not observed or observed / len(expected) < options.min_coverage:
        return ""
    if any(w.verdict != "drained" for w in windows):
        return ""
    missed = [c for c in expected if c.state == "missed"]
    lags = [c.lag_s for c in missed if c.lag_s is not None]
    lag = f" because the engines lagged the forecast by up to {max(lags):.3f} s" if lags else ""
    return (
        f"every engine drained in all {observed:,} observed windows; {len(missed):,} of {len(expected):,} "
        f"expected not observed{lag} (coverage {100 * observed / len(expected):.0f}% >= "
        f"--min-coverage {100 * options.min_coverage:g}%)"
    )


def _check_kv_integrity(timeline: Timeline) -> list[Violation]:
    """KV that may be corrupt: a decode side read blocks its prefill engine had freed
    (safety.py), or an output differs from what a single engine produces for the prompt
    (RequestRecord.expected_digest, when checked)."""
    out = [Violation(f.kind, f.engine, f.t, f.detail) for f in freed_before_read(timeline)]
    out += [
        Violation(
            "output_mismatch",
            "",
            r.end_t if r.end_t is not None else r.arrival_t,
            f"request {r.req_id!r}: output {r.output_digest} differs from a single "
            f"engine's {r.expected_digest} for the same prompt (corrupt KV?)",
        )
        for r in timeline.requests
        if r.expected_digest
        and r.error is None
        and r.finish_reason in ("length", "stop")
        and r.output_digest != r.expected_digest
    ]
    return out


def shared_reasons(shared: Iterable[dict]) -> list[str]:
    """Another client seen on the serve: no window that ends after it is judged a leak
    (its blocks are not this replay's alone), on any engine of it."""
    return [
        f"shared: {s['engine']} from {s['t']:.3f} s: {s['cause']}; no window ending after "
        "that is judged a leak"
        for s in shared
    ]


def unfinished_reason(unfinished: Sequence[RequestRecord], cut: bool) -> str:
    """Requests still running when the run was stopped, or while an engine was starved:
    not judged (a request that never ends is a violation only when nothing else explains it)."""
    why = (
        "when the run was stopped"
        if cut
        else "when the run ended, its engines starved of CPU (above)"
    )
    first = ", ".join(repr(r.req_id) for r in unfinished[:3])
    more = f" and {len(unfinished) - 3:,} more" if len(unfinished) > 3 else ""
    prefix = "stopped early: " if cut else ""
    return (
        f"{prefix}{len(unfinished):,} request{'s' if len(unfinished) != 1 else ''} still "
        f"running {why} ({first}{more}): "
        f"not judged, neither finished nor stuck"
    )


def starved_reasons(starved: Sequence[dict]) -> list[str]:
    """An engine alive but starved of CPU (replay/wall/faults.py Starved as dicts): its
    windows say nothing either way, so the run is inconclusive, with the figures."""
    out = []
    for s in starved:
        until = "until the end" if s.get("end_t") is None else f"until {s['end_t']:.3f} s"
        out.append(
            f"starved: from {s['t']:.3f} s {until}: {s['cause']}; give the engines CPU "
            f"(fewer jobs beside them) or replay on the virtual clock (--clock virtual)"
        )
    return out


def _inconclusive_reasons(
    coverage: Sequence[WindowCoverage],
    windows: Sequence[IdleWindow],
    ignored: dict[str, int],
    num_requests: int,
    options: VerifyOptions,
) -> list[str]:
    """Why the run does not prove its engines drain (empty: it does)."""
    reasons = [missed_reason(c, options.idle_threshold_s) for c in coverage if c.state == "missed"]
    blind = sum(c.state == "unobservable" for c in coverage)
    if blind:
        reasons.append(
            f"no engine's KV usage was observed, so none of the {blind:,} expected "
            f"idle windows was (over HTTP: give each engine's /metrics with --metrics)"
        )
    unreached = [c for c in coverage if c.state == "unreached"]
    if unreached:  # an interrupted run: one line for what it did not reach, one for what it did
        judged = [w for w in windows if w.verdict != "undecided"]
        drained = sum(w.verdict == "drained" for w in judged)
        reasons.append(
            f"stopped early: {drained:,} of {len(judged):,} reached windows drained; "
            f"{len(unreached):,} not reached (first: "
            f"{missed_reason(unreached[0], options.idle_threshold_s).split(': ', 1)[1]})"
        )
    undecided = [w for w in windows if w.verdict == "undecided"]
    if undecided:
        w = undecided[0]
        why = (
            "no samples (for scraped metrics: no reading surely taken after its "
            "drain deadline and before its end, or a drain not proven by the "
            "deadline), or shorter than the drain deadline and not drained"
        )
        if w.note == STILL_DRAINING:
            why = (
                f"{w.note}, before its deadline ({w.contract}): not a leak; a longer "
                f"window judges it"
            )
        elif w.note:
            why = (
                f"{w.note.split(':')[0]} ({w.contract}), and no later window reached "
                f"that deadline: lengthen --tail"
            )
        reasons.append(
            f"{len(undecided)} idle window{'s' if len(undecided) != 1 else ''} "
            f"undecided (first: {w.engine} at {w.start:.3f} s, {w.length:.3f} s long: {why})"
        )
    num_ignored = sum(ignored.values())
    if (
        num_ignored
        and not options.allow_ignored
        and num_ignored > options.max_ignored_share * num_requests
    ):
        causes = ", ".join(f"{n:,} {cause}" for cause, n in ignored.items())
        reasons.append(
            f"{num_ignored:,} of {num_requests:,} requests ignored by the engines "
            f"({100 * num_ignored / num_requests:.1f}% > "
            f"{100 * options.max_ignored_share:g}%): {causes}; size the engines for "
            f"the trace (--deployment, --max-model-len, --num-blocks) or --allow-ignored"
        )
    return reasons
