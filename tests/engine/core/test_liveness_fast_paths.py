"""The event loop's shortcuts give what the straightforward forms give (issue 14, goal 2)."""
from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.liveness import next_action
from engine.runner.mock_runner import MockModelRunner

POLICIES = ("legacy", "poll", "event")


def test_next_action_ignores_what_the_loop_no_longer_computes():
    """The loop asks must_poll only under event and has_unfinished only under legacy:
    every action equals the one with both computed."""
    for policy, has_work, executed, progress, must_poll, unfinished in itertools.product(
            POLICIES, *[(False, True)] * 5):
        full = next_action(policy, has_work, executed, progress, must_poll, has_unfinished=unfinished)
        lazy = next_action(policy, has_work, executed, progress, policy == "event" and must_poll,
                           has_unfinished=policy == "legacy" and unfinished)
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
