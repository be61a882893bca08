"""An engine that answers no stats request: starved (inconclusive) or stopped, dead, stuck (a fault).

The finding: on a loaded 2-core machine (four CPU hogs at nice -15 beside `kvdrain replay
examples/pd_idle.jsonl`) the replay said "fault: P: engine P answered no stats request for
3.9 s (stopped or stuck)", exit 4, the engines alive and runnable, each getting a few percent
of a core. The judge reads the engine's state and CPU time from /proc: a starved engine is a
coverage reason (inconclusive, exit 3, with the figures); a SIGSTOPped one stays a fault.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from replay.runtime.starvation import (
    Machine,
    ProcSample,
    StarvationJudge,
    classify,
    read_machine,
    read_proc,
)
from replay.verify.rules import verify
from replay.verify.timeline import EngineSample, RequestRecord, Timeline
from replay.wall.faults import FaultWatch
from tests.proc_utils import wait_until

LOADED = Machine(load_per_core=5.0, pressure_pct=99.0)  # as read beside the hogs
IDLE = Machine(load_per_core=0.1, pressure_pct=0.0)


# ---- the judgement, on recorded /proc figures -----------------------------------------------


def test_a_runnable_engine_given_two_percent_of_a_core_on_a_loaded_machine_is_starved():
    j = classify("P", ProcSample("RS", 10.0), ProcSample("RS", 10.08), 4.0, 4.0, LOADED, True)
    assert j.kind == "starved"
    assert "0.080 s of CPU in 4.000 s (2% of a core)" in j.cause and "CPU pressure 99%" in j.cause


def test_a_stopped_engine_is_a_fault_however_loaded_the_machine():
    j = classify("P", ProcSample("RS", 10.0), ProcSample("TT", 10.0), 4.0, 4.0, LOADED, True)
    assert j.kind == "stopped" and "engine P answered no stats request" in j.cause


def test_a_gone_or_zombie_engine_is_dead():
    assert classify("P", ProcSample("S", 1.0), None, 4.0, 4.0, LOADED, False).kind == "dead"
    assert (
        classify("P", ProcSample("S", 1.0), ProcSample("Z", 1.0), 4.0, 4.0, LOADED, False).kind
        == "dead"
    )


def test_an_asleep_engine_with_no_cpu_on_an_idle_machine_is_stuck():
    j = classify("P", ProcSample("S", 1.0), ProcSample("S", 1.0), 4.0, 4.0, IDLE, False)
    assert j.kind == "stuck" and "not runnable" in j.cause


def test_an_engine_spinning_on_a_core_without_answering_is_stuck():
    j = classify("P", ProcSample("R", 1.0), ProcSample("R", 4.8), 4.0, 4.0, LOADED, True)
    assert j.kind == "stuck" and "95% of a core" in j.cause


# ---- the watch and the verdict ---------------------------------------------------------------


class _Says:
    """A judge that answers as recorded."""

    def __init__(self, judgement):
        self.judgement = judgement

    def on_probe(self, engine):
        pass

    def on_answer(self, engine):
        pass

    def judge(self, engine, silent_s):
        return self.judgement


def _silent_p(watch: FaultWatch) -> None:
    watch.on_snapshot(0.0, "P", {})
    watch.on_snapshot(0.0, "D", {})
    assert watch.should_probe(1.0)
    watch.on_snapshot(1.1, "D", {})
    watch.check(4.0)


def test_a_starved_engine_is_no_fault_and_makes_the_run_inconclusive_with_its_figures():
    starved = classify("P", ProcSample("R", 10.0), ProcSample("R", 10.08), 4.0, 4.0, LOADED, True)
    watch = FaultWatch(["P", "D"], judge=_Says(starved))
    _silent_p(watch)
    watch.on_snapshot(5.0, "P", {})
    assert watch.faults == []
    (s,) = watch.starved
    assert (s.t, s.engine, s.end_t) == (0.0, "P", 5.0)
    used = [
        EngineSample(
            t=t,
            engine=e,
            num_used_blocks=0,
            num_cached_blocks=0,
            num_free_blocks=10,
            num_usable_blocks=10,
            num_waiting=0,
            num_skipped_waiting=0,
            num_waiting_for_remote_kvs=0,
            num_running=0,
            num_finished_awaiting_free=0,
            loop_state="idle",
            num_steps=0,
            num_wakeups=0,
        )
        for t in (0.0, 9.0)
        for e in "PD"
    ]
    record = RequestRecord(
        req_id="r",
        arrival_t=0.0,
        send_t=0.0,
        send_lateness_s=0.0,
        first_token_t=0.1,
        end_t=0.5,
        num_prompt_tokens=8,
        num_output_tokens=1,
        num_prefix_hit_tokens=0,
        finish_reason="length",
    )
    meta = {
        "faults": [],
        "starved": [{"t": s.t, "engine": s.engine, "cause": s.cause, "end_t": s.end_t}],
    }
    verdict = verify(
        Timeline(
            engines=["P", "D"],
            num_usable_blocks={"P": 10, "D": 10},
            samples=used,
            requests=[record],
            arrivals=[0.0],
            aborts=[],
            end_t=10.0,
            meta=meta,
        ),
        [],
    )
    assert (verdict.status, verdict.exit_code) == ("inconclusive", 3)
    assert any(
        r.startswith("starved: from 0.000 s until 5.000 s") and "2% of a core" in r
        for r in verdict.reasons
    )


def test_a_stopped_engine_judged_is_a_stalled_fault_naming_its_state():
    stopped = classify("P", ProcSample("R", 1.0), ProcSample("T", 1.0), 4.0, 4.0, LOADED, True)
    watch = FaultWatch(["P", "D"], judge=_Says(stopped))
    _silent_p(watch)
    (fault,) = watch.faults
    assert (fault.engine, fault.kind) == ("P", "stalled") and "state T" in fault.cause
    assert watch.starved == []


# ---- real processes ----------------------------------------------------------------------------


def _child(code: str, nice: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], preexec_fn=(lambda: os.nice(nice)) if nice else None
    )


def test_a_sigstopped_process_is_judged_stopped_from_proc():
    child = _child("import time\nwhile True: time.sleep(0.01)")
    try:
        judge = StarvationJudge({"P": child.pid})
        judge.on_probe("P")
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(
            lambda: (s := read_proc(child.pid)) is not None and s.states[:1] == "T", 10, "stopped"
        )
        judged = judge.judge("P", 4.0)
        assert judged.kind == "stopped", judged
    finally:
        child.kill()
        child.wait(10)
    assert read_proc(child.pid) is None  # reaped: gone


def test_a_spinning_process_at_nice_19_beside_a_hog_on_every_core_is_judged_starved():
    spinner = _child("while True: pass", nice=19)
    hogs = [_child("while True: pass") for _ in range(min(os.cpu_count() or 1, 8))]
    try:
        judge = StarvationJudge({"P": spinner.pid})
        judge.on_probe("P")
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            judged = judge.judge("P", 4.0)  # samples its state as the watch does on every pump
            time.sleep(0.1)
        if not read_machine().contended:
            pytest.skip(f"the hogs did not load this machine ({read_machine().describe()})")
        assert judged.kind == "starved", judged
    finally:
        for p in [spinner, *hogs]:
            p.kill()
        for p in [spinner, *hogs]:
            p.wait(10)
