"""Feeds the live dashboard from a running replay or serve. Runs in: frontend process.

Glue between the drivers (which know nothing of the screen) and replay/ui/tui.py (which
knows nothing of engines): on each tick it copies the newest snapshots, the progress
and the idle windows that have closed into a DashboardState and lets the view redraw.
"""
from __future__ import annotations

import time

from replay.live.driver import WallClockReplay
from replay.verify.timeline import Timeline
from replay.ui.dashboard import DashboardState, ReplayProgress, WindowVerdict
from replay.ui.tui import LiveView
from replay.verify.rules import EngineSeries, VerifyOptions, check_window, idle_windows

WINDOW_CHECK_INTERVAL_S = 1.0


class ReplayMonitor:
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
        for snapshot in replay.latest.values():
            view = state.view(snapshot.engine_id)
            if view.monotonic != snapshot.monotonic:
                state.apply_snapshot(snapshot)
        if state.progress is not None:
            self._update_progress(state.progress, replay)
        for engine, message in getattr(replay.router, "errors", [])[self._num_messages:]:
            state.messages.append(f"{engine}: {message.splitlines()[0]}")
        self._num_messages = len(getattr(replay.router, "errors", []))
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
