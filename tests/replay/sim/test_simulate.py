"""The virtual-clock replay (replay/sim/simulation.py) and its verification (replay/verify/rules.py)."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from connector.factory import make_pd_connector
from connector.messages import HeartbeatSpec, RecvSpec
from connector.pd import PDConnectorMetadata
from engine.config import EngineConfig, KVTransferConfig
from replay.sim.clock import EventLoop, to_ns
from replay.sim.kv_worker import SimKVWorker
from replay.sim.options import SimOptions
from replay.sim.simulation import simulate
from replay.trace.reader import TraceRecord, TraceSnapshot, read_trace
from replay.trace.shaping import ShapingOptions, shape
from replay.verify.rules import VerifyOptions, idle_windows, verify
from replay.verify.timeline import EngineSample, RequestRecord, Timeline
from tests.paths import MOONCAKE, public_trace

NUM_BLOCKS = 512


def bursts(
    num_bursts: int = 3,
    per_burst: int = 3,
    spacing: float = 0.3,
    shared_prefix: bool = False,
    pd: bool = True,
) -> list[dict]:
    """Bursts of requests `spacing` apart, 3 s of idle between bursts."""
    lines: list[dict] = [{"kvdrain_trace": 1, "name": "bursts"}]
    t = 0.0
    for b in range(num_bursts):
        for i in range(per_burst):
            own = [1000 + 100 * b + 10 * i + j for j in range(8)]
            hash_ids = [1, 2, 3, 4] + own[4:] if shared_prefix else own
            lines.append(
                {
                    "t": round(t, 6),
                    "id": f"b{b}-r{i}",
                    "hash_ids": hash_ids,
                    "prompt_len": 120,
                    "max_tokens": 4 + i,
                    "pd": pd,
                }
            )
            t += spacing
        t += 3.0
    return lines


def load(tmp_path: Path, lines: list[dict]) -> list[TraceRecord]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return list(read_trace(path))


def sim_options(**overrides) -> SimOptions:
    """SimOptions from flat overrides, each going where its name lives: the engine's
    config, the KV-transfer config, or the simulator's own latency model."""
    engine_keys = {f.name for f in fields(EngineConfig)}
    kv_keys = {f.name for f in fields(KVTransferConfig)}
    engine = replace(
        SimOptions().engine, **{k: v for k, v in overrides.items() if k in engine_keys}
    )
    kv = replace(KVTransferConfig(), **{k: v for k, v in overrides.items() if k in kv_keys})
    own = {k: v for k, v in overrides.items() if k not in engine_keys | kv_keys}
    return SimOptions(engine=engine, kv=kv, **own)


def run(records: list[TraceRecord], liveness: str, **overrides) -> Timeline:
    return simulate(records, sim_options(liveness=liveness, num_blocks=NUM_BLOCKS, **overrides))


def hold_intervals(timeline: Timeline, engine: str) -> list[float]:
    """Lengths of the spans in which the engine held blocks of finished requests."""
    spans, since = [], None
    for s in timeline.samples_for(engine):
        if s.num_finished_awaiting_free and since is None:
            since = s.t
        elif not s.num_finished_awaiting_free and since is not None:
            spans.append(s.t - since)
            since = None
    return spans + ([timeline.end_t - since] if since is not None else [])


def sample_at(timeline: Timeline, engine: str, t: float) -> EngineSample:
    """The engine's sample in force at t (the last at or before it: a value holds until
    the next sample)."""
    return [s for s in timeline.samples_for(engine) if s.t <= t][-1]


def dump(timeline: Timeline) -> str:
    return json.dumps(timeline.to_dict(), sort_keys=True)


