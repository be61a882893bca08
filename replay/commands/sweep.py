"""`kvdrain sweep SPEC`: a grid of virtual replays, one table out. Runs in: frontend process.

The spec (replay/sweep/spec.py) is read and every cell's options checked before any
runs (a bad one: exit 2); the cells run on this machine's cores or on a Ray cluster
(replay/sweep/executors.py), each line said as it comes back; the table is printed and
written as CSV (and a PNG with --plot). Exit 0 when every cell came back with a report,
whatever its verdict; 2 when the spec is bad or a cell could not run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
from rich.markup import escape

from replay.sweep.cell import CellResult
from replay.sweep.executors import run_locally, run_on_ray
from replay.sweep.spec import Cell, SpecError, SweepSpec, load_spec
from replay.sweep.table import row_of, to_csv, to_text, write_plot
from replay.verify.verdict import EXIT_OK, EXIT_USAGE


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepOptions:
    spec: Path
    csv: Path  # the table
    plot: Path | None = None
    workers: int | None = None  # cells at once on this machine (None: its cores)
    ray_address: str | None = None  # run on this Ray cluster instead


def sweep_cli_main(
    replay_cmd: click.Command,
    spec: Path,
    csv_path: Path | None,
    plot: Path | None,
    workers: int | None,
    ray_address: str | None,
    console,
) -> int:
    """`kvdrain sweep`'s options, each cell checked as `kvdrain replay` (replay_cmd) parses."""
    options = SweepOptions(
        spec=spec,
        csv=csv_path or spec.with_suffix(".csv"),
        plot=plot,
        workers=workers,
        ray_address=ray_address,
    )
    return sweep_main(options, replay_option_names(replay_cmd), _replay_check(replay_cmd), console)


def replay_option_names(replay_cmd: click.Command) -> frozenset[str]:
    return frozenset(
        opt.removeprefix("--")
        for param in replay_cmd.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
        if opt.startswith("--")
    )


def _replay_check(replay_cmd: click.Command) -> Callable[[list[str]], None]:
    def check(argv: list[str]) -> None:
        """A ValueError saying what `kvdrain replay` would refuse in these arguments."""
        try:
            replay_cmd.make_context("replay", [*argv, "--clock", "virtual", "--no-live"])
        except click.ClickException as e:
            raise ValueError(f"kvdrain replay {' '.join(argv)}: {e.format_message()}") from None

    return check


def sweep_main(
    options: SweepOptions,
    option_names: frozenset[str],
    check_argv: Callable[[list[str]], None],
    console,
) -> int:
    """check_argv: raises ValueError when `kvdrain replay` would refuse a cell's options."""
    try:
        spec = load_spec(options.spec, option_names)
        cells = spec.cells()
        for cell in cells:
            check_argv(cell.argv())
    except (SpecError, ValueError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return EXIT_USAGE
    where = f"Ray at {options.ray_address}" if options.ray_address else "this machine"
    console.print(f"sweep: {len(cells)} cells on {where}", highlight=False)
    started = time.monotonic()
    try:
        results = _run(cells, options, _say_each(console, spec))
    except RuntimeError as e:  # --ray without Ray
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return EXIT_USAGE
    return _table(spec, cells, results, options, console, time.monotonic() - started)


def _run(cells: list[Cell], options: SweepOptions, on_done) -> list[CellResult]:
    if options.ray_address is not None:
        return run_on_ray(cells, options.ray_address, on_done)
    return run_locally(cells, options.workers, on_done)


def _say_each(console, spec: SweepSpec):
    def said(cell: Cell, result: CellResult) -> None:
        status = result.report["status"] if result.report else "no report"
        line = f"  cell {cell.index}: {cell.label(spec.axes)}: {status} ({result.wall_s:.1f} s)"
        console.print(escape(line), highlight=False, soft_wrap=True)

    return said


def _table(
    spec: SweepSpec,
    cells: list[Cell],
    results: list[CellResult],
    options: SweepOptions,
    console,
    wall_s: float,
) -> int:
    rows = [row_of(cell, result, spec.axes) for cell, result in zip(cells, results)]
    console.print(escape(to_text(rows, spec.axes)), highlight=False, soft_wrap=True)
    options.csv.write_text(to_csv(rows, spec.axes))
    console.print(f"wrote {options.csv}", highlight=False, soft_wrap=True)
    if options.plot is not None:
        title = f"kvdrain sweep {spec.path.name}: {len(cells)} cells"
        write_plot(options.plot, rows, spec.axes, title)
        console.print(f"wrote {options.plot}", highlight=False, soft_wrap=True)
    failed = [(c, r) for c, r in zip(cells, results) if r.report is None]
    for cell, result in failed[:3]:
        tail = result.output.strip().splitlines()[-1:] or ["no output"]
        console.print(
            f"[red]error:[/] cell {cell.index} wrote no report: {escape(tail[0])}",
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"sweep: {len(cells)} cells in {wall_s:.1f} s", highlight=False)
    return EXIT_USAGE if failed else EXIT_OK
