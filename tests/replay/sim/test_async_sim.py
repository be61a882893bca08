"""The virtual-clock replay with async scheduling: the liveness policies keep their meaning under the batch queue."""

from __future__ import annotations

from dataclasses import replace

import pytest

from replay.sim.simulation import simulate
from replay.verify.rules import VerifyOptions, verify
from tests.replay.sim.test_simulate import bursts, dump, load, run, sim_options

VERIFY = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5)


def test_legacy_still_holds_prefill_blocks_through_idle_gaps_under_async_scheduling(tmp_path):
    timeline = run(load(tmp_path, bursts()), "legacy", async_scheduling=True)
    verdict = verify(timeline, [], VERIFY)
    leaks = [v for v in verdict.violations if v.kind == "leak"]
    assert verdict.exit_code == 1 and {v.engine for v in leaks} == {"P"} and len(leaks) == 3


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_fixed_policies_still_drain_under_async_scheduling(tmp_path, liveness):
    timeline = run(load(tmp_path, bursts()), liveness, async_scheduling=True)
    verdict = verify(timeline, [], VERIFY)
    assert verdict.exit_code == 0, verdict.violations
    assert all(w.verdict == "drained" and w.time_to_drain <= 0.005 for w in verdict.windows)


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_async_scheduling_gives_every_request_the_tokens_sync_gives(tmp_path, liveness):
    records = load(tmp_path, bursts(shared_prefix=True))
    sync, asynchronous = run(records, liveness), run(records, liveness, async_scheduling=True)
    tokens = {r.req_id: (r.output_digest, r.finish_reason) for r in sync.requests}
    assert {r.req_id: (r.output_digest, r.finish_reason) for r in asynchronous.requests} == tokens


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_fast_forward_equals_stepping_one_by_one_under_async_scheduling(tmp_path, liveness):
    records = load(tmp_path, bursts(spacing=0.3, shared_prefix=True))
    options = sim_options(
        liveness=liveness,
        sample_interval_s=0.0371,
        tail_s=2.0,
        pull_delay_s=1.3,
        kv_lease_s=0.9,
        async_scheduling=True,
    )
    fast, slow = simulate(records, options), simulate(records, replace(options, fast_forward=False))
    fast.meta.pop("fast_forward"), slow.meta.pop("fast_forward")
    assert dump(fast) == dump(slow)
    assert fast.counters == slow.counters
