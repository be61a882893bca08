"""A start-up judged from /proc readings: starved waits and ends inconclusive; stopped, dead,
stuck or slow past the limit is a fault.

The finding: beside four CPU hogs at nice -15, `kvdrain replay examples/pd_idle.jsonl
--no-live` ended `fault: engine P not ready within 120.0 s`, exit 4, twice; the engines were
importing torch at a few percent of a core. A start-up is now judged as a stats silence is.
"""

from __future__ import annotations

import os

from engine.proc.lifetime import descendants
from replay.runtime.startup import StartProgress, StartWatch, read_tree
from replay.runtime.starvation import Machine, ProcSample

LOADED = Machine(load_per_core=5.0, pressure_pct=90.0)
IDLE = Machine(load_per_core=0.1, pressure_pct=0.0)


def run(progress: StartProgress, readings, machine: Machine = LOADED):
    """Feed (t, states, cpu_s) readings; the first judgement, or None."""
    for t, states, cpu_s in readings:
        judgement = progress.update(t, ProcSample(states, cpu_s), machine)
        if judgement is not None:
            return t, judgement
    return None


def test_a_runnable_start_up_given_a_few_percent_of_a_core_waits_then_is_starved_at_the_limit():
    progress = StartProgress("engine P", started=0.0, limit_s=30.0)
    readings = [(t, "R", 0.03 * t) for t in range(1, 40)]
    t, judgement = run(progress, readings)
    assert t == 30 and judgement.kind == "starved" and not judgement.is_fault
    assert "engine P was still starting after 30.000 s" in judgement.cause
    assert "starved of CPU (3% of a core" in judgement.cause and "--start-limit" in judgement.cause


def test_a_stopped_start_up_is_a_fault_at_once_however_loaded_the_machine():
    progress = StartProgress("engine P", started=0.0)
    t, judgement = run(progress, [(1, "R", 0.5), (2, "T", 0.5)])
    assert t == 2 and judgement.kind == "stopped" and judgement.is_fault
    assert "SIGSTOP" in judgement.cause


def test_a_stopped_process_below_a_starting_engine_is_a_fault_at_once():
    """Its connector worker stopped (SIGSTOP) while the engine waits for it, asleep but for a
    thread runnable now and then: beside load this was judged starved at the limit (exit 3)."""
    progress = StartProgress("engine P", started=0.0, limit_s=15.0)
    readings = [(t, ("SR" if t % 2 else "SS") + "T", 0.5) for t in range(1, 20)]
    t, judgement = run(progress, readings)
    assert t == 1 and judgement.kind == "stopped" and judgement.is_fault
    assert "engine P or a process it started is stopped" in judgement.cause


def test_a_start_up_that_is_gone_is_dead():
    progress = StartProgress("engine P", started=0.0)
    assert progress.update(3.0, None, IDLE).kind == "dead"
    assert progress.update(3.0, ProcSample("Z", 1.0), IDLE).kind == "dead"


def test_alive_with_no_cpu_and_never_runnable_for_the_stuck_time_is_a_fault():
    progress = StartProgress("engine P", started=0.0, stuck_s=120.0)
    readings = [(1, "R", 1.0)] + [(t, "S", 1.0) for t in range(2, 200)]
    t, judgement = run(progress, readings, IDLE)
    assert t == 121 and judgement.kind == "stuck" and judgement.is_fault


def test_an_asleep_start_up_on_a_busy_machine_is_not_starved_it_does_not_want_the_cpu():
    progress = StartProgress("vllm serve", started=0.0, limit_s=20.0)
    readings = [(1, "R", 1.0)] + [(t, "S", 1.0) for t in range(2, 30)]
    t, judgement = run(progress, readings)
    assert t == 20 and judgement.kind == "slow" and judgement.is_fault
    assert "vllm serve was not ready within 20.000 s" in judgement.cause


def test_a_start_up_on_a_full_core_past_the_limit_is_a_fault_not_starvation():
    progress = StartProgress("engine P", started=0.0, limit_s=10.0)
    t, judgement = run(progress, [(t, "R", 0.95 * t) for t in range(1, 20)])
    assert t == 10 and judgement.kind == "slow"


def test_starved_is_judged_on_the_recent_readings_not_since_the_launch():
    """Fast at first (imports on an idle machine), starved lately: starved."""
    progress = StartProgress("engine P", started=0.0, limit_s=60.0)
    readings = [(t, "R", 0.9 * t) for t in range(1, 11)]
    readings += [(t, "R", 9.0 + 0.02 * (t - 10)) for t in range(11, 70)]
    t, judgement = run(progress, readings)
    assert t == 60 and judgement.kind == "starved" and "2% of a core" in judgement.cause


def test_the_watch_notes_a_starved_start_up_once_and_judges_it_at_the_limit():
    notes: list[str] = []
    now = [0.0]
    watch = StartWatch(
        limit_s=20.0,
        note=notes.append,
        clock=lambda: now[0],
        read=lambda pid: ProcSample("R", 0.03 * now[0]),
        machine=lambda: LOADED,
    )
    watch.watch("P", 1234, started=0.0, label="engine P")
    judgements = []
    for step in range(1, 100):  # ten checks a second, as the topology's wait makes them
        now[0] = step * 0.25
        judgements.append(watch.check("P"))
    assert notes == [
        "engine P is starting slowly, starved of CPU (3% of a core over the last 4.000 s; "
        "load 5.0 per core, CPU pressure 90%); waiting up to 20.000 s (--start-limit)"
    ]
    first = next(i for i, j in enumerate(judgements) if j is not None)
    assert 20.0 <= (first + 1) * 0.25 < 21.0 and judgements[first].kind == "starved"


def test_a_process_tree_is_read_with_its_children():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        tree = read_tree(os.getpid())
        assert tree is not None and len(tree.states) > len(read_tree(child.pid).states)
    finally:
        child.kill()
        child.wait()
