"""The virtual clock carries out a trace's faults: each one's effect on the timeline (the
request's end, its fault, P's blocks), and a pause or kill is no FAULT."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from replay.sim.simulation import simulate
from replay.trace.fault_shares import FaultShares
from replay.trace.reader import TraceEngineFault, TraceRequest
from replay.trace.shaping import ShapingOptions, shape
from replay.verify.rules import verify
from replay.verify.timeline import Timeline
from replay.verify.verdict import EXIT_FAULT
from tests.replay.sim.test_simulate import load, run, sim_options

LEASE_S = 2.0


def request(t: float, req_id: str, **extra) -> dict:
    return {"t": t, "id": req_id, "prompt_len": 100, "max_tokens": 8, **extra}


def faulted(tmp_path, lines: list[dict], liveness: str = "event", **overrides) -> Timeline:
    return run(load(tmp_path, lines), liveness, kv_lease_s=LEASE_S, **overrides)


def used(timeline: Timeline, engine: str, t: float) -> int:
    """The engine's used blocks as last sampled at or before t."""
    return [s.num_used_blocks for s in timeline.samples_for(engine) if s.t <= t][-1]


def test_a_plain_request_says_when_p_answered_and_when_d_read_its_blocks(tmp_path):
    (record,) = faulted(tmp_path, [request(0.0, "r")]).requests
    assert record.fault is None and record.finish_reason == "length"
    assert 0 < record.prefill_done_t < record.read_t < record.first_token_t


def test_a_dropped_d_leg_ends_at_ps_answer_and_p_holds_its_blocks_for_the_lease(tmp_path):
    timeline = faulted(tmp_path, [request(0.0, "r", fault="drop_decode")])
    (record,) = timeline.requests
    assert (record.fault, record.finish_reason, record.read_t) == ("drop_decode", "error", None)
    assert record.end_t == record.prefill_done_t and record.error.startswith("drop_decode")
    assert used(timeline, "P", record.end_t + LEASE_S - 0.1) == 7
    assert used(timeline, "P", record.end_t + LEASE_S + 0.1) == 0
    assert timeline.counters["P"]["num_expired"] == 1
    assert used(timeline, "D", timeline.end_t) == 0 and timeline.counters["D"]["num_steps"] == 0


def test_a_refused_d_leg_ends_at_ds_refusal_and_p_frees_at_once(tmp_path):
    timeline = faulted(tmp_path, [request(0.0, "r", fault="reject_decode")])
    (record,) = timeline.requests
    assert (record.fault, record.finish_reason) == ("reject_decode", "error")
    assert "max_tokens" in record.error and record.end_t == pytest.approx(record.prefill_done_t)
    assert used(timeline, "P", record.end_t + 0.05) == 0
    assert timeline.counters["P"]["num_expired"] == 0


@pytest.mark.parametrize(
    "when, at, num_tokens, p_holds",
    [
        ("prefill", 0.0, 0, False),  # P frees at once
        ("transfer", 0.0, 0, False),  # at P's answer: D told at once, and tells P
        ("decode", 0.0, 1, False),  # at D's first token
    ],
)
def test_an_abort_lands_in_its_phase(tmp_path, when, at, num_tokens, p_holds):
    timeline = faulted(tmp_path, [request(0.0, "r"), {"t": at, "abort": "r", "when": when}])
    (record,) = timeline.requests
    assert (record.fault, record.finish_reason) == (f"abort_{when}", "abort")
    assert record.num_output_tokens == num_tokens
    end = {"prefill": 0.0, "transfer": record.prefill_done_t, "decode": record.first_token_t}
    assert record.end_t == end[when] and [a.t for a in timeline.aborts] == [record.end_t]
    assert used(timeline, "P", record.end_t + 0.05) == 0
    assert timeline.counters["P"]["num_expired"] == 0


def test_a_plain_abort_is_named_by_the_phase_it_landed_in(tmp_path):
    (record,) = faulted(tmp_path, [request(0.0, "r"), {"t": 0.0075, "abort": "r"}]).requests
    assert record.fault == "abort_transfer" and record.end_t == 0.0075


def test_an_abort_whose_phase_passed_is_skipped_and_listed(tmp_path):
    timeline = faulted(tmp_path, [request(0.0, "r"), {"t": 0.5, "abort": "r", "when": "decode"}])
    (record,) = timeline.requests
    assert record.fault is None and record.finish_reason == "length" and not timeline.aborts
    assert timeline.meta["skipped_aborts"] == [
        {"t": 0.5, "req_id": "r", "when": "decode", "phase": None, "line": 2}
    ]


