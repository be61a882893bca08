"""`--async-scheduling` on the command line: the replay's verdicts keep their meaning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import EXAMPLE, cli

FAST = ["--runner", "mock", "--num-blocks", "256", "--no-live"]


@pytest.mark.parametrize("liveness,code", [("legacy", 1), ("poll", 0), ("event", 0)])
def test_virtual_replay_verdicts_with_async_scheduling(liveness: str, code: int, tmp_path: Path):
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(EXAMPLE),
            "--clock",
            "virtual",
            "--liveness",
            liveness,
            "--async-scheduling",
            "--report",
            str(report),
            *FAST,
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == code, result.output
    assert json.loads(report.read_text())["settings"]["engine"]["async_scheduling"] is True
