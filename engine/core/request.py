"""A request and its lifecycle status. Runs in: engine-core process."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.block_hash import BlockHash, hash_request_blocks


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > _PREEMPTED


# Statuses above it are finished. A plain name: on Python 3.11 each read of an Enum
# class attribute goes through its metaclass's __getattr__ hook (~850 instructions).
_PREEMPTED = RequestStatus.PREEMPTED

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",  # vLLM's _FINISHED_REASON_MAP
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)  # identity: queues remove by object
class Request:
    """A request: its tokens, its progress through the scheduler and its stop conditions.

    Fields in the order a decode step reads them. With its 20 slots a Request takes
    192 bytes, three 64-byte cache lines from a line boundary (CPython 3.11's small
    object allocator): the first holds the object's header and the first six fields,
    all that schedule() reads of a decode; update_from_output reads these and the
    second line's. The first four constructor arguments stay positional (req_id,
    prompt_token_ids, max_tokens, block_size); the others are keyword-only.
    """

    req_id: str
    # len(all_token_ids) and len(prompt_token_ids), kept as plain ints: the scheduler
    # reads them per request per step. (Not constructor arguments.)
    num_tokens: int = field(init=False, default=0)
    num_computed_tokens: int = field(default=0, kw_only=True)
    # The prompt, then every sampled token (output_token_ids is its tail).
    all_token_ids: list[int] = field(default_factory=list, kw_only=True)
    prompt_token_ids: list[int]
    max_tokens: int
    num_prompt_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(default=RequestStatus.WAITING, kw_only=True)
    eos_token_id: int | None = field(default=None, kw_only=True)
    stop_token_ids: tuple[int, ...] = field(default=(), kw_only=True)
    num_cached_tokens: int = field(
        default=-1, kw_only=True
    )  # prefix-cache hit tokens at first admission
    block_size: int
    block_hashes: list[BlockHash] = field(default_factory=list, kw_only=True)
    kv_transfer_params: dict | None = field(default=None, kw_only=True)
    num_preemptions: int = field(default=0, kw_only=True)
    # Async scheduling only (scheduler.py, "steps in flight"; vLLM's names): tokens the
    # model samples in steps not yet processed; tokens scheduled in such steps; of those,
    # the ones scheduled before a preemption (their output is stale); whether stale
    # output is dropped rather than delivered; the last step that scheduled it.
    num_output_placeholders: int = field(default=0, kw_only=True)
    num_in_flight_tokens: int = field(default=0, kw_only=True)
    num_stale_output_tokens: int = field(default=0, kw_only=True)
    drop_stale_output: bool = field(default=False, kw_only=True)
    last_sched_seq: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: request {self.req_id!r} has an empty prompt")
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens = len(self.all_token_ids)
        hash_request_blocks(self.all_token_ids, self.block_size, self.block_hashes)

    @property
    def output_token_ids(self) -> list[int]:
        """The sampled tokens so far (a copy: append with append_output_token_ids)."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return self.status > _PREEMPTED

    def append_output_token_ids(self, token_id: int) -> None:
        """Append a sampled token; a block it fills gets its prefix hash now, once."""
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
        if self.num_tokens % self.block_size == 0:
            hash_request_blocks(self.all_token_ids, self.block_size, self.block_hashes)

    def get_finished_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
