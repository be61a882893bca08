"""How many cores a launched deployment's processes burn while it has no request. Runs in: frontend process.

Measured on a 2-core host: each P/D instance's worker runs NIXL's UCX progress thread,
which polls without pause (nixl's agent sets no delay, and vLLM's NixlConnector offers
no way to turn the thread off): 1.8 of the 2 cores while idle, leaving its model threads
10-30% of a core in a replay, so bursts ran 4-10 s behind a 4 s gap. The figure is read
from /proc (utime + stime of every process below each instance) over a short interval
before the first request, and printed so that a lagging run's cause is on screen.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

SAMPLE_S = 1.0
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pids: Iterable[int]) -> int:
    """utime + stime of every pid (all its threads) that is still there."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().decode(errors="replace").rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total


def cores_used(pids: list[int], interval_s: float = SAMPLE_S) -> float:
    """The cores `pids` kept busy, on average, over interval_s from now."""
    before, t0 = cpu_ticks(pids), time.monotonic()
    time.sleep(interval_s)
    after, elapsed = cpu_ticks(pids), time.monotonic() - t0
    return (after - before) / TICKS_PER_S / elapsed


def idle_note(cores: float, num_cores: int) -> str:
    """One line for the launch: the figure, and what follows from it when it is a lot."""
    line = f"vllm: idle, its processes use {cores:.1f} of this host's {num_cores} cores"
    if cores >= num_cores / 2:
        line += (" (NIXL's UCX progress thread polls without pause in each P/D instance's worker):"
                 " the models get what is left, so the engines may lag the trace; shape it to this"
                 " host (--speedup, --scale-tokens, as `make e2e-vllm` does) or give them cores")
    return line
