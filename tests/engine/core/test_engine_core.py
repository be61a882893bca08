"""EngineCore driven by the liveness rule, as the process shell drives it (no sockets)."""

from __future__ import annotations

import pytest

from connector.pd import PDConnector
from engine.config import KVTransferConfig
from engine.core.engine_core import EngineCore, EngineStepResult
from engine.core.liveness import LoopAction, next_action
from engine.runner.mock_runner import MockModelRunner
from tests.fake_kv_agent import FakeKVAgent
from tests.utils import make_config


def make_core(liveness: str, send_after: int = 3, connector: bool = True) -> EngineCore:
    config = make_config(liveness=liveness, kv_transfer=KVTransferConfig() if connector else None)
    agent = FakeKVAgent(send_after) if connector else None
    return EngineCore(
        config, MockModelRunner(config), PDConnector(config) if connector else None, agent
    )


def run_until_blocked(core: EngineCore, max_steps: int = 100) -> list[LoopAction]:
    """The busy loop, minus the sockets: step until the policy says block."""
    actions = []
    for _ in range(max_steps):
        result = core.step()
        action = next_action(
            core.config.liveness,
            core.has_work(),
            result.model_executed,
            result.can_progress,
            core.must_poll(),
            has_unfinished=core.has_unfinished_requests(),
        )
        actions.append(action)
        if action in (LoopAction.WAIT_INPUT, LoopAction.WAIT_ANY):
            if action == LoopAction.WAIT_ANY and core.connector_agent.pending_send:
                continue  # a connector report would wake it; the fake reports on poll
            return actions
    raise AssertionError("the loop never blocked")


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_engine_loop_collects_delayed_free_only_when_fixed(liveness):
    core = make_core(liveness)
    core.add_request("r", list(range(20)), 1, {"do_remote_decode": True})
    actions = run_until_blocked(core)
    stats = core.make_stats()
    if liveness == "legacy":
        # Parks right after shipping the finished id: the blocks stay held.
        assert actions[-1] == LoopAction.WAIT_INPUT
        assert stats.num_used_blocks == 5 and stats.num_finished_awaiting_free == 1
        assert core.connector_agent.num_polls == 2
        # The next request wakes the loop, and only then are the blocks freed.
        core.add_request("next", list(range(100, 104)), 1)
        run_until_blocked(core)
        assert "r" not in core.scheduler.requests
        return
    expected_wait = LoopAction.SLEEP if liveness == "poll" else LoopAction.WAIT_ANY
    assert actions[1:-1] == [expected_wait] * (len(actions) - 2)
    assert actions[-1] == LoopAction.WAIT_INPUT
    assert stats.num_used_blocks == 0 and not core.scheduler.requests


def test_zero_token_steps_still_carry_finished_ids_and_metadata():
    core = make_core("poll", send_after=1)
    core.add_request("r", list(range(8)), 1, {"do_remote_decode": True})
    first = core.step()
    assert first.model_executed and not first.got_kv_reports
    assert core.scheduler.finished_req_ids == {"r"}
    second = core.step()
    # The report only freed a finished request's blocks: nothing left for another step.
    assert second == EngineStepResult(
        [], model_executed=False, can_progress=False, got_kv_reports=True
    )
    assert core.connector_agent.num_polls == 2
    assert not core.scheduler.requests  # the report came back in the zero-token step
    assert core.step() == EngineStepResult([], False, False, False)  # no work: no step
    assert core.num_steps == 2


def test_a_report_is_progress_only_while_unfinished_requests_remain():
    """A report that frees blocks a waiting request needs: the next step admits it, so
    step again at once. With nothing unfinished the next step would be a no-op (event
    blocks instead of taking it), and it is one: it schedules, ships and frees nothing."""
    config = make_config(liveness="event", num_blocks=6, kv_transfer=KVTransferConfig())
    core = EngineCore(config, MockModelRunner(config), PDConnector(config), FakeKVAgent(1))
    core.add_request("r", list(range(16)), 1, {"do_remote_decode": True})  # 4 of 5 blocks
    assert core.step().model_executed
    core.add_request("w", list(range(100, 116)), 1)  # needs 4 blocks: waits for r's
    step = core.step()
    assert step.got_kv_reports and not step.model_executed and step.can_progress
    assert core.step().model_executed  # w admitted on the freed blocks
    core = make_core("event", send_after=1)
    core.add_request("r", list(range(8)), 1, {"do_remote_decode": True})
    core.step()
    step = core.step()
    assert step.got_kv_reports and not step.can_progress
    stats = core.make_stats()
    extra = core.scheduler.schedule()  # what one more step would do: nothing
    assert extra.total_num_scheduled_tokens == 0 and not extra.scheduled
    assert not extra.finished_req_ids and extra.kv_connector_metadata.is_empty()
    assert core.make_stats() == stats


def test_no_connector_engine_blocks_when_done():
    core = make_core("event", connector=False)
    core.add_request("r", list(range(8)), 3)
    outputs = []
    while core.has_work():
        outputs.extend(core.step().outputs)
    assert [t for o in outputs for t in o.new_token_ids] == [8, 9, 10]
    assert core.make_stats().num_used_blocks == 0