def test_legacy_holds_prefill_blocks_through_idle_gaps(tmp_path):
    timeline = run(load(tmp_path, bursts()), "legacy")
    verdict = verify(timeline, [], VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5))
    assert verdict.exit_code == 1 and not verdict.ok
    leaks = [v for v in verdict.violations if v.kind == "leak"]
    assert {v.engine for v in leaks} == {"P"} and len(leaks) == 3  # 2 gaps + the tail
    for w in verdict.windows:
        if w.engine == "P":
            assert w.verdict == "leak" and w.num_blocks_held == 8 and w.time_to_drain is None
        else:
            assert w.verdict == "drained"
    # Parked on its input with the delayed free: the connector's report is never read.
    gap_sample = sample_at(timeline, "P", 2.5)
    assert gap_sample.loop_state == "blocked" and gap_sample.num_finished_awaiting_free == 1
    assert min(hold_intervals(timeline, "P")) > 2.5


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_fixed_policies_drain_within_milliseconds(tmp_path, liveness):
    timeline = run(load(tmp_path, bursts()), liveness)
    verdict = verify(timeline, [], VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5))
    assert verdict.exit_code == 0, verdict.violations
    assert len(verdict.windows) == 6  # 2 gaps + the tail, for P and D
    assert all(w.verdict == "drained" and w.time_to_drain <= 0.005 for w in verdict.windows)
    # Pull (2 ms + 8 blocks) + read done (0.5 ms) + a D step and a poll at most.
    assert max(hold_intervals(timeline, "P")) < 0.015


def test_event_wakes_far_less_than_poll(tmp_path):
    records = load(tmp_path, bursts())
    poll = run(records, "poll", pull_delay_s=0.05)
    event = run(records, "event", pull_delay_s=0.05)
    for engine in ("P", "D"):
        assert event.counters[engine]["num_wakeups"] * 5 < poll.counters[engine]["num_wakeups"]
    assert poll.counters["P"]["num_wakeups"] >= 9 * 40  # ~1 per ms while a pull is pending


def test_same_trace_and_options_give_identical_timelines(tmp_path):
    records = load(tmp_path, bursts(shared_prefix=True))
    for liveness in ("legacy", "poll", "event"):
        assert dump(run(records, liveness)) == dump(run(records, liveness))


def test_shared_hash_ids_hit_the_prefix_cache(tmp_path):
    lines = bursts(num_bursts=1, per_burst=2, spacing=0.0, shared_prefix=True)
    shared = run(load(tmp_path, lines), "poll")
    hits = [r.num_prefix_hit_tokens for r in shared.requests]
    assert hits == [0, 64]  # hash ids 1-4: four 16-token engine blocks
    assert shared.counters["P"]["num_prefix_hit_tokens"] == 64
    unique = run(load(tmp_path, bursts(num_bursts=1, per_burst=2, spacing=0.0)), "poll")
    peak = {
        name: max(s.num_used_blocks for s in tl.samples_for("P"))
        for name, tl in (("shared", shared), ("unique", unique))
    }
    assert peak == {"shared": 12, "unique": 16}


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_dropped_read_done_drains_after_expiry(tmp_path, liveness):
    records = load(tmp_path, bursts(spacing=0.8))  # sends never overlap
    # zmq: D's read is served, not pinned (an shm pin would defer the expiry to its
    # read lease, READ_LEASE_NS, as in the process; see test_kv_integrity.py).
    timeline = run(records, liveness, drop_read_done=True, kv_lease_s=0.5, transport="zmq")
    assert timeline.counters["P"]["num_expired"] == 9
    assert timeline.counters["P"]["num_read_done_dropped"] == 9  # D sends it; P drops it
    verdict = verify(timeline, [], VerifyOptions(drain_deadline_s=1.0))
    assert verdict.exit_code == 0, verdict.violations
    p_windows = [w for w in verdict.windows if w.engine == "P"]
    # The window opens when D's last request ends, a few tens of ms after P finished.
    assert len(p_windows) == 3 and all(0.4 < w.time_to_drain <= 0.5 for w in p_windows)
    # The lease runs from the end of the prefill step (request_finished stamps it as the
    # step's output is processed, as in the process): seen from outside, P holds for the
    # lease plus the reaping step (a zero-token step, and under poll at most one sleep).
    assert all(0.5 < span <= 0.5 + 0.0012 for span in hold_intervals(timeline, "P"))
    strict = verify(timeline, [], VerifyOptions(drain_deadline_s=0.2))
    assert strict.exit_code == 1


