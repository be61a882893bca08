"""Starved or stuck: what the OS says of an engine that answers no stats request. Runs in: frontend process.

An engine silent past the stall limit is either not running (stopped by SIGSTOP, dead, a
zombie, asleep with no CPU on an idle machine, or spinning on a full core without
answering: a fault) or alive and wanting the CPU that a loaded machine does not give it
(starved: the run is inconclusive, never a fault). The figures come from
/proc/<pid>/stat and /proc/<pid>/task/*/stat (each thread's state, the process's
utime + stime), /proc/loadavg and, where it exists, /proc/pressure/cpu. Where /proc is
missing (not Linux), nothing is known and the stall stays a fault.

`classify` is pure (recorded figures in, a judgement out); `StarvationJudge` reads /proc
for the engines whose pids it knows and remembers each one's figures from its first
unanswered probe.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from replay.verify.units import seconds

# An engine that got less than this share of one core while silent was starved, not spinning.
MAX_STARVED_SHARE = 0.5
# The machine is contended when its runnable tasks exceed its cores by this factor, or when
# tasks waited for a CPU at least this share of the last 10 s (/proc/pressure/cpu "some").
CONTENDED_LOAD_PER_CORE = 1.0
CONTENDED_PRESSURE_PCT = 10.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One reading of a process: its threads' states ("R", "S", "D", "T", "Z", ...) and its CPU seconds."""

    states: str  # one letter per thread, the main thread first
    cpu_s: float  # utime + stime, all threads


@dataclass(frozen=True, slots=True)
class Machine:
    """What the machine gives: runnable tasks per core, and CPU pressure (None: not exposed)."""

    load_per_core: float | None
    pressure_pct: float | None  # /proc/pressure/cpu some avg10

    @property
    def contended(self) -> bool:
        return (
            self.load_per_core is not None and self.load_per_core >= CONTENDED_LOAD_PER_CORE
        ) or (self.pressure_pct is not None and self.pressure_pct >= CONTENDED_PRESSURE_PCT)

    def describe(self) -> str:
        parts = []
        if self.load_per_core is not None:
            parts.append(f"load {self.load_per_core:.1f} per core")
        if self.pressure_pct is not None:
            parts.append(f"CPU pressure {self.pressure_pct:.0f}%")
        return ", ".join(parts) or "machine load unknown"


@dataclass(frozen=True, slots=True)
class Judgement:
    kind: str  # "starved" (not a fault) | "stopped" | "dead" | "stuck"
    cause: str  # the figures, in words


def classify(
    engine: str,
    before: ProcSample | None,
    after: ProcSample | None,
    interval_s: float,
    silent_s: float,
    machine: Machine,
    runnable_seen: bool,
    max_share: float = MAX_STARVED_SHARE,
) -> Judgement:
    """Judge an engine silent for silent_s from two readings interval_s apart (before: at its
    first unanswered probe, None if not read; after: now, None if it is gone).

    runnable_seen: some reading since `before` found a thread in state R (it wanted a CPU).
    """
    wall_s = silent_s
    if after is None or after.states[:1] in ("Z", "X"):
        return Judgement("dead", f"engine {engine} is gone (no process, or a zombie)")
    if after.states[:1] in ("T", "t"):
        return Judgement(
            "stopped",
            f"engine {engine} answered no stats request for {seconds(wall_s)}: "
            f"stopped (state T: SIGSTOP or a debugger)",
        )
    cpu_s = None if before is None else max(after.cpu_s - before.cpu_s, 0.0)
    share = None if cpu_s is None or interval_s <= 0 else cpu_s / interval_s
    figures = (
        f"{'unknown CPU' if cpu_s is None else f'{seconds(cpu_s)} of CPU'} in {seconds(interval_s)}"
        f"{'' if share is None else f' ({100 * share:.0f}% of a core)'}; {machine.describe()}"
    )
    wanted = runnable_seen or (machine.contended and cpu_s is not None and cpu_s > 0)
    if share is not None and share >= max_share:
        return Judgement(
            "stuck",
            f"engine {engine} answered no stats request for {seconds(wall_s)} "
            f"while running ({figures}): stuck in a loop",
        )
    if wanted and machine.contended:
        return Judgement(
            "starved",
            f"engine {engine} answered no stats request for {seconds(wall_s)}, "
            f"alive and runnable but starved of CPU ({figures})",
        )
    return Judgement(
        "stuck",
        f"engine {engine} answered no stats request for {seconds(wall_s)}, "
        f"not runnable (state {after.states[:1]}; {figures}): stuck",
    )


def read_proc(pid: int) -> ProcSample | None:
    """The process's threads' states and CPU seconds; None when it is gone (or /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            main = f.read()
        states = [_stat_fields(main)[0]]
        try:
            for tid in sorted(os.listdir(f"/proc/{pid}/task")):
                if tid != str(pid):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        states.append(_stat_fields(f.read())[0])
        except OSError:
            pass  # a thread that ended between the listing and the read
    except OSError:
        return None
    fields = _stat_fields(main)
    return ProcSample("".join(states), (int(fields[11]) + int(fields[12])) / _CLK_TCK)


def _stat_fields(text: str) -> list[str]:
    """The fields after "(comm)": state first (field 3 of proc(5)); utime, stime at 11, 12."""
    return text[text.rindex(")") + 2 :].split()


def read_machine() -> Machine:
    load = pressure = None
    try:
        with open("/proc/loadavg") as f:
            load = float(f.read().split()[0]) / (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
        pressure = float(dict(p.split("=") for p in some[1:])["avg10"])
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return Machine(load, pressure)


class StarvationJudge:
    """Reads /proc for engines by pid; an engine with no known pid is not judged (None)."""

    def __init__(self, pids: dict[str, int], max_share: float = MAX_STARVED_SHARE) -> None:
        self.pids, self.max_share = pids, max_share
        # engine -> (monotonic time, reading) at its first unanswered probe
        self.first: dict[str, tuple[float, ProcSample | None]] = {}
        self.runnable: dict[str, bool] = {}

    def on_probe(self, engine: str) -> None:
        """The engine was asked and has not answered yet: its silence's first reading."""
        if engine in self.pids and engine not in self.first:
            sample = read_proc(self.pids[engine])
            self.first[engine] = (time.monotonic(), sample)
            self.runnable[engine] = sample is not None and "R" in sample.states

    def on_answer(self, engine: str) -> None:
        self.first.pop(engine, None)
        self.runnable.pop(engine, None)

    def judge(self, engine: str, silent_s: float) -> Judgement | None:
        if engine not in self.pids:
            return None
        now = read_proc(self.pids[engine])
        seen = self.runnable.get(engine, False) or (now is not None and "R" in now.states)
        self.runnable[engine] = seen
        t0, before = self.first.get(engine, (time.monotonic(), None))
        return classify(
            engine,
            before,
            now,
            time.monotonic() - t0,
            silent_s,
            read_machine(),
            seen,
            self.max_share,
        )
