"""The idle CPU figure printed after a real vLLM deployment is ready (replay/deploy/idle_cpu.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from replay.deploy.idle_cpu import cores_used, cpu_ticks, idle_note

pytestmark = pytest.mark.timeout(60)


def test_a_spinning_process_counts_and_a_sleeping_one_does_not():
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cores_used([spinning.pid], 0.5) > 0
        before = cpu_ticks([sleeping.pid])
        assert cores_used([sleeping.pid], 0.5) == 0 and cpu_ticks([sleeping.pid]) == before
    finally:
        for p in (spinning, sleeping):
            p.kill()
            p.wait(timeout=10)


def test_a_process_that_is_gone_counts_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    assert cpu_ticks([p.pid]) == 0


def test_the_note_names_the_spinning_thread_only_when_the_deployment_burns_half_the_host():
    assert idle_note(0.1, 2) == "vllm: idle, its processes use 0.1 of this host's 2 cores"
    busy = idle_note(1.8, 2)
    assert busy.startswith("vllm: idle, its processes use 1.8 of this host's 2 cores (NIXL's UCX")
    assert "--speedup" in busy
