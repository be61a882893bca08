"""Runs of plain decode steps cut at the connector's next timed action: the same timelines as every step taken.

In the P/D topologies no simulated engine decodes while its connector has a timed
action due (P never decodes; D heartbeats only while it waits for KV), so the cut
(DecodeRun.plan's deadline) is never reached there. A D connector that heartbeats for
its requests as long as they live makes it reached.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from connector.pd import PDConnector
from engine.config import EngineConfig, KVTransferConfig
from engine.core.kv_connector import KVConnectorRole
from engine.core.outputs import KVConnectorOutput
from replay.sim import decode_run
from replay.sim.options import SimOptions
from replay.sim.simulation import Simulation
from tests.replay.sim.test_decode_runs import decode_heavy_workload


class HeartbeatingToTheEnd(PDConnector):
    """PDConnector, except that D heartbeats for a request until it finishes, not
    until its KV arrived: a timed action while the request decodes."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.worker_error is not None:
            self.worker_error = connector_output.worker_error


def make_heartbeating_connector(config: EngineConfig, role: KVConnectorRole):
    assert role is KVConnectorRole.SCHEDULER
    return HeartbeatingToTheEnd(config)


@pytest.fixture
def cut_runs(monkeypatch):
    """How many runs were planned with a deadline that cut them short."""
    cuts = []
    plan = decode_run.DecodeRun.plan.__func__

    def counting_plan(cls, now, num_steps, num_decodes, num_context_tokens, step_cost, deadline):
        run = plan(cls, now, num_steps, num_decodes, num_context_tokens, step_cost, deadline)
        whole = plan(cls, now, num_steps, num_decodes, num_context_tokens, step_cost, None)
        if whole is not None and (run is None or len(run.starts) < len(whole.starts)):
            cuts.append(now)
        return run

    monkeypatch.setattr(decode_run.DecodeRun, "plan", classmethod(counting_plan))
    return cuts


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lease_s", [0.03, 0.0731])
def test_a_run_cut_at_a_heartbeat_gives_the_timeline_of_every_step_taken(seed, lease_s, cut_runs):
    kv = KVTransferConfig(
        kv_connector=f"{__name__}:make_heartbeating_connector", kv_lease_s=lease_s
    )
    options = SimOptions(
        engine=replace(SimOptions().engine, num_blocks=96),
        kv=kv,
        topology="pd",
        tail_s=1.0,
        sample_interval_s=0.0171,
    )
    records = [r for r in decode_heavy_workload(seed) if getattr(r, "pd", None) is not False]

    def timeline(options: SimOptions) -> str:
        result = Simulation(records, options).run()
        result.meta.pop("fast_forward")
        return json.dumps(result.to_dict(), sort_keys=True)

    skipped = timeline(options)
    assert len(cut_runs) > 5  # the deadline cut runs short
    assert skipped == timeline(replace(options, fast_forward=False))
