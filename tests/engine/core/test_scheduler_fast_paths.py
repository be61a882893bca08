"""The scheduler's fast paths against its straightforward paths, step by step.

Two schedulers see the same seeded workload (arrivals with shared prefixes, aborts,
EOS and stop ids, max_model_len caps, chunked prefills, preemption under a small pool,
runner failures, P-side delayed frees, D-side remote loads with late, stale and failed
reports): one with `fast_path` on (the decode loop in _schedule_decodes, the sampled-
token loop in _update_sampled), one with it off. After every step their scheduler
outputs, request outputs, block tables, requests and pool state must be identical.
"""

from __future__ import annotations

import hashlib
import random
import sys
from array import array

import pytest

from engine.core.block_hash import NONE_HASH, hash_block_tokens
from engine.core.outputs import NO_REQ_IDS, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.runner.mock_runner import MockModelRunner
from tests.engine.core.test_random_workload import FakeWorld, make_random_request
from tests.utils import make_request, make_scheduler

PREFIXES = [[7] * 8, [9] * 12, list(range(40, 52))]


def pool_state(sched: Scheduler) -> tuple:
    pool = sched.block_pool
    return (
        [b.block_id for b in pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted((h, b.block_id) for h, b in pool.cached_block_hash_to_block.items()),
        pool.num_cached_free_blocks,
        pool.num_used_blocks,
    )


def request_state(request: Request) -> tuple:
    return (
        request.req_id,
        request.status,
        request.num_computed_tokens,
        request.num_tokens,
        list(request.all_token_ids),
        list(request.output_token_ids),
        list(request.block_hashes),
        request.num_cached_tokens,
        request.num_preemptions,
    )


def scheduler_state(sched: Scheduler) -> tuple:
    kv = sched.kv_cache_manager
    return (
        [request_state(r) for r in sched.requests.values()],
        [r.req_id for r in sched.waiting],
        [r.req_id for r in sched.skipped_waiting],
        [r.req_id for r in sched.running],
        {req_id: [b.block_id for b in blocks] for req_id, blocks in kv.req_to_blocks.items()},
        dict(kv.num_cached_block),
        sorted(sched.held_for_send),
        sorted(sched.held_for_recv),
        sorted(sched.finished_req_ids),
        sorted(sched.deferred_req_ids),
        sorted(sched.finished_recving_kv_req_ids),
        sorted(sched.failed_recving_kv_req_ids),
        sched.make_stats(),
        pool_state(sched),
    )


class Twin:
    """A scheduler, its mock runner and its fake connector world."""

    def __init__(self, fast: bool, seed: int, use_kv_connector: bool, **config) -> None:
        self.sched = make_scheduler(use_kv_connector=use_kv_connector, **config)
        self.sched.fast_path = fast
        self.runner = MockModelRunner(self.sched.config)
        self.world = FakeWorld(random.Random(seed))
        self.num_fast_decodes = 0
        if fast:  # count what the fast loop schedules: the test must exercise it
            decodes = self.sched._schedule_decodes

            def counting(out, req_index, budget):
                num_decodes = decodes(out, req_index, budget)
                self.num_fast_decodes += num_decodes
                return num_decodes

            self.sched._schedule_decodes = counting

    def step(self, failures: random.Random) -> tuple:
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        if meta is not None:
            self.world.register(meta)
        if failures.random() < 0.05 and self.sched.running:  # an abort while the step runs
            victim = failures.choice(sorted(r.req_id for r in self.sched.running))
            self.sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        runner_out = self.runner.execute(out)
        for req_id in out.req_ids:  # the runner fails a request now and then
            if failures.random() < 0.02:
                runner_out.sampled_token_ids.pop(req_id, None)
                runner_out.failed[req_id] = "injected failure"
        if meta is not None:
            runner_out.kv_connector_output = self.world.reports(flush=failures.random() < 0.1)
        self.world.now += 1
        outputs = self.sched.update_from_output(out, runner_out)
        self.sched.block_pool.check_invariants()
        return out, runner_out, outputs


def plain_request(rng: random.Random, i: int, block_size: int) -> Request:
    prompt = list(rng.choice(PREFIXES)) if rng.random() < 0.6 else []
    prompt += [rng.randrange(500) for _ in range(rng.randint(1, 40))]
    return Request(
        f"r{i}",
        prompt,
        rng.randint(1, 40),
        block_size,
        eos_token_id=rng.choice([None, None, rng.randrange(500)]),
        stop_token_ids=tuple(rng.randrange(500) for _ in range(rng.choice([0, 0, 2]))),
    )


def run_twins(seed: int, use_kv_connector: bool, **config) -> Twin:
    rng = random.Random(seed)
    fast = Twin(True, seed, use_kv_connector, **config)
    slow = Twin(False, seed, use_kv_connector, **config)
    block_size = fast.sched.block_size
    num_requests = rng.randint(10, 40)
    for i in range(num_requests):
        make = (
            (lambda: make_random_request(random.Random(seed * 1000 + i), i))  # noqa: B023
            if use_kv_connector
            else (lambda: plain_request(random.Random(seed * 1000 + i), i, block_size))  # noqa: B023
        )
        assert fast.sched.add_request(make()) == slow.sched.add_request(make())
        if rng.random() < 0.1 and fast.sched.requests:
            victim = rng.choice(sorted(fast.sched.requests))
            assert fast.sched.finish_requests(
                [victim], RequestStatus.FINISHED_ABORTED
            ) == slow.sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        for _ in range(rng.randint(0, 4)):
            compare_step(fast, slow, seed, i)
    for n in range(400):
        if not fast.sched.has_requests() and not fast.world.pending:
            break
        compare_step(fast, slow, seed, num_requests + n)
    return fast


def compare_step(fast: Twin, slow: Twin, seed: int, step: int) -> None:
    fast_out = fast.step(random.Random(seed * 7919 + step))
    slow_out = slow.step(random.Random(seed * 7919 + step))
    assert fast_out == slow_out, f"seed {seed} step {step}: outputs differ"
    assert scheduler_state(fast.sched) == scheduler_state(slow.sched), f"seed {seed} step {step}"


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    "config",
    [
        # roomy pool, decodes dominate
        dict(num_blocks=128, max_num_batched_tokens=64, max_num_seqs=16),
        # small pool: preemption, decodes that need a block find none
        dict(num_blocks=20, max_num_batched_tokens=24, max_num_seqs=8),
        # a tiny budget (the fast loop stops at it), max_model_len caps, no prefix caching
        dict(
            num_blocks=64,
            max_num_batched_tokens=5,
            max_num_seqs=8,
            max_model_len=40,
            enable_prefix_caching=False,
        ),
        # vLLM's admission without the full-sequence reservation
        dict(
            num_blocks=24,
            max_num_batched_tokens=16,
            max_num_seqs=6,
            scheduler_reserve_full_isl=False,
        ),
    ],
    ids=["roomy", "pressure", "tiny_budget", "no_reserve"],
)
def test_fast_path_matches_slow_path(seed, config):
    twin = run_twins(seed, use_kv_connector=False, **config)
    assert twin.num_fast_decodes > 0


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_fast_path_matches_slow_path_with_connector(seed, policy):
    """P-side delayed frees and D-side loads: reports, invalid blocks, stale ids."""
    twin = run_twins(
        seed,
        use_kv_connector=True,
        num_blocks=24,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        kv_load_failure_policy=policy,
    )
    assert twin.num_fast_decodes > 0


