"""Skipped steps (idle fast-forward, decode runs) against every step taken, on random configurations and workloads."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from engine.config import KVTransferConfig
from replay.sim.cost import StepCost
from replay.sim.options import SimOptions
from replay.sim.simulation import Simulation
from replay.trace.reader import TraceAbort, TraceRequest

STEP_COST = StepCost(
    base_s=0.0031, per_prefill_token_s=1.7e-5, per_decode_seq_s=2.3e-4, per_context_token_s=3.1e-7
)


def random_options(rng: random.Random) -> SimOptions:
    """Every setting a simulation has, small values favoured: pools that preempt, budgets
    that chunk, caps that stop, leases that expire, latencies of zero (events at one instant)."""
    engine = replace(
        SimOptions().engine,
        liveness=rng.choice(["legacy", "poll", "event"]),
        num_blocks=rng.choice([8, 12, 20, 40, 96, 400]),
        block_size=rng.choice([2, 4, 8, 16]),
        max_num_seqs=rng.choice([1, 2, 3, 8, 64]),
        max_num_batched_tokens=rng.choice([2, 3, 5, 16, 64, 2048]),
        max_model_len=rng.choice([24, 40, 72, 200, 8192]),
        enable_prefix_caching=rng.random() < 0.8,
        eos_token_id=rng.choice([None, None, 3, 7]),
        kv_load_failure_policy=rng.choice(["fail", "recompute"]),
        scheduler_reserve_full_isl=rng.random() < 0.5,
        async_scheduling=rng.random() < 0.1,
        model=replace(SimOptions().engine.model, vocab_size=rng.choice([16, 64, 512])),
    )
    kv = KVTransferConfig(
        kv_lease_s=rng.choice([30.0, 0.05, 0.2, 0.013]),
        drop_read_done=rng.random() < 0.2,
        transport=rng.choice(["shm", "zmq"]),
        pull_delay_ms=rng.choice([0.0, 0.0, 4.0, 40.0]),
    )
    return SimOptions(
        engine=engine,
        kv=kv,
        topology=rng.choice(["single", "pd", "1p2d", "2p1d", "2p2d"]),
        router=rng.choice(["round-robin", "least-loaded", "prefix"]),
        pull_delay_s=rng.choice([0.002, 0.004, 0.0]),
        per_block_s=rng.choice([0.00005, 0.0, 0.004]),
        read_done_latency_s=rng.choice([0.0005, 0.0, 0.004]),
        step_base_s=rng.choice([0.004, 0.001, 0.0031]),
        step_per_token_s=rng.choice([0.0, 0.00002]),
        zero_step_s=rng.choice([0.0001, 0.001, 0.004]),
        step_cost=STEP_COST if rng.random() < 0.15 else None,
        sample_interval_s=rng.choice([0.1, 0.004, 0.001, 0.0171]),
        tail_s=rng.choice([0.0, 0.5, 1.0]),
    )


def random_records(rng: random.Random, options: SimOptions) -> list:
    """Arrivals often on the step grid (so inputs meet step starts), shared prompts,
    requests forced to a decode engine alone or through P, aborts (of unknown ids too)."""
    grid, vocab, records, t = options.step_base_s, options.engine.model.vocab_size, [], 0.0
    shared = [tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 40))) for _ in range(3)]
    for i in range(rng.randint(3, 30)):
        t += rng.choice(
            [0.0, 0.0, grid, 2 * grid, 3 * grid, 0.013, 0.05, 0.4, grid * rng.randint(1, 30)]
        )
        max_tokens, pd = (
            rng.choice([1, 2, 3, 17, 40, 90, 200]),
            rng.choice([None, None, False, True]),
        )
        if rng.random() < 0.3:
            tokens = rng.choice(shared)
            records.append(
                TraceRequest(
                    round(t, 9), f"r{i}", max_tokens, len(tokens), prompt_token_ids=tokens, pd=pd
                )
            )
        else:
            hash_ids = tuple(rng.sample([1, 2, 3], rng.randint(0, 2))) + (1000 + i,)
            records.append(
                TraceRequest(
                    round(t, 9),
                    f"r{i}",
                    max_tokens,
                    16 * len(hash_ids) - rng.randint(0, 15),
                    hash_ids=hash_ids,
                    hash_block_size=16,
                    pd=pd,
                )
            )
        if rng.random() < 0.3:
            dt = rng.choice([0.0, grid, grid * rng.randint(1, 40), 0.0123, 0.1])
            records.append(TraceAbort(round(t + dt, 9), f"r{i}"))
        if rng.random() < 0.05:
            records.append(TraceAbort(round(t, 9), "nosuch"))
    return sorted(records, key=lambda r: r.t)  # stable: an abort stays after its request


def outcome(records, options: SimOptions) -> str:
    """The timeline as JSON, or the error the simulation raised."""
    try:
        timeline = Simulation(records, options).run()
    except Exception as e:  # the same input must fail the same way
        return f"{type(e).__name__}: {e}"
    timeline.meta.pop("fast_forward")
    return json.dumps(timeline.to_dict(), sort_keys=True)


@pytest.mark.parametrize("block", range(4))
def test_skipping_steps_gives_the_timeline_of_every_step_taken_on_random_configurations(block):
    for seed in range(25 * block, 25 * block + 25):
        rng = random.Random(seed)
        options = random_options(rng)
        records = random_records(rng, options)
        assert outcome(records, options) == outcome(
            records, replace(options, fast_forward=False)
        ), f"seed {seed}"
