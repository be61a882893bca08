"""What a launched deployment's processes burn while it has no request, and the threads that spin then, lowered. Runs in: frontend process.

Each P/D instance's worker runs NIXL's UCX progress thread, which polls without pause
(nixl's agent sets no delay, and vLLM's NixlConnector offers no way to turn the thread
off): on a 2-core host the two of them used 2.0 of the cores while the pair was idle, and
shared each instance's core with its model thread in a replay (which then got 10-30% of
it). So on a CPU host, once every instance is ready and before the first request, every
thread below the instances that is not its process's main thread and was runnable for
SPIN_SHARE of SAMPLE_S (/proc's schedstat: on a core or waiting for one, so a spinner
reads about 1 however loaded the host is) is lowered to nice 19. Nice ranks threads
within one scheduling group: each instance is its own session, hence its own autogroup
where the kernel makes them, so the spinner then yields to its own instance's model and
server threads, not to other processes. The cores used come from utime + stime.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

SAMPLE_S = 1.0
SPIN_SHARE = 0.9  # of the time runnable while idle: a thread that polls rather than waits
LOWERED_NICE = 19
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class IdleCpu:
    cores: float  # the cores the processes kept busy, on average, over the sample
    lowered: tuple[int, ...]  # the spinning threads lowered to LOWERED_NICE (thread ids)


def thread_times(pids: Iterable[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (utime + stime in ticks, ns runnable: on a core or waiting for one),
    for every thread of every pid still there."""
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
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    on_cpu_ns, waiting_ns = f.read().split()[:2]
                out[(pid, int(tid))] = (
                    int(fields[11]) + int(fields[12]),
                    int(on_cpu_ns) + int(waiting_ns),
                )
            except (OSError, ValueError, IndexError):
                continue
    return out


def lower_spinners(
    pids: list[int], interval_s: float = SAMPLE_S, share: float = SPIN_SHARE
) -> IdleCpu:
    """Sample `pids` over interval_s from now (they should be idle), then lower every thread
    that is not its process's main one and was runnable for `share` of it."""
    before, t0 = thread_times(pids), time.monotonic()
    time.sleep(interval_s)
    after, elapsed = thread_times(pids), time.monotonic() - t0
    cores, lowered = 0.0, []
    for key in sorted(k for k in after if k in before):
        (ticks, runnable_ns), (ticks0, runnable0_ns) = after[key], before[key]
        cores += (ticks - ticks0) / TICKS_PER_S / elapsed
        pid, tid = key
        if tid != pid and (runnable_ns - runnable0_ns) / 1e9 / elapsed >= share and _lower(tid):
            lowered.append(tid)
    return IdleCpu(cores=cores, lowered=tuple(lowered))


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
        return line + (
            f"; {len(idle.lowered)} threads that spin while idle (on P/D: NIXL's UCX "
            f"progress thread) lowered to nice {LOWERED_NICE}, below their own "
            f"instance's model and server threads"
        )
    if idle.cores >= num_cores / 2:
        line += (
            ": the models get what is left, so the engines may lag the trace; shape it to this"
            " host (--speedup, --scale-tokens, as `make e2e-vllm` does) or give them cores"
        )
    return line
