"""Two replays against one `kvdrain serve`: each says the serve is shared, neither blames the other's blocks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay.verify.verdict import EXIT_INCONCLUSIVE
from tests.paths import ROOT


def _trace(path: Path, lines: list[tuple[float, str]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"t": t, "id": req_id, "prompt_len": 48, "max_tokens": 8}) + "\n"
            for t, req_id in lines
        )
    )
    return path


def _every_3_s(path: Path) -> Path:
    """Five bursts of five requests, 3 s apart: idle windows of about 2.7 s."""
    return _trace(
        path, [(round(3.0 * b + 0.05 * i, 3), f"a{b}-{i}") for b in range(5) for i in range(5)]
    )


def _one_burst(path: Path) -> Path:
    """30 requests over 1.5 s: longer than any burst of the other, so it meets one of its
    idle windows; and its own tail (3 s) meets one of the other's bursts."""
    return _trace(path, [(round(0.05 * i, 3), f"b{i}") for i in range(30)])


def _address(serve: subprocess.Popen, timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = serve.stdout.readline()
        if not line:
            break
        if m := re.search(r"tcp://127\.0\.0\.1:\d+", line):
            return m.group(0)
    raise AssertionError("the serve printed no address")


def _replay(trace: Path, address: str, report: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "replay",
            str(trace),
            "--target",
            address,
            "--report",
            str(report),
            "--tail",
            "4",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_two_replays_against_one_serve_each_name_the_other_and_blame_no_leak(tmp_path):
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "256",
            "--pull-delay-ms",
            "100",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    replays: list[subprocess.Popen] = []
    try:
        address = _address(serve)
        first = _replay(_every_3_s(tmp_path / "a.jsonl"), address, tmp_path / "a.json")
        replays.append(first)
        while not re.search(r"sent [1-9]", first.stdout.readline() or "sent 1"):
            pass  # the first replay is sending: the second runs inside it
        replays.append(_replay(_one_burst(tmp_path / "b.jsonl"), address, tmp_path / "b.json"))
        outs = [p.communicate(timeout=180)[0] for p in replays]
    finally:
        for p in replays:
            if p.poll() is None:
                p.kill()
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)
    for p, out, name in zip(replays, outs, ("a", "b")):
        assert p.returncode == EXIT_INCONCLUSIVE, out  # another client is not a dead engine
        assert "the serve is shared" in out, out
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["faults"] == [] and report["status"] == "inconclusive"
        assert any(r.startswith("shared: ") for r in report["reasons"]), report["reasons"]
        assert not [v for v in report["violations"] if v["kind"] == "leak"], out
