"""The live dashboard: pure render at 80 and 160 columns, plain lines, rates, LiveView without a terminal, its feeds."""
from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from engine.messages import StatsSnapshot
from replay.live.monitor import ReplayMonitor, ServeMonitor
from replay.ui.dashboard import DashboardState, EngineView, ReplayProgress, WindowVerdict
from replay.verify.timeline import EngineSample, RequestRecord
from replay.ui.tui import LiveView, plain_line, render, sparkline, summary_text
from replay.verify.rules import IdleWindow, VerifyOptions

CONNECTOR = dict(num_sent=17, num_expired=1, num_recved=0, num_failed_recvs=0, num_recvs_in_flight=0,
                 num_sends_pending=3, oldest_send_age_ms=120, num_read_done_dropped=0,
                 num_bytes_pulled=0, connector_worker_pid=4242)


def make_counts(**overrides: int) -> dict[str, int]:
    counts = dict(num_waiting=3, num_skipped_waiting=1, num_waiting_for_remote_kvs=0, num_running=4,
                  num_finished_awaiting_free=2, num_blocks=127, num_used_blocks=40,
                  num_cached_blocks=12, num_free_blocks=87, num_preemptions=0,
                  num_stale_kv_reports=0, num_prefix_hit_tokens=64, num_bad_messages=0, **CONNECTOR)
    counts.update(overrides)
    return counts


def make_state() -> DashboardState:
    state = DashboardState(title="kvdrain replay pd_idle.jsonl", elapsed_s=12.3)
    for t, steps, wakeups in ((1.0, 10, 1), (3.0, 50, 5)):
        state.view("P").update("P", t, "blocked", steps, wakeups, make_counts())
    d_counts = make_counts(num_waiting=0, num_skipped_waiting=2, num_waiting_for_remote_kvs=5,
                           num_running=6, num_finished_awaiting_free=0, num_used_blocks=12,
                           num_cached_blocks=30, num_free_blocks=115, num_sends_pending=0,
                           num_recvs_in_flight=7, num_failed_recvs=1, connector_worker_pid=4243)
    state.apply_snapshot(StatsSnapshot("D", 1, 3.0, "stepping", 100, 2, d_counts))
    state.progress = ReplayProgress("pd_idle.jsonl", num_total=32, duration_s=40.0, clock="wall",
                                    liveness="event", speedup=2.0)
    for lateness in (0.001, 0.002, 0.008):
        state.progress.record_send(lateness)
    state.progress.trace_t = 12.3
    state.windows = [WindowVerdict.of(IdleWindow("P", 3.0, 5.0, False, 12, 0.12, "drained", 0)),
                     WindowVerdict("D", 6.0, 2.5, 8, None, "leak")]
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
    for needle in ("engine P", "engine D", "idle windows", "kvdrain replay", "clock wall",
                   "liveness event", "speed ×2", "elapsed 12.3s",
                   "blocked", "stepping", "drained", "leak", "never", "120ms",  # P's oldest send, the window's drain
                   "40/127", "12/127", "worker pid 4242", "worker pid 4243",
                   "sent 3/32", "trace 12.3/40.0s", "p50 2ms", "p99 8ms",
                   "connector worker of D (pid 4243) died", "recvs in flight", "sends pending"):
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
        state.apply_sample(EngineSample(t, "E", 5, 2, 100, 105, 1, 0, 0, 2, 0, "stepping", steps, 1))
    view = state.engines["E"]
    assert view.steps_per_s == pytest.approx(40.0) and not view.has_connector
    assert view.counts["num_free_blocks"] == 100 and view.counts["num_blocks"] == 105
    assert "E used 5/105 stepping" in plain_line(state)


def test_sparkline():
    assert sparkline([0, 1, 2, 4, 8], 10) == "▁▃▄▅█"
    assert sparkline([0, 0, 0], 10) == "▁▁▁"
    assert sparkline([0, 5, 10, 20, 40], 3) == "▄▅█"  # the last `width` points
    assert sparkline([1], 0) == "" and sparkline([], 5) == ""
    assert sparkline([1000, 1], 2)[1] == "▂"  # any use stays above the zero bar


