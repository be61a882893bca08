"""Async scheduling (AsyncScheduler and the batch queue) against the synchronous scheduler as an oracle."""

from __future__ import annotations

import random

import pytest

from connector.pd import PDConnector
from engine.config import KVTransferConfig
from engine.core.async_scheduler import AsyncScheduler
from engine.core.engine_core import EngineCore
from engine.core.liveness import LoopAction, next_action
from engine.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from engine.runner.mock_runner import MockModelRunner
from tests.fake_kv_agent import FakeKVAgent
from tests.utils import make_config


class RecordingRunner(MockModelRunner):
    """The mock runner, keeping every batch it ran."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.batches: list[SchedulerOutput] = []

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.batches.append(sched_out)
        return super().execute(sched_out)


def make_core(
    async_scheduling: bool,
    role: str | None = None,
    send_after: int = 3,
    eos_token_id: int | None = None,
    **overrides,
) -> EngineCore:
    kv_transfer = KVTransferConfig(kv_role=role, kv_addr="ipc://w") if role else None
    config = make_config(
        async_scheduling=async_scheduling,
        kv_transfer=kv_transfer,
        eos_token_id=eos_token_id,
        **overrides,
    )
    connector = PDConnector(config) if role else None
    worker = FakeKVAgent(send_after) if role else None
    return EngineCore(config, RecordingRunner(config), connector, worker)


def run_to_idle(
    core: EngineCore, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 5000
) -> dict[str, tuple[list[int], str]]:
    """Steps while there is work (and until the arrivals are in); each request's
    tokens and finish reason."""
    arrivals = arrivals or {}
    streams: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    last_arrival = max(arrivals, default=-1)
    for step in range(max_steps):
        for req_id, prompt, max_tokens in arrivals.get(step, ()):
            core.add_request(req_id, prompt, max_tokens)
        if not core.has_work():
            if step > last_arrival:
                return {r: (streams.get(r, []), finished[r]) for r in finished}
            continue
        for output in core.step().outputs:
            streams.setdefault(output.req_id, []).extend(output.new_token_ids)
            if output.finished:
                finished[output.req_id] = output.finish_reason
    raise AssertionError("the engine never went idle")


def random_arrivals(seed: int, num: int = 24) -> dict[int, list[tuple]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(num):
        prompt = [rng.randrange(500) for _ in range(rng.randint(1, 90))]
        arrivals.setdefault(rng.randrange(40), []).append((f"r{i}", prompt, rng.randint(1, 30)))
    return arrivals


def test_engine_core_with_async_scheduling_runs_the_async_scheduler_and_a_batch_queue():
    core = make_core(True)
    assert isinstance(core.scheduler, AsyncScheduler)
    assert core.batch_queue is not None
    assert make_core(False).batch_queue is None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: preemptions with output in flight
def test_async_scheduling_gives_every_request_the_tokens_the_sync_scheduler_gives(seed, num_blocks):
    arrivals = random_arrivals(seed)
    sync = run_to_idle(make_core(False, num_blocks=num_blocks), arrivals)
    core = make_core(True, num_blocks=num_blocks)
    assert run_to_idle(core, arrivals) == sync
    pool = core.scheduler.block_pool
    assert pool.get_num_used_blocks() == 0 and not core.scheduler.requests
    pool.check_invariants()


def test_small_pool_preempts_requests_whose_output_is_in_flight():
    core = make_core(True, num_blocks=14)
    preempted_in_flight = []
    preempt = core.scheduler._preempt

    def watching(request, out):
        preempted_in_flight.append(request.num_in_flight_tokens > 0)
        preempt(request, out)

    core.scheduler._preempt = watching
    for seed in range(6):
        run_to_idle(core, random_arrivals(seed))
    assert any(preempted_in_flight)


def test_a_decode_is_scheduled_before_the_previous_token_is_processed():
    core = make_core(True)
    core.add_request("r", [10, 11, 12], 3)
    first = core.step()  # schedules the prefill; its output is in flight
    assert first.outputs == [] and len(core.batch_queue) == 1
    second = core.step()  # schedules the decode of the token in flight, then processes the prefill
    assert [o.new_token_ids for o in second.outputs] == [[13]]
    decode = core.model_runner.batches[1]
    assert decode.req_ids == ["r"] and decode.num_computed_tokens == [3]
    # The placeholder reached the runner as the token the prefill sampled.
    assert decode.token_ids == [13] and PLACEHOLDER_TOKEN_ID not in decode.token_ids


def test_async_scheduling_never_schedules_past_max_tokens():
    for async_scheduling in (False, True):
        core = make_core(async_scheduling)
        core.add_request("r", list(range(5)), 4)
        run_to_idle(core)
        scheduled = sum(b.total_num_scheduled_tokens for b in core.model_runner.batches)
        assert scheduled == 5 + 4 - 1  # the last sampled token never gets a slot


def test_an_eos_costs_async_scheduling_one_decode_whose_token_is_dropped():
    outcomes = {}
    for async_scheduling in (False, True):
        core = make_core(async_scheduling, eos_token_id=7)
        core.add_request("r", [3], 20)  # the mock runner samples 4, 5, 6, 7 = EOS
        outcomes[async_scheduling] = (
            run_to_idle(core),
            sum(b.total_num_scheduled_tokens for b in core.model_runner.batches),
        )
    assert outcomes[True][0] == outcomes[False][0] == {"r": ([4, 5, 6, 7], "stop")}
    assert outcomes[True][1] == outcomes[False][1] + 1


def test_an_abort_while_its_step_is_in_flight_drops_that_output():
    core = make_core(True)
    core.add_request("r", [1, 2, 3], 10)
    core.step()
    core.step()  # a decode is in flight
    core.abort_requests(["r"])
    outputs = [o for _ in range(3) for o in core.step().outputs]
    assert outputs == [] and not core.has_work()
    assert core.scheduler.block_pool.get_num_used_blocks() == 0


def test_a_consumer_frees_an_aborted_requests_blocks_only_after_its_step_in_flight():
    core = make_core(True, role="kv_consumer")
    core.add_request("r", list(range(20)), 10)
    core.step()  # the prefill is in flight
    pool = core.scheduler.block_pool
    num_used = pool.get_num_used_blocks()
    core.abort_requests(["r"])
    assert num_used > 0 and pool.get_num_used_blocks() == num_used
    assert core.scheduler.has_deferred_frees() and "r" not in core.scheduler.requests
    core.step()  # processes the prefill: its writes are done
    assert pool.get_num_used_blocks() == 0 and not core.scheduler.has_deferred_frees()


def test_a_producer_frees_a_delayed_request_when_its_send_is_reported():
    for async_scheduling in (False, True):
        core = make_core(async_scheduling, role="kv_producer", send_after=2)
        core.add_request("r", list(range(20)), 1, {"do_remote_decode": True})
        for _ in range(20):
            if not core.has_work():
                break
            core.step()
        assert not core.scheduler.requests and core.scheduler.block_pool.get_num_used_blocks() == 0


def test_every_policy_steps_at_once_when_only_a_batch_in_flight_is_left():
    for liveness in ("legacy", "poll", "event"):
        action = next_action(
            liveness, True, False, False, has_unfinished=False, only_in_flight=True
        )
        assert action is LoopAction.STEP
    assert next_action("poll", True, False, has_unfinished=True) is LoopAction.SLEEP


def test_engine_has_work_while_a_batch_is_in_flight_without_requests():
    core = make_core(True)
    core.add_request("r", [1, 2, 3], 1)
    seen = []
    while core.has_work():
        seen.append((core.scheduler.has_requests(), len(core.batch_queue)))
        core.step()
    # The last step had no request to schedule, only a batch to process.
    assert seen[-1] == (False, 1) and not core.batch_queue


def test_the_async_scheduler_overrides_only_what_vllms_overrides():
    """vLLM 0.32's AsyncScheduler: _update_after_schedule (placeholders) and
    _update_request_with_output; the rest of what a step in flight needs is Scheduler's."""
    overrides = {name for name in vars(AsyncScheduler) if not name.startswith("__")}
    assert overrides == {"_update_after_schedule", "_update_request_with_output"}


