"""An interrupted `kvdrain replay`, as a user stops one: Ctrl-C (SIGINT) or SIGTERM while it
sends, SIGTERM while its engines start, `q` in the live view. Each run is a real
`python -m cli replay` process: one exit code (130, 143), one verdict line for the part
that ran, the report written, "stopping" shown before the engines are shut down."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
# Bursts of 4 every 2 s for 40 s: still sending whenever the signal lands.
TRACE = "".join(
    json.dumps({"t": 2.0 * (i // 4), "id": f"r{i}", "prompt_len": 32, "max_tokens": 4}) + "\n"
    for i in range(80)
)


class Replay:
    """`python -m cli replay TRACE --runner mock ...` with its output in a file."""

    def __init__(self, tmp_path: Path, *args: str, stdin: int | None = None) -> None:
        trace, self.report, self.log = (
            tmp_path / "trace.jsonl",
            tmp_path / "report.json",
            tmp_path / "out.txt",
        )
        trace.write_text(TRACE)
        env = dict(os.environ, PYTHONUNBUFFERED="1", KVDRAIN_RUN_ROOT=str(tmp_path))
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cli",
                    "replay",
                    str(trace),
                    "--runner",
                    "mock",
                    "--num-blocks",
                    "256",
                    "--idle-threshold",
                    "1",
                    "--drain-deadline",
                    "0.5",
                    "--report",
                    str(self.report),
                    *args,
                ],
                cwd=ROOT,
                stdin=stdin if stdin is not None else subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.output(), re.MULTILINE):
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode} first:\n{self.output()}"
            )
            assert time.monotonic() < deadline, f"no {pattern!r} in {timeout_s} s:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 60) -> tuple[int, str]:
        try:
            return self.proc.wait(timeout_s), self.output()
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def assert_one_verdict(output: str, status: str, code: int) -> str:
    assert "Traceback" not in output, output
    assert re.findall(r"\(exit (\d+)\)", output) == [str(code)], output  # no 3, then 130
    verdict = [line for line in output.splitlines() if line.startswith(f"{status}: ")]
    assert len(verdict) == 1, output
    assert output.index("stopping (") < output.index(verdict[0]), output
    return verdict[0]


def assert_report(replay: Replay, status: str, code: int, by: str) -> dict:
    report = json.loads(replay.report.read_text())
    assert (report["status"], report["exit_code"], report["interrupted"]) == (status, code, by)
    assert report["stop"]["by"] == by
    return report


@pytest.mark.parametrize(
    "sig,status,code", [(signal.SIGINT, "INTERRUPTED", 130), (signal.SIGTERM, "TERMINATED", 143)]
)
def test_a_signal_while_sending_is_one_exit_code_and_one_line_for_the_part_that_ran(
    tmp_path, sig, status, code
):
    replay = Replay(tmp_path)  # stdout not a terminal: the live view prints plain lines
    try:
        replay.wait_for(r"^t=\S+ sent [1-9]")
        replay.proc.send_signal(sig)
        returncode, output = replay.finish()
    finally:
        replay.kill()
    assert returncode == code, output
    line = assert_one_verdict(output, status, code)
    assert re.search(
        rf"by {sig.name} after \d+\.\d{{3}} s and \d+ of 80 requests: \d+ of \d+ reached "
        r"windows drained; \d+ not reached",
        line,
    ), line
    assert "stopped early" not in output and "not reached (first" not in output, output
    report = assert_report(replay, status.lower(), code, sig.name)
    assert 0 < report["stop"]["num_sent"] < 80


def test_sigterm_while_the_engines_start_writes_the_report_and_says_stopping(tmp_path):
    replay = Replay(tmp_path)  # the plain live view: each start-up phase is a line at once
    try:
        replay.wait_for(r"^(forecasting idle windows|starting engines)")
        replay.proc.send_signal(signal.SIGTERM)
        returncode, output = replay.finish()
    finally:
        replay.kill()
    assert returncode == 143, output
    line = assert_one_verdict(output, "TERMINATED", 143)
    assert "before any request was sent" in line, line
    assert assert_report(replay, "terminated", 143, "SIGTERM")["requests"]["num_requests"] == 0


def test_q_in_the_live_view_is_named_q_and_exits_130(tmp_path):
    leader, follower = pty.openpty()  # keys are read where stdin is a terminal
    replay = Replay(tmp_path, stdin=follower)
    try:
        os.close(follower)
        replay.wait_for(r"^t=\S+ sent [1-9]")
        os.write(leader, b"q")
        returncode, output = replay.finish()
    finally:
        replay.kill()
        os.close(leader)
    assert returncode == 130, output
    line = assert_one_verdict(output, "INTERRUPTED", 130)
    assert "by q after" in line and "SIGINT" not in output, output
    assert_report(replay, "interrupted", 130, "q")


def test_a_signal_while_the_trace_is_checked_still_writes_the_report(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import replay.pipeline
    from cli import cli

    real = replay.pipeline.validate_trace

    def signalled(*args, **kwargs):  # a real signal, as a user's, before anything started
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(replay.pipeline, "validate_trace", signalled)
    report, handler = tmp_path / "report.json", signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(ROOT / "examples" / "pd_idle.jsonl"),
            "--runner",
            "mock",
            "--no-live",
            "--report",
            str(report),
        ],
    )
    assert result.exit_code == 143, result.output
    assert result.output.startswith("stopping (SIGTERM)"), result.output
    assert "TERMINATED: by SIGTERM during start-up, before any request was sent" in result.output
    assert json.loads(report.read_text())["status"] == "terminated"
    assert signal.getsignal(signal.SIGTERM) is handler  # given back


def test_ctrl_c_before_the_verb_takes_over_its_signals_is_130_not_click_s_1(monkeypatch):
    from click.testing import CliRunner

    import replay.commands.replay
    from cli import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay.commands.replay, "replay_main", interrupted)
    result = CliRunner().invoke(
        cli, ["replay", str(ROOT / "examples" / "pd_idle.jsonl"), "--no-live"]
    )
    assert result.exit_code == 130, result.output
    assert "Aborted" not in result.output
