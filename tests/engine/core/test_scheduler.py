from __future__ import annotations

import pytest

from engine.core.request import RequestStatus
from engine.core.stop import check_stop
from tests.utils import assert_scheduler_empty, make_request, make_scheduler, step


def run_to_completion(sched, max_steps=1000):
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_requests():
            return tokens
        _, outputs = step(sched)
        for o in outputs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")


def test_chunked_prefill_of_a_prompt_larger_than_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", num_tokens=40, max_tokens=3))
    chunks, sampled = [], []
    for _ in range(4):
        out, outputs = step(sched)
        chunks.append(out.total_num_scheduled_tokens)
        sampled.append([t for o in outputs for t in o.new_token_ids])
    assert chunks == [16, 16, 8, 1]
    assert sampled == [[], [], [40], [41]]  # a token only once the prompt is done
    run_to_completion(sched)
    assert_scheduler_empty(sched)


def test_budget_is_shared_running_first():
    sched = make_scheduler(max_num_batched_tokens=20)
    sched.add_request(make_request("a", num_tokens=8))
    sched.add_request(make_request("b", num_tokens=30, start=50))
    out, _ = step(sched)
    assert {s.req_id: len(s.token_ids) for s in out.scheduled} == {"a": 8, "b": 12}
    out, _ = step(sched)
    assert {s.req_id: len(s.token_ids) for s in out.scheduled} == {"a": 1, "b": 18}


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", num_tokens=4, start=i * 10))
    out, _ = step(sched)
    assert [s.req_id for s in out.scheduled] == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_preemption_when_pool_is_full_and_same_tokens_later():
    reference = make_scheduler()
    tight = make_scheduler(num_blocks=8)  # 7 usable blocks of 4 tokens
    for sched in (reference, tight):
        for i in range(3):
            sched.add_request(make_request(f"r{i}", num_tokens=6, max_tokens=8, start=i * 7))
    expected = run_to_completion(reference)
    got = run_to_completion(tight)
    assert tight.num_preemptions > 0
    assert got == expected
    assert_scheduler_empty(tight)


def test_stop_on_eos_and_stop_ids_and_max_model_len():
    sched = make_scheduler(eos_token_id=12)
    sched.add_request(make_request("eos", num_tokens=4, start=8, eos_token_id=12))
    _, outputs = step(sched)  # prompt 8..11 -> samples 12 = eos
    assert outputs[0].finish_reason == "stop"
    sched = make_scheduler(max_model_len=12)
    sched.add_request(make_request("long", num_tokens=10, max_tokens=100))
    tokens = run_to_completion(sched)
    assert len(tokens["long"]) == 2  # 10 prompt + 2 output = max_model_len
    stop = make_request("stopid", num_tokens=4)
    stop.stop_token_ids = (6,)
    sched = make_scheduler()
    sched.add_request(stop)
    tokens = run_to_completion(sched)
    assert tokens["stopid"] == [4, 5, 6]


def test_prompt_too_long_finishes_ignored_with_a_reason():
    """FINISHED_IGNORED is reported as vLLM does: finish reason "length"."""
    sched = make_scheduler(max_model_len=16)
    big = make_request("big", num_tokens=16)
    out = sched.add_request(big)
    assert big.status == RequestStatus.FINISHED_IGNORED
    assert out.finish_reason == "length" and "max_model_len" in out.error
    out = make_scheduler(num_blocks=3).add_request(make_request("huge", num_tokens=12))
    assert out.finish_reason == "length" and "KV blocks" in out.error


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", num_tokens=4))
    sched.add_request(make_request("wait", num_tokens=4, start=20))
    step(sched)
    outs = sched.finish_requests(["wait", "run", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [(o.req_id, o.finish_reason) for o in outs] == [("wait", "abort"), ("run", "abort")]
    # Abort of a finished/unknown id is ignored (vLLM #25067).
    assert sched.finish_requests(["run"], RequestStatus.FINISHED_ABORTED) == []
    step(sched)
    assert_scheduler_empty(sched)


def test_prefix_hits_skip_cached_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", num_tokens=13, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", num_tokens=13, max_tokens=1))
    out, _ = step(sched)
    assert out.scheduled[0].num_computed_tokens == 12 and len(out.scheduled[0].token_ids) == 1
    assert sched.num_prefix_hit_tokens == 12
    run_to_completion(sched)
    assert_scheduler_empty(sched)


