"""The live dashboard: pure render at 80 and 160 columns, plain lines, rates, LiveView without a terminal, its feeds."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from engine.proc.messages import StatsSnapshot
from replay.pipeline import FORECASTING, RUNNING, STARTING, ReplayConfig, ReplayHooks, run_replay
from replay.runtime.interrupt import Interrupted
from replay.ui.dashboard import (
    DashboardState,
    EngineView,
    ReplayProgress,
    StartupState,
    WindowVerdict,
)
from replay.ui.monitor import ReplayMonitor, ServeMonitor, SnapshotWindows, server_line
from replay.ui.tui import LiveView, plain_line, render, sparkline, summary_text
from replay.verify.rules import IdleWindow, VerifyOptions
from replay.verify.timeline import EngineSample, RequestRecord
from replay.wall.faults import FaultWatch
from tests.paths import EXAMPLE, ROOT

CONNECTOR = dict(
    num_sent=17,
    num_expired=1,
    num_recved=0,
    num_failed_recvs=0,
    num_recvs_in_flight=0,
    num_sends_pending=3,
    oldest_send_age_ms=120,
    num_read_done_dropped=0,
    num_bytes_pulled=0,
    connector_worker_pid=4242,
)


def make_counts(**overrides: int) -> dict[str, int]:
    counts = dict(
        num_waiting=3,
        num_skipped_waiting=1,
        num_waiting_for_remote_kvs=0,
        num_running=4,
        num_finished_awaiting_free=2,
        num_usable_blocks=127,
        num_used_blocks=40,
        num_cached_blocks=12,
        num_free_blocks=87,
        num_preemptions=0,
        num_stale_kv_reports=0,
        num_prefix_hit_tokens=64,
        num_bad_messages=0,
        **CONNECTOR,
    )
    counts.update(overrides)
    return counts


def make_state() -> DashboardState:
    state = DashboardState(title="kvdrain replay pd_idle.jsonl", elapsed_s=12.3)
    for t, steps, wakeups in ((1.0, 10, 1), (3.0, 50, 5)):
        state.view("P").update("P", t, "blocked", steps, wakeups, make_counts())
    d_counts = make_counts(
        num_waiting=0,
        num_skipped_waiting=2,
        num_waiting_for_remote_kvs=5,
        num_running=6,
        num_finished_awaiting_free=0,
        num_used_blocks=12,
        num_cached_blocks=30,
        num_free_blocks=115,
        num_sends_pending=0,
        num_recvs_in_flight=7,
        num_failed_recvs=1,
        connector_worker_pid=4243,
    )
    state.apply_snapshot(StatsSnapshot("D", 1, 3.0, "stepping", 100, 2, d_counts))
    state.progress = ReplayProgress(
        trace_name="pd_idle.jsonl",
        num_total=32,
        duration_s=40.0,
        clock="wall",
        liveness="event",
        speedup=2.0,
    )
    for lateness in (0.001, 0.002, 0.008):
        state.progress.record_send(lateness)
    state.progress.trace_t = 12.3
    state.windows = [
        WindowVerdict.of(
            IdleWindow(
                engine="P",
                start=3.0,
                end=5.0,
                is_tail=False,
                num_used_at_start=12,
                time_to_drain=0.12,
                verdict="drained",
                num_blocks_held=0,
            )
        ),
        WindowVerdict(
            engine="D",
            start=6.0,
            length=2.5,
            num_used_at_start=8,
            time_to_drain=None,
            verdict="leak",
        ),
    ]
    state.messages = ["connector worker of D (pid 4243) died"]
    return state


def render_text(state: DashboardState, width: int) -> str:
    console = Console(record=True, width=width, height=24, file=io.StringIO())
    console.print(render(state))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 160])
def test_render_shows_engines_progress_and_verdicts(width):
    text = render_text(make_state(), width)
    lines = text.splitlines()
    assert len(lines) == 24 and all(len(line) <= width for line in lines)
    for needle in (
        "engine P",
        "engine D",
        "idle windows",
        "kvdrain replay",
        "clock wall",
        "liveness event",
        "speed ×2",
        "elapsed 12.3s",
        "blocked",
        "stepping",
        "drained",
        "leak",
        "never",
        "120ms",  # P's oldest send, the window's drain
        "40/127",
        "12/127",
        "worker pid 4242",
        "worker pid 4243",
        "sent 3/32",
        "trace 12.3/40.0s",
        "p50 2ms",
        "p99 8ms",
        "connector worker of D (pid 4243) died",
        "recvs in flight",
        "sends pending",
    ):
        assert needle in text, needle
    # P and D side by side: one line holds both engines' WAITING_FOR_REMOTE_KVS and running.
    assert re.findall(r"remote KVs\s+(\d+)\s+running\s+(\d+)", text) == [("0", "4"), ("5", "6")]
    assert "20 steps/s" in text and "2.0 wake/s" in text  # P: 40 steps, 4 wake-ups in 2 s


def test_render_regions_and_empty_state():
    layout = render(DashboardState(title="kvdrain top"))
    for name in ("header", "engines", "windows", "footer"):
        assert layout.get(name) is not None, name
    text = render_text(DashboardState(title="kvdrain top"), 80)
    assert "kvdrain top" in text and "waiting for the first stats" in text


def test_engine_view_rates_and_history_from_two_updates():
    view = EngineView("D")
    view.update("D", 10.0, "stepping", 100, 4, make_counts(num_used_blocks=5))
    assert view.steps_per_s == 0.0 and view.wakeups_per_s == 0.0  # one update: no rate yet
    view.update("D", 10.5, "polling", 150, 9, make_counts(num_used_blocks=0))
    assert view.steps_per_s == pytest.approx(100.0) and view.wakeups_per_s == pytest.approx(10.0)
    assert list(view.used_history) == [5, 0] and view.loop_state == "polling"
    view.update("D", 11.0, "blocked", 3, 0, make_counts())  # restarted engine: counters went back
    assert view.steps_per_s == 0.0 and view.has_connector
    with pytest.raises(ValueError):
        view.update("P", 12.0, "blocked", 0, 0, {})
    for i in range(500):
        view.update("D", 20.0 + i, "blocked", 0, 0, {"num_used_blocks": i})
    assert len(view.used_history) == 120 and view.used_history[-1] == 499


def test_apply_sample_feeds_a_virtual_clock_engine():
    state = DashboardState()
    for t, steps in ((1.0, 10), (1.5, 30)):
        state.apply_sample(
            EngineSample(
                t=t,
                engine="E",
                num_used_blocks=5,
                num_cached_blocks=2,
                num_free_blocks=100,
                num_usable_blocks=105,
                num_waiting=1,
                num_skipped_waiting=0,
                num_waiting_for_remote_kvs=0,
                num_running=2,
                num_finished_awaiting_free=0,
                loop_state="stepping",
                num_steps=steps,
                num_wakeups=1,
            )
        )
    view = state.engines["E"]
    assert view.steps_per_s == pytest.approx(40.0) and not view.has_connector
    assert view.counts["num_free_blocks"] == 100 and view.counts["num_usable_blocks"] == 105
    assert "E used 5/105 stepping" in plain_line(state)


def test_sparkline():
    assert sparkline([0, 1, 2, 4, 8], 10) == "▁▃▄▅█"
    assert sparkline([0, 0, 0], 10) == "▁▁▁"
    assert sparkline([0, 5, 10, 20, 40], 3) == "▄▅█"  # the last `width` points
    assert sparkline([1], 0) == "" and sparkline([], 5) == ""
    assert sparkline([1000, 1], 2)[1] == "▂"  # any use stays above the zero bar


def test_plain_line_and_summary():
    state = make_state()
    assert plain_line(state) == (
        "t=12.3s sent 3/32 | P used 40/127 blocked | D used 12/127 stepping"
        " | idle windows 2: P 1 drained, D 1 leak"
    )
    summary = summary_text(state)
    assert summary.startswith("final t=12.3s")
    assert "window D 6.00s +2.50s: 8 used at start, never drained: leak" in summary
    assert "! connector worker of D (pid 4243) died" in summary


def test_the_progress_line_counts_idle_windows_as_the_verdict_does_not_engine_windows():
    state = make_state()
    state.windows = [
        WindowVerdict(
            engine=e,
            start=start,
            length=4.0,
            num_used_at_start=9,
            time_to_drain=None if e == "P" else 0.01,
            verdict="leak" if e == "P" else "drained",
            num_blocks_held=9,
        )
        for start in (1.0, 6.0)
        for e in ("P", "D")
    ]
    assert plain_line(state).endswith(" | idle windows 2: P 2 leak, D 2 drained")
    assert "idle windows 2  P: 2 leak  D: 2 drained" in render_text(state, 80)


def test_the_final_line_of_a_shaped_replay_has_no_eta_and_counts_what_shaping_kept():

    state = make_state()
    state.progress.rate_per_s, state.progress.eta_s, state.progress.num_total = 70.0, 11.2, 8819
    timeline = SimpleNamespace(samples=[], requests=[object()] * 781, end_t=300.0, meta={})
    result = SimpleNamespace(timeline=timeline, verdict=SimpleNamespace(windows=()))
    ReplayMonitor(state, SimpleNamespace(tick=lambda: None), VerifyOptions()).show_final(result)
    line = plain_line(state)
    assert "sent 781/781" in line and "ETA" not in line


def test_live_view_without_terminal_prints_plain_lines_and_summary():
    state, out, now = make_state(), io.StringIO(), [0.0]
    console = Console(file=out, force_terminal=False, width=200)
    with LiveView(state, console, clock=lambda: now[0]) as view:
        assert not view.is_live
        for _ in range(10):  # 10 ticks 0.25 s apart: one line a second at most
            now[0] += 0.25
            state.progress.trace_t += 0.25
            view.tick()
    lines = out.getvalue().splitlines()
    plain = [line for line in lines if line.startswith("t=")]
    assert [line.split()[0] for line in plain] == ["t=12.6s", "t=13.6s", "t=14.6s"]
    assert lines.count("! connector worker of D (pid 4243) died") == 1  # printed once as it came
    assert lines[-4].startswith("final t=14.8s sent 3/32") and lines[-1].startswith("  ! connector")
    assert "\x1b[" not in out.getvalue()


def test_live_view_on_a_terminal_keeps_the_last_frame():
    state, out, now = make_state(), io.StringIO(), [0.0]
    console = Console(file=out, force_terminal=True, width=80, height=24)
    with LiveView(state, console, clock=lambda: now[0]) as view:
        assert view.is_live
        state.windows.append(
            WindowVerdict(
                engine="P",
                start=9.0,
                length=1.0,
                num_used_at_start=0,
                time_to_drain=0.0,
                verdict="drained",
            )
        )
    assert "idle windows 3" in out.getvalue()  # the exit refresh drew the final state


class CountingView:
    """A LiveView stand-in: counts redraws."""

    def __init__(self) -> None:
        self.num_ticks = 0
        self.quit_requested = False

    def tick(self, force: bool = False) -> None:
        self.num_ticks += 1


def test_serve_feed_applies_each_engines_newest_snapshot_once():
    state, view = DashboardState(), CountingView()
    monitor = ServeMonitor(state, view)
    server = SimpleNamespace(
        latest={"P": StatsSnapshot("P", 1, 1.0, "blocked", 10, 1, make_counts())},
        take_stats=lambda: [],
    )
    monitor.on_tick(server)
    monitor.on_tick(server)  # the same snapshot again: no second update, so no zero-time rate
    assert state.engines["P"].num_steps == 10 and len(state.engines["P"].used_history) == 1
    server.latest["P"] = StatsSnapshot(
        "P", 2, 3.0, "polling", 50, 5, make_counts(num_used_blocks=7)
    )
    monitor.on_tick(server)
    p = state.engines["P"]
    assert p.steps_per_s == pytest.approx(20.0) and list(p.used_history) == [40, 7]
    assert p.loop_state == "polling" and view.num_ticks == 3


def test_top_feed_applies_every_snapshot_in_order():
    state, view = DashboardState(), CountingView()
    ServeMonitor(state, view).on_snapshots(
        [
            StatsSnapshot("D", 1, 1.0, "stepping", 0, 0, make_counts()),
            StatsSnapshot("D", 2, 2.0, "blocked", 30, 4, make_counts()),
        ]
    )
    assert state.engines["D"].steps_per_s == pytest.approx(30.0) and view.num_ticks == 1


def test_replay_feed_copies_progress_errors_and_the_final_picture():
    state = DashboardState(
        progress=ReplayProgress(trace_name="t.jsonl", num_total=2, duration_s=4.0, clock="wall")
    )
    view = CountingView()
    monitor = ReplayMonitor(state, view, VerifyOptions())
    records = {
        r: RequestRecord(
            req_id=r,
            arrival_t=t,
            send_t=t + 0.003,
            send_lateness_s=0.003,
            first_token_t=None,
            end_t=None,
            num_prompt_tokens=8,
            num_output_tokens=0,
            num_prefix_hit_tokens=0,
            finish_reason=None,
        )
        for r, t in (("r0", 0.0), ("r1", 0.5))
    }
    faults = FaultWatch(["P", "D"])  # the driver's: what died or stalled, named
    faults.on_error(1.0, "D", "Traceback (most recent call last):\nRuntimeError: engine D died")
    replay = SimpleNamespace(
        latest={},
        requests=records,
        samples=[],
        arrivals=[0.0, 0.5],
        aborts=[],
        faults=faults,
        now=lambda: 1.5,
    )
    monitor.on_tick(replay)
    monitor.on_tick(replay)  # nothing new: no second send, no repeated message
    assert state.progress.num_sent == 2 and state.progress.lateness_s == [0.003, 0.003]
    assert state.progress.trace_t == 1.5 and state.messages == [
        "fault: D: RuntimeError: engine D died"
    ]
    final = SimpleNamespace(
        timeline=SimpleNamespace(
            samples=[
                EngineSample(
                    t=t,
                    engine="P",
                    num_used_blocks=used,
                    num_cached_blocks=0,
                    num_free_blocks=127 - used,
                    num_usable_blocks=127,
                    num_waiting=0,
                    num_skipped_waiting=0,
                    num_waiting_for_remote_kvs=0,
                    num_running=0,
                    num_finished_awaiting_free=0,
                    loop_state="blocked",
                    num_steps=9,
                    num_wakeups=2,
                )
                for t, used in ((1.0, 5), (2.0, 0))
            ],
            requests=list(records.values()),
            end_t=6.0,
            meta={},
        ),
        verdict=SimpleNamespace(
            windows=[
                IdleWindow(
                    engine="P",
                    start=3.0,
                    end=5.0,
                    is_tail=False,
                    num_used_at_start=12,
                    time_to_drain=0.12,
                    verdict="drained",
                    num_blocks_held=0,
                )
            ]
        ),
    )
    monitor.show_final(final)
    assert state.engines["P"].counts["num_used_blocks"] == 0 and state.progress.trace_t == 6.0
    assert [w.verdict for w in state.windows] == ["drained"] and view.num_ticks == 2


# ---- start-up phases, virtual progress, q, the serve's idle windows ----------------------


def test_startup_phases_tick_and_end_in_ready():
    """The start-up panel shows the phase with its own clock and each engine's state;
    RUNNING ends it with "ready in N s"; plain output gets one line per event."""
    state = DashboardState(
        title="kvdrain replay t.jsonl",
        startup=StartupState(engines=["P", "D"]),
        progress=ReplayProgress(trace_name="t.jsonl", num_total=4, duration_s=2.0, clock="wall"),
    )
    out, view = io.StringIO(), CountingView()
    monitor = ReplayMonitor(state, view, VerifyOptions())
    monitor.start -= 10.0  # ten seconds in
    monitor.on_phase(FORECASTING, [])
    monitor.on_progress(64, 3.0)  # the wall clock's forecast of idle windows
    assert state.startup.detail == "64/4 requests" and state.progress.num_sent == 0
    monitor.on_phase(STARTING, [])
    monitor.start -= 1.5
    monitor.on_phase(STARTING, ["P"])
    text = render_text(state, 80)
    assert re.search(r"starting engines\s+1\.5s", text), text
    assert re.search(r"engine P\s+ready in 11\.5\ds", text) and re.search(
        r"engine D\s+starting", text
    )
    assert plain_line(state).startswith("starting engines 1.5s | P ready")
    monitor.on_phase(RUNNING, ["P", "D"])
    assert state.startup.ready_s == pytest.approx(11.5, abs=0.1) and view.num_ticks == 5
    assert [re.sub(r"[\d.]+ s", "N s", line) for line in state.startup.lines] == [
        "forecasting idle windows (at N s)",
        "starting engines (at N s)",
        "engine P ready in N s",
        "engine D ready in N s",
        "ready in N s: sending the trace",
    ]
    console = Console(file=out, force_terminal=False, width=200)
    with LiveView(state, console, read_keys=False) as live:
        live.tick()
    printed = out.getvalue()
    assert "starting engines (at 10.00 s)" in printed and "ready in 11." in printed


def test_virtual_progress_has_rate_and_eta():
    state = DashboardState(
        progress=ReplayProgress(trace_name="t.jsonl", num_total=1000, duration_s=60.0)
    )
    monitor = ReplayMonitor(state, CountingView(), VerifyOptions())
    monitor.start -= 2.0
    monitor.on_progress(250, 30.0)
    p = state.progress
    assert p.num_sent == 250 and p.trace_t == 30.0
    assert p.rate_per_s == pytest.approx(125, rel=0.05) and p.eta_s == pytest.approx(6.0, rel=0.05)
    text = render_text(state, 120)
    assert re.search(r"simulated 250/1000 .*12\d req/s ETA 6\.\ds", text), text
    assert " 12" in plain_line(state) and "req/s ETA" in plain_line(state)


def test_progress_callback_runs_during_a_virtual_replay_and_changes_nothing():
    config = ReplayConfig(trace=EXAMPLE, clock="virtual")
    calls: list[tuple[int, float]] = []
    with_progress = run_replay(config, ReplayHooks(on_progress=lambda n, t: calls.append((n, t))))
    without = run_replay(config)
    assert calls and calls[-1][0] == 32  # the last call: every request fed
    assert [n for n, _ in calls] == sorted(n for n, _ in calls)
    assert with_progress.timeline.samples == without.timeline.samples
    assert with_progress.timeline.requests == without.timeline.requests
    assert with_progress.verdict.to_dict() == without.verdict.to_dict()


class FakeKeys:
    def __init__(self, typed: str) -> None:
        self.typed, self.num_exits = typed, 0

    def __enter__(self):
        return self

    def read(self) -> str:
        typed, self.typed = self.typed, ""
        return typed

    def __exit__(self, *exc: object) -> None:
        self.num_exits += 1


def test_q_sets_quit_and_a_replay_monitor_stops_like_ctrl_c():
    state, now = DashboardState(), [0.0]
    view = LiveView(
        state,
        Console(file=io.StringIO(), force_terminal=False),
        clock=lambda: now[0],
        read_keys=False,
    )
    view.keys = keys = FakeKeys("xq")
    monitor = ReplayMonitor(state, view, VerifyOptions())
    with pytest.raises(Interrupted) as stopped:
        with view:
            assert state.quit_key
            monitor.on_phase(STARTING, [])
    assert stopped.value.signum == signal.SIGINT and view.quit_requested
    assert keys.num_exits == 1 and not state.quit_key  # the terminal is restored on the way out


def snap(engine: str, t: float, used: int, running: int) -> StatsSnapshot:
    return StatsSnapshot(
        engine,
        1,
        t,
        "blocked",
        0,
        0,
        make_counts(
            num_used_blocks=used,
            num_running=running,
            num_waiting=0,
            num_skipped_waiting=0,
            num_waiting_for_remote_kvs=0,
        ),
    )


def test_serve_windows_are_judged_like_a_replays():
    """Busy, 2 s quiet (P drains at +0.1 s, D holds blocks throughout), busy again:
    one closed window per engine, P drained, D leaked; then an open window shown as it drains."""
    windows = SnapshotWindows(VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5))
    for s in (
        snap("P", 100.0, 8, 2),
        snap("D", 100.0, 4, 1),
        snap("P", 101.0, 8, 0),
        snap("D", 101.0, 4, 0),
        snap("P", 101.1, 0, 0),
        snap("P", 103.0, 8, 1),
    ):
        windows.add(s)
    got = {(w.engine, w.verdict, w.start, round(w.length, 3)) for w in windows.verdicts(103.0)}
    assert got == {("P", "drained", 1.0, 2.0), ("D", "leak", 1.0, 2.0)}
    windows.add(snap("P", 104.0, 8, 0))
    assert len(windows.verdicts(104.5)) == 2  # quiet for 0.5 s: not a window yet
    windows.add(snap("P", 104.2, 0, 0))
    tail = windows.verdicts(105.5)[2:]
    assert {(w.engine, w.verdict, w.start) for w in tail} == {
        ("P", "drained", 4.0),
        ("D", "leak", 4.0),
    }


def test_top_feed_fills_the_idle_window_panel():
    state, view = DashboardState(), CountingView()
    monitor = ServeMonitor(state, view, VerifyOptions(idle_threshold_s=1.0))
    now = time.monotonic()
    monitor.on_snapshots(
        [snap("P", now - 5, 8, 1), snap("P", now - 4, 0, 0), snap("P", now - 1, 2, 1)]
    )
    assert [(w.engine, w.verdict) for w in state.windows] == [("P", "drained")]
    assert "idle windows 1" in render_text(state, 80)


def test_the_live_view_on_a_pty_shows_phases_and_quits_on_q():
    """kvdrain replay on a pseudo-terminal: the start-up panel, then q: the run stops
    with its summary (exit 130) and the terminal's settings are as before."""
    import termios

    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    env = dict(os.environ, COLUMNS="120", LINES="40", TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "replay", str(EXAMPLE), "--runner", "mock"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=ROOT,
    )
    screen, sent_q, deadline = "", False, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None or _readable(master):
            if _readable(master, 0.2):
                screen += re.sub(
                    r"\x1b\[[0-9;?]*[A-Za-z]", "", os.read(master, 65536).decode(errors="replace")
                )
            if (
                not sent_q and "ready in" in screen and re.search(r"remote KVs +\d", screen)
            ):  # running
                os.write(master, b"q")
                sent_q = True
            if time.monotonic() > deadline:
                break
        assert proc.wait(timeout=30) == 130, screen[-2000:]
        after = termios.tcgetattr(slave)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)
    assert sent_q and "start-up" in screen and "ready in" in screen
    assert "INTERRUPTED: by q after" in screen and "exit 130" in screen
    assert after[3] & (termios.ICANON | termios.ECHO) == before[3] & (termios.ICANON | termios.ECHO)