def test_a_paused_d_steps_no_more_until_its_pause_ends_and_ps_lease_runs_out(tmp_path):
    lines = [request(0.0, "r"), {"t": 0.003, "pause": "D", "for_s": 5.0}]
    timeline = faulted(tmp_path, lines)
    (record,) = timeline.requests
    d_steps = [s.num_steps for s in timeline.samples_for("D") if 0.003 <= s.t < 5.003]
    assert len(set(d_steps)) == 1  # no step while paused: no heartbeat for P's lease
    assert timeline.counters["P"]["num_expired"] == 1  # P freed what D had not read
    assert record.finish_reason == "error" and record.end_t > 5.003  # D's load failed
    assert timeline.meta["engine_faults"] == [
        {"t": 0.003, "engine": "D", "action": "pause", "for_s": 5.0}
    ]
    assert verify(timeline, []).exit_code != EXIT_FAULT


def test_a_short_pause_of_d_keeps_ps_lease_by_its_heartbeats(tmp_path):
    lines = [request(0.0, "r"), {"t": 0.003, "pause": "D", "for_s": 1.0}]
    timeline = faulted(tmp_path, lines)
    (record,) = timeline.requests
    assert record.finish_reason == "length" and record.read_t > 1.003
    assert timeline.counters["P"]["num_expired"] == 0


def test_a_killed_p_loses_its_requests_and_the_later_ones(tmp_path):
    lines = [
        request(0.0, "at-p"),
        {"t": 0.002, "kill": "P"},
        request(0.5, "later"),
        request(0.5, "alone", pd=False),
    ]
    timeline = faulted(tmp_path, lines)
    at_p, later, alone = timeline.requests
    assert (at_p.finish_reason, at_p.error, at_p.end_t) == (
        "error",
        "engine P was killed",
        0.002,
    )
    assert later.error == "no prefill engine left: every one was killed" and later.end_t == 0.5
    assert alone.finish_reason == "length"
    assert max(s.t for s in timeline.samples_for("P")) <= 0.002  # P is gone
    assert timeline.meta["engine_faults"][0]["action"] == "kill"
    assert verify(timeline, []).exit_code != EXIT_FAULT


def test_a_killed_ps_blocks_are_not_read_by_d(tmp_path):
    timeline = faulted(tmp_path, [request(0.0, "r"), {"t": 0.0061, "kill": "P"}])
    (record,) = timeline.requests
    assert record.prefill_done_t < 0.0061 and record.finish_reason == "error"
    assert record.error == "KV load from the remote engine failed" and record.read_t is None


def test_fault_shares_give_the_same_timeline_for_the_same_seed(tmp_path):
    lines = [request(0.1 * i, f"r{i}") for i in range(40)]
    records = load(tmp_path, lines)
    shares = ["drop_decode=0.2", "reject_decode=0.2", "abort_transfer=0.2", "abort_decode=0.2"]

    def faults(seed: int) -> list:
        opts = ShapingOptions(faults=FaultShares.parse(shares, seed))
        timeline = run(list(shape(iter(records), opts)), "event", kv_lease_s=LEASE_S)
        assert all(r.end_t is not None for r in timeline.requests)  # never "unfinished"
        return [(r.req_id, r.fault, r.finish_reason, r.end_t) for r in timeline.requests]

    first = faults(5)
    assert first == faults(5) and first != faults(6)
    assert {f for _, f, _, _ in first} == {
        None,
        "drop_decode",
        "reject_decode",
        "abort_transfer",
        "abort_decode",
    }


def faulted_workload(seed: int) -> list:
    """Decoding requests, a share with each fault, pauses of both engines mid-decode, a
    kill of D near the end."""
    rng = random.Random(seed)
    records, t = [], 0.0
    for i in range(30):
        t += rng.choice([0.01, 0.05, 0.3])
        records.append(
            TraceRequest(round(t, 6), f"r{i}", rng.choice([8, 60]), 100, line=i + 1, fault=None)
        )
    shares = FaultShares.parse(
        ["drop_decode=0.1", "reject_decode=0.1", "abort_transfer=0.1", "abort_decode=0.1"], seed
    )
    records = list(shape(iter(records), ShapingOptions(faults=shares)))
    records += [
        TraceEngineFault(round(t / 3, 6), "pause", "D", 0.7),
        TraceEngineFault(round(t / 2, 6), "pause", "P", 0.4),
        TraceEngineFault(round(t, 6), "kill", "D"),
    ]
    return sorted(records, key=lambda r: r.t)  # stable: an abort stays after its request


@pytest.mark.parametrize("liveness", ["event", "poll", "legacy"])
@pytest.mark.parametrize("seed", [1, 2])
def test_faults_give_the_same_timeline_with_skipped_steps_as_step_by_step(liveness, seed):
    options = sim_options(liveness=liveness, num_blocks=512, kv_lease_s=LEASE_S)
    records = faulted_workload(seed)
    fast, slow = simulate(records, options), simulate(records, replace(options, fast_forward=False))
    fast.meta.pop("fast_forward"), slow.meta.pop("fast_forward")
    assert fast.meta["engine_faults"] and fast.to_dict() == slow.to_dict()