def test_legacy_with_dropped_read_done_reaps_only_when_an_input_wakes_it(tmp_path):
    timeline = run(load(tmp_path, bursts()), "legacy", drop_read_done=True, kv_lease_s=0.5)
    # Parked on its input, P checks no lease: each burst's leases are reaped by the next
    # burst's first step; the last burst's never are.
    assert timeline.counters["P"]["num_expired"] == 6
    assert verify(timeline, [], VerifyOptions(drain_deadline_s=1.0)).exit_code == 1
    held = [s.num_finished_awaiting_free for s in timeline.samples_for("P")]
    assert held[-1] == 3 and max(held) == 3


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_single_topology_drains_under_every_policy(tmp_path, liveness):
    timeline = run(load(tmp_path, bursts(pd=False)), liveness, topology="single")
    assert timeline.engines == ["E"]
    verdict = verify(timeline, [], VerifyOptions())
    assert verdict.exit_code == 0 and len(verdict.windows) == 3
    assert all(r.finish_reason == "length" for r in timeline.requests)


@pytest.mark.parametrize(
    "liveness,spacing,overrides",
    [
        ("poll", 0.3, {"drop_read_done": True, "kv_lease_s": 0.7}),  # ~600 idle polls a request
        ("poll", 0.0, {"pull_delay_s": 0.0173, "num_blocks": 14}),  # P waits for blocks too
        ("legacy", 0.3, {"pull_delay_s": 0.0231}),  # D sleeps on pending loads
        ("legacy", 0.0, {"pull_delay_s": 0.0173, "num_blocks": 14}),  # P sleeps waiting for blocks
        ("event", 0.3, {"drop_read_done": True, "kv_lease_s": 0.7}),
        # D waits longer than the lease: heartbeats every 1/6 of it, reaps of extended leases.
        ("legacy", 0.3, {"pull_delay_s": 1.3, "kv_lease_s": 0.9}),
        ("poll", 0.3, {"pull_delay_s": 1.3, "kv_lease_s": 0.9}),
        ("event", 0.3, {"pull_delay_s": 1.3, "kv_lease_s": 0.9}),
    ],
)
def test_fast_forward_equals_stepping_one_by_one(tmp_path, liveness, spacing, overrides):
    records = load(tmp_path, bursts(spacing=spacing, shared_prefix=True))
    options = sim_options(liveness=liveness, sample_interval_s=0.0371, tail_s=2.0, **overrides)
    fast, slow = simulate(records, options), simulate(records, replace(options, fast_forward=False))
    fast.meta.pop("fast_forward"), slow.meta.pop("fast_forward")
    assert dump(fast) == dump(slow)
    assert fast.counters == slow.counters


def d_steps_per_second(timeline: Timeline, t0: float, t1: float) -> float:
    samples = [s for s in timeline.samples_for("D") if t0 <= s.t <= t1]
    return (samples[-1].num_steps - samples[0].num_steps) / (samples[-1].t - samples[0].t)


def test_legacy_decode_sleeps_while_its_load_waits(tmp_path):
    """vLLM before #43433 slept 1 ms per zero-token step while unfinished requests
    waited: about 1,000 steps/s (here 1 / (1 ms + a 0.1 ms step)), not a spin."""
    records = load(tmp_path, bursts(num_bursts=1, per_burst=1))
    timeline = run(records, "legacy", pull_delay_s=1.0)
    waiting = [s for s in timeline.samples_for("D") if 0.2 <= s.t <= 0.9]
    assert all(s.num_waiting_for_remote_kvs == 1 and s.loop_state == "polling" for s in waiting)
    rate = d_steps_per_second(timeline, 0.2, 0.9)
    assert 1000 / 1.1 - 5 < rate <= 1000
    poll = run(records, "poll", pull_delay_s=1.0)
    assert d_steps_per_second(poll, 0.2, 0.9) == rate  # the same loop while a load waits
    assert timeline.counters["D"]["num_wakeups"] > 900  # each sleep wakes once


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_heartbeats_keep_the_lease_while_decode_waits_longer_than_it(tmp_path, liveness):
    """D pulls 3 s after it got the request, the lease is 1 s: D's heartbeats (every
    1/6 s while it steps, even under event) keep P's leases until the reads."""
    records = load(tmp_path, bursts(num_bursts=1))
    timeline = run(records, liveness, pull_delay_s=3.0, kv_lease_s=1.0)
    assert timeline.counters["P"]["num_expired"] == 0
    assert [r.finish_reason for r in timeline.requests] == ["length"] * 3
    assert max(hold_intervals(timeline, "P")) > 3.0  # held past three leases, then read
    assert verify(timeline, [], VerifyOptions(drain_deadline_s=1.0)).exit_code == 0


