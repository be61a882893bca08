"""A sweep's table: one row per cell out of its report, as CSV and as a plot. Runs in: frontend process.

Columns: the cell's index and axes, then what its report says (status, exit code, idle
windows judged and leaked, the most blocks a leaked window held, lease expiries, the
report's stable digest), then where and how long it ran (wall_s, host: the only columns
that differ between two runs of the same grid). Rows are in the grid's order.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from replay.sweep.cell import CellResult, stable_digest
from replay.sweep.spec import Cell

FOUND = (
    "status",
    "exit_code",
    "windows",
    "windows_leaked",
    "blocks_held",
    "expiries",
    "report_sha256",
)
WHERE = ("wall_s", "host")
MEASURES = ("blocks_held", "windows_leaked", "expiries")  # the plot's panels


def columns(axes: tuple[str, ...]) -> tuple[str, ...]:
    return ("cell", *axes, *FOUND, *WHERE)


def row_of(cell: Cell, result: CellResult, axes: tuple[str, ...]) -> dict:
    """One cell's row (its measures empty when it wrote no report)."""
    row = {"cell": cell.index, **{a: cell.label((a,)).partition("=")[2] for a in axes}}
    row |= dict.fromkeys(FOUND, "")
    report = result.report
    if report is not None:
        windows = report.get("windows", [])
        leaked = [w for w in windows if w["verdict"] in ("leak", "fault_leak")]
        row |= {
            "status": report["status"],
            "windows": len(windows),
            "windows_leaked": len(leaked),
            "blocks_held": max((w["num_blocks_held"] for w in leaked), default=0),
            "expiries": sum(e.get("num_expired") or 0 for e in report.get("engines", [])),
            "report_sha256": stable_digest(report)[:16],
        }
    row["exit_code"] = result.exit_code
    return row | {"wall_s": f"{result.wall_s:.2f}", "host": result.host}


def to_csv(rows: list[dict], axes: tuple[str, ...]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns(axes), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def to_text(rows: list[dict], axes: tuple[str, ...]) -> str:
    """The table for the terminal, columns aligned."""
    names = [c for c in columns(axes) if c != "report_sha256"]
    cells = [names] + [[str(r[c]) for c in names] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(names))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells)


def write_plot(path: Path, rows: list[dict], axes: tuple[str, ...], title: str) -> None:
    """One horizontal bar panel per measure, a bar per cell (matplotlib: the plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'kvdrain[plot]'") from None
    labels = [" ".join(f"{a}={r[a]}" for a in axes) or f"cell {r['cell']}" for r in rows]
    height = 1.0 + 0.28 * len(rows)
    figure, panels = plt.subplots(1, len(MEASURES), figsize=(14, height), sharey=True)
    for panel, measure in zip(panels, MEASURES):
        values = [r[measure] if r[measure] != "" else 0 for r in rows]
        panel.barh(
            range(len(rows)), values, color="#c0392b" if measure != "expiries" else "#7f8c8d"
        )
        panel.set_xlim(0, max([*values, 1]) * 1.05)
        panel.set_title(measure.replace("_", " "))
        panel.set_yticks(range(len(rows)), labels, fontsize=7)
        panel.invert_yaxis()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
