"""A replay against --target http:// shows itself live: plain progress lines while it
runs, the server's own identity and liveness in the header, windows as they close."""

from __future__ import annotations

import io
import signal

import pytest
from rich.console import Console

from replay.metrics.scrape import MetricsSource
from replay.target.client import HttpReplay, HttpTargetOptions
from replay.trace.reader import read_trace
from replay.trace.shaping import ShapingOptions, shape
from replay.ui.dashboard import DashboardState, ReplayProgress, StartupState
from replay.ui.monitor import ReplayMonitor
from replay.ui.tui import LiveView
from replay.verify.rules import VerifyOptions
from tests.http_utils import engines, running_front
from tests.paths import EXAMPLE

pytestmark = pytest.mark.timeout(120)


def test_an_http_replay_prints_progress_and_the_servers_liveness_while_it_runs():
    state = DashboardState(title="kvdrain replay pd_idle.jsonl")
    state.progress = ReplayProgress(
        trace_name="pd_idle.jsonl",
        num_total=32,
        duration_s=5.0,
        clock="wall",
        liveness="",
        speedup=4.0,
    )
    state.startup = StartupState(phase="forecasting idle windows")  # where the forecast left it
    out = io.StringIO()
    view = LiveView(
        state,
        Console(file=out, force_terminal=False, width=200),
        plain_interval_s=0.5,
        read_keys=False,
    )
    monitor = ReplayMonitor(state, view, VerifyOptions(idle_threshold_s=0.5, drain_deadline_s=0.3))
    seen_windows_during_run = []

    def on_tick(replay: HttpReplay) -> None:
        monitor.on_http_tick(replay)
        seen_windows_during_run.append(len(state.windows))

    with engines(liveness="legacy") as (router, model), running_front(router, model) as front:
        url = f"http://127.0.0.1:{front.port}"
        options = HttpTargetOptions(
            url, (MetricsSource.parse(f"{url}/metrics"),), scrape_interval_s=0.05, tail_s=0.5
        )
        with view:
            HttpReplay(options, on_tick=on_tick).run(
                shape(read_trace(EXAMPLE), ShapingOptions(speedup=4.0))
            )
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if line.startswith("t=") and " sent " in line]
    assert len(progress) >= 3, lines  # a line every half second of a 5 s run
    assert any("in flight" in line for line in progress)
    assert state.startup.ready_s is not None  # the start-up panel gave way
    assert state.progress.liveness == "legacy" and state.server.startswith("kvdrain (aiohttp)")
    assert max(seen_windows_during_run) > 0  # windows listed as they closed, not only at the end
    assert any("P used" in line for line in progress)  # each engine's scraped KV usage


def test_q_in_the_live_view_of_an_http_replay_stops_it_there():
    """The live view's `q` raises Interrupted inside a scrape tick: it stops the sending
    too (it was swallowed with the scrape loop, and the replay ran to its end)."""
    from replay.runtime.interrupt import QUIT_KEY, Interrupted

    ticks = []

    def on_tick(replay: HttpReplay) -> None:
        ticks.append(replay.now())
        if len(ticks) == 10:
            raise Interrupted(signal.SIGINT, key=QUIT_KEY)

    with engines() as (router, model), running_front(router, model) as front:
        url = f"http://127.0.0.1:{front.port}"
        options = HttpTargetOptions(
            url, (MetricsSource.parse(f"{url}/metrics"),), scrape_interval_s=0.05, tail_s=0.5
        )
        timeline = HttpReplay(options, on_tick=on_tick).run(
            shape(read_trace(EXAMPLE), ShapingOptions(speedup=4.0))
        )
    assert timeline.meta["interrupted"] == QUIT_KEY
    assert len(ticks) == 10  # no scrape after it
    assert len(timeline.requests) < 32 and timeline.end_t < 4.0  # the 4.3 s trace was cut
