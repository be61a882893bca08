"""The idle CPU figure printed once a real vLLM deployment is ready, and the spinning threads
lowered then (replay/vllm/idle_cpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from replay.vllm.idle_cpu import LOWERED_NICE, IdleCpu, idle_note, lower_spinners, thread_times

pytestmark = pytest.mark.timeout(60)

# A process whose main thread sleeps while a second thread polls, as NIXL's progress thread
# does in a vLLM worker; it prints the poller's thread id once it runs.
POLLER = """
import threading, time
def poll():
    print(threading.get_native_id(), flush=True)
    while True:
        pass
threading.Thread(target=poll, daemon=True).start()
time.sleep(60)
"""


def _nice(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[16])


def test_a_thread_that_spins_while_idle_is_lowered_and_a_main_thread_is_not():
    poller = subprocess.Popen([sys.executable, "-c", POLLER], stdout=subprocess.PIPE, text=True)
    busy_main = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        tid = int(poller.stdout.readline())
        idle = lower_spinners([poller.pid, busy_main.pid], 0.5)  # runnable all along, loaded or not
        assert idle.lowered == (tid,) and idle.cores > 0
        assert _nice(poller.pid, tid) == LOWERED_NICE
        assert _nice(poller.pid, poller.pid) == _nice(busy_main.pid, busy_main.pid) == os.nice(0)
    finally:
        for p in (poller, busy_main):
            p.kill()
            p.wait(timeout=10)


def test_a_process_that_is_gone_counts_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    assert thread_times([p.pid]) == {}
    assert lower_spinners([p.pid], 0.01) == IdleCpu(cores=0.0, lowered=())


def test_the_note_says_what_was_lowered_or_what_the_idle_load_means():
    assert (
        idle_note(IdleCpu(0.1, ()), 2) == "vllm: idle, its processes use 0.1 of this host's 2 cores"
    )
    lowered = idle_note(IdleCpu(2.0, (11, 12)), 2)
    assert lowered.startswith(
        "vllm: idle, its processes use 2.0 of this host's 2 cores; 2 threads that "
        "spin while idle (on P/D: NIXL's UCX progress thread)"
    )
    assert "--speedup" in idle_note(IdleCpu(1.8, ()), 2)
