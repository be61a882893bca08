"""Feeds the live dashboard from a running replay, a serve, or a serve's stats (top). Runs in: frontend process.

The one place where engine data becomes DashboardState: the drivers know nothing of the
screen and replay/ui/tui.py knows nothing of engines. A new panel is its state in
replay/ui/dashboard.py, its view in replay/ui/tui.py and its feed here.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from engine.messages import StatsSnapshot
from replay.live.driver import WallClockReplay
from replay.live.serve import Server
from replay.pipeline import ReplayConfig, ReplayResult
from replay.ui.dashboard import DashboardState, ReplayProgress, WindowVerdict
from replay.ui.tui import LiveView
from replay.verify.rules import EngineSeries, VerifyOptions, check_window, idle_windows
from replay.verify.timeline import Timeline

WINDOW_CHECK_INTERVAL_S = 1.0


def replay_state(config: ReplayConfig, num_requests: int, duration: float) -> DashboardState:
    """The dashboard of a replay of `num_requests` over `duration` trace seconds, before it starts."""
    state = DashboardState(title=f"kvdrain replay {config.trace.name}")
    total = min(num_requests, config.shaping.max_requests or num_requests)
    state.progress = ReplayProgress(config.trace.name, total, duration / config.shaping.speedup,
                                    config.clock, config.engine.liveness, config.shaping.speedup)
    return state


def apply_newest(state: DashboardState, snapshots: Iterable[StatsSnapshot]) -> None:
    """Each engine's newest snapshot, unless the view already shows it."""
    for snapshot in snapshots:
        if state.view(snapshot.engine_id).monotonic != snapshot.monotonic:
            state.apply_snapshot(snapshot)


class ReplayMonitor:
    """A wall-clock replay's ticks and a replay's final result -> the dashboard."""

    def __init__(self, state: DashboardState, view: LiveView, verify_options: VerifyOptions) -> None:
        self.state = state
        self.view = view
        self.verify_options = verify_options
        self.start = time.monotonic()
        self._last_window_check = 0.0
        self._num_messages = 0

    def on_tick(self, replay: WallClockReplay) -> None:
        state = self.state
        state.elapsed_s = time.monotonic() - self.start
        apply_newest(state, replay.latest.values())
        if state.progress is not None:
            self._update_progress(state.progress, replay)
        errors = replay.target.errors
        for engine, message in errors[self._num_messages:]:
            state.messages.append(f"{engine}: {message.splitlines()[0]}")
        self._num_messages = len(errors)
        if state.elapsed_s - self._last_window_check >= WINDOW_CHECK_INTERVAL_S:
            self._last_window_check = state.elapsed_s
            state.windows = closed_windows(replay, self.verify_options)
        self.view.tick()

    @staticmethod
    def _update_progress(progress: ReplayProgress, replay: WallClockReplay) -> None:
        records = list(replay.requests.values())
        for record in records[progress.num_sent:]:
            progress.record_send(record.send_lateness_s)
        progress.trace_t = max(replay.now(), 0.0)

    def show_final(self, result: ReplayResult) -> None:
        """The final picture: every engine's last sample and every window's verdict."""
        state = self.state
        last = {s.engine: s for s in result.timeline.samples}
        for sample in last.values():
            state.apply_sample(sample)
        state.windows = [WindowVerdict.of(w) for w in result.verdict.windows]
        if state.progress is not None:
            state.progress.num_sent = len(result.timeline.requests)
            state.progress.trace_t = result.timeline.end_t


class ServeMonitor:
    """A serve's engines -> the dashboard: the serve's own (on_tick) or top's (on_snapshots)."""

    def __init__(self, state: DashboardState, view: LiveView) -> None:
        self.state = state
        self.view = view
        self.start = time.monotonic()

    def on_tick(self, server: Server) -> None:
        self.state.elapsed_s = time.monotonic() - self.start
        apply_newest(self.state, server.latest.values())
        self.view.tick()

    def on_snapshots(self, snapshots: list[StatsSnapshot]) -> None:
        """Every snapshot a serve sent, in order (rates come from each pair)."""
        for snapshot in snapshots:
            self.state.apply_snapshot(snapshot)
        self.state.elapsed_s = time.monotonic() - self.start
        self.view.tick()


def closed_windows(replay: WallClockReplay, options: VerifyOptions) -> list[WindowVerdict]:
    """Verdicts of the idle windows that have ended so far (the tail is judged at the end)."""
    now = replay.now()
    timeline = Timeline(engines=list(replay.latest), num_blocks={}, samples=sorted(replay.samples, key=lambda s: s.t),
                        requests=list(replay.requests.values()), arrivals=list(replay.arrivals),
                        aborts=list(replay.aborts), end_t=now)
    verdicts = []
    for window in idle_windows(timeline, options.idle_threshold_s):
        start, end, is_tail = window
        if is_tail or end > now:
            continue
        for engine in timeline.engines:
            checked = check_window(EngineSeries.of(timeline, engine), window, options.drain_deadline_s)
            verdicts.append(WindowVerdict.of(checked))
    return verdicts