def test_plain_line_and_summary():
    state = make_state()
    assert plain_line(state) == ("t=12.3s sent 3/32 | P used 40/127 blocked | D used 12/127 stepping"
                                 " | windows 1 drained 1 leak")
    summary = summary_text(state)
    assert summary.startswith("final t=12.3s")
    assert "window D 6.00s +2.50s: 8 used at start, never drained: leak" in summary
    assert "! connector worker of D (pid 4243) died" in summary


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
        state.windows.append(WindowVerdict("P", 9.0, 1.0, 0, 0.0, "drained"))
    assert "idle windows 3" in out.getvalue()  # the exit refresh drew the final state


class CountingView:
    """A LiveView stand-in: counts redraws."""

    def __init__(self) -> None:
        self.num_ticks = 0

    def tick(self, force: bool = False) -> None:
        self.num_ticks += 1


def test_serve_feed_applies_each_engines_newest_snapshot_once():
    state, view = DashboardState(), CountingView()
    monitor = ServeMonitor(state, view)
    server = SimpleNamespace(latest={"P": StatsSnapshot("P", 1, 1.0, "blocked", 10, 1, make_counts())})
    monitor.on_tick(server)
    monitor.on_tick(server)  # the same snapshot again: no second update, so no zero-time rate
    assert state.engines["P"].num_steps == 10 and len(state.engines["P"].used_history) == 1
    server.latest["P"] = StatsSnapshot("P", 2, 3.0, "polling", 50, 5, make_counts(num_used_blocks=7))
    monitor.on_tick(server)
    p = state.engines["P"]
    assert p.steps_per_s == pytest.approx(20.0) and list(p.used_history) == [40, 7]
    assert p.loop_state == "polling" and view.num_ticks == 3


def test_top_feed_applies_every_snapshot_in_order():
    state, view = DashboardState(), CountingView()
    ServeMonitor(state, view).on_snapshots([StatsSnapshot("D", 1, 1.0, "stepping", 0, 0, make_counts()),
                                            StatsSnapshot("D", 2, 2.0, "blocked", 30, 4, make_counts())])
    assert state.engines["D"].steps_per_s == pytest.approx(30.0) and view.num_ticks == 1


def test_replay_feed_copies_progress_errors_and_the_final_picture():
    state = DashboardState(progress=ReplayProgress("t.jsonl", num_total=2, duration_s=4.0, clock="wall"))
    view = CountingView()
    monitor = ReplayMonitor(state, view, VerifyOptions())
    records = {r: RequestRecord(r, t, t + 0.003, 0.003, None, None, 8, 0, 0, None)
               for r, t in (("r0", 0.0), ("r1", 0.5))}
    replay = SimpleNamespace(latest={}, requests=records, samples=[], arrivals=[0.0, 0.5], aborts=[],
                             target=SimpleNamespace(errors=[("D", "engine D died\ntraceback")]),
                             now=lambda: 1.5)
    monitor.on_tick(replay)
    monitor.on_tick(replay)  # nothing new: no second send, no repeated message
    assert state.progress.num_sent == 2 and state.progress.lateness_s == [0.003, 0.003]
    assert state.progress.trace_t == 1.5 and state.messages == ["D: engine D died"]
    final = SimpleNamespace(
        timeline=SimpleNamespace(samples=[EngineSample(t, "P", used, 0, 127 - used, 127, 0, 0, 0, 0, 0,
                                                       "blocked", 9, 2) for t, used in ((1.0, 5), (2.0, 0))],
                                 requests=list(records.values()), end_t=6.0),
        verdict=SimpleNamespace(windows=[IdleWindow("P", 3.0, 5.0, False, 12, 0.12, "drained", 0)]))
    monitor.show_final(final)
    assert state.engines["P"].counts["num_used_blocks"] == 0 and state.progress.trace_t == 6.0
    assert [w.verdict for w in state.windows] == ["drained"] and view.num_ticks == 2
