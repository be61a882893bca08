"""A server that restarts in its idle windows is not one that drains: a /metrics whose
counters go back, or whose process_start_time_seconds changes, inside a window is an engine
that died and came back. The run is a fault naming it, and that window is never drained."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from aiohttp import web

from replay.trace.records import TraceRequest
from replay.verify.outcome import http_verdict
from replay.verify.rules import VerifyOptions, verify
from tests.http_utils import serving_in_thread
from tests.replay.target.test_hostile_server import LeakyPD, invoke_replay, replay_against

pytestmark = pytest.mark.timeout(90)

RESTART_MODES = ("restart", "counters", "process")


class RestartingPD(LeakyPD):
    """LeakyPD whose P leaks 8 blocks, but which looks freshly restarted 0.2 s into each
    idle window: usage 0, and (mode "restart") its counters back to 0 and a new
    process_start_time_seconds, or only the counters ("counters"), or only the start
    time ("process": another process behind the same URL, its counters higher)."""

    def __init__(self, mode: str) -> None:
        super().__init__(delay_s=0.0, busy_s=0.3)
        self.mode = mode
        self.started = 1_765_000_000.0
        self.num_steps = self.num_success = 0
        self.ended_at: float | None = None  # the last request's end, until a restart

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.ended_at = None
        self.num_steps += 10
        try:
            return await super().completions(request)
        finally:
            self.num_success += 1
            self.ended_at = time.monotonic()

    def _restart_if_idle(self) -> None:
        if self.ended_at is None or time.monotonic() - self.ended_at < 0.2:
            return
        self.ended_at, self.has_run = None, False
        if self.mode in ("restart", "counters"):
            self.num_steps = self.num_success = 0
        else:
            self.num_steps += 1000
        if self.mode in ("restart", "process"):
            self.started += 7.0

    async def metrics(self, request: web.Request) -> web.Response:
        self._restart_if_idle()
        response = await super().metrics(request)
        counters = "".join(
            f'kvdrain:engine_steps_total{{engine="{e}"}} {self.num_steps}\n'
            f'vllm:request_success_total{{engine="{e}",finished_reason="length",'
            f'model_name="m"}} {self.num_success}\n'
            for e in ("P", "D")
        )
        start = f"process_start_time_seconds {self.started}\n"
        return web.Response(text=response.text + counters + start)


TRACE = [TraceRequest(0.0, "a", 2, 1), TraceRequest(2.5, "b", 2, 1)]
OPTIONS = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5)


@pytest.mark.parametrize("mode", RESTART_MODES)
def test_a_server_that_restarts_in_its_idle_windows_is_a_fault_never_drained(mode: str):
    timeline = replay_against(RestartingPD(mode).app(), TRACE, tail_s=2.0, scrape_interval_s=0.05)
    verdict = verify(timeline, [], OPTIONS)
    status, _ = http_verdict(timeline, verdict)
    assert status == "fault", (status, verdict.windows)
    restarts = [f for f in verdict.faults if f["kind"] == "restarted"]
    assert {f["engine"] for f in restarts} == {"P", "D"}
    assert "restarted between" in restarts[0]["cause"]
    assert "drained" not in [w.verdict for w in verdict.windows if w.engine == "P"]


def test_the_same_server_without_restarts_is_a_violation():
    """The control: P's leak is seen once nothing resets it."""
    timeline = replay_against(LeakyPD(0.0, 0.3).app(), TRACE, tail_s=2.0, scrape_interval_s=0.05)
    verdict = verify(timeline, [], OPTIONS)
    assert verdict.status == "violation" and not verdict.faults


def test_a_restart_ends_the_replay_with_exit_4_naming_the_engine_and_when(tmp_path: Path):
    with serving_in_thread(RestartingPD("restart").app()) as url:
        result = invoke_replay(
            url,
            tmp_path,
            "--metrics",
            url + "/metrics",
            "--tail",
            "1.5",
            "--scrape-interval",
            "0.05",
        )
    assert result.exit_code == 4, result.output
    assert "FAULT" in result.output and "VERIFIED" not in result.output
    assert "fault: P: " in result.output and "restarted between" in result.output
