"""Trace records: what one line of a trace means, whatever its format. Runs in: frontend process.

The readers (replay/trace/reader.py, replay/trace/formats.py) yield these in file order; the
shaping, synthesis, simulation and verification code consume them. replay/trace/reader.py
re-exports every name here, so `from replay.trace.reader import TraceRequest` is the usual import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

DEFAULT_HASH_BLOCK_SIZE = 16

# The phases of a request's way, as the client can tell them (replay/deploy/pd_flow.py):
# P has it and has not answered; P answered and D has streamed no token; D is streaming.
AbortPhase = Literal["prefill", "transfer", "decode"]
ABORT_PHASES: tuple[str, ...] = get_args(AbortPhase)
# What the trace makes of a request's D leg: never sent, or sent in a form D refuses.
RequestFault = Literal["drop_decode", "reject_decode"]
REQUEST_FAULTS: tuple[str, ...] = get_args(RequestFault)
# What the trace does to an engine's processes.
EngineAction = Literal["pause", "kill"]
ENGINE_ACTIONS: tuple[str, ...] = get_args(EngineAction)

# The reader's caps, whatever the engines: they bound what one line can make us allocate.
MAX_LINE_BYTES = 8 << 20  # one line; holds a prompt of MAX_PROMPT_TOKENS ids below 10**6
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in one JSONL line
MAX_TRACE_T = 1e7  # seconds (about 116 days) from the trace start
MAX_PROMPT_TOKENS = 1 << 20  # prompt length, and the tokens of one hash block
MAX_OUTPUT_TOKENS = 1 << 20  # max_tokens
MAX_ID_CHARS = 256  # a request id
MAX_TOKEN_ID = (1 << 31) - 1  # a prompt token id, before the vocabulary check
MAX_COUNT = (1 << 31) - 1  # a snapshot's block or queue count
MAX_ENGINES = 64  # engines in a snapshot's kv or queues


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
    fault: RequestFault | None = None  # what becomes of its D leg; None: it is sent


@dataclass(frozen=True, slots=True)
class TraceAbort:
    """The client aborts request `req_id` at `t`; with `when`, at the first moment at or
    after t that the request is in that phase."""

    t: float
    req_id: str
    line: int = 0
    when: AbortPhase | None = None


@dataclass(frozen=True, slots=True)
class TraceEngineFault:
    """At `t` an engine's processes are paused for `for_s` seconds (SIGSTOP, then SIGCONT)
    or killed (SIGKILL); only where kvdrain owns them."""

    t: float
    action: EngineAction
    engine: str
    for_s: float | None = None  # a pause's length; None for a kill
    line: int = 0


@dataclass(frozen=True, slots=True)
class TraceSnapshot:
    """Recorded per-engine KV block counts and queue lengths at `t`."""

    t: float
    kv: dict[str, dict[str, int]]
    queues: dict[str, dict[str, int]] = field(default_factory=dict)
    line: int = 0


TraceRecord = TraceHeader | TraceRequest | TraceAbort | TraceSnapshot | TraceEngineFault


def scaled(n: int, factor: float) -> int:
    """A token count times `factor`, rounded, at least 1."""
    return max(1, int(n * factor + 0.5))


def scaled_lengths(req: TraceRequest, factor: float) -> tuple[int, int, int]:
    """(prompt_len, max_tokens, hash_block_size) of `req` after token scaling.

    A hash-id prompt scales its block size the same way and its length is clamped into
    what its ids cover, ((n-1)*block, n*block], so every shared block stays shared.
    """
    if factor == 1.0:
        return req.prompt_len, req.max_tokens, req.hash_block_size
    length, block = scaled(req.prompt_len, factor), req.hash_block_size
    if req.hash_ids is not None:
        block, n = scaled(block, factor), len(req.hash_ids)
        length = min(max(length, (n - 1) * block + 1), n * block)
    return length, scaled(req.max_tokens, factor), block
