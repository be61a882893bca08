"""The KV-connector lifecycle: vLLM PR #43433, remote decode and remote prefill flows."""

from __future__ import annotations

import pytest

from connector.messages import HeartbeatSpec
from engine.config import EngineConfig, KVTransferConfig
from engine.core.request import RequestStatus
from engine.utils import cdiv
from tests.utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    runner_output,
    step,
)

REMOTE_DECODE = {"do_remote_decode": True}


def remote_prefill_params(num_tokens: int, first_block: int = 100) -> dict:
    n = cdiv(num_tokens, BLOCK_SIZE)
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "x",
        "remote_block_ids": list(range(first_block, first_block + n)),
        "remote_addr": "ipc://p",
    }


def finish_prefill_request(sched, req_id="id-0", num_tokens=10):
    """Steps 1-3 of reference §5.1: the request stops; its free is delayed."""
    sched.add_request(make_request(req_id, num_tokens, max_tokens=1, params=dict(REMOTE_DECODE)))
    out, outputs = step(sched)
    assert out.total_num_scheduled_tokens == num_tokens
    (output,) = outputs
    assert output.finish_reason == "length"
    return output


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_delayed_kv_connector_free_keeps_scheduler_active(liveness):
    sched = make_scheduler(use_kv_connector=True, liveness=liveness)
    output = finish_prefill_request(sched)
    params = output.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_block_ids"] == [1, 2, 3]
    assert params["remote_engine_id"] == "engine" and params["remote_addr"] == "ipc://p-worker"
    assert "id-0" in sched.requests and sched.finished_req_ids == {"id-0"}
    assert sched.block_pool.get_num_used_blocks() == 3
    # Step 4: the finished id is shipped; the scheduler's own set is now empty.
    out, _ = step(sched)
    assert out.total_num_scheduled_tokens == 0 and out.finished_req_ids == {"id-0"}
    assert out.kv_connector_metadata.reqs_to_send == {"id-0": [1, 2, 3]}
    assert not sched.finished_req_ids
    assert sched.block_pool.get_num_used_blocks() == 3  # still held for the decode side
    if liveness == "legacy":
        # vLLM before #43433: no work reported, so the engine parks with blocks held.
        assert not sched.has_finished_requests() and not sched.has_requests()
        return
    assert sched.has_finished_requests() and sched.has_requests()
    # Steps 5-6: the report arrives in an empty step; everything is released.
    step(sched, finished_sending={"id-0"})
    assert not sched.has_requests()
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_without_connector_no_work_after_finish(liveness):
    sched = make_scheduler(liveness=liveness)
    sched.add_request(make_request("a", 10, max_tokens=1))
    step(sched)
    step(sched)
    assert not sched.has_requests()
    assert_scheduler_empty(sched)


def test_basic_remote_decode_lifecycle():
    """vLLM test_remote_decode_lifecycle.py::test_basic_lifecycle."""
    sched = make_scheduler(use_kv_connector=True)
    finish_prefill_request(sched, num_tokens=10)
    req = sched.requests["id-0"]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not sched.running and not sched.waiting
    assert all(b.ref_cnt == 1 for b in sched.kv_cache_manager.req_to_blocks["id-0"])
    step(sched)
    out, _ = step(sched, finished_sending={"id-0"})
    assert not out.finished_req_ids
    assert_scheduler_empty(sched)


def test_short_prompt_still_delays_one_partial_block():
    sched = make_scheduler(use_kv_connector=True)
    output = finish_prefill_request(sched, num_tokens=3)
    assert output.kv_transfer_params["remote_block_ids"] == [1]
    step(sched, finished_sending={"id-0"})
    assert_scheduler_empty(sched)


def test_remote_prefill_lifecycle():
    sched = make_scheduler(use_kv_connector=True)
    sched.add_request(make_request("d", 10, max_tokens=3, params=remote_prefill_params(10)))
    out, outputs = step(sched)
    req = sched.requests["d"]
    assert out.total_num_scheduled_tokens == 0 and not outputs
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req in sched.skipped_waiting
    (load,) = out.kv_connector_metadata.reqs_to_recv.values()
    assert load.local_block_ids == [1, 2, 3] and load.remote_block_ids == [100, 101, 102]
    assert sched.has_unfinished_requests()
    out, _ = step(sched)  # nothing to do while the load is in flight
    assert out.total_num_scheduled_tokens == 0
    step(sched, finished_recving={"d"})
    out, outputs = step(sched)  # promoted: recompute the last prompt token only
    assert [(s.num_computed_tokens, s.token_ids, s.is_new) for s in out.scheduled] == [
        (9, [9], True)
    ]
    assert out.scheduled[0].new_block_ids == [1, 2, 3]
    assert outputs[0].new_token_ids == [10]
    while sched.has_requests():
        step(sched)
    assert_scheduler_empty(sched)


