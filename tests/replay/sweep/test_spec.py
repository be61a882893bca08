"""A sweep's spec: replay options as TOML, lists as axes, cells in the file's order; keys
the sweep sets itself or replay does not know are refused before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.sweep.cell import CellResult, stable_digest
from replay.sweep.spec import SpecError, load_spec
from replay.sweep.table import row_of, to_csv

NAMES = frozenset(("liveness", "kv-lease-s", "max-requests", "drop-read-done", "insert-idle-at"))


def spec_at(tmp_path: Path, text: str) -> Path:
    (tmp_path / "a.jsonl").write_text('{"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 2}\n')
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_lists_are_axes_and_cells_run_the_first_key_outermost(tmp_path: Path):
    spec = load_spec(
        spec_at(
            tmp_path,
            'trace = "a.jsonl"\nliveness = ["legacy", "event"]\nkv_lease_s = [5, 30.5]\n'
            "max-requests = 8\ndrop-read-done = true\ninsert-idle-at = [[1.0, 2.0]]\n",
        ),
        NAMES,
    )
    assert spec.axes == ("liveness", "kv-lease-s")
    cells = spec.cells()
    assert [c.label(spec.axes) for c in cells] == [
        "liveness=legacy kv-lease-s=5",
        "liveness=legacy kv-lease-s=30.5",
        "liveness=event kv-lease-s=5",
        "liveness=event kv-lease-s=30.5",
    ]
    trace = str((tmp_path / "a.jsonl").resolve())  # relative to the spec file
    assert cells[1].argv() == [
        trace, "--liveness", "legacy", "--kv-lease-s", "30.5", "--max-requests", "8",
        "--drop-read-done", "--insert-idle-at", "1.0", "--insert-idle-at", "2.0",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text,why",
    [
        ('liveness = ["legacy"]\n', "no `trace`"),
        ('trace = "nope.jsonl"\n', "no such file"),
        ('trace = "a.jsonl"\nclock = "wall"\n', "the sweep sets it"),
        ('trace = "a.jsonl"\nreport = "r.json"\n', "the sweep sets it"),
        ('trace = "a.jsonl"\nspeed = 2\n', "not a `kvdrain replay` option"),
        ('trace = "a.jsonl"\nliveness = []\n', "an empty list"),
        ('trace = "a.jsonl"\nkv_lease_s = 1\nkv-lease-s = 2\n', "named twice"),
        ('trace = "a.jsonl"\nliveness = {a = 1}\n', "not a string, number or boolean"),
        ("trace = \n", "sweep.toml"),
    ],
)
def test_a_spec_that_cannot_make_a_grid_is_refused_saying_why(tmp_path: Path, text, why):
    with pytest.raises(SpecError, match=why):
        load_spec(spec_at(tmp_path, text), NAMES)


REPORT = {
    "status": "violation",
    "kvdrain": {"version": "0.1.0", "date": "2026-12-05T00:00:00+00:00", "host": "a"},
    "settings": {"wall_s": 1.5, "trace": "/t.jsonl"},
    "windows": [
        {"verdict": "leak", "num_blocks_held": 15},
        {"verdict": "leak", "num_blocks_held": 18},
        {"verdict": "drained", "num_blocks_held": 0},
    ],
    "engines": [{"num_expired": 2}, {"num_expired": None}],
}


def test_a_row_counts_leaked_windows_held_blocks_and_expiries_and_ignores_where_it_ran(
    tmp_path: Path,
):
    spec = load_spec(
        spec_at(tmp_path, 'trace = "a.jsonl"\nliveness = ["legacy", "event"]\n'), NAMES
    )
    cell = spec.cells()[0]
    here = CellResult(exit_code=1, report=REPORT, wall_s=1.0, host="a")
    moved = {
        **REPORT,
        "kvdrain": {**REPORT["kvdrain"], "date": "2027-01-01T00:00:00+00:00", "host": "b"},
        "settings": {**REPORT["settings"], "wall_s": 9.0},
    }
    there = CellResult(exit_code=1, report=moved, wall_s=9.0, host="b")
    row = row_of(cell, here, spec.axes)
    assert row | {"report_sha256": ""} == {
        "cell": 0, "liveness": "legacy", "status": "violation", "exit_code": 1, "windows": 3,
        "windows_leaked": 2, "blocks_held": 18, "expiries": 2, "report_sha256": "",
        "wall_s": "1.00", "host": "a",
    }  # fmt: skip
    assert stable_digest(REPORT) == stable_digest(moved)
    assert stable_digest(REPORT) != stable_digest({**REPORT, "status": "verified"})
    far = to_csv([row_of(cell, there, spec.axes)], spec.axes)
    near = to_csv([row], spec.axes)
    assert near.splitlines()[0].endswith(",report_sha256,wall_s,host")
    assert [line.rsplit(",", 2)[0] for line in near.splitlines()] == [
        line.rsplit(",", 2)[0] for line in far.splitlines()
    ]