def test_next_action_table():
    for unfinished in (True, False):
        assert next_action("poll", True, False, has_unfinished=unfinished) == LoopAction.SLEEP
        assert next_action("event", True, False, has_unfinished=unfinished) == LoopAction.WAIT_ANY
    assert (
        next_action("event", True, False, can_progress=True, has_unfinished=True) == LoopAction.STEP
    )
    assert (
        next_action("event", True, False, must_poll=True, has_unfinished=True) == LoopAction.SLEEP
    )
    assert (
        next_action("poll", True, False, can_progress=True, has_unfinished=True) == LoopAction.SLEEP
    )
    for policy in ("legacy", "poll", "event"):
        assert next_action(policy, True, True, has_unfinished=True) == LoopAction.STEP
        assert next_action(policy, False, False, has_unfinished=False) == LoopAction.WAIT_INPUT
    with pytest.raises(ValueError):
        next_action("nope", True, False, has_unfinished=True)


def test_legacy_sleeps_while_unfinished_requests_wait_and_never_spins():
    """vLLM before #43433: `if not model_executed and has_unfinished_requests(): sleep(1 ms)`."""
    assert next_action("legacy", True, False, has_unfinished=True) == LoopAction.SLEEP
    assert (
        next_action("legacy", True, False, can_progress=True, has_unfinished=True)
        == LoopAction.SLEEP
    )
    # Only finished ids to ship: step once more (it ships them), then park on the input.
    assert next_action("legacy", True, False, has_unfinished=False) == LoopAction.STEP


def test_legacy_decode_sleeps_between_steps_while_its_load_waits():
    core = make_core("legacy")
    core.connector_agent.recv_after = 10**9  # the load never lands
    params = {
        "do_remote_prefill": True,
        "remote_request_id": "p0",
        "remote_engine_id": "P",
        "remote_block_ids": [7, 8],
        "remote_addr": "ipc:///tmp/p-kv",
    }
    core.add_request("d", list(range(8)), 4, params)
    actions = [
        next_action(
            "legacy",
            core.has_work(),
            step.model_executed,
            step.can_progress,
            core.must_poll(),
            has_unfinished=core.has_unfinished_requests(),
        )
        for step in (core.step() for _ in range(5))
    ]
    assert core.make_stats().num_waiting_for_remote_kvs == 1
    assert actions == [LoopAction.SLEEP] * 5  # the pre-fix loop slept; it did not spin


def test_malformed_request_fails_alone():
    core = make_core("event", connector=False)
    (empty,) = core.add_request("empty", [], 4)
    (zero,) = core.add_request("zero", [1, 2], 0)
    assert (empty.finish_reason, zero.finish_reason) == ("error", "error")
    assert "prompt" in empty.error and "max_tokens" in zero.error
    core.add_request("ok", [1, 2, 3], 2)
    tokens = []
    while core.has_work():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert tokens == [4, 5]


def test_duplicate_request_id_fails_alone_and_the_original_finishes():
    """A duplicate id is refused with an error output; the original is untouched (vLLM's
    front makes ids unique instead, so its core never sees one)."""
    core = make_core("event", connector=False)
    assert core.add_request("r", [1, 2, 3], 3) == []
    core.step()
    (dup,) = core.add_request("r", [7, 8], 2)
    assert (dup.req_id, dup.new_token_ids, dup.finish_reason) == ("r", [], "error")
    assert "duplicate" in dup.error
    tokens = []
    while core.has_work():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert tokens == [5, 6]  # the original's last two tokens (4 came in the first step)
    assert core.make_stats().num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("release, taken_first", [("0.12", False), ("0.13", True), ("0.34", True)])
def test_an_abort_during_ps_last_prefill_step_is_taken_before_its_output_from_0_13(
    release, taken_first, async_scheduling
):
    """vllm/v1/engine/core.py EngineCore.step and step_with_batch_queue: the aborts that
    came during the forward (aborts_queue) are taken right before update_from_output
    (0.13, #29987), so P frees the request at once; before, it finished first and its
    blocks were held for a D that never comes."""
    config = make_config(
        kv_transfer=KVTransferConfig(kv_role="kv_producer", kv_addr="ipc://w"),
        vllm_release=release,
        async_scheduling=async_scheduling,
    )
    core = EngineCore(config, MockModelRunner(config), PDConnector(config), FakeKVAgent(10**6))
    core.add_request("r", list(range(1, 30)), 1, {"do_remote_decode": True})
    outputs = []
    while not outputs:
        started = core.start_step()
        if started.sched_out is not None or started.batch.scheduled:
            core.aborts_queue.append("r")  # the client's abort, during the forward
        outputs = list(core.finish_step(started).outputs)
    assert [(o.req_id, o.finish_reason) for o in outputs] == [
        ("r", "abort" if taken_first else "length")
    ]
    scheduler = core.scheduler
    assert (scheduler.block_pool.get_num_used_blocks() == 0) is taken_first
    assert scheduler.held_for_send == (set() if taken_first else {"r"})
    assert not core.aborts_queue