def _readable(fd: int, timeout_s: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


def test_serve_windows_end_where_an_engine_takes_blocks_for_new_work():
    """P takes a request and finishes it within one step (no snapshot shows it queued):
    its blocks rising ends the quiet spell there, so P's new blocks are not a leak."""
    windows = SnapshotWindows(VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5))
    for s in (
        snap("D", 10.0, 4, 1),
        snap("D", 11.0, 0, 0),
        snap("P", 11.0, 0, 0),
        snap("P", 14.0, 6, 0),
        snap("D", 14.01, 2, 1),
    ):
        windows.add(s)
    got = {(w.engine, w.verdict, w.start, round(w.length, 3)) for w in windows.verdicts(15.0)}
    assert got == {("P", "drained", 1.0, 3.0), ("D", "drained", 1.0, 3.0)}


def test_at_80_columns_the_title_keeps_the_trace_name_and_the_facts_give_way():
    state = make_state()
    state.title = "kvdrain replay AzureLLMInferenceTrace_code.csv"
    state.server = "kvdrain (aiohttp) kvdrain/tiny pd"
    first = render_text(state, 80).splitlines()[0]
    assert first.startswith("kvdrain replay AzureLLMInferenceTrace_code.csv ") and first.endswith(
        "…"
    )


def test_scraped_engines_of_one_source_sort_prefill_first():
    from replay.ui.tui import engine_order

    assert sorted(["x:D", "x:P", "D", "P", "E"], key=engine_order) == ["P", "D", "E", "x:P", "x:D"]


