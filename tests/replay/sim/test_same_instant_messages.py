"""A message sent at once (zero latency) by an engine's step start reaches the engines
that step after it too late for their step at that instant: skipped steps must agree."""

from __future__ import annotations

import json
from dataclasses import replace

from engine.config import KVTransferConfig
from replay.sim.options import SimOptions
from replay.sim.simulation import Simulation
from replay.trace.reader import TraceAbort, TraceRequest


def timeline_json(records, options: SimOptions) -> str:
    timeline = Simulation(records, options).run()
    timeline.meta.pop("fast_forward")
    return json.dumps(timeline.to_dict(), sort_keys=True)


def test_a_heartbeat_sent_at_once_misses_the_polling_prefills_step_at_that_instant():
    """D heartbeats (12 ms lease: every 2 ms) with no latency from its step start at T;
    P (rank 0, polling for its delayed free) started its step at T already in the
    every-step run, so only its next step reaps; the fast-forward let the step at T take it."""
    engine = replace(
        SimOptions().engine,
        num_blocks=30,
        block_size=4,
        max_num_seqs=4,
        liveness="poll",
        kv_load_failure_policy="recompute",
        eos_token_id=7,
    )
    options = SimOptions(
        engine=engine,
        kv=KVTransferConfig(kv_lease_s=0.012),
        topology="pd",
        pull_delay_s=0.0,
        per_block_s=0.001,
        read_done_latency_s=0.0,
        step_base_s=0.004,
        step_per_token_s=0.0,
        zero_step_s=0.001,
        sample_interval_s=0.002,
        tail_s=0.0,
    )
    records = [
        TraceRequest(0.058, "r4", 2, 36, hash_ids=(2, 3, 1004)),
        TraceRequest(0.063, "r6", 90, 2, hash_ids=(1006,), pd=False),
        TraceRequest(0.084, "r8", 40, 9, hash_ids=(1008,), pd=False),
        TraceRequest(
            0.18,
            "r12",
            17,
            17,
            prompt_token_ids=(
                113,
                456,
                38,
                336,
                412,
                98,
                85,
                58,
                458,
                79,
                355,
                209,
                361,
                474,
                378,
                129,
                59,
            ),
        ),
        TraceRequest(0.18, "r13", 17, 8, hash_ids=(1013,)),
        TraceRequest(0.18, "r14", 17, 28, hash_ids=(3, 1014)),
        TraceAbort(0.24, "r14"),
    ]
    assert timeline_json(records, options) == timeline_json(
        records, replace(options, fast_forward=False)
    )
