"""Plain records that flow scheduler -> runner -> scheduler -> frontend. Runs in: engine-core process."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions from `num_computed_tokens`."""

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    # Blocks appended to the request's block table this step. When `is_new` the table
    # starts over from these (first schedule, or resumed after preemption).
    new_block_ids: list[int]
    is_new: bool
    # True when this chunk reaches the end of the request's known tokens: sample one.
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Finished since the previous schedule(): the worker side drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: object | None = None


@dataclass(slots=True)
class KVConnectorOutput:
    """What the connector's worker side reports back through the runner output."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # What died on the worker side (say, the connector worker process); None: healthy.
    worker_error: str | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass(slots=True)
class ModelRunnerOutput:
    # One sampled token per request whose computed tokens reached its length this step.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Requests the runner could not execute (bad token ids, bad block table): id -> why.
    failed: dict[str, str] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class RequestOutput:
    """Per request per step, to the frontend (vLLM's EngineCoreOutput)."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" (also ignored) | "abort" | "error"
    kv_transfer_params: dict | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    """Queue and block counts of one engine at one moment."""

    num_waiting: int = 0
    num_skipped_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_running: int = 0
    num_finished_awaiting_free: int = 0
    num_blocks: int = 0  # usable blocks, the null block excluded
    num_used_blocks: int = 0
    num_cached_blocks: int = 0  # free but still holding a prefix hash
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_stale_kv_reports: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (once per request)
    num_kv_load_failures: int = 0