def test_a_parked_legacy_prefill_reaps_no_lease(tmp_path):
    records = load(tmp_path, bursts(num_bursts=1))
    timeline = run(records, "legacy", drop_read_done=True, kv_lease_s=0.5, tail_s=5.0)
    assert timeline.counters["P"]["num_expired"] == 0  # 10 leases long past, none reaped
    last = timeline.samples_for("P")[-1]
    assert last.loop_state == "blocked" and last.num_finished_awaiting_free == 3
    for liveness in ("poll", "event"):  # they step, so they reap
        fixed = run(records, liveness, drop_read_done=True, kv_lease_s=0.5, tail_s=5.0)
        assert fixed.counters["P"]["num_expired"] == 3


def test_event_prefill_wakes_at_the_lease_and_reaps_at_once(tmp_path):
    """Blocked on reports with a held send, event P wakes when the lease falls due
    (its poll timeout), steps, and frees: one wake-up per lease, no polling."""
    records = load(tmp_path, bursts(num_bursts=1, per_burst=1))
    timeline = run(
        records, "event", drop_read_done=True, kv_lease_s=2.0, tail_s=5.0, transport="zmq"
    )  # no pin: its read lease would defer the expiry
    (span,) = hold_intervals(timeline, "P")
    # From the prefill step's end (the stamp) to the reaping step's end.
    assert span == pytest.approx(2.0 + 0.0001, abs=1e-9)
    assert timeline.counters["P"]["num_wakeups"] <= 4


def test_decode_tokens_equal_a_single_engine(tmp_path):
    records = load(tmp_path, bursts(shared_prefix=True))
    pd = run(records, "poll")
    single = run(records, "poll", topology="single")
    assert [(r.req_id, r.num_output_tokens, r.output_digest) for r in pd.requests] == [
        (r.req_id, r.num_output_tokens, r.output_digest) for r in single.requests
    ]
    assert all(r.num_output_tokens == 4 + int(r.req_id[-1]) for r in pd.requests)


def test_event_decode_starts_right_after_its_pull(tmp_path):
    timeline = run(load(tmp_path, bursts()), "event")
    assert all(r.first_token_t is not None for r in timeline.requests)
    assert max(r.first_token_t - r.arrival_t for r in timeline.requests) < 0.05


@pytest.mark.parametrize(
    "at,chunked,num_expired",
    [
        (0.002, True, 0),  # on P between two prefill chunks: P frees at once
        (0.012, False, 0),  # on D: D's pull still completes and tells P
        # Lands while P's last step runs, so P finishes and holds the blocks anyway: the
        # router sends it on to D to be aborted at once, and D's connector tells P to free.
        (0.002, False, 0),
    ],
)
def test_abort_reaches_the_engine_holding_the_request(tmp_path, at, chunked, num_expired):
    lines = bursts(num_bursts=1, per_burst=1) + [{"t": at, "abort": "b0-r0"}]
    timeline = run(
        load(tmp_path, lines),
        "poll",
        kv_lease_s=1.0,
        max_num_batched_tokens=64 if chunked else 2048,
    )
    (record,) = timeline.requests
    assert record.finish_reason == "abort" and record.end_t == at
    assert [(a.t, a.req_id) for a in timeline.aborts] == [(at, "b0-r0")]
    assert timeline.counters["P"]["num_expired"] == num_expired
    assert verify(timeline, [], VerifyOptions(drain_deadline_s=1.5)).exit_code == 0
    assert verify(timeline, [], VerifyOptions()).exit_code == num_expired