def test_remote_prefill_reads_only_blocks_past_the_local_prefix_hit():
    sched = make_scheduler(use_kv_connector=True)
    sched.add_request(make_request("warm", 10, max_tokens=1))
    step(sched)
    step(sched)
    sched.add_request(make_request("d", 10, max_tokens=2, params=remote_prefill_params(10)))
    out, _ = step(sched)
    (load,) = out.kv_connector_metadata.reqs_to_recv.values()
    assert load.remote_block_ids == [102]  # blocks 0-1 were local prefix hits
    assert len(load.local_block_ids) == 1


def test_abort_while_waiting_for_remote_kvs_holds_blocks_until_recv():
    """vLLM #32255."""
    sched = make_scheduler(use_kv_connector=True)
    sched.add_request(make_request("d", 10, params=remote_prefill_params(10)))
    step(sched)
    (output,) = sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert output.finish_reason == "abort"
    assert sched.block_pool.get_num_used_blocks() == 3
    assert sched.has_requests()  # poll/event keep stepping to collect the receive
    step(sched, finished_sending={"d"})  # wrong kind of report: stale, ignored
    assert sched.block_pool.get_num_used_blocks() == 3 and sched.num_stale_kv_reports == 1
    step(sched, finished_recving={"d"})
    assert_scheduler_empty(sched)


def test_abort_of_delayed_free_request_is_ignored():
    sched = make_scheduler(use_kv_connector=True)
    finish_prefill_request(sched)
    assert sched.finish_requests(["id-0"], RequestStatus.FINISHED_ABORTED) == []
    step(sched, finished_sending={"id-0"})
    assert_scheduler_empty(sched)


def test_stale_and_duplicate_reports_are_counted_not_fatal():
    sched = make_scheduler(use_kv_connector=True)
    finish_prefill_request(sched)
    # vLLM #46240: one id in both sets in one step, plus unknown ids.
    step(
        sched,
        finished_sending={"id-0", "nope"},
        finished_recving={"id-0", "ghost"},
        invalid_block_ids={63},
    )
    assert_scheduler_empty(sched)
    step(sched, finished_sending={"id-0"})  # a duplicate after release
    assert sched.num_stale_kv_reports == 5
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_policy(policy):
    sched = make_scheduler(use_kv_connector=True, kv_load_failure_policy=policy)
    sched.add_request(make_request("d", 10, max_tokens=2, params=remote_prefill_params(10)))
    step(sched)
    _, outputs = step(sched, finished_recving={"d"}, invalid_block_ids={2})
    if policy == "fail":
        assert [(o.req_id, o.finish_reason) for o in outputs] == [("d", "error")]
        assert_scheduler_empty(sched)
        return
    out, _ = step(sched)
    # Block 1 was valid, block 2 was not: recompute from token 4.
    assert out.scheduled[0].num_computed_tokens == BLOCK_SIZE
    assert len(out.scheduled[0].token_ids) == 10 - BLOCK_SIZE
    while sched.has_requests():
        step(sched)
    assert_scheduler_empty(sched)


def test_remote_params_that_do_not_fit_fall_back_to_local_prefill():
    sched = make_scheduler(use_kv_connector=True)
    params = remote_prefill_params(10)
    params["remote_block_ids"] = [5]
    sched.add_request(make_request("d", 10, max_tokens=1, params=params))
    out, outputs = step(sched)
    assert out.total_num_scheduled_tokens == 10 and outputs[0].finished
    assert sched.connector.num_bad_params == 1
    assert sched.connector.get_counters() == {"num_bad_params": 1}  # published with the stats


def test_bad_params_are_counted_once_per_request_not_per_admission_attempt():
    """A request whose params do not fit, waiting behind a full pool, is one bad request."""
    sched = make_scheduler(use_kv_connector=True, num_blocks=6)  # 5 usable blocks of 4 tokens
    sched.add_request(make_request("big", num_tokens=16, max_tokens=4))  # holds 4-5 blocks
    step(sched)
    params = remote_prefill_params(10)
    params["remote_block_ids"] = [1]  # 1 block for a 3-block prompt
    sched.add_request(make_request("d", num_tokens=10, max_tokens=2, params=params))
    for _ in range(4):
        step(sched)
    assert sched.connector.num_bad_params == 1
    while sched.has_requests():
        step(sched)
    assert sched.connector.num_bad_params == 1 and not sched.connector._bad_params_counted