def test_the_sparkline_says_its_scale_and_a_tall_screen_gets_history_charts():
    state = make_state()
    text = render_text(state, 80)
    assert "peak 40/127" in text
    console = Console(record=True, width=200, height=50, file=io.StringIO())
    console.print(render(state))
    tall = console.export_text()
    assert "P used, last 2 reports" in tall and "D used, last 1 reports" in tall
    assert sum(1 for line in tall.splitlines() if not line.strip("│ ╭╮╰╯─")) < 5  # no blank screen


def test_the_view_explains_the_kv_bars_glyphs_and_the_queue_abbreviations_when_it_has_room():
    text = render_text(make_state(), 80)
    assert "█ used  ▒ cached (free, still hashed)  ░ free" in text
    assert "remote KVs: WAITING_FOR_REMOTE_KVS" in text and "fin-await-free: finished" in text


def test_a_virtual_replay_says_where_its_engines_are_instead_of_waiting_for_stats():
    state = DashboardState(title="kvdrain replay x")
    state.progress = ReplayProgress(trace_name="x", num_total=10, duration_s=5.0, clock="virtual")
    text = render_text(state, 80)
    assert (
        "waiting for the first stats" not in text
        and "virtual clock: engines run in-process; blocks and windows show at the end" in text
    )


def test_a_wide_footer_adds_requests_in_flight_and_ttft_so_far():
    state = make_state()
    state.progress.num_in_flight, state.progress.ttft_s = 2, [0.010, 0.020, 0.300]
    narrow = render_text(state, 80)
    assert "sent 3/32 (2 in flight)" in narrow and "ttft" not in narrow
    console = Console(record=True, width=200, height=50, file=io.StringIO())
    console.print(render(state))
    assert "ttft p50 20ms p99 300ms" in console.export_text()