def test_snapshots_match_exactly_or_within_tolerance(tmp_path):
    timeline = run(load(tmp_path, bursts()), "legacy")
    free = NUM_BLOCKS - 1
    good = TraceSnapshot(2.0, {"P": {"used": 8, "free": free - 8}, "D": {"used": 0, "free": free}})
    off = TraceSnapshot(2.0, {"P": {"used": 7, "free": free - 7}})
    ok = verify(timeline, [good], VerifyOptions())
    assert not [v for v in ok.violations if v.kind == "snapshot"]
    bad = verify(timeline, [off, TraceSnapshot(2.0, {"X": {"used": 0, "free": 0}})])
    assert [(v.kind, v.engine) for v in bad.violations if v.kind == "snapshot"] == [
        ("snapshot", "P"),
        ("snapshot", "X"),
    ]
    loose = verify(timeline, [off], VerifyOptions(snapshot_tolerance_blocks=1))
    assert not [v for v in loose.violations if v.kind == "snapshot"]


def test_conservation_and_unfinished_requests_are_violations(tmp_path):
    timeline = run(load(tmp_path, bursts(num_bursts=1)), "poll")
    data = timeline.to_dict()
    assert Timeline.from_dict(json.loads(json.dumps(data))).to_dict() == data
    broken = Timeline.from_dict(data)
    sample = broken.samples[3]
    broken.samples[3] = EngineSample(**{**data["samples"][3], "num_free_blocks": 0})
    broken.requests[0].end_t = None
    kinds = sorted(v.kind for v in verify(broken, []).violations)
    assert kinds == ["conservation", "unfinished"] and sample.num_free_blocks > 0


def test_idle_windows_follow_the_clients_view():
    timeline = Timeline(
        engines=["E"],
        num_usable_blocks={"E": 10},
        samples=[],
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=20.0,
    )
    timeline.requests = [
        _record("a", 0.0, 5.0),
        _record("b", 1.0, 2.0),
        _record("c", 6.0, 7.0),
        _record("d", 6.5, 9.0),
    ]
    assert idle_windows(timeline, 1.0) == [(5.0, 6.0, False), (9.0, 20.0, True)]
    assert idle_windows(timeline, 1.5) == [(9.0, 20.0, True)]
    timeline.requests[2].end_t = None  # never ends: no window after it, and a violation
    assert idle_windows(timeline, 1.0) == [(5.0, 6.0, False)]


def _record(req_id: str, arrival: float, end: float) -> RequestRecord:
    return RequestRecord(
        req_id=req_id,
        arrival_t=arrival,
        send_t=arrival,
        send_lateness_s=0.0,
        first_token_t=None,
        end_t=end,
        num_prompt_tokens=1,
        num_output_tokens=1,
        num_prefix_hit_tokens=0,
        finish_reason="length",
    )


@public_trace(MOONCAKE)
@pytest.mark.parametrize("liveness,exit_code", [("legacy", 1), ("poll", 0), ("event", 0)])
def test_mooncake_slice(liveness, exit_code):
    shaping = ShapingOptions(scale_tokens=0.03125, max_requests=300)
    timeline = simulate(shape(read_trace(MOONCAKE), shaping), sim_options(liveness=liveness))
    assert len(timeline.requests) == 300
    verdict = verify(timeline, [], VerifyOptions())
    assert verdict.exit_code == exit_code and len(verdict.windows) > 10


def _run_until(loop: EventLoop, t: int) -> None:
    while loop.heap and loop.heap[0][0] <= t:
        fn, arg = loop.pop()
        fn(arg)
    loop.now = t


