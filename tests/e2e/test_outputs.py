"""A replay's output files (--report, --requests, --plot, --series) and its interrupted runs, from the command line."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import replay.commands.replay_run as commands
from tests.e2e.test_cli import EXAMPLE, Serve, invoke

VIRTUAL = ["--clock", "virtual", "--no-live"]


def _error_lines(output: str) -> list[str]:
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if line.startswith(("error:", "Error:"))]


def _nothing_runs(monkeypatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the replay ran")

    monkeypatch.setattr(commands, "prepare_replay", never)


@pytest.mark.parametrize("flag", ["--report", "--requests", "--series", "--plot"])
def test_an_output_in_a_missing_directory_is_exit_2_before_the_run(
    tmp_path: Path, monkeypatch, flag: str
):
    _nothing_runs(monkeypatch)
    result = invoke("replay", str(EXAMPLE), *VIRTUAL, flag, str(tmp_path / "no" / "out.png"))
    assert result.exit_code == 2, result.output
    [line] = _error_lines(result.output)
    assert line.startswith(f"error: {flag} ") and "no such directory" in line


def test_a_plot_not_named_png_and_an_output_that_is_a_directory_are_exit_2_before_the_run(
    tmp_path: Path, monkeypatch
):
    _nothing_runs(monkeypatch)
    plot = invoke("replay", str(EXAMPLE), *VIRTUAL, "--plot", str(tmp_path / "x.notpng"))
    assert plot.exit_code == 2 and "*.png" in _error_lines(plot.output)[0], plot.output
    folder = invoke("replay", str(EXAMPLE), *VIRTUAL, "--report", str(tmp_path))
    assert folder.exit_code == 2 and "is a directory" in _error_lines(folder.output)[0], (
        folder.output
    )


def test_a_write_that_fails_after_the_run_is_one_line_the_verdict_stands_and_the_rest_are_written(
    tmp_path: Path,
):
    """/dev/full passes the check (it is writable) and fails the write: one line naming
    the flag, the verdict's exit status (it printed VERIFIED, then exited 2), and every
    other output still written and said."""
    requests, plot, series = tmp_path / "r.jsonl", tmp_path / "p.png", tmp_path / "s.csv"
    result = invoke(
        "replay",
        str(EXAMPLE),
        *VIRTUAL,
        "--report",
        "/dev/full",
        "--requests",
        str(requests),
        "--plot",
        str(plot),
        "--series",
        str(series),
    )
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    [line] = _error_lines(result.output)
    assert line.startswith("error: --report /dev/full: not written: ")
    assert line.endswith("the verdict stands")
    assert len(requests.read_text().splitlines()) == 32 and series.stat().st_size > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    for path in (requests, plot, series):
        assert f"wrote {path}" in result.output


def test_a_plot_that_cannot_be_written_is_not_lost_silently(tmp_path: Path):
    full = tmp_path / "full.png"
    full.symlink_to("/dev/full")
    result = invoke("replay", str(EXAMPLE), *VIRTUAL, "--plot", str(full))
    assert result.exit_code == 0, result.output  # the verdict's; the failed write said
    [line] = _error_lines(result.output)
    assert line.startswith(f"error: --plot {full}: not written")


def test_every_output_written_is_said(tmp_path: Path):
    paths = {
        flag: tmp_path / name
        for flag, name in (
            ("--report", "r.json"),
            ("--requests", "q.jsonl"),
            ("--plot", "p.png"),
            ("--series", "s.csv"),
        )
    }
    result = invoke(
        "replay", str(EXAMPLE), *VIRTUAL, *[a for f, p in paths.items() for a in (f, str(p))]
    )
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("wrote ")] == [
        f"wrote {p}" for p in paths.values()
    ]


def _signal_at(owner: type, name: str, nth: int, signum: int, monkeypatch) -> None:
    """owner.name sends this process `signum` on its nth call (a real signal, as a user's)."""
    real, calls = getattr(owner, name), []

    def hooked(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signum)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, hooked)


def _assert_partial(result, report: Path, code: int, name: str) -> dict:
    assert result.exit_code == code, result.output
    assert f"by {name} after" in result.output, result.output
    data = json.loads(report.read_text())
    assert data["interrupted"] == name and f"wrote {report}" in result.output
    return data


def test_sigterm_of_a_virtual_replay_gives_a_partial_verdict_and_the_report(
    tmp_path: Path, monkeypatch
):
    from replay.sim.simulation import Simulation

    _signal_at(Simulation, "_on_record", 10, signal.SIGTERM, monkeypatch)
    report = tmp_path / "r.json"
    result = invoke("replay", str(EXAMPLE), *VIRTUAL, "--report", str(report))
    data = _assert_partial(result, report, 143, "SIGTERM")
    assert 0 < data["requests"]["num_requests"] < 32


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_of_an_http_replay_gives_a_partial_verdict_and_the_report(
    tmp_path: Path, monkeypatch
):
    from replay.target.client import HttpReplay

    _signal_at(HttpReplay, "_start", 5, signal.SIGINT, monkeypatch)
    serve = Serve("--http", "0")
    try:
        url = serve.wait_for(r"HTTP on (http://\S+)", 30).group(1)
        report = tmp_path / "r.json"
        result = invoke(
            "replay",
            str(EXAMPLE),
            "--target",
            url,
            "--metrics",
            f"{url}/metrics",
            "--speedup",
            "4",
            "--no-live",
            "--tail",
            "0.5",
            "--report",
            str(report),
        )
        data = _assert_partial(result, report, 130, "SIGINT")
        assert 0 < data["requests"]["num_requests"] < 32
    finally:
        assert serve.stop() == 0
