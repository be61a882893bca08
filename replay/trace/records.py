"""Trace records: what one line of a trace means, whatever its format. Runs in: frontend process.

The readers (replay/trace/reader.py, replay/trace/formats.py) yield these in file order; the
shaping, synthesis, simulation and verification code consume them. replay/trace/reader.py
re-exports every name here, so `from replay.trace.reader import TraceRequest` is the usual import.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_HASH_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """The optional first line of a kvdrain trace: version and free-form metadata."""

    version: int
    metadata: dict[str, object]
    line: int = 1


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request arriving at `t` seconds of trace time."""

    t: float
    req_id: str
    max_tokens: int
    prompt_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
    pd: bool | None = None
    line: int = 0


@dataclass(frozen=True, slots=True)
class TraceAbort:
    """The client aborts request `req_id` at `t`."""

    t: float
    req_id: str
    line: int = 0


@dataclass(frozen=True, slots=True)
class TraceSnapshot:
    """Recorded per-engine KV block counts and queue lengths at `t`."""

    t: float
    kv: dict[str, dict[str, int]]
    queues: dict[str, dict[str, int]] = field(default_factory=dict)
    line: int = 0


TraceRecord = TraceHeader | TraceRequest | TraceAbort | TraceSnapshot
