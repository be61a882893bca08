"""One cell of a sweep run as a `kvdrain replay` process, and its report. Runs in: a sweep worker (this machine or a Ray node).

The replay runs in a process of its own (`python -m cli replay ... --clock virtual`), so
no state passes between cells, with PYTHONHASHSEED fixed: the same cell gives the same
report wherever it runs. The report is read back whole; its wall-time and host fields
(VOLATILE) are the only ones that differ between runs, so report_sha256 (of the rest)
names what the cell found.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CELL_TIMEOUT_S = 3600.0
VOLATILE = (("kvdrain", "date"), ("kvdrain", "host"), ("settings", "wall_s"))
MAX_OUTPUT_CHARS = 2000  # of a failed cell's output, kept for the error line


@dataclass(frozen=True, slots=True, kw_only=True)
class CellResult:
    """What one cell's replay gave: its exit status, its report (None: none written)."""

    exit_code: int
    report: dict | None
    wall_s: float
    host: str
    output: str = ""  # the end of its output, when it wrote no report


def run_cell(argv: list[str], timeout_s: float = CELL_TIMEOUT_S) -> CellResult:
    """`kvdrain replay ARGV --clock virtual --no-live --report ...` in a process of its own."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvdrain-sweep-") as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "cli", "replay", *argv]
        command += ["--clock", "virtual", "--no-live", "--report", str(report)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "COLUMNS": "100"}
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=timeout_s
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            code, output = -1, f"no verdict in {timeout_s:g} s"
        body = json.loads(report.read_text()) if report.is_file() else None
    return CellResult(
        exit_code=code,
        report=body,
        wall_s=time.monotonic() - started,
        host=socket.gethostname(),
        output="" if body is not None else output[-MAX_OUTPUT_CHARS:],
    )


def stable_digest(report: dict) -> str:
    """sha256 of the report without its VOLATILE fields, canonical JSON: equal for the
    same cell wherever and whenever it ran."""
    kept = json.loads(json.dumps(report))
    for outer, inner in VOLATILE:
        if isinstance(kept.get(outer), dict):
            kept[outer].pop(inner, None)
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
