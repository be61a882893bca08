"""The kvdrain command line: thin click commands that parse, build configs and delegate. Runs in: frontend process."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdrain")
def cli() -> None:
    """kvdrain: replay traces against a miniature vLLM v1 engine and find KV-block leaks."""


if __name__ == "__main__":
    cli()