def test_a_serves_header_names_its_topology_liveness_and_http_url():
    state = DashboardState(title="kvdrain serve tcp://127.0.0.1:5555", server="pd  liveness legacy")
    monitor = ServeMonitor(
        state, SimpleNamespace(tick=lambda: None), http_url=lambda: "http://127.0.0.1:8000"
    )
    monitor.on_tick(SimpleNamespace(take_stats=lambda: [], latest={}))
    first = render_text(state, 120).splitlines()[0]
    assert "pd  liveness legacy  http://127.0.0.1:8000" in first


def test_a_servers_name_in_the_header_is_text_never_markup_nor_escapes():
    server = server_line({"server": "[blink]srv[/blink]\x1b[2J", "model": "m[/]\u202e"})
    assert server == "[blink]srv[/blink]\\x1b[2J m[/]\\u202e"
    state = DashboardState(title="t", server=server)
    assert server in render_text(state, 120).splitlines()[0]


def test_eight_engines_are_one_row_each_p_before_d_readable_at_80_columns():
    state = make_state()
    state.engines.clear()
    for name in ("D1", "P10", "D0", "P2", "P0", "P1", "D2", "D3"):
        state.view(name).update(name, 1.0, "blocked", 5, 1, make_counts(num_used_blocks=15))
    text = render_text(state, 80)
    rows = [line for line in text.splitlines() if "blocked" in line]
    assert [row.split()[1] for row in rows] == ["P0", "P1", "P2", "P10", "D0", "D1", "D2", "D3"]
    assert all("15/127" in row for row in rows)  # each engine's used blocks, whole at 80 columns
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "1 leak" in text  # the windows panel still has room below
    state.windows = [
        WindowVerdict(
            engine=name,
            start=1.0,
            length=2.0,
            num_used_at_start=15,
            time_to_drain=None if name.startswith("P") else 0.0,
            verdict="leak" if name.startswith("P") else "drained",
        )
        for name in state.engines
    ]
    assert "idle windows 1  P (4): 4 leak  D (4): 4 drained" in render_text(state, 80)


