"""Switches that remove one known divergence on the vLLM side, to confirm each cause alone.

Runs in: the parity venv. Each switch makes vLLM 0.32.0 behave like kvdrain did before
issue 10 on one point (kvdrain now follows vLLM, so a switch turned on shows that cause
as a difference); all off (the default) is vLLM as shipped. Patches are per Scheduler
instance where vLLM allows it, module-level only for check_stop (restored by nobody:
one process, one run).
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


def apply(scheduler: Scheduler, switches: VllmSwitches) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    if switches.append_all_frees:
        _append_all_frees(pool)
    if switches.one_block_per_hash:
        _one_block_per_hash(pool)
    sched_module.check_stop = _length_first_check_stop if switches.length_before_stop else vllm_check_stop


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
