"""Timing fidelity: the virtual clock with a mock-runner calibration against the wall clock.

The bundled example replays in both clocks with the mock runner: the wall clock with
real engine processes (at 4x speed, so it takes seconds), the virtual clock with the
calibration `kvdrain calibrate --runner mock` measures here and now. Both must reach the
same verdict over the same idle windows, and every request must end at the same time
within 20%.

What is compared, and why it is robust: end times are seconds from the trace's origin,
so they are the trace's arrival times plus milliseconds of engine work. Below the wall
clock's own resolution a difference means nothing: on a shared 2-core machine a process
waits for a CPU at each wake-up, and a P/D request crosses five processes several
times. So a thread samples wake-up delays (sleep 2 ms, see how late it wakes) during
the wall run, and a slack of three times the worst one (at least MIN_SLACK_S) is allowed
beside the 20%; on a quiet machine that is a few tens of ms, so in practice only the
first burst's end times (under 0.3 s) are judged by it. If a wake-up took longer than
MAX_WAKEUP_DELAY_S the machine is too loaded to judge timing and the test says so
(skip) instead of failing at random. Measured: with 2 and 3 busy loops beside the
usual load, the worst wake-up was 38 and 42 ms and the worst end-time miss beyond 20%
9 and 72 ms.
"""

from __future__ import annotations

import threading
import time

import pytest

from cli import EXAMPLE
from engine.config import EngineConfig
from replay.commands.calibrate import CalibrateOptions, calibrate
from replay.pipeline import ReplayConfig, ReplayResult, run_replay
from replay.trace.shaping import ShapingOptions
from replay.verify.rules import VerifyOptions

SPEEDUP = 4.0  # the example's ~4 s gaps become ~1 s
IDLE_THRESHOLD_S = 0.5  # well inside those gaps
RELATIVE = 0.20
MIN_SLACK_S = 0.03
MAX_WAKEUP_DELAY_S = 0.15


class WakeupProbe:
    """A thread that sleeps 2 ms at a time and keeps the worst lateness of its wake-ups."""

    def __init__(self) -> None:
        self.worst_s = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            time.sleep(0.002)
            self.worst_s = max(self.worst_s, time.perf_counter() - start - 0.002)

    def __enter__(self) -> WakeupProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def replay(clock: str, **extra) -> ReplayResult:
    return run_replay(
        ReplayConfig(
            trace=EXAMPLE,
            clock=clock,
            topology="pd",
            engine=EngineConfig(runner="mock", num_blocks=512),
            shaping=ShapingOptions(speedup=SPEEDUP),
            tail_s=1.0,
            verify=VerifyOptions(IDLE_THRESHOLD_S, 0.25, 0 if clock == "virtual" else 2),
            **extra,
        )
    )


def windows(result: ReplayResult) -> list[tuple]:
    return [(w.engine, w.is_tail, w.verdict, w.start, w.end) for w in result.verdict.windows]


def close(wall_t: float, virtual_t: float, slack: float) -> bool:
    return abs(wall_t - virtual_t) <= RELATIVE * virtual_t + slack


@pytest.mark.slow
def test_virtual_clock_with_a_measured_mock_calibration_matches_the_wall_clock():
    calibration = calibrate(CalibrateOptions(runner="mock", num_reps=3))
    with WakeupProbe() as probe:
        wall = replay("wall")
    if probe.worst_s > MAX_WAKEUP_DELAY_S:
        pytest.skip(
            f"a wake-up was {probe.worst_s * 1e3:.0f} ms late during the wall-clock run: "
            f"this machine is too loaded to judge timing fidelity"
        )
    virtual = replay("virtual", calibration=calibration)
    slack = max(MIN_SLACK_S, 3 * probe.worst_s)

    assert (wall.verdict.ok, wall.verdict.exit_code) == (
        virtual.verdict.ok,
        virtual.verdict.exit_code,
    )
    assert [v.kind for v in wall.verdict.violations] == [v.kind for v in virtual.verdict.violations]
    w_windows, v_windows = windows(wall), windows(virtual)
    assert [w[:3] for w in w_windows] == [v[:3] for v in v_windows], (w_windows, v_windows)
    assert len(v_windows) == 2 * 4  # P and D: three gaps and the tail
    for w, v in zip(w_windows, v_windows):
        assert close(w[3], v[3], slack), (
            w,
            v,
        )  # a window starts when its burst's last request ends
        # and ends when the engine's next request reaches it (the wall's send, a little after
        # the arrival the virtual clock sends at; the tail: when observing stops)
        assert close(w[4], v[4], slack) or w[1]

    v_requests = {r.req_id: r for r in virtual.timeline.requests}
    assert sorted(v_requests) == sorted(r.req_id for r in wall.timeline.requests)
    table = [
        (r.req_id, round(r.end_t, 4), round(v_requests[r.req_id].end_t, 4))
        for r in wall.timeline.requests
    ]
    for r in wall.timeline.requests:
        v = v_requests[r.req_id]
        assert (r.finish_reason, r.num_output_tokens, r.output_digest) == (
            v.finish_reason,
            v.num_output_tokens,
            v.output_digest,
        )
        assert close(r.end_t, v.end_t, slack), (r.req_id, r.end_t, v.end_t, slack, table)