def test_scraped_windows_are_judged_live_as_the_final_verdict_judges_scrapes():
    """top --metrics and the live HTTP view judge scrapes by the scrape rule: a 1 Hz
    reading of 8 blocks at the window's start and 0 after the deadline is no proof of a
    drain by it (the final verdict: undecided); the engine-stats rule called it a leak."""
    from replay.verify.rules import EngineSeries, check_window
    from replay.verify.timeline import SAMPLING_SCRAPED, Timeline

    def reading(t: float, used: int, running: int = 0) -> EngineSample:
        return EngineSample(
            t=t + 0.05,
            engine="P",
            num_used_blocks=used,
            num_cached_blocks=0,
            num_free_blocks=100 - used,
            num_usable_blocks=100,
            num_waiting=0,
            num_skipped_waiting=0,
            num_waiting_for_remote_kvs=0,
            num_running=running,
            num_finished_awaiting_free=0,
            loop_state="",
            num_steps=0,
            num_wakeups=0,
            send_t=t,
        )

    samples = [
        reading(-1.0, 8, 1),
        reading(0.0, 8),
        reading(1.0, 0),
        reading(2.0, 0),
        reading(3.0, 0),
    ]
    windows = SnapshotWindows(
        VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5), scraped=True
    )
    for sample in [*samples, reading(4.0, 9, 1)]:
        windows.add_sample(sample)
    (live,) = windows.verdicts(4.05)
    timeline = Timeline(
        engines=["P"],
        num_usable_blocks={"P": 100},
        samples=samples,
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=4.05,
        meta={"sampling": SAMPLING_SCRAPED},
    )
    final = check_window(
        EngineSeries.of(timeline, "P"),
        (live.start, live.start + live.length, False),
        0.5,
        scraped=True,
    )
    assert live.verdict == final.verdict == "undecided"