def test_legacy_counts_waiting_for_remote_kvs_as_unfinished():
    """Legacy sleeps 1 ms per zero-token step while a load is pending (DESIGN.md)."""
    sched = make_scheduler(use_kv_connector=True, liveness="legacy")
    sched.add_request(make_request("d", 10, params=remote_prefill_params(10)))
    out, _ = step(sched)
    assert out.total_num_scheduled_tokens == 0 and sched.has_requests()


def test_runner_output_helper_matches_sampling():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=1))
    out = sched.schedule()
    assert runner_output(out).sampled_token_ids == {"a": 5}


def test_abort_before_admission_tells_prefill_to_free():
    """A D request aborted while still waiting: its connector queues an empty receive,
    so the worker tells P "read done" without reading (vLLM NIXL does the same)."""
    sched = make_scheduler(use_kv_connector=True, max_num_seqs=1)
    sched.add_request(make_request("busy", 10, max_tokens=50))
    step(sched)  # "busy" holds the only seat: the next request waits
    sched.add_request(make_request("d", 10, params=remote_prefill_params(10)))
    sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    (release,) = out.kv_connector_metadata.reqs_to_recv.values()
    assert (
        release.req_id == "d" and release.local_block_ids == [] and release.remote_request_id == "x"
    )
    assert "d" not in sched.requests


def test_decode_side_that_ignores_a_request_still_releases_prefill():
    """D cannot fit it: P holds its blocks for D all the same, so D must say "read done"."""
    sched = make_scheduler(use_kv_connector=True, num_blocks=5)
    output = sched.add_request(
        make_request("d", 10, max_tokens=50, params=remote_prefill_params(10))
    )
    assert output.finish_reason == "length"  # FINISHED_IGNORED, as vLLM reports it
    assert sched.has_requests()  # the id still has to reach the connector's agent
    out, _ = step(sched)
    (release,) = out.kv_connector_metadata.reqs_to_recv.values()
    assert release.local_block_ids == [] and release.remote_request_id == "x"
    assert not sched.has_requests()


def test_prefill_stopped_by_eos_still_holds_its_blocks_for_decode():
    """vLLM 0.32's NIXL request_finished delays the free for FINISHED_STOPPED too (P's
    one token was EOS: stop order puts EOS before the length cap)."""
    sched = make_scheduler(use_kv_connector=True, eos_token_id=10)
    sched.add_request(
        make_request("p", 10, max_tokens=1, eos_token_id=10, params=dict(REMOTE_DECODE))
    )
    _, (output,) = step(sched)  # prompt 0..9 samples 10 = EOS
    assert output.finish_reason == "stop"
    assert output.kv_transfer_params["remote_block_ids"] == [1, 2, 3]
    assert sched.held_for_send == {"p"} and sched.block_pool.get_num_used_blocks() == 3
    step(sched, finished_sending={"p"})
    assert_scheduler_empty(sched)


def test_default_policies_are_vllm_0_32s():
    config = EngineConfig()
    assert config.kv_load_failure_policy == "fail" and config.scheduler_reserve_full_isl


def _start_loads(sched, *req_ids, num_tokens=10):
    for i, req_id in enumerate(req_ids):
        sched.add_request(
            make_request(
                req_id,
                num_tokens,
                max_tokens=2,
                start=50 * i,
                params=remote_prefill_params(num_tokens),
            )
        )
    out, _ = step(sched)
    assert set(out.kv_connector_metadata.reqs_to_recv) == set(req_ids)
    return [sched.requests[req_id] for req_id in req_ids]


