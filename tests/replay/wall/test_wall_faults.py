"""The wall clock carries out a trace's faults on real engine processes (mock runner): the
routing's on the requests, a pause and a kill on the processes; what the trace asked for
is no FAULT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.config import EngineConfig, KVTransferConfig
from replay.pipeline import ReplayConfig, ReplayResult, run_replay
from replay.verify.verdict import EXIT_FAULT
from replay.wall.faults import FaultWatch
from tests.proc_utils import descendants

# ---- the watch: what a pause or kill the trace asked for shows is expected -------------------


def watch_of(*engines: str) -> FaultWatch:
    watch = FaultWatch(list(engines), stall_s=3.0, probe_interval_s=1.0)
    for engine in engines:
        watch.on_snapshot(0.0, engine, {"num_slow_recvs": 0, "num_pull_timeouts": 0})
    return watch


def test_a_paused_engines_stall_and_slow_loads_are_expected_not_faults():
    watch = watch_of("P", "D")
    watch.expect(0.5, "D", "pause", 10.0)
    assert watch.should_probe(1.0)
    watch.on_snapshot(1.1, "P", {})
    watch.check(4.0)
    watch.on_snapshot(10.8, "D", {"num_slow_recvs": 1, "last_recv_wait_ms": 9000})
    assert watch.faults == []
    assert [(f.engine, f.kind, f.end_t) for f in watch.expected] == [
        ("D", "stalled", 10.8),
        ("D", "slow_load", None),
    ]


def test_a_stall_that_outlasts_its_pause_is_a_fault_after_all():
    watch = watch_of("P", "D")
    watch.expect(0.5, "D", "pause", 2.0)
    watch.should_probe(1.0)
    watch.on_snapshot(1.1, "P", {})
    watch.check(4.0)
    assert watch.faults == [] and watch.expected[0].kind == "stalled"
    watch.check(5.6)  # 2 s of pause and STALL_S after it: D should have answered by now
    (stall,) = watch.faults
    assert (stall.engine, stall.kind, stall.end_t) == ("D", "stalled", None)
    assert watch.expected == []


def test_a_killed_engine_is_no_longer_probed_and_reads_of_it_timing_out_are_expected():
    watch = watch_of("P", "D")
    watch.expect(0.5, "P", "kill")
    watch.on_error(0.6, "P", "engine core P (pid 9) died with exit code -9", "died")
    watch.on_snapshot(2.0, "D", {"num_pull_timeouts": 1})
    assert watch.should_probe(9.0) and watch.asked == {"D": 9.0}
    watch.check(20.0)
    assert [f.kind for f in watch.faults] == ["stalled"]  # D's silence is D's own
    assert [(f.engine, f.kind) for f in watch.expected] == [
        ("P", "died"),
        ("D", "transfer_timeout"),
    ]


# ---- the wall-clock miniature --------------------------------------------------------------

LEASE_S = 2.0


def wall(tmp_path: Path, lines: list[dict], kv_lease_s: float = 30.0) -> ReplayResult:
    path = tmp_path / "faults.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = {pid for pid, _ in descendants(os.getpid())}
    config = ReplayConfig(
        trace=path,
        clock="wall",
        engine=EngineConfig(runner="mock", num_blocks=512, liveness="event"),
        kv=KVTransferConfig(kv_lease_s=kv_lease_s),
    )
    result = run_replay(config)
    assert {pid for pid, _ in descendants(os.getpid())} <= before  # every engine stopped
    return result


def request(t: float, req_id: str, **extra) -> dict:
    return {"t": t, "id": req_id, "prompt_len": 64, "max_tokens": 8, **extra}


@pytest.mark.slow
def test_each_request_fault_ends_its_request_on_the_wall_clock(tmp_path):
    result = wall(
        tmp_path,
        [
            request(0.0, "drop", fault="drop_decode"),
            request(0.3, "reject", fault="reject_decode"),
            request(0.6, "transfer"),
            {"t": 0.6, "abort": "transfer", "when": "transfer"},
            request(0.9, "decode"),
            {"t": 0.9, "abort": "decode", "when": "decode"},
            request(1.2, "prefill"),
            {"t": 1.2, "abort": "prefill", "when": "prefill"},
            request(1.5, "late"),
            {"t": 2.5, "abort": "late", "when": "prefill"},
        ],
        kv_lease_s=LEASE_S,
    )
    timeline = result.timeline
    by_id = {r.req_id: r for r in timeline.requests}
    got = {r.req_id: (r.fault, r.finish_reason) for r in timeline.requests}
    assert got == {
        "drop": ("drop_decode", "error"),
        "reject": ("reject_decode", "error"),
        "transfer": ("abort_transfer", "abort"),
        "decode": ("abort_decode", "abort"),
        "prefill": ("abort_prefill", "abort"),
        "late": (None, "length"),
    }
    drop, reject = by_id["drop"], by_id["reject"]
    assert drop.end_t == pytest.approx(drop.prefill_done_t, abs=0.05) and drop.read_t is None
    assert "max_tokens" in reject.error and reject.end_t >= reject.prefill_done_t - 0.05
    assert by_id["transfer"].end_t == pytest.approx(by_id["transfer"].prefill_done_t, abs=0.05)
    decode = by_id["decode"]
    assert decode.num_output_tokens == 1 and decode.end_t == decode.first_token_t == decode.read_t
    assert by_id["prefill"].end_t == pytest.approx(1.2, abs=0.05)
    assert by_id["late"].prefill_done_t < by_id["late"].read_t <= by_id["late"].end_t
    assert [s["req_id"] for s in timeline.meta["skipped_aborts"]] == ["late"]
    assert timeline.counters["P"]["num_expired"] == 1  # the dropped leg's blocks, by the lease
    assert timeline.meta["faults"] == [] and result.verdict.exit_code != EXIT_FAULT


@pytest.mark.slow
def test_a_paused_d_resumes_and_the_pause_is_no_fault(tmp_path):
    result = wall(
        tmp_path,
        [request(0.0, "before"), {"t": 0.5, "pause": "D", "for_s": 4.0}, request(1.0, "during")],
    )
    timeline = result.timeline
    during = timeline.request("during")
    assert during.finish_reason == "length" and during.first_token_t > 4.4  # D read it then
    assert max(s.t for s in timeline.samples_for("D")) > 4.5  # D answers again
    assert timeline.meta["engine_faults"][0]["action"] == "pause"
    assert timeline.meta["faults"] == [] and not timeline.meta["starved"]
    assert [f["kind"] for f in timeline.meta["expected_faults"]] == ["stalled"]
    assert result.verdict.exit_code != EXIT_FAULT


@pytest.mark.slow
def test_a_killed_p_is_expected_and_the_run_goes_on(tmp_path):
    result = wall(
        tmp_path,
        [
            request(0.0, "before"),
            {"t": 0.5, "kill": "P"},
            {"t": 0.6, "pause": "P", "for_s": 1.0},  # gone already: nothing to do
            {"t": 0.7, "kill": "P"},
            request(1.0, "lost"),
            request(1.0, "alone", pd=False),
        ],
    )
    timeline = result.timeline
    assert timeline.request("before").finish_reason == "length"
    lost = timeline.request("lost")
    assert (lost.finish_reason, lost.error) == (
        "error",
        "no prefill engine left: every one was killed",
    )
    assert timeline.request("alone").finish_reason == "length"
    assert [f["action"] for f in timeline.meta["engine_faults"]] == ["kill", "pause", "kill"]
    assert timeline.meta["faults"] == [] and result.verdict.exit_code != EXIT_FAULT
