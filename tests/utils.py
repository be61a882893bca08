"""Test helpers in the spirit of vLLM's tests/v1/core/utils.py."""

from __future__ import annotations

from dataclasses import replace

from connector.pd import PDConnector
from engine.config import EngineConfig, KVTransferConfig
from engine.core.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler

BLOCK_SIZE = 4


def make_config(**overrides) -> EngineConfig:
    base = EngineConfig(
        num_blocks=64,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        liveness="poll",
    )
    return replace(base, **overrides)


def make_scheduler(use_kv_connector: bool = False, **overrides) -> Scheduler:
    if use_kv_connector:
        overrides.setdefault("kv_transfer", KVTransferConfig(kv_addr="ipc://p-worker"))
    config = make_config(**overrides)
    return Scheduler(config, PDConnector(config) if use_kv_connector else None)


def make_request(
    req_id: str,
    num_tokens: int = 10,
    max_tokens: int = 16,
    *,
    start: int = 0,
    params: dict | None = None,
    block_size: int = BLOCK_SIZE,
    eos_token_id: int | None = None,
    prompt: list[int] | None = None,
) -> Request:
    if prompt is None:
        prompt = [(start + i) % 500 for i in range(num_tokens)]
    return Request(
        req_id, prompt, max_tokens, block_size, eos_token_id=eos_token_id, kv_transfer_params=params
    )


def runner_output(
    sched_out: SchedulerOutput,
    token_id: int | None = None,
    finished_sending=(),
    finished_recving=(),
    invalid_block_ids=(),
) -> ModelRunnerOutput:
    """One sampled token per request that reached its end (vLLM's create_model_runner_output)."""
    sampled = {
        s.req_id: (token_id if token_id is not None else (s.token_ids[-1] + 1) % 512)
        for s in sched_out.scheduled
        if s.sample
    }
    kv = None
    if finished_sending or finished_recving or invalid_block_ids:
        kv = KVConnectorOutput(set(finished_sending), set(finished_recving), set(invalid_block_ids))
    return ModelRunnerOutput(sampled_token_ids=sampled, kv_connector_output=kv)


def step(sched: Scheduler, **kv) -> tuple[SchedulerOutput, list]:
    sched_out = sched.schedule()
    outputs = sched.update_from_output(sched_out, runner_output(sched_out, **kv))
    sched.block_pool.check_invariants()
    return sched_out, outputs


def assert_scheduler_empty(sched: Scheduler) -> None:
    """The leak oracle: nothing queued, nothing held, every block free."""
    assert not sched.requests, f"requests still held: {list(sched.requests)}"
    assert not sched.waiting and not sched.skipped_waiting and not sched.running
    assert not sched.held_for_send and not sched.held_for_recv
    assert not sched.finished_recving_kv_req_ids and not sched.failed_recving_kv_req_ids
    assert not sched.kv_cache_manager.req_to_blocks
    pool = sched.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    pool.check_invariants()
