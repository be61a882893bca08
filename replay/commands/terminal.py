"""What the verbs print alike: an error line, no live view. Runs in: frontend process."""

from __future__ import annotations

from rich.markup import escape


def print_error(console, error: object) -> None:
    """One unwrapped line, so a file:line stays whole for editors and grep; the error's
    text is never markup (it may quote a server)."""
    console.print(f"[red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)


class NoView:
    """--no-live: no dashboard at all, only the final summary (and notes on the way)."""

    def __init__(self, console) -> None:
        self.console = console

    def __enter__(self) -> NoView:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    quit_requested = False

    def tick(self, force: bool = False) -> None:
        return None