def test_finished_load_is_promoted_only_when_admission_reaches_it_with_a_seat():
    """vLLM's lazy promotion: a finished receive only marks the id; the admission loop
    promotes it when it gets there with a seat free, first come first served."""
    sched = make_scheduler(use_kv_connector=True, max_num_seqs=2)
    d1, d2 = _start_loads(sched, "d1", "d2")  # loads hold blocks, not seats
    for i in (1, 2):
        sched.add_request(make_request(f"l{i}", 4, max_tokens=50, start=200 + 10 * i))
    step(sched)  # l1 and l2 take both seats
    step(sched, finished_recving={"d2", "d1"})
    out, _ = step(sched)  # no seat: nothing promoted, nothing cached yet
    assert d1.status == d2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.block_pool.get_cached_block(d1.block_hashes[0]) is None
    assert list(sched.skipped_waiting) == [d1, d2]
    sched.finish_requests(["l1"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)  # one seat: the first load to arrive goes first
    assert [(s.req_id, s.num_computed_tokens) for s in out.scheduled if s.is_new] == [("d1", 9)]
    assert d2.status == RequestStatus.WAITING_FOR_REMOTE_KVS and list(sched.skipped_waiting) == [d2]
    sched.finish_requests(["l2"], RequestStatus.FINISHED_ABORTED)
    while sched.has_requests():
        step(sched)
    assert_scheduler_empty(sched)


def test_no_promotion_in_a_step_that_preempted():
    sched = make_scheduler(use_kv_connector=True, num_blocks=6, max_num_seqs=1)  # 5 usable
    sched.add_request(make_request("d", 8, max_tokens=2, params=remote_prefill_params(8)))
    sched.add_request(make_request("r", 4, max_tokens=16, start=100))  # 5 blocks at most
    out, _ = step(sched)  # d's load holds 2 blocks; r takes the seat
    d = sched.requests["d"]
    step(sched, finished_recving={"d"})
    while not out.preempted_req_ids:  # r grows until the pool runs dry
        assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # r holds the only seat
        out, _ = step(sched)
    assert out.preempted_req_ids == {"r"} and not out.scheduled
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # the seat is free, but not now
    out, _ = step(sched)
    assert [(s.req_id, s.num_computed_tokens) for s in out.scheduled] == [("d", 7)]


def test_promotion_caches_every_loaded_block_then_recomputes_the_last_token():
    """vLLM's _update_waiting_for_remote_kv: cache_blocks over all loaded tokens (the
    full last block too), only then num_computed_tokens = num_tokens - 1."""
    sched = make_scheduler(use_kv_connector=True)
    (d,) = _start_loads(sched, "d", num_tokens=8)  # exactly two full blocks
    step(sched, finished_recving={"d"})
    sched._update_waiting_for_remote_kv(d)  # what the admission loop does on reaching it
    pool = sched.block_pool
    assert [pool.get_cached_block(h).block_id for h in d.block_hashes[:2]] == [1, 2]
    assert d.num_computed_tokens == 7 and d.status == RequestStatus.WAITING


def test_failed_load_with_no_valid_tokens_frees_its_blocks_and_starts_over():
    sched = make_scheduler(use_kv_connector=True, kv_load_failure_policy="recompute")
    _start_loads(sched, "d")  # blocks 1, 2, 3
    step(sched, finished_recving={"d"}, invalid_block_ids={1})
    out, _ = step(sched)
    # Freed (unhashed: to the free queue's head, tail first), looked up afresh,
    # prefilled locally in the blocks it just gave back.
    (s,) = out.scheduled
    assert (s.num_computed_tokens, len(s.token_ids), s.new_block_ids) == (0, 10, [3, 2, 1])
    while sched.has_requests():
        step(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_invalid_blocks_cut_back_running_requests_too(policy):
    """vLLM's _handle_invalid_blocks also scans `running`: a running request whose
    computed KV lost a block recomputes from there (or fails, evicting that KV)."""
    sched = make_scheduler(use_kv_connector=True, kv_load_failure_policy=policy)
    sched.add_request(make_request("r", 12, max_tokens=4))
    step(sched)  # blocks 1, 2, 3, all full and cached
    r = sched.requests["r"]
    out, outputs = step(sched, invalid_block_ids={2})
    assert out.scheduled[0].num_computed_tokens == 12  # this step's decode is thrown away
    if policy == "fail":
        assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
            ("r", [], "error")
        ]
        pool = sched.block_pool
        # Blocks 2 on (4 was this step's) lost their hashes: reused first; 1 stays cached.
        assert [b.block_id for b in pool.free_block_queue][:3] == [4, 3, 2]
        assert pool.get_cached_block(r.block_hashes[0]).block_id == 1
        assert pool.get_cached_block(r.block_hashes[1]) is None
        assert_scheduler_empty(sched)
        return
    assert not outputs and r.num_computed_tokens == BLOCK_SIZE and r.output_token_ids == [12]
    out, outputs = step(sched)
    assert [(s.num_computed_tokens, len(s.token_ids)) for s in out.scheduled] == [(4, 9)]
    assert outputs[0].new_token_ids == [13]  # the thrown-away token, sampled again
    while sched.has_requests():
        step(sched)
    assert r.output_token_ids == [12, 13, 14, 15]
    assert_scheduler_empty(sched)


def test_duplicate_id_leaves_the_original_load_alone():
    """A duplicate of a D request must not tell P to free blocks D is still pulling."""
    sched = make_scheduler(use_kv_connector=True)
    (d,) = _start_loads(sched, "d")
    dup = sched.add_request(make_request("d", 10, params=remote_prefill_params(10)))
    assert dup.finish_reason == "error" and "duplicate" in dup.error
    out, _ = step(sched)
    assert not out.finished_req_ids and not out.kv_connector_metadata.reqs_to_recv
    assert sched.requests["d"] is d and d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, finished_recving={"d"})
    while sched.has_requests():
        step(sched)
    assert_scheduler_empty(sched)