def test_sim_worker_expiry_belongs_to_one_registration():
    """The simulator drives the process's SendLedger: a re-used id keeps its own deadline."""
    loop, peers = EventLoop(), {}
    options = sim_options(kv_lease_s=1.0, read_done_latency_s=0.0)
    p, d = SimKVWorker("P", loop, options, peers), SimKVWorker("D", loop, options, peers)
    p.start_load_kv(PDConnectorMetadata({"r1": [1]}))
    # An empty receive on D only says "read done" to P.
    d.start_load_kv(PDConnectorMetadata(reqs_to_recv={"x": RecvSpec("x", [], [], "P", "r1", "")}))
    _run_until(loop, to_ns(0.5))
    assert p.get_finished(set()).finished_sending == {"r1"}
    p.start_load_kv(PDConnectorMetadata({"r1": [2]}))  # the id comes back at 0.5 s
    _run_until(loop, to_ns(1.4))
    assert p.get_finished(set()).finished_sending == set()  # the first deadline (1 s) is not its
    _run_until(loop, to_ns(1.5))
    assert p.get_finished(set()).finished_sending == {"r1"}
    assert p.get_counters()["num_expired"] == 1 and p.get_counters()["num_sent"] == 1


def test_sim_worker_forgets_an_early_read_done_after_the_expiry():
    """As the process does: an early "read done" is held for the expiry, then dropped."""
    loop, peers = EventLoop(), {}
    options = sim_options(kv_lease_s=1.0, read_done_latency_s=0.0)
    p, d = SimKVWorker("P", loop, options, peers), SimKVWorker("D", loop, options, peers)
    d.start_load_kv(PDConnectorMetadata(reqs_to_recv={"x": RecvSpec("x", [], [], "P", "r1", "")}))
    _run_until(loop, to_ns(0.2))
    p.start_load_kv(PDConnectorMetadata({"r1": [1]}))  # within the hold: freed at once
    assert p.get_finished(set()).finished_sending == {"r1"}
    d.start_load_kv(PDConnectorMetadata(reqs_to_recv={"y": RecvSpec("y", [], [], "P", "r2", "")}))
    _run_until(loop, to_ns(1.3))  # r2's hold ended at 1.2 s
    p.start_load_kv(PDConnectorMetadata({"r2": [2]}))
    assert p.get_finished(set()).finished_sending == set()
    _run_until(loop, to_ns(2.3))
    assert p.get_finished(set()).finished_sending == {"r2"} and p.get_counters()["num_expired"] == 1


def test_sim_worker_reaps_only_when_its_engine_asks_and_heartbeats_extend():
    """P's leases end in get_finished (its engine's step), never on a clock event; a
    heartbeat from D is applied at P's next get_finished; without more the lease lapses."""
    loop, peers = EventLoop(), {}
    options = sim_options(kv_lease_s=1.0, read_done_latency_s=0.0)
    p, d = SimKVWorker("P", loop, options, peers), SimKVWorker("D", loop, options, peers)
    p.start_load_kv(
        PDConnectorMetadata(
            {"r1": [1], "r2": [2]}, send_deadlines={"r1": to_ns(1.0), "r2": to_ns(1.0)}
        )
    )
    assert p.next_deadline_ns() == to_ns(1.0)
    _run_until(loop, to_ns(0.5))
    d.start_load_kv(PDConnectorMetadata(heartbeats=[HeartbeatSpec("P", "sim://P", ["r1"])]))
    _run_until(loop, to_ns(0.6))
    assert p.has_reports()  # the LeaseDue message: it wakes P, whose next step reaps
    assert p.get_finished(set()).finished_sending == set()  # applied: r1 -> 0.6 + 2/3 s
    _run_until(loop, to_ns(5.0))
    assert not p.has_reports()  # nothing expires while P does not step
    assert p.get_finished(set()).finished_sending == {"r1", "r2"}
    assert p.get_counters()["num_expired"] == 2 and p.next_deadline_ns() is None


