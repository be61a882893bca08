"""Every exit code of replay and top, from the command line: one line of error, no traceback.

0, 1 and 3 come from verdicts (tests/replay/verify/test_verdict.py, tests/e2e/test_cli.py); here: 2 for
usage and unreachable targets, 3 for ignored requests from the CLI, 4 for a dead engine
or a serve that went silent, 130 for Ctrl-C.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner

import replay.serve.client as serve_client
from cli import EXAMPLE, cli
from engine.proc.client import EngineDeadError
from engine.proc.messages import GetStats
from replay.pipeline import PreparedReplay
from replay.serve.messages import ServeInfo, decode, encode

FAST = ["--runner", "mock", "--no-live"]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _one_error_line(output: str) -> None:
    assert "Traceback" not in output
    assert (
        sum(line.startswith("error:") or line.startswith("Error:") for line in output.splitlines())
        == 1
    ), output


def test_target_forms_and_options_that_do_not_apply_are_usage_errors():
    for bad in ("127.0.0.1", "localhost:port", "ftp://h:1", ":5"):
        result = invoke("replay", str(EXAMPLE), "--target", bad, *FAST)
        assert result.exit_code == 2 and "--target" in result.output, (bad, result.output)
    for option in (
        ["--liveness", "legacy"],
        ["--num-blocks", "64"],
        ["--runner", "torch"],
        ["--topology", "single"],
        ["--deployment", "llama3-8b-h100"],
    ):
        result = invoke("replay", str(EXAMPLE), "--target", "127.0.0.1:1", "--no-live", *option)
        assert result.exit_code == 2, result.output
        assert "does not apply with --target" in result.output and option[0] in result.output
    old = invoke("replay", str(EXAMPLE), "--target", "127.0.0.1:1", "--profile", "llama3-8b-h100")
    assert old.exit_code == 2 and "--deployment: does not apply with --target" in old.output
    result = invoke("replay", str(EXAMPLE), "--target", "127.0.0.1:1", "--clock", "virtual")
    assert result.exit_code == 2 and "--clock virtual" in result.output


@pytest.mark.slow  # waits out the 5 s connect timeout twice
def test_unreachable_target_is_exit_2_for_replay_and_top():
    for args in (
        ["replay", str(EXAMPLE), "--target", "127.0.0.1:1", "--no-live"],
        ["replay", str(EXAMPLE), "--target", "tcp://127.0.0.1:1", "--no-live"],
        ["top", "--connect", "tcp://127.0.0.1:1", "--seconds", "1"],
    ):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        _one_error_line(result.output)
        assert "no kvdrain serve answered at tcp://127.0.0.1:1" in result.output
        assert (
            "replay --target http://127.0.0.1:1, top --metrics http://127.0.0.1:1/metrics"
            in result.output
        )


def test_ignored_requests_make_the_cli_inconclusive(tmp_path: Path):
    # 4 of the example's 32 requests can never fit a 16-block pool (prompts of up to 294
    # tokens): exit 3, each cause counted; --allow-ignored gives the drain verdict back.
    report = tmp_path / "r.json"
    args = [
        "replay",
        str(EXAMPLE),
        "--clock",
        "virtual",
        "--num-blocks",
        "17",
        "--report",
        str(report),
        *FAST,
    ]
    result = invoke(*args)
    data = json.loads(report.read_text())
    assert result.exit_code == 3 and data["status"] == "inconclusive", result.output
    assert data["ignored"] == {"can never fit the KV pool": data["requests"]["num_ignored"]}
    assert data["requests"]["num_ignored"] > 0 and "INCONCLUSIVE" in result.output
    assert "can never fit the KV pool" in result.output
    allowed = invoke(*args, "--allow-ignored")
    assert allowed.exit_code == 0, allowed.output


def test_a_dead_engine_is_exit_4_and_ctrl_c_is_130(monkeypatch):
    def dead(*args, **kwargs):
        raise EngineDeadError("P", "engine P died (exit code -9)")

    monkeypatch.setattr(PreparedReplay, "run", dead)
    result = invoke("replay", str(EXAMPLE), "--clock", "virtual", *FAST)
    assert result.exit_code == 4 and "fault: engine P died" in result.output
    _one_error_line(result.output)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreparedReplay, "run", interrupted)
    assert invoke("replay", str(EXAMPLE), "--clock", "virtual", *FAST).exit_code == 130


class SilentServe:
    """Answers each client's first GetStats with a ServeInfo, then nothing (a serve that hung)."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        answered: set[bytes] = set()
        while not self.stop.is_set():
            if self.socket.poll(20):
                identity, frame = self.socket.recv_multipart()
                if isinstance(decode(frame), GetStats) and identity not in answered:
                    info = ServeInfo(["P", "D"], "pd", "event", 512, 16, "mock", 4096, 512, "tiny")
                    self.socket.send_multipart([identity, encode(info)])
                    answered.add(identity)
        self.socket.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_a_serve_that_goes_silent_is_a_named_fault(monkeypatch):
    monkeypatch.setattr(serve_client, "LOST_AFTER_S", 0.5)
    serve = SilentServe()
    try:
        result = invoke(
            "replay", str(EXAMPLE), "--target", serve.address.removeprefix("tcp://"), "--no-live"
        )
        assert result.exit_code == 4, result.output
        assert "stopped answering" in result.output
        _one_error_line(result.output)
        top = invoke("top", "--connect", serve.address, "--seconds", "30")
        assert top.exit_code == 4 and "disconnected" in top.output, top.output
    finally:
        serve.close()


@pytest.mark.slow
@pytest.mark.parametrize("liveness,allowed", [("legacy", {1, 3}), ("event", {0, 3})])
def test_wall_replay_beside_a_cpu_hog_is_never_falsely_verified(liveness, allowed, tmp_path):
    # Two bounded spinning children take the CPUs the engines need; the engines lag. The
    # verdict may become inconclusive (a window not observed), but legacy's leak is never
    # VERIFIED and event's drain is never a violation.
    import subprocess
    import sys

    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    report = tmp_path / "r.json"
    try:
        result = invoke(
            "replay",
            str(EXAMPLE),
            "--liveness",
            liveness,
            "--speedup",
            "4",
            "--max-requests",
            "16",
            "--pull-delay-ms",
            "200",
            "--num-blocks",
            "256",
            "--report",
            str(report),
            *FAST,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)
    data = json.loads(report.read_text())
    assert result.exit_code in allowed, result.output
    assert data["exit_code"] == result.exit_code
    if result.exit_code == 3:
        assert data["reasons"] and "INCONCLUSIVE" in result.output
