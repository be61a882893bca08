"""What a launched deployment's processes burn while it has no request, and the threads that spin then, lowered. Runs in: frontend process.

Measured on a 2-core host: each P/D instance's worker runs NIXL's UCX progress thread,
which polls without pause (nixl's agent sets no delay, and vLLM's NixlConnector offers
no way to turn the thread off): 2.0 of the 2 cores while idle. In a replay its model
threads then got 10-30% of a core and bursts ran 19-23 s behind 16 s gaps (inconclusive);
with those two threads at nice 19 the same row observed 4 of 4 windows (verified), and
the pre-fix release still leaked. So on a CPU host, once every instance is ready and
before the first request, every thread below the instances that is not its process's
main thread and kept SPIN_SHARE of a core busy over SAMPLE_S is lowered to nice 19: it
still runs whenever a core is free, and the models, the API servers and the replay come
first. Figures come from /proc (utime + stime).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

SAMPLE_S = 1.0
SPIN_SHARE = 0.5  # of a core, while idle: a thread that polls rather than waits
LOWERED_NICE = 19
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class IdleCpu:
    cores: float  # the cores the processes kept busy, on average, over the sample
    lowered: tuple[int, ...]  # the spinning threads lowered to LOWERED_NICE (thread ids)


def thread_ticks(pids: Iterable[int]) -> dict[tuple[int, int], int]:
    """(pid, tid) -> utime + stime, for every thread of every pid still there."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    fields = f.read().decode(errors="replace").rpartition(")")[2].split()
                out[(pid, int(tid))] = int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue
    return out


def lower_spinners(pids: list[int], interval_s: float = SAMPLE_S, share: float = SPIN_SHARE) -> IdleCpu:
    """Sample `pids` over interval_s from now (they should be idle), then lower every thread
    that is not its process's main one and kept `share` of a core busy."""
    before, t0 = thread_ticks(pids), time.monotonic()
    time.sleep(interval_s)
    after, elapsed = thread_ticks(pids), time.monotonic() - t0
    used = {key: (ticks - before[key]) / TICKS_PER_S / elapsed
            for key, ticks in after.items() if key in before}
    lowered = []
    for (pid, tid), cores in sorted(used.items()):
        if tid != pid and cores >= share and _lower(tid):
            lowered.append(tid)
    return IdleCpu(cores=sum(used.values()), lowered=tuple(lowered))


def _lower(tid: int) -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, LOWERED_NICE)  # a thread id: that thread alone
    except OSError:  # gone, or not ours to change
        return False
    return True


def idle_note(idle: IdleCpu, num_cores: int) -> str:
    """One line for the launch: the figure, what was lowered, and what follows from it."""
    line = f"vllm: idle, its processes use {idle.cores:.1f} of this host's {num_cores} cores"
    if idle.lowered:
        return line + (f"; {len(idle.lowered)} threads that spin while idle (NIXL's UCX progress "
                       f"thread, one per P/D worker) lowered to nice {LOWERED_NICE}, so the models "
                       f"and the replay come first")
    if idle.cores >= num_cores / 2:
        line += (": the models get what is left, so the engines may lag the trace; shape it to this"
                 " host (--speedup, --scale-tokens, as `make e2e-vllm` does) or give them cores")
    return line