def test_sim_worker_heartbeat_moves_the_lease_from_the_reap_time():
    loop, peers = EventLoop(), {}
    options = sim_options(kv_lease_s=1.0, read_done_latency_s=0.0)
    p, d = SimKVWorker("P", loop, options, peers), SimKVWorker("D", loop, options, peers)
    p.start_load_kv(PDConnectorMetadata({"r1": [1]}, send_deadlines={"r1": to_ns(1.0)}))
    _run_until(loop, to_ns(0.5))
    d.start_load_kv(PDConnectorMetadata(heartbeats=[HeartbeatSpec("P", "sim://P", ["r1"])]))
    _run_until(loop, to_ns(0.6))
    p.get_finished(set())
    assert p.next_deadline_ns() == to_ns(0.6) + to_ns(1.0) * 2 // 3
    _run_until(loop, to_ns(1.2))
    assert p.get_finished(set()).finished_sending == set()  # the old lease (1 s) is gone
    _run_until(loop, p.next_deadline_ns())
    assert p.get_finished(set()).finished_sending == {"r1"}  # D stopped heartbeating: it lapses


FACTORY_CALLS: list[tuple[str, str]] = []


def recording_factory(config, role, kv_cache_handle=None):
    FACTORY_CALLS.append((config.engine_id, role.value))
    return make_pd_connector(config, role, kv_cache_handle)


def test_engines_build_their_connector_through_the_configured_factory(tmp_path):
    records = load(tmp_path, bursts(num_bursts=1))
    FACTORY_CALLS.clear()
    named = run(records, "event", kv_connector="tests.replay.sim.test_simulate:recording_factory")
    assert FACTORY_CALLS == [("P", "scheduler"), ("D", "scheduler")]  # the agent is simulated
    named.meta.clear()
    default = run(records, "event")
    default.meta.clear()
    assert dump(named) == dump(default)


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_sim_decode_reads_through_p_and_a_refused_read_fails_the_load(transport):
    """As the process's D (connector/pull_outcome.py): a pull asks P's ledger; a read of
    an expired send is refused, so the load fails (its blocks invalid) and P is released
    unread, never told "read done" (which would be a read after expiry)."""
    loop, peers = EventLoop(), {}
    options = sim_options(
        kv_lease_s=1.0, read_done_latency_s=0.0, pull_delay_s=0.0, transport=transport
    )
    p, d = SimKVWorker("P", loop, options, peers), SimKVWorker("D", loop, options, peers)
    p.start_load_kv(
        PDConnectorMetadata(
            {"ok": [1, 2], "old": [3]}, send_deadlines={"ok": to_ns(9.0), "old": to_ns(1.0)}
        )
    )
    _run_until(loop, to_ns(1.0))
    assert p.get_finished(set()).finished_sending == {"old"}  # reaped: expired
    d.start_load_kv(
        PDConnectorMetadata(
            reqs_to_recv={
                "a": RecvSpec("a", [7, 8], [1, 2], "P", "ok", "sim://P"),
                "b": RecvSpec("b", [9], [3], "P", "old", "sim://P"),
            }
        )
    )
    _run_until(loop, to_ns(1.5))
    out = d.get_finished(set())
    assert out.finished_recving == {"a", "b"} and out.invalid_block_ids == {9}
    assert p.get_finished(set()).finished_sending == {"ok"}
    counters = p.get_counters()
    assert counters["num_reads_refused"] == 1 and counters["num_released_unread"] == 1
    assert counters["num_reads_after_expiry"] == 0 and counters["num_sent"] == 1


def test_sim_pin_copy_that_outlasts_its_read_lease_fails_the_load():
    loop, peers = EventLoop(), {}
    options = sim_options(
        read_done_latency_s=0.0, pull_delay_s=0.0, per_block_s=1.5, kv_lease_s=30.0, transport="shm"
    )
    p, d = SimKVWorker("P", loop, options, peers), SimKVWorker("D", loop, options, peers)
    p.start_load_kv(PDConnectorMetadata({"r1": [1, 2]}))
    d.start_load_kv(
        PDConnectorMetadata(reqs_to_recv={"a": RecvSpec("a", [5, 6], [1, 2], "P", "r1", "")})
    )
    _run_until(loop, to_ns(4.0))  # the copy took 3 s, the pin lasts 2 s
    out = d.get_finished(set())
    assert out.finished_recving == {"a"} and out.invalid_block_ids == {5, 6}
    assert p.get_finished(set()).finished_sending == {"r1"}
    assert p.get_counters()["num_released_unread"] == 1


