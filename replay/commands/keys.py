"""`kvdrain keys`: CURVE key pairs for a serve and its clients. Runs in: frontend process."""

from __future__ import annotations

from pathlib import Path

import click

from replay.verify.verdict import EXIT_OK


def keys_main(directory: Path) -> int:
    """Each key file written, one path a line; a usage error if the directory cannot
    hold them."""
    from replay.serve.auth import AuthError, generate_keys

    try:
        for path in generate_keys(directory):
            click.echo(str(path))
    except (AuthError, OSError) as e:
        raise click.UsageError(str(e)) from None
    return EXIT_OK
