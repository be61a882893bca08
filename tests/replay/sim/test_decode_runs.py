"""Runs of plain decode steps skipped at once against every step taken: the same timelines."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from engine.core import decode_run
from replay.sim.clock import TICK, to_ns
from replay.sim.cost import StepCost
from replay.sim.decode_run import DecodeRun
from replay.sim.options import SimOptions
from replay.sim.simulation import Simulation
from replay.trace.reader import TraceAbort, TraceRequest


def decode_heavy_workload(seed: int, num_requests: int = 36) -> list:
    """Overlapping requests with long outputs (runs of decodes), shared prefixes,
    requests sent to a decode engine alone, aborts in the middle of decoding."""
    rng, records, t = random.Random(seed), [], 0.0
    for i in range(num_requests):
        t += rng.choice([0.0, 0.002, 0.013, 0.05, 0.4])
        hash_ids = tuple(rng.sample([1, 2, 3], rng.randint(0, 2))) + (1000 * seed + i,)
        max_tokens = rng.choice([1, 3, 17, 40, 90])
        records.append(
            TraceRequest(
                round(t, 6),
                f"r{i}",
                max_tokens,
                16 * len(hash_ids) - rng.randint(0, 15),
                hash_ids=hash_ids,
                hash_block_size=16,
                pd=rng.choice([None, None, False]),
            )
        )
        if max_tokens == 90 and rng.random() < 0.5:  # about 0.4 s of decoding
            records.append(TraceAbort(round(t + rng.choice([0.05, 0.1237, 0.2]), 6), f"r{i}"))
    return sorted(records, key=lambda r: r.t)  # stable: an abort stays after its request


def timeline_json(records, options: SimOptions) -> str:
    timeline = Simulation(records, options).run()
    timeline.meta.pop("fast_forward")
    return json.dumps(timeline.to_dict(), sort_keys=True)


@pytest.fixture
def num_skipped_steps(monkeypatch):
    """Counts the decode steps the simulator made in runs rather than one by one."""
    counts = []
    take = decode_run.take_plain_decode_steps

    def counting_take(scheduler, next_tokens, num_steps):
        counts.append(num_steps)
        return take(scheduler, next_tokens, num_steps)

    monkeypatch.setattr("replay.sim.engine.take_plain_decode_steps", counting_take)
    return counts


STEP_COST = StepCost(
    base_s=0.0031, per_prefill_token_s=1.7e-5, per_decode_seq_s=2.3e-4, per_context_token_s=3.1e-7
)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "liveness,topology,overrides",
    [
        ("event", "pd", {}),
        ("event", "pd", {"num_blocks": 12}),  # pressure: preemption
        ("legacy", "pd", {"num_blocks": 40, "eos_token_id": 7}),  # stops on EOS
        (
            "poll",
            "single",
            {"block_size": 4, "eos_token_id": 30},
        ),  # a block boundary every 4 tokens
        ("event", "1p2d", {"max_model_len": 72, "block_size": 8}),  # length caps
        ("event", "single", {"step_cost": STEP_COST}),  # every step its own cost
    ],
    ids=["pd", "pd_pressure", "legacy_stops", "single_small_blocks", "1p2d_caps", "step_cost"],
)
def test_skipped_decode_runs_give_the_timeline_of_every_step_taken(
    seed, liveness, topology, overrides, num_skipped_steps
):
    """Tokens, their times (TTFT, ITL), samples (blocks, queues, step counts), counters,
    preemptions, aborts and stops: byte for byte the timeline of the simulation that
    takes every step, and the runs skipped steps."""
    overrides = dict(overrides)
    step_cost = overrides.pop("step_cost", None)
    engine = replace(SimOptions().engine, liveness=liveness, **{"num_blocks": 96, **overrides})
    if "eos_token_id" in overrides:  # a small vocabulary: the mock's tokens reach EOS often
        engine = replace(engine, model=replace(engine.model, vocab_size=64))
    options = SimOptions(
        engine=engine,
        topology=topology,
        tail_s=1.0,
        sample_interval_s=0.0171,
        step_cost=step_cost,
    )
    records = decode_heavy_workload(seed)
    skipped = timeline_json(records, options)
    assert sum(num_skipped_steps) > 20
    num_skipped_steps.clear()
    assert skipped == timeline_json(records, replace(options, fast_forward=False))
    assert not num_skipped_steps
    timeline = json.loads(skipped)
    reasons = {r["finish_reason"] for r in timeline["requests"]}
    assert {"abort", "length"} <= reasons
    if "eos_token_id" in overrides:
        assert "stop" in reasons
    if overrides == {"num_blocks": 12}:
        assert sum(c["num_preemptions"] for c in timeline["counters"].values()) > 0


def test_a_run_keeps_the_steps_that_start_before_the_connectors_next_timed_action():
    """A step that starts at or after the deadline would heartbeat or reap: it is taken."""

    def cost(num_decodes, num_context_tokens):
        return 10 + num_context_tokens

    run = DecodeRun.plan(100, 5, 2, 4, cost, deadline=140)
    assert run.starts == [100, 114, 130] and run.end == 148
    assert DecodeRun.plan(100, 5, 2, 4, cost, deadline=100) is None
    whole = DecodeRun.plan(100, 3, 2, 4, cost, deadline=None)
    assert whole.starts == [100, 114, 130] and whole.end == 148
    assert [whole.num_started_by(t) for t in (99, 100, 113, 114, 200)] == [0, 1, 1, 2, 3]
    assert [whole.num_started_before(t) for t in (100, 101, 114, 115)] == [0, 1, 1, 2]
    assert [whole.end_of(i) for i in range(3)] == [114, 130, 148]


@pytest.mark.parametrize("topology", ["single", "pd"])
def test_a_request_that_arrives_as_a_skipped_step_starts_joins_that_step(
    topology, num_skipped_steps
):
    """Every step takes 4 ms, so arrivals at multiples of 4 ms meet step starts: the
    step starting then drains the input (deliveries come first at one instant)."""
    records = [TraceRequest(0.0, "long", 60, 20, hash_ids=(1, 2), hash_block_size=16)]
    records += [
        TraceRequest(0.004 * k, f"r{k}", 5, 12, hash_ids=(10 + k,), hash_block_size=16)
        for k in (3, 7, 8, 20)
    ]
    options = SimOptions(
        topology=topology,
        step_base_s=0.004,
        step_per_token_s=0.0,
        pull_delay_s=0.004,
        tail_s=0.5,
        sample_interval_s=0.002,
    )
    skipped = timeline_json(records, options)
    assert sum(num_skipped_steps) > 10
    assert skipped == timeline_json(records, replace(options, fast_forward=False))


def test_a_simulation_stopped_inside_a_run_has_the_timeline_of_every_step_taken():
    """Ctrl-C's timeline (Simulation.stopped): the run's steps that started by then
    are taken, the tokens of those that ended are the client's, as with every step."""
    records = decode_heavy_workload(1)

    def stopped(options: SimOptions, stop_ns: int) -> tuple[str, bool]:
        sim = Simulation(records, options)
        sim._feed()
        sim.loop.push(0, TICK, 0, sim._tick)
        while sim.loop.heap and sim.loop.heap[0][0] <= stop_ns:
            fn, arg = sim.loop.pop()
            fn(arg)
        in_run = any(engine.run is not None for engine in sim.engines.values())
        sim.loop.now = stop_ns  # the signal's moment, whichever event came last
        timeline = sim.stopped("SIGINT")
        timeline.meta.pop("fast_forward")
        return json.dumps(timeline.to_dict(), sort_keys=True), in_run

    options = SimOptions(topology="single", tail_s=1.0, sample_interval_s=0.0171)
    num_in_run = 0
    for stop_ns in range(to_ns(0.0103), to_ns(1.2), to_ns(0.0397)):
        skipped, in_run = stopped(options, stop_ns)
        num_in_run += in_run
        assert skipped == stopped(replace(options, fast_forward=False), stop_ns)[0]
    assert num_in_run > 5
