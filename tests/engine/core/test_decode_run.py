"""engine/core/decode_run.py's count of plain decode steps, against the scheduler stepped one step at a time."""

from engine.core.decode_run import num_plain_decode_steps
from engine.runner.mock_runner import MockModelRunner
from tests.utils import make_request, make_scheduler


def never_stops(request, k):
    return [1] * k  # no EOS configured: no token stops a request


def test_a_scheduler_with_nothing_running_has_no_plain_decode_steps():
    """An empty step is not a decode step: the count is 0, not the limit (a run of empty
    steps would be timed as decode steps)."""
    assert num_plain_decode_steps(make_scheduler(num_blocks=16), never_stops, 4096) == 0


def test_the_count_ends_before_the_step_that_starts_a_block():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=64)  # block size 4
    sched.add_request(make_request("a", num_tokens=5, max_tokens=10))
    runner = MockModelRunner(sched.config)
    out = sched.schedule()  # the prefill: 5 computed, 6 tokens after it
    sched.update_from_output(out, runner.execute(out))
    # Slots 5, 6 and 7 are in block 1; slot 8 starts block 2: 3 plain steps.
    assert num_plain_decode_steps(sched, never_stops, 100) == 3
    for _ in range(3):
        out = sched.schedule()
        assert out.new_block_ids == {}
        sched.update_from_output(out, runner.execute(out))
    assert sched.schedule().new_block_ids == {"a": [3]}