S = 1_000_000_000  # ns


def test_prefill_stamps_a_lease_for_length_capped_and_stopped_alike():
    """vLLM 0.32 NIXL request_finished: deadline = now + kv_lease_duration, with the
    engine's clock (set_time); an abort frees at once and gets none."""
    sched = make_scheduler(use_kv_connector=True, eos_token_id=10)
    sched.connector.set_time(7 * S)
    sched.add_request(make_request("cap", 10, max_tokens=1, start=100, params=dict(REMOTE_DECODE)))
    sched.add_request(
        make_request("eos", 10, max_tokens=1, eos_token_id=10, params=dict(REMOTE_DECODE))
    )
    sched.add_request(make_request("gone", 10, max_tokens=5, start=200, params=dict(REMOTE_DECODE)))
    _, outputs = step(sched)
    assert sorted((o.req_id, o.finish_reason) for o in outputs if o.finished) == [
        ("cap", "length"),
        ("eos", "stop"),
    ]
    sched.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    meta = out.kv_connector_metadata
    assert set(meta.reqs_to_send) == {"cap", "eos"}
    assert meta.send_deadlines == {"cap": 7 * S + 30 * S, "eos": 7 * S + 30 * S}  # 30 s default


def test_decode_heartbeats_while_it_waits_and_only_when_it_steps():
    """vLLM 0.32 NIXL build_connector_meta: every tracked remote id, per P engine, at
    most every lease // 6 (the first at once); tracked from add_request until
    finished_recving or request_finished."""
    sched = make_scheduler(
        use_kv_connector=True, kv_transfer=KVTransferConfig(kv_addr="ipc://d", kv_lease_s=6.0)
    )
    conn = sched.connector
    conn.set_time(10 * S)
    sched.add_request(make_request("d1", 10, params=remote_prefill_params(10)))
    assert conn.next_deadline_ns() == 10 * S  # due at once
    out, _ = step(sched)
    assert out.kv_connector_metadata.heartbeats == [HeartbeatSpec("P", "ipc://p", ["x"])]
    assert conn.next_deadline_ns() == 11 * S  # every 6 s // 6
    conn.set_time(10 * S + S // 2)
    sched.add_request(
        make_request(
            "d2", 10, start=50, params={**remote_prefill_params(10, 200), "remote_request_id": "y"}
        )
    )
    out, _ = step(sched)
    assert out.kv_connector_metadata.heartbeats == []  # one throttle for all requests
    conn.set_time(111 * S)  # D did not step for 100 s: one heartbeat when it next does
    out, _ = step(sched)
    assert out.kv_connector_metadata.heartbeats == [HeartbeatSpec("P", "ipc://p", ["x", "y"])]
    conn.set_time(112 * S)
    step(sched, finished_recving={"d1"})  # this step's heartbeat went out before the report
    sched.finish_requests(["d2"], RequestStatus.FINISHED_ABORTED)
    assert conn.next_deadline_ns() is None
    conn.set_time(200 * S)
    out, _ = step(sched)
    assert out.kv_connector_metadata.heartbeats == []


def test_requests_without_remote_fields_send_no_heartbeats():
    sched = make_scheduler(use_kv_connector=True)
    sched.add_request(make_request("p", 10, max_tokens=1, params=dict(REMOTE_DECODE)))
    params = {**remote_prefill_params(10), "remote_addr": None}
    sched.add_request(make_request("d", 10, start=50, params=params))
    out, _ = step(sched)
    assert out.kv_connector_metadata.heartbeats == [] and sched.connector.next_deadline_ns() is None
