"""Trace shaping: window, gap caps, idle insertion, token scaling. Runs in: frontend process.

Every step works in trace time, before the speedup, in this order:
1. window: records with t < start are dropped, the stream stops at the first record
   with t >= end, and after `max_requests` requests it stops at the next request; an
   abort whose request was dropped is dropped too.
2. gap cap: a gap longer than `max_gap` between consecutive request arrivals shrinks to
   `max_gap`, moving everything after it earlier. Records inside a capped gap keep their
   offset from the previous arrival, at most `max_gap`. The lead-in before the first
   request is not a gap between arrivals and is kept.
3. inserted idle: `insert_idle` seconds after every `insert_idle_every` = N requests
   (between requests N and N+1, 2N and 2N+1, ...), or before the first record at or after
   each time in `insert_idle_at` (original trace times, as `kvdrain inspect` prints them; times
   before `start` are ignored).
4. token scaling: prompt and output lengths times `scale_tokens`, rounded, at least 1. A
   hash-id prompt scales its hash block size the same way (512 * 0.05 = 25.6 -> 26) and
   its length is clamped into what its ids cover, ((n-1)*block, n*block], so every shared
   block stays shared; a token-id prompt is cut, or repeated cyclically to grow.
   Recorded snapshots keep their counts (of the full-size trace); the log says so.
5. faults: seeded shares of requests get a fault (`--fault`, replay/trace/fault_shares.py);
   the log counts each.
Replay time is (shaped trace time - start) / speedup, with start 0 when none is given:
the first request keeps its own offset (t starts at 0 only if the trace's first record
is at `start`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.utils import cdiv
from replay.trace.fault_shares import FaultShares
from replay.trace.reader import TraceAbort, TraceHeader, TraceRecord, TraceRequest, TraceSnapshot
from replay.trace.records import scaled_lengths

LOG_EXAMPLES = 3


def _require(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


@dataclass(frozen=True, slots=True)
class ShapingOptions:
    """How to reshape a trace before replay; the defaults change nothing."""

    speedup: float = 1.0
    start: float | None = None
    end: float | None = None
    max_requests: int | None = None
    max_gap: float | None = None
    insert_idle: float | None = None
    insert_idle_every: int | None = None
    insert_idle_at: tuple[float, ...] = ()
    scale_tokens: float = 1.0
    faults: FaultShares = field(default_factory=FaultShares)

    def __post_init__(self) -> None:
        _require(self.speedup > 0, "speedup", f"must be > 0, got {self.speedup!r}")
        _require(self.scale_tokens > 0, "scale_tokens", f"must be > 0, got {self.scale_tokens!r}")
        for name in ("start", "max_gap"):
            value = getattr(self, name)
            _require(value is None or value >= 0, name, f"must be >= 0, got {value!r}")
        _require(
            self.end is None or self.end > (self.start or 0.0),
            "end",
            f"must be > start ({self.start or 0.0}), got {self.end!r}",
        )
        _require(
            self.max_requests is None or self.max_requests >= 1,
            "max_requests",
            f"must be >= 1, got {self.max_requests!r}",
        )
        _require(
            self.insert_idle is None or self.insert_idle > 0,
            "insert_idle",
            f"must be > 0, got {self.insert_idle!r}",
        )
        where = (self.insert_idle_every is not None) + bool(self.insert_idle_at)
        _require(
            where == (self.insert_idle is not None),
            "insert_idle",
            "needs exactly one of insert_idle_every or insert_idle_at, and they need it",
        )
        _require(
            self.insert_idle_every is None or self.insert_idle_every >= 1,
            "insert_idle_every",
            f"must be >= 1, got {self.insert_idle_every!r}",
        )
        _require(
            all(t >= 0 for t in self.insert_idle_at),
            "insert_idle_at",
            f"times must be >= 0, got {self.insert_idle_at!r}",
        )


@dataclass(slots=True)
class ShapingLog:
    """Every change shaping made: a count and the first few examples of each kind."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, example: str) -> None:
        """Count one change of `kind`, keeping `example` if it is among the first few."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < LOG_EXAMPLES:
            shown.append(example)

    def lines(self) -> list[str]:
        """One line per kind of change, in the order first seen: a change made once as
        itself, one made n times as "n times" and its first few examples."""
        return [
            f"{kind}: {self.examples[kind][0]}"
            if n == 1
            else f"{kind}: {n:,} times ({'; '.join(self.examples[kind])}"
            f"{'; ...' if n > len(self.examples[kind]) else ''})"
            for kind, n in self.counts.items()
        ]


def scale_request(req: TraceRequest, factor: float, t: float | None = None) -> TraceRequest:
    """`req` with its prompt and output lengths scaled, keeping its prefix structure (and
    moved to `t` if given: one new record, not two)."""
    length, max_tokens, block = scaled_lengths(req, factor)
    token_ids = req.prompt_token_ids
    if token_ids is not None:
        token_ids = (token_ids * cdiv(length, len(token_ids)))[:length]
    return dataclasses.replace(
        req,
        t=req.t if t is None else t,
        max_tokens=max_tokens,
        prompt_len=length,
        prompt_token_ids=token_ids,
        hash_block_size=block,
    )


@dataclass(slots=True)
class _Clock:
    """Trace-time offsets built up while streaming (steps 2 and 3)."""

    idle_at: list[float]  # sorted insert_idle_at times not yet passed
    last_arrival: float | None = None  # original t of the previous request
    last_shaped: float = 0.0  # its t after gap caps
    removed: float = 0.0  # seconds cut out by gap caps so far
    inserted: float = 0.0  # seconds of idle inserted so far
    num_requests: int = 0


def _insert_idle(rec: TraceRecord, opts: ShapingOptions, clock: _Clock, log: ShapingLog) -> None:
    idle, every, n = opts.insert_idle or 0.0, opts.insert_idle_every, clock.num_requests
    while clock.idle_at and rec.t >= clock.idle_at[0]:
        clock.inserted += idle
        log.note("inserted idle", f"{idle:g} s at t={clock.idle_at.pop(0):g} s")
    if isinstance(rec, TraceRequest) and every and n and n % every == 0:
        clock.inserted += idle
        log.note("inserted idle", f"{idle:g} s after request {n} (t={rec.t:.3f} s)")


def _shift(rec: TraceRecord, opts: ShapingOptions, clock: _Clock, log: ShapingLog) -> float:
    """The shaped trace time of `rec`: inserted idle and capped gaps applied."""
    _insert_idle(rec, opts, clock, log)
    gap = None if clock.last_arrival is None else rec.t - clock.last_arrival
    is_capped = opts.max_gap is not None and gap is not None and gap > opts.max_gap
    if not isinstance(rec, TraceRequest):
        if is_capped:  # inside a capped gap: at most max_gap after the previous arrival
            return clock.last_shaped + opts.max_gap + clock.inserted
        return rec.t - clock.removed + clock.inserted
    if is_capped:
        clock.removed += gap - opts.max_gap
        log.note(
            "capped gap", f"at t={clock.last_arrival:.3f} s from {gap:.3f} s to {opts.max_gap:g} s"
        )
    clock.last_arrival, clock.last_shaped = rec.t, rec.t - clock.removed
    clock.num_requests += 1
    return clock.last_shaped + clock.inserted


def _in_window(
    rec: TraceRecord, opts: ShapingOptions, kept: set[str], log: ShapingLog
) -> bool | None:
    """Whether to keep `rec`; None ends the stream."""
    if opts.end is not None and rec.t >= opts.end:
        log.note("stopped at end", f"first record past end={opts.end:g} s at t={rec.t:.3f} s")
        return None
    if (
        isinstance(rec, TraceRequest)
        and opts.max_requests is not None
        and len(kept) >= opts.max_requests
    ):
        log.note(
            "stopped at max_requests",
            f"{opts.max_requests} requests kept, stopped at t={rec.t:.3f} s",
        )
        return None
    if opts.start is not None and rec.t < opts.start:
        log.note("dropped before start", f"{type(rec).__name__} at t={rec.t:.3f} s")
        return False
    if isinstance(rec, TraceAbort) and rec.req_id not in kept:
        log.note("dropped abort", f"of {rec.req_id!r}, whose request was dropped")
        return False
    if isinstance(rec, TraceRequest):
        kept.add(rec.req_id)
    return True


def shape(
    records: Iterator[TraceRecord], opts: ShapingOptions, log: ShapingLog | None = None
) -> Iterator[TraceRecord]:
    """Stream `records` reshaped by `opts`, t in replay seconds; changes go to `log`."""
    log = ShapingLog() if log is None else log
    for rec in _shaped(records, opts, log):
        if not (opts.faults and isinstance(rec, TraceRequest)):
            yield rec
            continue
        for out in opts.faults.put_into(rec):
            if out is not rec:  # a fault the shares put in
                name = out.fault if isinstance(out, TraceRequest) else f"abort_{out.when}"
                log.note(f"fault {name}", rec.req_id)
            yield out


def _shaped(
    records: Iterator[TraceRecord], opts: ShapingOptions, log: ShapingLog
) -> Iterator[TraceRecord]:
    """Steps 1 to 4 (module docstring) and the speedup."""
    base = opts.start or 0.0
    clock = _Clock(sorted(t for t in opts.insert_idle_at if t >= base))
    kept: set[str] = set()  # ids of the requests let through, for their aborts
    if opts.speedup != 1.0:
        log.note("speedup", f"replay t = (trace t - {base:g} s) / {opts.speedup:g}")
    for rec in records:
        if isinstance(rec, TraceHeader):
            yield rec
            continue
        keep = _in_window(rec, opts, kept, log)
        if keep is None:
            return
        if not keep:
            continue
        t = (_shift(rec, opts, clock, log) - base) / opts.speedup
        if isinstance(rec, TraceRequest) and opts.scale_tokens != 1.0:
            scaled = scale_request(rec, opts.scale_tokens, t)
            log.note(
                "scaled tokens",
                f"{rec.req_id}: prompt {rec.prompt_len} -> "
                f"{scaled.prompt_len}, output {rec.max_tokens} -> "
                f"{scaled.max_tokens}",
            )
            yield scaled
            continue
        if isinstance(rec, TraceSnapshot) and opts.scale_tokens != 1.0:
            log.note("unscaled snapshot", f"t={rec.t:.3f} s: its counts are of the full-size trace")
        yield dataclasses.replace(rec, t=t)
