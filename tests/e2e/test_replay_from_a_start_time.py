"""`--start` keeps a clean run clean, in both clocks.

Reported: four requests at t=45 and four at t=50, `replay FILE --runner mock --start 40`
said "expected window not reached: the tail: the replay stopped before it ended", exit 3,
while `--start 0` and the virtual clock verified. At this tree it verifies in both clocks;
these tests hold it there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import ROOT


def _trace(tmp_path):
    path = tmp_path / "start.jsonl"
    path.write_text(
        "".join(
            json.dumps({"t": t, "id": f"r{t}-{i}", "prompt_len": 64, "max_tokens": 4}) + "\n"
            for t in (45, 50)
            for i in range(4)
        )
    )
    return path


@pytest.mark.parametrize("clock", ["virtual", pytest.param("wall", marks=pytest.mark.slow)])
def test_a_replay_from_start_40_verifies_both_windows_of_a_trace_that_begins_at_45(tmp_path, clock):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "replay",
            str(_trace(tmp_path)),
            "--clock",
            clock,
            "--runner",
            "mock",
            "--start",
            "40",
            "--no-live",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 of 2 expected observed" in done.stdout