def test_decode_fast_path_allocates_a_block_only_at_a_boundary():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=64)
    sched.add_request(make_request("a", num_tokens=7, max_tokens=10))  # block size 4
    out = sched.schedule()
    assert out.new_block_ids == {"a": [1, 2]} and out.new_req_ids == {"a"}
    sched.update_from_output(out, MockModelRunner(sched.config).execute(out))
    out = sched.schedule()  # 8th token: the slot is in block 2
    assert out.req_ids == ["a"] and out.num_computed_tokens == [7] and out.new_block_ids == {}
    sched.update_from_output(out, MockModelRunner(sched.config).execute(out))
    out = sched.schedule()  # 9th token starts block 3
    assert out.new_block_ids == {"a": [3]} and out.token_ids == [8]


def test_a_decode_is_scheduled_from_the_first_cache_line_of_its_request():
    """_schedule_decodes reads four fields of a request: among its first six slots, which
    share the first 64-byte line of a 192-byte object with its header."""
    assert {"req_id", "num_tokens", "num_computed_tokens", "all_token_ids"} <= set(
        Request.__slots__[:6]
    )
    assert sys.getsizeof(Request("r", [1], 1, 4)) == 192


def test_scheduler_output_columns_round_trip_records():
    records = [
        ScheduledRequest(
            req_id="p",
            token_ids=[1, 2, 3],
            num_computed_tokens=4,
            new_block_ids=[5],
            is_new=True,
            sample=False,
        ),
        ScheduledRequest(
            req_id="d",
            token_ids=[9],
            num_computed_tokens=20,
            new_block_ids=[],
            is_new=False,
            sample=True,
        ),
        ScheduledRequest(
            req_id="e",
            token_ids=[8],
            num_computed_tokens=31,
            new_block_ids=[6],
            is_new=False,
            sample=True,
        ),
    ]
    out = SchedulerOutput(records, 5)
    assert out.scheduled == tuple(records)
    assert (out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, out.token_ids) == (
        ["p", "d", "e"],
        [4, 20, 31],
        [3, 1, 1],
        [1, 2, 3, 9, 8],
    )
    assert out.new_block_ids == {"p": [5], "e": [6]} and out.partial_req_ids == {"p"}
    assert SchedulerOutput(out.scheduled, 5) == out


