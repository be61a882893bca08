"""`kvdrain inspect`: what a trace holds and what a replay of it would do (a dry run). Runs in: frontend process.

The measures are taken on the shaped trace, with replay's defaults (idle threshold
VerifyOptions' 1 s, no shaping unless asked), so what inspect says is what replay will
see: requests sent, what shaping changed or dropped, the idle gaps, the requests the
engines would refuse (a prompt that does not fit max_model_len) or cap (prompt +
output over it), at a wall replay's default max_model_len and the virtual clock's, and
how long a wall replay takes. Bad lines are all counted, the first few reported.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.profiles import DEFAULT_VIRTUAL_DEPLOYMENT, DEPLOYMENT_PRESETS
from replay.trace.faults import FAULT_NAMES
from replay.trace.reader import (
    TraceAbort,
    TraceEngineFault,
    TraceRequest,
    TraceSnapshot,
    TraceSummary,
    detect_format,
    read_trace,
    validate_trace,
)
from replay.trace.shaping import ShapingLog, ShapingOptions, shape

TOP_GAPS = 5
MAX_ENGINE_FAULTS_SHOWN = 5
BURST_S = 1.0  # the busiest stretch of this length is reported
BURST_NOTE = 10_000  # said when at least this many requests arrive within it
# The virtual clock's memory per request waiting at once, and per prompt token of it.
WAITING_REQUEST_BYTES = 1_600
TOKEN_BYTES = 40
DEFAULT_IDLE_THRESHOLD_S = 1.0  # replay's (replay/verify/rules.py VerifyOptions)
DEFAULT_TAIL_S = 2.0  # replay's tail at its default drain deadline (max(2, 3 x 0.5 s))


def default_max_model_lens() -> dict[str, int]:
    """The max_model_len a replay runs by default, per clock."""
    virtual = (
        DEPLOYMENT_PRESETS[DEFAULT_VIRTUAL_DEPLOYMENT]
        .sizes()
        .get("max_model_len", EngineConfig().max_model_len)
    )
    return {"wall": EngineConfig().max_model_len, "virtual": virtual}


@dataclass(frozen=True, slots=True)
class IdleGap:
    """A gap between consecutive request arrivals."""

    start: float  # t of the arrival before the gap
    length: float
    after_line: int  # file line of that arrival


@dataclass(slots=True)
class LengthCheck:
    """The requests one max_model_len would refuse (the prompt does not fit: the engine
    rejects it), cap, or never generate (max_tokens alone does not fit: replay/trace/limits.py
    refuses the trace, exit 2)."""

    max_model_len: int
    source: str  # whose default it is, or "--max-model-len"
    num_refused: int = 0
    num_capped: int = 0
    num_invalid: int = 0

    def add(self, req: TraceRequest) -> None:
        if req.prompt_len >= self.max_model_len:
            self.num_refused += 1
        elif req.max_tokens >= self.max_model_len:
            self.num_invalid += 1
        elif req.prompt_len + req.max_tokens > self.max_model_len:
            self.num_capped += 1


@dataclass(frozen=True, slots=True)
class Burst:
    """The busiest BURST_S of the trace: when it starts, its requests and prompt tokens."""

    t: float
    num_requests: int
    num_prompt_tokens: int

    def virtual_bytes(self) -> int:
        """What the virtual clock holds for these requests waiting at once (the engines'
        Request objects, token ids and block hashes), as bench/README.md measured it."""
        return self.num_requests * WAITING_REQUEST_BYTES + self.num_prompt_tokens * TOKEN_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceInspection:
    """What `inspect_trace` measured; times are replay seconds (the shaped trace's)."""

    path: str
    format: str
    num_requests: int
    num_aborts: int
    num_snapshots: int
    duration: float  # first to last request arrival
    total_prompt_tokens: int
    total_output_tokens: int
    idle_threshold: float
    num_idle_gaps: int  # gaps of idle_threshold seconds or more
    top_gaps: tuple[IdleGap, ...]  # longest first, at most TOP_GAPS
    num_hash_refs: int  # hash-id block references, 0 without hash ids
    num_reused_refs: int  # references to an id seen earlier in the trace
    num_trace_requests: int = 0  # before shaping
    shaping: tuple[str, ...] = ()  # ShapingLog lines: what shaping changed
    last_arrival: float = 0.0  # replay time of the last request
    length_checks: tuple[LengthCheck, ...] = ()
    num_bad_lines: int = 0
    bad_line_messages: tuple[str, ...] = ()
    num_skipped: int = 0  # rows the format itself skips (zero tokens: a failed request)
    tail_s: float = DEFAULT_TAIL_S
    burst: Burst | None = None  # the busiest second
    faults: tuple[tuple[str, int], ...] = ()  # (--fault name, requests), FAULT_NAMES order
    engine_faults: tuple[TraceEngineFault, ...] = ()  # the first MAX_ENGINE_FAULTS_SHOWN
    num_engine_faults: int = 0

    @property
    def mean_rate(self) -> float:
        return self.num_requests / self.duration if self.duration > 0 else 0.0

    @property
    def mean_prompt_len(self) -> float:
        return self.total_prompt_tokens / max(1, self.num_requests)

    @property
    def mean_output_len(self) -> float:
        return self.total_output_tokens / max(1, self.num_requests)

    @property
    def prefix_reuse(self) -> float | None:
        """Share of hash-id references that repeat an earlier id (infinite-cache hits)."""
        return self.num_reused_refs / self.num_hash_refs if self.num_hash_refs else None

    @property
    def wall_s(self) -> float:
        """How long a wall replay runs: to the last arrival, then the tail (start-up aside)."""
        return self.last_arrival + self.tail_s


@dataclass(slots=True)
class _Pass:
    """The one streaming pass over the shaped records."""

    idle_threshold: float
    checks: tuple[LengthCheck, ...]
    counts: dict = field(default_factory=lambda: {TraceRequest: 0, TraceAbort: 0, TraceSnapshot: 0})
    first: TraceRequest | None = None
    last: TraceRequest | None = None
    prompt: int = 0
    output: int = 0
    num_gaps: int = 0
    num_refs: int = 0
    num_reused: int = 0
    top: list = field(default_factory=list)  # min-heap of (length, start, line)
    seen: set = field(default_factory=set)
    second: deque = field(default_factory=deque)  # (t, prompt_len) of the last BURST_S
    second_tokens: int = 0
    burst: Burst | None = None
    faults: dict = field(default_factory=dict)  # --fault name -> requests
    engine_faults: list = field(default_factory=list)  # the first MAX_ENGINE_FAULTS_SHOWN

    def add(self, rec) -> None:
        self.counts[type(rec)] = self.counts.get(type(rec), 0) + 1
        self._note_fault(rec)
        if not isinstance(rec, TraceRequest):
            return
        last = self.last
        if last is not None and rec.t - last.t >= self.idle_threshold:
            self.num_gaps += 1
            heapq.heappush(self.top, (rec.t - last.t, last.t, last.line))
            if len(self.top) > TOP_GAPS:
                heapq.heappop(self.top)
        self.first, self.last = rec if self.first is None else self.first, rec
        self.prompt, self.output = self.prompt + rec.prompt_len, self.output + rec.max_tokens
        for hash_id in rec.hash_ids or ():
            self.num_reused += hash_id in self.seen
            self.seen.add(hash_id)
        self.num_refs += len(rec.hash_ids or ())
        for check in self.checks:
            check.add(rec)
        self._note_burst(rec)

    def _note_fault(self, rec) -> None:
        name = None
        if isinstance(rec, TraceRequest):
            name = rec.fault
        elif isinstance(rec, TraceAbort) and rec.when is not None:
            name = f"abort_{rec.when}"
        elif (
            isinstance(rec, TraceEngineFault) and len(self.engine_faults) < MAX_ENGINE_FAULTS_SHOWN
        ):
            self.engine_faults.append(rec)
        if name is not None:
            self.faults[name] = self.faults.get(name, 0) + 1

    def _note_burst(self, rec: TraceRequest) -> None:
        """The most requests to arrive within BURST_S of each other, and their prompt tokens."""
        second = self.second
        second.append((rec.t, rec.prompt_len))
        self.second_tokens += rec.prompt_len
        while rec.t - second[0][0] >= BURST_S:
            self.second_tokens -= second.popleft()[1]
        if self.burst is None or len(second) > self.burst.num_requests:
            self.burst = Burst(second[0][0], len(second), self.second_tokens)


def _length_checks(max_model_len: int | None) -> tuple[LengthCheck, ...]:
    if max_model_len is not None:
        return (LengthCheck(max_model_len, "--max-model-len"),)
    return tuple(
        LengthCheck(n, f"{clock} default") for clock, n in default_max_model_lens().items()
    )


def inspect_trace(
    path: str | Path,
    fmt: str | None = None,
    idle_threshold: float = DEFAULT_IDLE_THRESHOLD_S,
    shaping: ShapingOptions = ShapingOptions(),
    max_model_len: int | None = None,
    tail_s: float = DEFAULT_TAIL_S,
) -> TraceInspection:
    """Measure the shaped trace in one streaming pass, after a validating pass that
    counts every bad line (TraceError for a trace replay could not read at all)."""
    if not idle_threshold > 0:
        raise ValueError(f"idle_threshold: must be > 0, got {idle_threshold!r}")
    fmt = detect_format(path) if fmt is None else fmt
    summary: TraceSummary = validate_trace(path, fmt, skip_bad_lines=True)
    log = ShapingLog()
    scan = _Pass(idle_threshold, _length_checks(max_model_len))
    for rec in shape(read_trace(path, fmt, skip_bad_lines=True), shaping, log):
        scan.add(rec)
    gaps = tuple(
        IdleGap(start, length, line) for length, start, line in sorted(scan.top, reverse=True)
    )
    first, last = scan.first, scan.last
    return TraceInspection(
        path=str(path),
        format=fmt,
        num_requests=scan.counts[TraceRequest],
        num_aborts=scan.counts[TraceAbort],
        num_snapshots=scan.counts[TraceSnapshot],
        duration=last.t - first.t if last is not None else 0.0,
        total_prompt_tokens=scan.prompt,
        total_output_tokens=scan.output,
        idle_threshold=idle_threshold,
        num_idle_gaps=scan.num_gaps,
        top_gaps=gaps,
        num_hash_refs=scan.num_refs,
        num_reused_refs=scan.num_reused,
        num_trace_requests=summary.num_requests,
        shaping=tuple(log.lines()),
        last_arrival=last.t if last is not None else 0.0,
        length_checks=scan.checks,
        num_bad_lines=summary.num_bad_lines,
        bad_line_messages=summary.bad_line_messages,
        num_skipped=summary.num_skipped,
        tail_s=tail_s,
        burst=scan.burst,
        faults=tuple((name, scan.faults[name]) for name in FAULT_NAMES if name in scan.faults),
        engine_faults=tuple(scan.engine_faults),
        num_engine_faults=scan.counts.get(TraceEngineFault, 0),
    )


def _duration(seconds: float) -> str:
    """'42 s', '3 min 5 s', '1 h 0 min'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    return f"{minutes // 60} h {minutes % 60} min"


def format_inspection(insp: TraceInspection) -> list[str]:
    """Plain-text lines describing an inspection, for the terminal."""
    lines = [
        f"trace: {insp.path} ({insp.format})",
        f"requests: {insp.num_requests:,} over {insp.duration:,.1f} s "
        f"({insp.mean_rate:.3g} req/s); aborts: {insp.num_aborts:,}; "
        f"snapshots: {insp.num_snapshots:,}",
        f"prompt tokens: {insp.total_prompt_tokens:,} total, {insp.mean_prompt_len:,.1f} mean",
        f"output tokens: {insp.total_output_tokens:,} total, {insp.mean_output_len:,.1f} mean",
        f"idle gaps of {insp.idle_threshold:g} s or more: {insp.num_idle_gaps:,}"
        + (f", longest {insp.top_gaps[0].length:.1f} s" if insp.top_gaps else ""),
    ]
    lines += [
        f"  {gap.length:9.3f} s after t={gap.start:.3f} s (line {gap.after_line})"
        for gap in insp.top_gaps
    ]
    if insp.num_idle_gaps > len(insp.top_gaps):
        lines.append(f"  ... and {insp.num_idle_gaps - len(insp.top_gaps):,} more")
    if insp.prefix_reuse is None:
        lines.append("prefix-block reuse: n/a (no hash ids)")
    else:
        lines.append(
            f"prefix-block reuse: {insp.prefix_reuse:.1%} ({insp.num_reused_refs:,} "
            f"of {insp.num_hash_refs:,} hash-id block references repeat an earlier id)"
        )
    return lines + fault_lines(insp) + dry_run_lines(insp)


def fault_lines(insp: TraceInspection) -> list[str]:
    """The faults the shaped trace asks for (its own and --fault's), if any."""
    lines = []
    if insp.faults:
        lines.append("faults: " + ", ".join(f"{n:,} {name}" for name, n in insp.faults))
    if insp.num_engine_faults:
        shown = "; ".join(_engine_fault(f) for f in insp.engine_faults)
        more = insp.num_engine_faults - len(insp.engine_faults)
        lines.append(f"engine faults: {shown}" + (f"; ... and {more:,} more" if more else ""))
    return lines


def _engine_fault(fault: TraceEngineFault) -> str:
    """'pause D at t=5.000 s for 40 s' or 'kill P at t=9.000 s (line 12)'."""
    length = f" for {fault.for_s:g} s" if fault.for_s is not None else ""
    return f"{fault.action} {fault.engine} at t={fault.t:.3f} s{length} (line {fault.line})"


def dry_run_lines(insp: TraceInspection) -> list[str]:
    """What a replay of the shaped trace would send, drop, refuse and cap, and how long."""
    dropped = insp.num_trace_requests - insp.num_requests
    if insp.num_requests == 0:
        lines = [
            f"a replay would send none of the trace's {insp.num_trace_requests:,} requests "
            f"(shaping drops them all): replay refuses it (exit 2)"
        ]
    else:
        lines = [
            f"a replay would send {insp.num_requests:,} of the trace's {insp.num_trace_requests:,} "
            f"requests" + (f" (shaping drops {dropped:,})" if dropped > 0 else ""),
            f"  a wall replay takes about {_duration(insp.wall_s)} (last arrival "
            f"{insp.last_arrival:,.1f} s + {insp.tail_s:g} s tail; start-up aside)",
        ]
    lines += [f"  shaping: {line}" for line in insp.shaping]
    burst = insp.burst
    if burst is not None and burst.num_requests >= BURST_NOTE:
        lines.append(
            f"  busiest second: {burst.num_requests:,} requests from t={burst.t:,.3f} s wait "
            f"in the engines at once: a virtual replay holds them in memory together, about "
            f"{burst.virtual_bytes() / 2**20:,.0f} MiB (--max-requests, --start and --end cut it)"
        )
    for check in insp.length_checks:
        lines.append(
            f"  max_model_len {check.max_model_len:,} ({check.source}): "
            f"{check.num_refused:,} too long, {check.num_capped:,} capped"
            + (
                f", {check.num_invalid:,} with max_tokens that can never be generated "
                f"(replay refuses the trace, exit 2)"
                if check.num_invalid
                else ""
            )
        )
    if any(check.num_refused for check in insp.length_checks):
        lines += [
            "  (too long: the prompt does not fit: the engine rejects it, counted as ignored,",
            "  and over 1% ignored is inconclusive without --allow-ignored; capped: the",
            "  engine stops them at the limit)",
        ]
    if insp.num_skipped:
        lines.append(f"  {insp.num_skipped:,} rows with zero tokens (failed requests) are skipped")
    return lines


def bad_line_lines(insp: TraceInspection) -> list[str]:
    """Every bad line up to the reader's bound, then how many more."""
    lines = [f"bad line: {m}" for m in insp.bad_line_messages]
    hidden = insp.num_bad_lines - len(insp.bad_line_messages)
    if hidden > 0:
        lines.append(f"... and {hidden:,} more bad lines")
    return lines


LONG_WALL_S = 300.0  # a wall replay longer than this says so before it starts


def wall_time_note(
    clock: str,
    path: str | Path,
    fmt: str | None,
    shaping: ShapingOptions,
    duration_s: float,
    tail_s: float = DEFAULT_TAIL_S,
    skip_bad_lines: bool = False,
) -> str | None:
    """Before a long wall-clock replay: how long it will take, and how to make it shorter.

    The time is the shaped trace's (every shaping option, --max-requests and --max-gap
    among them), measured by a pass over it only when the unshaped bound, the trace's
    `duration_s` within --start/--end at the speedup, could be long: shaping shortens a
    trace, except --insert-idle.
    """
    if clock != "wall":
        return None
    end = duration_s if shaping.end is None else min(duration_s, shaping.end)
    bound_s = max(end - (shaping.start or 0.0), 0.0) / shaping.speedup + tail_s
    if bound_s <= LONG_WALL_S and shaping.insert_idle is None:
        return None
    last_arrival = shaped_last_arrival(path, fmt, shaping, skip_bad_lines)
    wall_s = last_arrival + tail_s
    if wall_s <= LONG_WALL_S:
        return None
    return (
        f"this wall-clock replay takes about {_duration(wall_s)} (last arrival {last_arrival:,.1f} s "
        f"+ {tail_s:g} s tail; start-up aside); --clock virtual runs it in seconds, "
        f"--speedup, --max-gap, --max-requests or --end shorten it, and `kvdrain inspect` previews it"
    )


def shaped_requests(
    path: str | Path, fmt: str | None, shaping: ShapingOptions, skip_bad_lines: bool = False
) -> Iterator[TraceRequest]:
    """The shaped trace's requests, streaming, in replay time."""
    for rec in shape(read_trace(path, fmt, skip_bad_lines=skip_bad_lines), shaping, ShapingLog()):
        if isinstance(rec, TraceRequest):
            yield rec


def shaped_last_arrival(
    path: str | Path, fmt: str | None, shaping: ShapingOptions, skip_bad_lines: bool = False
) -> float:
    """The replay time of the shaped trace's last request (0 when shaping leaves none)."""
    last = 0.0
    for req in shaped_requests(path, fmt, shaping, skip_bad_lines):
        last = req.t
    return last


def no_request_left(
    path: str | Path,
    fmt: str | None,
    shaping: ShapingOptions,
    num_requests: int,
    skip_bad_lines: bool = False,
) -> str | None:
    """Why a replay would send nothing: a --start/--end window that holds none of the
    trace's requests (None: it holds some, or no window was given)."""
    if shaping.start is None and shaping.end is None:
        return None
    if next(shaped_requests(path, fmt, shaping, skip_bad_lines), None) is not None:
        return None
    given = " ".join(
        f"--{name} {value:g}"
        for name, value in (("start", shaping.start), ("end", shaping.end))
        if value is not None
    )
    return (
        f"{path}: {given} keeps none of the trace's {num_requests:,} requests, so a replay would "
        f"send nothing and prove nothing; `kvdrain inspect {path}` shows when they arrive"
    )


def only_tail_note(coverage, speedup: float, idle_threshold_s: float) -> str | None:
    """A sped-up run whose only idle window is the tail: the trace's gaps fell below
    the idle threshold, so the verdict covers the tail alone; say so."""
    if speedup <= 1 or not coverage or any(not c.is_tail for c in coverage):
        return None
    return (
        f"at --speedup {speedup:g} no gap between arrivals is {idle_threshold_s:g} s or longer, "
        f"so only the tail was checked; a lower --speedup, a lower --idle-threshold or "
        f"--insert-idle keeps idle windows in the run (`kvdrain inspect --speedup "
        f"{speedup:g}` shows the gaps)"
    )
