"""The dashboard's state: what the live view shows, as plain data (no rich). Runs in: frontend process."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.proc.messages import StatsSnapshot
from replay.verify.rules import IdleWindow
from replay.verify.timeline import EngineSample

HISTORY_LEN = 120  # used-blocks points kept per engine for the sparkline
SAMPLE_COUNTS = (
    "num_waiting",
    "num_skipped_waiting",
    "num_waiting_for_remote_kvs",
    "num_running",
    "num_finished_awaiting_free",
    "num_usable_blocks",
    "num_used_blocks",
    "num_cached_blocks",
    "num_free_blocks",
)


@dataclass(slots=True)
class EngineView:
    """One engine as last reported, with its step / wake-up rates and used-blocks history."""

    engine_id: str
    counts: dict[str, int] = field(default_factory=dict)
    loop_state: str = "stepping"
    monotonic: float | None = None  # time of the last update, in the feeder's clock
    num_steps: int = 0
    num_wakeups: int = 0
    steps_per_s: float = 0.0
    wakeups_per_s: float = 0.0
    used_history: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))
    unit: str = "blocks"  # of the KV counts: "blocks", or a scraped server's "tokens" | "ppm"
    # The counts the feeder really observes (a scraped vLLM has no loop state or step
    # counts); None: all of them. The view prints the others as unknown.
    observed: frozenset[str] | None = None

    def is_observed(self, key: str) -> bool:
        return self.observed is None or key in self.observed

    def update(
        self,
        engine_id: str,
        monotonic: float,
        loop_state: str,
        num_steps: int,
        num_wakeups: int,
        counts: dict[str, int],
    ) -> None:
        """Take one report; rates come from this one and the previous one."""
        if engine_id != self.engine_id:
            raise ValueError(f"engine_id: view of {self.engine_id!r} got {engine_id!r}")
        if self.monotonic is not None and monotonic > self.monotonic:
            dt = monotonic - self.monotonic
            # A counter that went back means a restarted engine: no rate from that pair.
            self.steps_per_s = max(num_steps - self.num_steps, 0) / dt
            self.wakeups_per_s = max(num_wakeups - self.num_wakeups, 0) / dt
        self.monotonic, self.loop_state = monotonic, loop_state
        self.num_steps, self.num_wakeups = num_steps, num_wakeups
        self.counts = dict(counts)
        self.used_history.append(int(counts.get("num_used_blocks", 0)))

    @property
    def has_connector(self) -> bool:
        return "num_sent" in self.counts or "num_sends_pending" in self.counts


def sample_counts(sample: EngineSample) -> dict[str, int]:
    """The counts dict of a virtual-clock sample, keyed like StatsSnapshot.counts."""
    return {name: getattr(sample, name) for name in SAMPLE_COUNTS}


@dataclass(slots=True, kw_only=True)
class ReplayProgress:
    """Where the replay is: requests sent, trace time, how late the sends were."""

    trace_name: str
    num_total: int
    duration_s: float
    clock: str = "virtual"  # "wall" | "virtual"
    liveness: str = ""
    speedup: float = 1.0
    num_sent: int = 0
    trace_t: float = 0.0
    lateness_s: list[float] = field(default_factory=list)
    num_in_flight: int | None = None  # sent, not yet ended (None: not tracked)
    ttft_s: list[float] = field(default_factory=list)  # of the requests that had a first token
    rate_per_s: float | None = None  # requests per wall second (virtual clock)
    eta_s: float | None = None  # wall seconds to the end at that rate (virtual clock)

    def update_rate(self, num_done: int, wall_s: float) -> None:
        """Rate and ETA after num_done requests in wall_s seconds (virtual clock)."""
        if num_done <= 0 or wall_s <= 0:
            return
        self.rate_per_s = num_done / wall_s
        self.eta_s = max(self.num_total - num_done, 0) / self.rate_per_s

    def record_send(self, lateness_s: float) -> None:
        self.num_sent += 1
        self.lateness_s.append(lateness_s)

    def lateness_percentile_s(self, q: float) -> float | None:
        """Nearest-rank percentile of the send lateness so far; None before the first send."""
        return _nearest_rank(self.lateness_s, q)

    def ttft_percentile_s(self, q: float) -> float | None:
        """Nearest-rank percentile of the time to first token so far; None before one."""
        return _nearest_rank(self.ttft_s, q)


def _nearest_rank(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)] if ordered else None


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowVerdict:
    """One closed idle window of one engine, as the dashboard lists it."""

    engine: str
    start: float
    length: float
    num_used_at_start: int
    time_to_drain: float | None  # None: never drained
    verdict: str  # "drained" | "leak" | "undecided"
    num_blocks_held: int = 0  # used blocks at the window's last sample that had any

    @staticmethod
    def of(window: IdleWindow) -> WindowVerdict:
        return WindowVerdict(
            engine=window.engine,
            start=window.start,
            length=window.length,
            num_used_at_start=window.num_used_at_start,
            time_to_drain=window.time_to_drain,
            verdict=window.verdict,
            num_blocks_held=window.num_blocks_held,
        )

    def sentence(self) -> str:
        """'P held 15 blocks through 40.0 s idle: leak' / 'D drained 8 blocks in 3ms'."""
        if self.time_to_drain is None:
            return (
                f"{self.engine} held {self.num_blocks_held:,} blocks through "
                f"{self.length:.1f} s idle: {self.verdict}"
            )
        return (
            f"{self.engine} drained {self.num_used_at_start:,} blocks in "
            f"{1000 * self.time_to_drain:.0f} ms of {self.length:.1f} s idle: {self.verdict}"
        )


@dataclass(slots=True)
class StartupState:
    """A wall-clock run's start-up: the phase now, which engines are ready, when it ended.
    Times are seconds since the frontend started (DashboardState.elapsed_s's clock)."""

    phase: str = "starting"
    phase_start_s: float = 0.0
    engines: list[str] = field(default_factory=list)  # expected, if known before they start
    ready_at: dict[str, float] = field(default_factory=dict)  # engine -> when its Ready came
    detail: str = ""  # e.g. how far the idle-window forecast got
    ready_s: float | None = None  # when the run itself started; None: still starting
    lines: list[str] = field(default_factory=list)  # one per event, for plain output

    def enter(self, phase: str, now_s: float) -> None:
        if phase != self.phase:
            self.phase, self.phase_start_s, self.detail = phase, now_s, ""
            self.lines.append(f"{phase} (at {now_s:.2f} s)")

    def engine_ready(self, engine: str, now_s: float) -> None:
        if engine not in self.ready_at:
            self.ready_at[engine] = now_s
            self.lines.append(f"engine {engine} ready in {now_s:.2f} s")

    def finish(self, now_s: float) -> None:
        if self.ready_s is None:
            self.ready_s = now_s
            self.lines.append(f"ready in {now_s:.2f} s: sending the trace")


@dataclass(slots=True)
class DashboardState:
    """Everything the dashboard shows; the frontend mutates it, render() reads it."""

    engines: dict[str, EngineView] = field(default_factory=dict)
    progress: ReplayProgress | None = None
    windows: list[WindowVerdict] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # errors, e.g. a dead connector worker
    title: str = "kvdrain"
    server: str = ""  # who answers a --target: its own identity ("" for local engines)
    elapsed_s: float = 0.0  # since the frontend started, in its clock
    startup: StartupState | None = None  # a wall-clock replay's start-up
    quit_key: bool = False  # the view reads keys: `q` quits

    def view(self, engine_id: str) -> EngineView:
        """The view of `engine_id`, made on first use."""
        if engine_id not in self.engines:
            self.engines[engine_id] = EngineView(engine_id)
        return self.engines[engine_id]

    def apply_snapshot(self, snapshot: StatsSnapshot) -> None:
        self.view(snapshot.engine_id).update(
            snapshot.engine_id,
            snapshot.monotonic,
            snapshot.loop_state,
            snapshot.num_steps,
            snapshot.num_wakeups,
            snapshot.counts,
        )

    def apply_sample(self, sample: EngineSample) -> None:
        self.view(sample.engine).update(
            sample.engine,
            sample.t,
            sample.loop_state,
            sample.num_steps,
            sample.num_wakeups,
            sample_counts(sample),
        )