def test_an_empty_scheduler_output_is_the_constructor_s_with_its_own_containers():
    fast, slow = SchedulerOutput.empty(), SchedulerOutput()
    assert fast == slow and type(fast) is SchedulerOutput
    for (
        slot
    ) in SchedulerOutput.__slots__:  # every slot set; none mutable shared with another output
        value = getattr(fast, slot)
        assert value == getattr(slow, slot)
        if value is NO_REQ_IDS:  # an id set still empty: immutable, so adding to it fails
            with pytest.raises(AttributeError):
                value.add("x")
        elif value is not None and not isinstance(value, int):
            assert value is not getattr(SchedulerOutput.empty(), slot)


def test_ids_added_to_an_empty_scheduler_output_stay_in_it():
    out, other = SchedulerOutput.empty(), SchedulerOutput.empty()
    out.add(
        ScheduledRequest(
            req_id="p",
            token_ids=[1, 2],
            num_computed_tokens=0,
            new_block_ids=[3],
            is_new=True,
            sample=False,
        )
    )
    out.add_preempted("q")
    assert (out.new_req_ids, out.partial_req_ids, out.preempted_req_ids) == ({"p"}, {"p"}, {"q"})
    assert other == SchedulerOutput() and NO_REQ_IDS == frozenset()


def test_block_hash_is_sha256_of_parent_and_int64_tokens():
    rng = random.Random(0)
    parent = None
    for _ in range(200):
        tokens = [rng.randrange(-(2**40), 2**40) for _ in range(rng.choice([1, 4, 16]))]
        expected = hashlib.sha256((parent or NONE_HASH) + array("q", tokens).tobytes()).digest()[
            :16
        ]
        assert hash_block_tokens(parent, tokens) == expected
        parent = expected


def test_a_request_aborted_while_its_step_ran_gets_no_token_and_the_others_do():
    sched = make_scheduler()
    for req_id in ("a", "b", "c"):
        sched.add_request(make_request(req_id, num_tokens=5, max_tokens=3))
    out = sched.schedule()
    runner_out = MockModelRunner(sched.config).execute(out)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # c now sits at b's place
    outputs = sched.update_from_output(out, runner_out)
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("a", None), ("c", None)]
    assert [sched.requests[r].num_tokens for r in ("a", "c")] == [6, 6]
    assert [r.req_id for r in sched.running] == ["a", "c"]


def test_fast_update_skipped_when_the_runner_failed_a_request():
    sched = make_scheduler()
    for req_id in ("a", "b"):
        sched.add_request(make_request(req_id, num_tokens=5, max_tokens=3))
    out = sched.schedule()
    outputs = sched.update_from_output(out, ModelRunnerOutput({"a": 7}, {"b": "bad"}))
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", [7], None),
        ("b", [], "error"),
    ]
    assert [r.req_id for r in sched.running] == ["a"]