def test_runner_failure_fails_only_that_request():
    from engine.core.outputs import ModelRunnerOutput

    sched = make_scheduler()
    sched.add_request(make_request("bad", num_tokens=4))
    sched.add_request(make_request("good", num_tokens=4, start=30))
    out = sched.schedule()
    runner_out = ModelRunnerOutput(
        sampled_token_ids={"good": 7}, failed={"bad": "token id 999 out of range"}
    )
    outputs = sched.update_from_output(out, runner_out)
    by_id = {o.req_id: o for o in outputs}
    assert by_id["bad"].finish_reason == "error" and "999" in by_id["bad"].error
    assert by_id["good"].new_token_ids == [7] and not by_id["good"].finished
    run_to_completion(sched)
    assert_scheduler_empty(sched)


def test_request_that_could_never_fit_the_pool_is_ignored_not_wedged():
    sched = make_scheduler(num_blocks=5, max_model_len=64)  # 4 blocks of 4 tokens
    out = sched.add_request(make_request("grows", num_tokens=10, max_tokens=20))
    assert out.finish_reason == "length" and "pool has 4" in out.error
    assert sched.add_request(make_request("fits", num_tokens=10, max_tokens=6)) is None


def test_a_request_whose_kv_fills_the_pool_exactly_runs():
    """The last sampled token never gets a KV slot: prompt 10 + 3 outputs computes 12
    tokens, exactly 3 blocks of 4, so it runs to completion in a 3-block pool."""
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    assert sched.add_request(make_request("a", num_tokens=10, max_tokens=3)) is None
    tokens = []
    while sched.has_requests():
        _, outputs = step(sched)
        tokens += [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == 3 and sched.block_pool.get_num_free_blocks() == 3


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_admission_needs_blocks_for_the_whole_sequence(reserve_full_isl):
    """vLLM 0.32 (scheduler_reserve_full_isl, its default): a waiting request is admitted
    only if blocks for its whole current sequence are free, even when its first chunk
    would fit; it waits at the head, and nothing is preempted for it."""
    sched = make_scheduler(
        num_blocks=9,
        max_num_batched_tokens=8,  # 8 usable blocks
        scheduler_reserve_full_isl=reserve_full_isl,
    )
    sched.add_request(make_request("r0", num_tokens=12, max_tokens=3))
    sched.add_request(make_request("r1", num_tokens=24, max_tokens=2, start=100))  # 6 blocks now
    out, _ = step(sched)
    assert {s.req_id: len(s.token_ids) for s in out.scheduled} == {"r0": 8}
    out, _ = step(sched)  # r0 holds 3 blocks: 5 free, r1's first chunk needs only 1
    scheduled = {s.req_id: len(s.token_ids) for s in out.scheduled}
    if reserve_full_isl:
        assert scheduled == {"r0": 4} and list(sched.waiting) == [sched.requests["r1"]]
    else:
        assert scheduled == {"r0": 4, "r1": 4}
    assert sched.num_preemptions == 0
    run_to_completion(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("last", ["eos", "stop_id"])
def test_stop_beats_length_on_the_last_allowed_token(last):
    """vLLM's check_stop: EOS and stop ids come before max_tokens."""
    sched = make_scheduler(eos_token_id=12)
    req = make_request("r", num_tokens=4, start=8, max_tokens=1, eos_token_id=12)
    if last == "stop_id":
        req.eos_token_id, req.stop_token_ids = None, (12,)
    sched.add_request(req)
    _, outputs = step(sched)  # prompt 8..11 -> samples 12
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([12], "stop")]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_check_stop_order():
    req = make_request("r", num_tokens=15, max_tokens=1, eos_token_id=3)
    req.append_output_token_ids(3)  # EOS, the last allowed token and max_model_len at once
    assert check_stop(req, max_model_len=16) and req.status == RequestStatus.FINISHED_STOPPED
    req = make_request("r", num_tokens=15, max_tokens=1, eos_token_id=3)
    req.append_output_token_ids(4)
    assert check_stop(req, max_model_len=16) and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_duplicate_request_id_is_refused_and_the_original_runs_on():
    sched = make_scheduler()
    original = make_request("r", num_tokens=6, max_tokens=2)
    assert sched.add_request(original) is None
    step(sched)
    out = sched.add_request(make_request("r", num_tokens=3, start=40))
    assert out.finish_reason == "error" and "duplicate" in out.error
    assert sched.requests["r"] is original and sched.running == [original]
    assert not sched.finished_req_ids
    tokens = run_to_completion(sched)
    assert tokens["r"] == [7] and original.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_scheduler_empty(sched)


def test_the_stats_count_the_usable_blocks_which_are_the_pools_blocks_but_the_null_block():
    sched = make_scheduler(num_blocks=8)  # vLLM's num_gpu_blocks: the null block 0 included
    sched.add_request(make_request("a", num_tokens=6))
    step(sched)
    stats = sched.make_stats()
    assert sched.block_pool.num_blocks == 8 and stats.num_usable_blocks == 7
    assert stats.num_used_blocks + stats.num_free_blocks == stats.num_usable_blocks
    assert stats.num_used_blocks == 2
