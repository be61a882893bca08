"""Switches that turn one behaviour of vLLM off on the vLLM side, to confirm each known cause alone.

Runs in: a parity venv. Each switch makes vLLM behave, on one point, as a naive model
would (kvdrain follows vLLM there, so a switch turned on shows that cause as a
difference); all off (the default) is vLLM as shipped. Patches are per Scheduler
instance where vLLM allows it, module-level only for check_stop (set again by every
apply). CAUSES names each switch with the workloads and modes that show it;
`python -m tests.parity.run --check-causes` confirms every one still does, and
`--check-releases` that kvdrain told the release before a behaviour matches vLLM with
that behaviour switched off (vLLM's own code standing in for the older release).
"""

from __future__ import annotations

from dataclasses import dataclass

import vllm.v1.core.sched.scheduler as sched_module
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import check_stop as vllm_check_stop
from vllm.v1.request import RequestStatus


@dataclass(frozen=True, slots=True)
class VllmSwitches:
    reserve_full_isl: bool = True  # False: scheduler_reserve_full_isl=False, vLLM only (cause 1)
    kv_load_failure_policy: str | None = None  # None: the workload's (both sides)
    append_all_frees: bool = False  # free_blocks appends unhashed blocks too (cause 2)
    one_block_per_hash: bool = False  # no duplicate cached blocks (cause 3)
    length_before_stop: bool = False  # check_stop tests length before EOS/stop ids (cause 7)
    # Async scheduling: a consumer frees at once, though a step in flight may still write
    # the blocks (vLLM: defer_block_free, sched/scheduler.py _free_request_blocks).
    no_defer_block_free: bool = False
    # Async scheduling: a producer delivers a preempted request's stale output (vLLM:
    # requires_kv_delivery drops it, sched/scheduler.py _preempt_request).
    deliver_stale_on_producer: bool = False
    # An abort that arrives during a step is handled after its output, as before vLLM
    # #29987 (engine/core.py _process_aborts_queue, 0.13.0).
    abort_after_output: bool = False
    # D's refusal before admission does not reach the engine, as before vLLM #41269
    # (AsyncLLM.notify_kv_transfer_request_rejected, 0.21.0).
    no_rejection_notice: bool = False


@dataclass(frozen=True, slots=True)
class Cause:
    """A known behaviour of vLLM kvdrain follows, the switch that turns it off on the
    vLLM side, and where that shows: workloads, in which scheduling modes."""

    name: str
    switches: VllmSwitches
    workloads: tuple[str, ...]
    modes: tuple[str, ...] = ("sync", "async")
    # The last vLLM release without the behaviour, if the switch restores what it did
    # (engine/core/release.py): kvdrain told that release must match vLLM so switched.
    before: str | None = None


CAUSES = (
    Cause(
        "admission reserves the whole sequence (scheduler_reserve_full_isl)",
        VllmSwitches(reserve_full_isl=False),
        ("pressure",),
    ),
    Cause(
        "unhashed freed blocks go to the free queue's head",
        VllmSwitches(append_all_frees=True),
        ("pressure",),
    ),
    Cause(
        "a second block may be cached under a cached hash",
        VllmSwitches(one_block_per_hash=True),
        ("d_side", "d_pressure"),
    ),
    Cause(
        "EOS and stop ids before the length caps (check_stop)",
        VllmSwitches(length_before_stop=True),
        ("stops",),
    ),
    Cause(
        "kv_load_failure_policy fail, vLLM's default",
        VllmSwitches(kv_load_failure_policy="recompute"),
        ("d_side",),
    ),
    Cause(
        "a consumer defers frees past the step in flight",
        VllmSwitches(no_defer_block_free=True),
        ("d_side", "d_decode_pressure"),
        ("async",),
    ),
    Cause(
        "a producer drops a preempted request's stale output",
        VllmSwitches(deliver_stale_on_producer=True),
        ("p_pressure",),
        ("async",),
    ),
    Cause(
        "an abort during the last prefill step is taken before its output",
        VllmSwitches(abort_after_output=True),
        ("p_faults",),
        before="0.12.0",
    ),
    Cause(
        "D's refusal before admission tells P to free the send",
        VllmSwitches(no_rejection_notice=True),
        ("d_faults",),
        before="0.20.2",
    ),
)


def apply(scheduler: Scheduler, switches: VllmSwitches) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    if switches.append_all_frees:
        _append_all_frees(pool)
    if switches.one_block_per_hash:
        _one_block_per_hash(pool)
    sched_module.check_stop = (
        _length_first_check_stop if switches.length_before_stop else vllm_check_stop
    )
    if switches.no_defer_block_free:
        scheduler.defer_block_free = False
    if switches.deliver_stale_on_producer:
        scheduler.requires_kv_delivery = False


def _append_all_frees(pool: BlockPool) -> None:
    """kvdrain: every freed block joins the free queue's tail, in the given order."""

    def free_blocks(ordered_blocks) -> None:
        released = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                released.append(block)
        pool.free_block_queue.append_n(released)

    pool.free_blocks = free_blocks


def _one_block_per_hash(pool: BlockPool) -> None:
    """kvdrain: a block computed under an already-cached hash stays uncached."""
    original = pool._insert_block_hash

    def insert(block_hash, block, num_tokens) -> None:
        if pool.cached_block_hash_to_block.get_one_block(block_hash) is not None:
            return
        original(block_hash, block, num_tokens)

    pool._insert_block_hash = insert


def _length_first_check_stop(request, max_model_len: int) -> bool:
    """kvdrain: length caps first, then EOS, then stop ids."""
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return vllm_check_stop(request, max_model_len)
