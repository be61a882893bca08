"""Per-step shortcuts against their definitions: the liveness predicates, the loop's next action and deadline, the cost model's step shape."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.liveness import next_action
from engine.core.outputs import ScheduledRequest, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.runner.mock_runner import MockModelRunner
from replay.sim.cost import StepShape
from tests.engine.core.test_scheduler_fast_paths import run_twins
from tests.utils import make_request, make_scheduler, step


def reference_has_requests(sched: Scheduler) -> bool:
    """has_unfinished_requests() or has_finished_requests(), as vLLM writes them."""
    num_unfinished = len(sched.waiting) + len(sched.skipped_waiting) + len(sched.running)
    by_count = (
        sched.config.liveness != "legacy"
        and sched.connector is not None
        and len(sched.requests) > num_unfinished
    )  # vLLM #43433
    return num_unfinished > 0 or bool(sched.finished_req_ids) or by_count


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
@pytest.mark.parametrize("use_kv_connector", [False, True])
def test_liveness_predicates_equal_their_definitions(monkeypatch, seed, liveness, use_kv_connector):
    seen = {"idle": 0}
    has_requests = Scheduler.has_requests

    def checking(self: Scheduler) -> bool:
        got = has_requests(self)
        assert got == reference_has_requests(self)
        assert self.has_unfinished_requests() == (self.get_num_unfinished_requests() > 0)
        assert self.has_finished_requests() == (
            bool(self.finished_req_ids)
            or (
                self.config.liveness != "legacy"
                and self.connector is not None
                and len(self.requests) > self.get_num_unfinished_requests()
            )
        )
        seen["idle"] += not got
        return got

    monkeypatch.setattr(Scheduler, "has_requests", checking)
    run_twins(
        seed,
        use_kv_connector,
        liveness=liveness,
        num_blocks=20,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    assert seen["idle"]  # the workload drains


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_a_delayed_free_alone_is_work_except_under_legacy(liveness):
    """The has_requests shortcut's last branch: nothing queued, a send held for D."""
    sched = make_scheduler(use_kv_connector=True, liveness=liveness)
    sched.add_request(make_request("p", max_tokens=1, params={"do_remote_decode": True}))
    step(sched)  # prefilled and finished; its blocks held for D
    step(sched)  # its finished id shipped
    assert sched.requests and not sched.finished_req_ids and not sched.has_unfinished_requests()
    assert sched.has_requests() == reference_has_requests(sched) == (liveness != "legacy")


def reference_shape(sched_out: SchedulerOutput) -> StepShape:
    """StepShape.of as first written, over the records."""
    prefill = decode = context = 0
    for chunk in sched_out.scheduled:
        if len(chunk.token_ids) == 1:
            decode += 1
        else:
            prefill += len(chunk.token_ids)
        context += chunk.num_computed_tokens
    return StepShape(prefill, decode, context)


def test_step_shape_from_columns_equals_the_records():
    rng = random.Random(0)
    for _ in range(200):
        records = [
            ScheduledRequest(
                req_id=f"r{i}",
                token_ids=[7] * rng.choice([1, 1, 2, 5, 64]),
                num_computed_tokens=rng.randrange(500),
                new_block_ids=[],
                is_new=rng.random() < 0.3,
                sample=True,
            )
            for i in range(rng.randint(0, 8))
        ]
        sched_out = SchedulerOutput(records, sum(len(r.token_ids) for r in records))
        assert StepShape.of(sched_out) == reference_shape(sched_out)


POLICIES = ("legacy", "poll", "event")


def test_next_action_ignores_what_the_loop_no_longer_computes():
    """The loop asks must_poll only under event and has_unfinished only under legacy:
    every action equals the one with both computed."""
    for policy, has_work, executed, progress, must_poll, unfinished in itertools.product(
        POLICIES, *[(False, True)] * 5
    ):
        full = next_action(
            policy, has_work, executed, progress, must_poll, has_unfinished=unfinished
        )
        lazy = next_action(
            policy,
            has_work,
            executed,
            progress,
            policy == "event" and must_poll,
            has_unfinished=policy == "legacy" and unfinished,
        )
        assert lazy == full, (policy, has_work, executed, progress, must_poll, unfinished)


class _Timed:
    def __init__(self, due: int | None) -> None:
        self.due = due

    def next_deadline_ns(self) -> int | None:
        return self.due

    def set_time(self, now_ns: int) -> None:
        pass


def test_next_deadline_is_the_earliest_of_both_halves():
    config = EngineConfig(num_blocks=16, block_size=4)
    for connector_due, worker_due in itertools.product((None, 0, 5, 9), repeat=2):
        core = EngineCore(config, MockModelRunner(config), None, _Timed(worker_due))
        core.scheduler.connector = _Timed(connector_due)
        dues = [d for d in (connector_due, worker_due) if d is not None]
        assert core.next_deadline_ns() == min(dues, default=None)
    core = EngineCore(config, MockModelRunner(config))
    assert core.next_deadline_ns() is None