def test_virtual_replay_reports_no_read_after_expiry_the_process_cannot_produce():
    """D aborted during a slow pull stops heartbeating; P's lease lapses before D reads:
    the read is refused, as in the process, so the verdict has no read_after_expiry."""
    from replay.trace.records import TraceAbort, TraceRequest
    from replay.verify.rules import _check_kv_integrity

    for transport in ("zmq", "shm"):
        opts = SimOptions(
            engine=EngineConfig(num_blocks=64, max_model_len=512, block_size=16),
            kv=KVTransferConfig(kv_lease_s=0.05, pull_delay_ms=300, transport=transport),
            tail_s=1.0,
        )
        timeline = simulate([TraceRequest(0.0, "r0", 4, 100), TraceAbort(0.1, "r0")], opts)
        assert timeline.counters["P"]["num_expired"] == 1
        assert timeline.counters["P"]["num_reads_after_expiry"] == 0
        assert list(_check_kv_integrity(timeline)) == []


def spaced(gap_s: float, num_requests: int = 5) -> list[dict]:
    """`num_requests` P/D requests, `gap_s` apart."""
    return [
        {"t": i * gap_s, "id": f"r{i}", "prompt_len": 100, "max_tokens": 4, "pd": True}
        for i in range(num_requests)
    ]


@pytest.mark.parametrize("liveness", ["legacy", "event"])
def test_a_gap_of_hours_costs_what_a_ten_second_gap_costs(tmp_path, liveness):
    short = run(load(tmp_path, spaced(10.0)), liveness)
    long = run(load(tmp_path, spaced(1e4)), liveness)
    assert long.end_t > 4e4 and len(long.samples) == len(short.samples) < 200
    options = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5)
    judged = [
        [
            (w.engine, w.verdict, w.num_used_at_start, w.time_to_drain, w.num_blocks_held)
            for w in verify(t, [], options).windows
        ]
        for t in (short, long)
    ]
    assert judged[0] == judged[1] and len(judged[0]) == 10


def test_samples_skip_only_stretches_in_which_every_engine_is_blocked(tmp_path):
    """Between two samples of an engine nothing it shows changed, except where some
    engine was not blocked: there the grid goes on, sample_interval_s apart."""
    timeline = run(load(tmp_path, bursts(spacing=0.3)), "legacy", sample_interval_s=0.1)
    times = sorted({s.t for s in timeline.samples})
    for t0, t1 in zip(times, times[1:]):
        if t1 - t0 > 0.1 + 1e-9:
            assert all(sample_at(timeline, e, t0).loop_state == "blocked" for e in timeline.engines)
    # A leak stays visible through the gap: the sample in force holds P's blocks.
    assert sample_at(timeline, "P", 2.5).num_used_blocks == 8


def _poisson(num_requests: int, seed: int = 1) -> list[dict]:
    """P/D requests arriving at 50/s, with a 2 s pause every 100."""
    import random

    rnd, t, lines = random.Random(seed), 0.0, []
    for i in range(num_requests):
        t += rnd.expovariate(50.0) + (2.0 if i % 100 == 99 else 0.0)
        lines.append(
            {
                "t": round(t, 6),
                "id": f"r{i}",
                "prompt_len": rnd.randint(50, 400),
                "max_tokens": rnd.randint(2, 16),
                "pd": True,
            }
        )
    return lines


@pytest.mark.slow
def test_a_replay_holds_under_three_kilobytes_per_request(tmp_path):
    """What a long replay costs grows with its requests alone (timeline samples, request
    records: about 2.5 KB each, 6.4 samples a request), so 2 million lines fit in ~5 GB."""
    import gc
    import tracemalloc

    def retained(num_requests: int) -> int:
        records = load(tmp_path, _poisson(num_requests))
        gc.collect()
        tracemalloc.start()
        try:
            timeline = simulate(records, sim_options(liveness="event", num_blocks=2048))
            verdict = verify(timeline, [])
            gc.collect()
            assert verdict.exit_code == 0 and len(timeline.requests) == num_requests
            return tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    small, large = retained(300), retained(1200)
    per_request = (large - small) / 900
    assert 1000 < per_request < 3000, per_request
