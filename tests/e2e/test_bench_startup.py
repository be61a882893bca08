"""bench/startup.py's run of the real CLI: a verdict after the first request is not a start-up failure."""

from __future__ import annotations

from tests.paths import ROOT


def test_an_inconclusive_run_still_counts_for_start_up(monkeypatch):
    """A run whose verdict is inconclusive (exit 3: here every request is ignored, for a
    pool of 4 blocks) or a violation (1) still started and sent its first request: one_run
    returns its phases (with a note, as for a fault) instead of aborting the benchmark."""
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.startup as startup

    args = startup.replay_args
    monkeypatch.setattr(startup, "replay_args", lambda runner: [*args(runner), "--num-blocks", "4"])
    marks, _ = startup.one_run("mock")
    assert "first request" in marks and 0 < marks["first request"] < 120
