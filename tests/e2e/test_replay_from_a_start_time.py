"""`--start` keeps a clean run clean, in both clocks.

Reported: eight requests at t=45.0-50.3, `replay FILE --start 40` said "1 not reached
(the tail: the replay stopped before it ended)", exit 3, three runs of three, while
`--start 0` and the virtual clock verified: the run's last arrival (50.3 - 40 =
10.299999999999997 s) was compared with the model's tail (10.3 s, off its integer clock).
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
            json.dumps({"t": t, "id": f"r{i}", "prompt_len": 64, "max_tokens": 4}) + "\n"
            for i, t in enumerate((45.0, 45.2, 45.5, 45.9, 50.0, 50.1, 50.2, 50.3))
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
