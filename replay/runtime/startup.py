"""A start-up that takes long, judged: starved (keep waiting), or stopped, stuck, dead. Runs in: frontend process.

An engine (kvdrain's, or a vLLM instance) that is still starting is read from /proc with
its child processes: alive and making progress (its CPU time grows, or a thread is
runnable) is waited for up to one start limit; starved of CPU on a busy machine at that
limit makes the run inconclusive; stopped, gone, or alive with no progress for STUCK_S
is a fault.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.proc.lifetime import descendants
from replay.runtime.starvation import (
    MAX_STARVED_SHARE,
    Machine,
    ProcSample,
    read_machine,
    read_proc,
)
from replay.verify.units import seconds

START_LIMIT_S = 300.0  # --start-limit: one for every kind of engine
STUCK_S = 120.0  # alive, never runnable and using no CPU this long: stuck
READ_EVERY_S = 1.0
RECENT_S = 10.0  # the readings that say whether it is starved now

StartKind = Literal["starved", "stopped", "dead", "stuck", "slow"]


@dataclass(frozen=True, slots=True)
class StartJudgement:
    kind: StartKind
    cause: str

    @property
    def is_fault(self) -> bool:
        return self.kind != "starved"


class StartupStarved(Exception):
    """A start-up that reached its limit starved of CPU: the run is inconclusive."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(slots=True)
class StartProgress:
    """One starting process tree's readings so far (pure: readings in, judgements out).
    Starved means wanting the CPU lately (a thread runnable, or CPU time growing) and
    getting little of it on a contended machine, over the last RECENT_S of readings."""

    name: str
    started: float  # when it was launched
    limit_s: float = START_LIMIT_S
    stuck_s: float = STUCK_S
    recent: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (t, cpu, R)
    last_progress: float = field(init=False)
    starved: str | None = None  # the figures of the latest reading that found it starved

    def __post_init__(self) -> None:
        self.last_progress = self.started

    def update(
        self, t: float, sample: ProcSample | None, machine: Machine
    ) -> StartJudgement | None:
        """The judgement at time t, or None: keep waiting."""
        waited = seconds(t - self.started)
        if sample is None or sample.states[:1] in ("Z", "X"):
            return StartJudgement("dead", f"{self.name} is gone {waited} into its start-up")
        if sample.states[:1] in ("T", "t"):
            return StartJudgement(
                "stopped",
                f"{self.name} is stopped (state T: SIGSTOP or a debugger) {waited} "
                "into its start-up",
            )
        if "T" in sample.states:  # a thread of it, or of a child (its connector worker)
            return StartJudgement(
                "stopped",
                f"{self.name} or a process it started is stopped (state T: SIGSTOP or a "
                f"debugger) {waited} into its start-up",
            )
        self._read(t, sample)
        self.starved = self._starved_figures(machine)
        if t - self.last_progress >= self.stuck_s:
            return StartJudgement(
                "stuck",
                f"{self.name} is alive but used no CPU and was never runnable for "
                f"{seconds(t - self.last_progress)} of its start-up: stuck",
            )
        if t - self.started >= self.limit_s:
            return self._at_limit(machine)
        return None

    def _read(self, t: float, sample: ProcSample) -> None:
        last = self.recent[-1] if self.recent else None
        runnable = "R" in sample.states
        if runnable or (last is not None and sample.cpu_s > last[1]):
            self.last_progress = t
        self.recent.append((t, sample.cpu_s, runnable))
        while len(self.recent) > 2 and t - self.recent[1][0] >= self.window_s:
            self.recent.popleft()

    @property
    def window_s(self) -> float:
        return min(RECENT_S, self.limit_s / 3)

    def _share(self) -> float | None:
        """Its share of one core over the recent readings; None before two of them."""
        if len(self.recent) < 2 or self.recent[-1][0] <= self.recent[0][0]:
            return None
        (t0, cpu0, _), (t1, cpu1, _) = self.recent[0], self.recent[-1]
        return max(cpu1 - cpu0, 0.0) / (t1 - t0)

    def _starved_figures(self, machine: Machine) -> str | None:
        share = self._share()
        if share is None or not machine.contended or share >= MAX_STARVED_SHARE:
            return None
        if self.recent[-1][0] - self.recent[0][0] < self.window_s / 2:
            return None  # too few readings yet to call it starved
        cpu_grew = self.recent[-1][1] > self.recent[0][1]
        if not (cpu_grew or any(runnable for _, _, runnable in self.recent)):
            return None  # asleep: it does not want the CPU it lacks
        span = seconds(self.recent[-1][0] - self.recent[0][0])
        return f"{100 * share:.0f}% of a core over the last {span}; {machine.describe()}"

    def _at_limit(self, machine: Machine) -> StartJudgement:
        limit = seconds(self.limit_s)
        if self.starved is not None:
            return StartJudgement(
                "starved",
                f"{self.name} was still starting after {limit}, alive and runnable "
                f"but starved of CPU ({self.starved}): run it on a quieter machine, or give it "
                "longer with --start-limit",
            )
        share = self._share()
        used = "" if share is None else f", using {100 * share:.0f}% of a core lately"
        return StartJudgement(
            "slow",
            f"{self.name} was not ready within {limit}{used} ({machine.describe()}); "
            "if its start-up is known to be that slow, raise --start-limit",
        )


def read_tree(pid: int) -> ProcSample | None:
    """The process and every descendant: all threads' states (the process's own first) and
    their CPU seconds together; None when the process is gone."""
    root = read_proc(pid)
    if root is None:
        return None
    states, cpu_s = [root.states], root.cpu_s
    for child in descendants(pid):
        sample = read_proc(child)
        if sample is not None:
            states.append(sample.states)
            cpu_s += sample.cpu_s
    return ProcSample("".join(states), cpu_s)


class StartWatch:
    """Starting processes by name, read from /proc at most once per READ_EVERY_S each;
    `note` hears once per process that it is starved while it is still waited for."""

    def __init__(
        self,
        limit_s: float = START_LIMIT_S,
        stuck_s: float = STUCK_S,
        note: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[int], ProcSample | None] = lambda pid: read_tree(pid),
        machine: Callable[[], Machine] = read_machine,
    ) -> None:
        self.limit_s, self.stuck_s, self.note, self.clock = limit_s, stuck_s, note, clock
        self.read, self.machine = read, machine
        self.progress: dict[str, StartProgress] = {}
        self.pids: dict[str, int] = {}
        self.read_at: dict[str, float] = {}
        self.noted: set[str] = set()

    def watch(self, name: str, pid: int, started: float | None = None, label: str = "") -> None:
        """Judge `name` (pid and its descendants) from `started`; its messages call it
        `label` (default: its name)."""
        self.pids[name] = pid
        self.progress[name] = StartProgress(
            label or name, self.clock() if started is None else started, self.limit_s, self.stuck_s
        )

    def check(self, name: str) -> StartJudgement | None:
        """Its judgement now (None: keep waiting); reads /proc only once a READ_EVERY_S."""
        now = self.clock()
        if name not in self.pids or now - self.read_at.get(name, -READ_EVERY_S) < READ_EVERY_S:
            return None
        self.read_at[name] = now
        progress = self.progress[name]
        judgement = progress.update(now, self.read(self.pids[name]), self.machine())
        if progress.starved is not None and name not in self.noted and self.note is not None:
            self.noted.add(name)
            self.note(
                f"{progress.name} is starting slowly, starved of CPU ({progress.starved}); waiting up "
                f"to {seconds(self.limit_s)} (--start-limit)"
            )
        return judgement
