"""`kvdrain inspect`: a trace, and a dry run of its replay. Runs in: frontend process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from replay.commands.groups import IDLE_THRESHOLD, TraceInput
from replay.commands.options import OptionGroup
from replay.verify.verdict import EXIT_OK, EXIT_USAGE


@dataclass(frozen=True, slots=True, kw_only=True)
class DryRun:
    """What inspect checks the trace against: replay's own settings."""

    idle_threshold_s: float
    max_model_len: int | None
    tail_s: float


DRY_RUN = OptionGroup(
    "Dry run (replay's settings)",
    "dry_run",
    (
        click.option(
            "--idle-threshold",
            "idle_threshold_s",
            type=IDLE_THRESHOLD,
            default=1.0,
            show_default=True,
            help="Count gaps between arrivals at least this "
            "long (seconds), as replay's --idle-threshold.",
        ),
        click.option(
            "--max-model-len",
            type=click.IntRange(1),
            default=None,
            help="Check prompts against this [default: a wall and a virtual replay's own].",
        ),
        click.option(
            "--tail",
            "tail_s",
            type=click.FloatRange(min=0, min_open=True),
            default=2.0,
            show_default=True,
            help="The replay's tail, for how long a wall replay takes.",
        ),
    ),
    build=DryRun,
)


def inspect_main(trace: Path, trace_input: TraceInput, shaping, dry_run: DryRun) -> int:
    """The inspection printed; exit 2 for a trace replay would stop at (bad lines too,
    unless --skip-bad-lines)."""
    from replay.trace.inspect import bad_line_lines, format_inspection, inspect_trace
    from replay.trace.reader import TraceError

    try:
        insp = inspect_trace(
            trace,
            trace_input.fmt,
            dry_run.idle_threshold_s,
            shaping,
            dry_run.max_model_len,
            dry_run.tail_s,
        )
    except (TraceError, ValueError) as e:  # a data error: one line, as replay prints it
        click.echo(f"error: {e}", err=True)
        return EXIT_USAGE
    for line in format_inspection(insp):
        click.echo(line)
    for line in bad_line_lines(insp):
        click.echo(line, err=not trace_input.skip_bad_lines)
    if insp.num_bad_lines and not trace_input.skip_bad_lines:
        click.echo(
            f"error: {insp.num_bad_lines:,} bad lines: replay stops at the first "
            f"(--skip-bad-lines skips and counts them)",
            err=True,
        )
        return EXIT_USAGE
    return EXIT_OK
