"""`kvdrain sweep SPEC` on this machine's cores and on a local Ray cluster: one row per
cell, each cell's report the same wherever it ran (byte-identical tables but for
wall_s and host); a bad cell refused before any runs. The Ray test skips without Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import cli

pytestmark = pytest.mark.timeout(180)
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pd_idle.jsonl"
GRID = f'trace = "{EXAMPLE}"\nliveness = ["legacy", "event"]\nmax-requests = 12\n'


def sweep(tmp_path: Path, *args: str, text: str = GRID):
    spec = tmp_path / "grid.toml"
    spec.write_text(text)
    return CliRunner().invoke(cli, ["sweep", str(spec), *args], catch_exceptions=False)


def without_where(csv: str) -> list[str]:
    """The table's lines less their last two columns (wall_s, host)."""
    return [line.rsplit(",", 2)[0] for line in csv.splitlines()]


def test_a_sweep_on_this_machine_gives_one_row_per_cell_the_same_for_the_same_cell(
    tmp_path: Path,
):
    """Cells 0 and 2 are the same cell, run by two replay processes at once."""
    grid = GRID.replace('"event"]', '"event", "legacy"]')
    result = sweep(tmp_path, "--workers", "3", "--plot", str(tmp_path / "grid.png"), text=grid)
    assert result.exit_code == 0, result.output
    lines = without_where((tmp_path / "grid.csv").read_text())
    assert lines[0] == (
        "cell,liveness,status,exit_code,windows,windows_leaked,blocks_held,expiries,report_sha256"
    )
    assert lines[1].startswith("0,legacy,violation,1,") and lines[2].startswith(
        "1,event,verified,0,"
    )
    assert lines[3].partition(",")[2] == lines[1].partition(",")[2]
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_a_cell_replay_would_refuse_is_a_usage_error_before_any_runs(tmp_path: Path):
    result = sweep(tmp_path, text=GRID.replace('"event"', '"sometimes"'))
    assert result.exit_code == 2 and "sometimes" in result.output
    assert "cells on" not in result.output and not (tmp_path / "grid.csv").exists()


@pytest.mark.ray
def test_a_sweep_on_a_local_ray_gives_the_same_table_as_on_this_machine(tmp_path: Path):
    ray = pytest.importorskip("ray", reason="no Ray here: `make ray` installs it")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        address = ray.get_runtime_context().gcs_address
        spec = tmp_path / "grid.toml"
        spec.write_text(GRID)
        on_ray = subprocess.run(
            [sys.executable, "-m", "cli", "sweep", str(spec), "--ray", address,
             "--csv", str(tmp_path / "ray.csv")],
            capture_output=True, text=True, timeout=150,
        )  # fmt: skip
    finally:
        ray.shutdown()
    assert on_ray.returncode == 0, on_ray.stdout + on_ray.stderr
    assert f"on Ray at {address}" in on_ray.stdout
    here = sweep(tmp_path, "--csv", str(tmp_path / "here.csv"))
    assert here.exit_code == 0, here.output
    ray_table = without_where((tmp_path / "ray.csv").read_text())
    assert ray_table == without_where((tmp_path / "here.csv").read_text())