def pool_state(core: EngineCore) -> tuple:
    """Every block's hash and references, and the free queue's order."""
    pool = core.scheduler.block_pool
    blocks = [(b.block_id, b.block_hash, b.ref_cnt) for b in pool.blocks]
    return blocks, [b.block_id for b in pool.free_block_queue]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("role", [None, "kv_consumer", "kv_producer"])
def test_early_caching_caches_what_vllm_0_32_cached_at_every_step(seed, role):
    """0.33+ caches a landed token's blocks in update_from_output up to num_computed_tokens
    - num_in_flight_tokens, 0.32 in the AsyncScheduler up to num_computed_tokens -
    num_output_placeholders. With one token sampled per step the two are the same prefix:
    same pool, block for block, every step (a small pool: preemptions, evictions)."""
    cores = [
        make_core(True, role=role, num_blocks=14, vllm_release=release)
        for release in ("0.32", "0.34")
    ]
    assert [c.scheduler.caches_blocks_early for c in cores] == [False, True]
    arrivals = random_arrivals(seed)
    for step in range(400):
        for core in cores:
            for req_id, prompt, max_tokens in arrivals.get(step, ()):
                params = {"do_remote_decode": True} if role == "kv_producer" else None
                core.add_request(req_id, prompt, max_tokens, params)
            if core.has_work():
                core.step()
        assert pool_state(cores[0]) == pool_state(cores[1]), step
    assert not any(core.has_work() for core in cores)


def test_a_block_the_sampled_token_fills_is_cached_once_its_kv_lands():
    """The first sampled token's KV is written by the next step (the decode): its block
    is cached when that step's output is processed, under either release."""
    for release in ("0.32", "0.34"):
        core = make_core(True, vllm_release=release)
        core.add_request("r", list(range(7)), 10)  # blocks of 4: the 8th token fills block 1
        pool, cached = core.scheduler.block_pool, []
        for _ in range(3):  # the prefill in flight; its output; the first decode's output
            core.step()
            table = core.scheduler.kv_cache_manager.get_block_ids("r")
            cached.append(pool.blocks[table[1]].block_hash is not None)
        assert cached == [False, False, True]
