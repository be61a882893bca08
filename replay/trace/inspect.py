"""Trace inspection for `kvdrain inspect`. Runs in: frontend process."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

from replay.trace.reader import TraceAbort, TraceRequest, TraceSnapshot, detect_format, read_trace

TOP_GAPS = 5


@dataclass(frozen=True, slots=True)
class IdleGap:
    """A gap between consecutive request arrivals."""

    start: float  # t of the arrival before the gap
    length: float
    after_line: int  # file line of that arrival


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceInspection:
    """What `inspect_trace` measured; arrivals and gaps are in trace seconds."""

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


def inspect_trace(path: str | Path, fmt: str | None = None,
                  idle_threshold: float = 5.0) -> TraceInspection:
    """Measure a trace in one streaming pass."""
    if not idle_threshold > 0:
        raise ValueError(f"idle_threshold: must be > 0, got {idle_threshold!r}")
    fmt = detect_format(path) if fmt is None else fmt
    records = read_trace(path, fmt)
    counts = {TraceRequest: 0, TraceAbort: 0, TraceSnapshot: 0}
    first = last = None
    prompt = output = num_gaps = num_refs = num_reused = 0
    top: list[tuple[float, float, int]] = []  # min-heap of (length, start, line)
    seen: set[int] = set()
    for rec in records:
        counts[type(rec)] = counts.get(type(rec), 0) + 1
        if not isinstance(rec, TraceRequest):
            continue
        if last is not None and rec.t - last.t >= idle_threshold:
            num_gaps += 1
            heapq.heappush(top, (rec.t - last.t, last.t, last.line))
            if len(top) > TOP_GAPS:
                heapq.heappop(top)
        first, last = rec if first is None else first, rec
        prompt, output = prompt + rec.prompt_len, output + rec.max_tokens
        for hash_id in rec.hash_ids or ():
            num_reused += hash_id in seen
            seen.add(hash_id)
        num_refs += len(rec.hash_ids or ())
    gaps = tuple(IdleGap(start, length, line) for length, start, line in sorted(top, reverse=True))
    duration = last.t - first.t if last is not None else 0.0
    return TraceInspection(path=str(path), format=fmt, num_requests=counts[TraceRequest],
                           num_aborts=counts[TraceAbort], num_snapshots=counts[TraceSnapshot],
                           duration=duration, total_prompt_tokens=prompt, total_output_tokens=output,
                           idle_threshold=idle_threshold, num_idle_gaps=num_gaps, top_gaps=gaps,
                           num_hash_refs=num_refs, num_reused_refs=num_reused)


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
    lines += [f"  {gap.length:9.3f} s after t={gap.start:.3f} s (line {gap.after_line})"
              for gap in insp.top_gaps]
    if insp.prefix_reuse is None:
        lines.append("prefix-block reuse: n/a (no hash ids)")
    else:
        lines.append(f"prefix-block reuse: {insp.prefix_reuse:.1%} ({insp.num_reused_refs:,} "
                     f"of {insp.num_hash_refs:,} hash-id block references repeat an earlier id)")
    return lines
