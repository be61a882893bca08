"""Plain records shared by both sides of the parity harness: configs, requests, snapshots.

Runs in: the parity venv only (imports neither vLLM nor kvdrain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

VOCAB_SIZE = 512  # kvdrain's default model vocabulary; tokens stay below it


@dataclass(frozen=True, slots=True)
class SchedConfig:
    """What both schedulers are built from (kvdrain's EngineConfig fields)."""

    num_blocks: int = 64  # includes the null block 0, on both sides
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    eos_token_id: int | None = None
    role: str | None = None  # None: no connector; "P": kv_producer; "D": kv_consumer
    legacy: bool = False  # pre-#43433 liveness on both sides
    reserve_full_isl: bool = True  # vLLM's scheduler_reserve_full_isl (its default)
    kv_load_failure_policy: str = "fail"  # vLLM 0.32's default
    # vLLM's AsyncScheduler and the engine core's batch queue (step_with_batch_queue),
    # against kvdrain's (engine/core/async_scheduler.py, engine/core/batch_queue.py).
    async_scheduling: bool = False
    # The release kvdrain follows (engine/core/release.py); the harness sets it to the
    # vLLM it compares against.
    vllm_release: str = "0.34"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    remote: str | None = None  # "decode" (P side) or "prefill" (D side)

    def kv_transfer_params(self, block_size: int) -> dict | None:
        """Fresh params (both schedulers mutate them), like a router would send."""
        if self.remote == "decode":
            return {"do_remote_decode": True}
        if self.remote != "prefill":
            return None
        num_blocks = -(-len(self.prompt) // block_size)
        return {
            "do_remote_prefill": True,
            "remote_engine_id": "P",
            "remote_request_id": f"p-{self.req_id}",
            "remote_block_ids": list(range(1, num_blocks + 1)),
            "remote_host": "localhost",  # vLLM's NIXL needs host, port and tp_size
            "remote_port": 5600,
            "tp_size": 1,
            "remote_addr": "tcp://localhost:5600",  # kvdrain's host and port
        }


@dataclass(frozen=True, slots=True)
class Arrival:
    tick: int
    spec: RequestSpec


@dataclass(frozen=True, slots=True)
class Abort:
    tick: int
    req_id: str


@dataclass(frozen=True, slots=True)
class Reject:
    """D refuses the request before admission (vLLM: notify_kv_transfer_request_rejected,
    a request aborted as it is added; kvdrain: Scheduler.reject_request): what its params
    hold on P must be released."""

    tick: int
    spec: RequestSpec


LegFault = Literal["dropped", "rejected"]


@dataclass(slots=True)
class Workload:
    name: str
    seed: int
    config: SchedConfig
    events: list[Arrival | Abort | Reject]
    eos_prob: float = 0.0  # chance that a sampled token is EOS
    stop_prob: float = 0.0  # chance that a sampled token is one of the request's stop ids
    max_report_delay: int = 0  # ticks before the fake connector worker reports a transfer
    load_failure_prob: float = 0.0  # chance that a remote load loses one block
    num_ticks: int = 200
    # P side: sends whose D leg never reads them ("dropped": P's worker frees them when
    # their lease runs out, lease_ticks after the send) or was refused by D ("rejected":
    # D's worker tells P to free them at once).
    leg_faults: dict[str, LegFault] = field(default_factory=dict)
    lease_ticks: int = 40
    # Requests aborted while the step carrying their last prefill chunk runs: handled
    # before that step's output is processed (vLLM's _process_aborts_queue).
    aborts_in_last_prefill: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's output of one step, as the frontend sees it."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None


@dataclass(slots=True)
class Snapshot:
    """Everything compared after a tick; equal snapshots mean the sides agree."""

    stepped: bool = False
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Scheduled requests sent to the runner in full: first scheduled, or resumed after a
    # preemption (vLLM 0.34's scheduled_new_reqs; 0.32 and 0.33 send a resumed one as a
    # cached request named in resumed_req_ids).
    new_req_ids: tuple[str, ...] = ()
    outputs: list[StepOutput] = field(default_factory=list)
    free: int = 0
    used: int = 0
    cached_free: int = 0  # free blocks that still hold a prefix hash (evictable)
    running: int = 0
    waiting: int = 0  # every unfinished request not running (all waiting queues)
    waiting_for_remote_kvs: int = 0
    held: int = 0  # finished but blocks still held (delayed free, aborted load)
    evictions: int = 0
    preemptions: int = 0
    has_requests: bool = False
    in_flight: int = 0  # batches scheduled, output not yet processed (async only)
    has_unfinished_requests: bool = False
    # Remote sends the step's connector metadata asks P to free without a read (vLLM
    # NIXL's receives that only notify P: a request finished or refused before its load,
    # or a full local prefix hit).
    released: tuple[str, ...] = ()
    block_tables: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def diff(self, other: Snapshot) -> list[str]:
        """Names of the fields that differ."""
        return [name for name in self.__slots__ if getattr(self, name) != getattr(other, name)]
