"""`kvdrain explain`: what verdicts, columns and units mean. Runs in: frontend process."""

from __future__ import annotations

import click

from replay.verify.verdict import EXIT_OK


def explain_main() -> int:
    """The glossary, printed."""
    from replay.verify.report import LEGEND

    click.echo(LEGEND)
    return EXIT_OK
