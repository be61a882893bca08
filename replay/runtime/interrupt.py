"""Stopping a run on Ctrl-C, SIGTERM or the live view's `q` the same way: one exception, later signals noted. Runs in: frontend process.

Inside `interruptible()`, the first SIGINT or SIGTERM raises Interrupted in the main
thread (as Ctrl-C's KeyboardInterrupt does), so the run stops sending where it is and
its `finally` blocks shut the engines down and remove the run directory; `on_stop`
hears it first, so "stopping..." is on the screen while they do. The live view's `q`
raises the same Interrupted, named `q`. Signals that arrive after the first are only
counted: the shutdown they would cut short is bounded anyway. The exit status
(replay/verify/verdict.py's table) is the shell's 128 + signal number: 130
(interrupted) for Ctrl-C and `q`, 143 (terminated) for SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

from replay.verify.verdict import EXIT_INTERRUPTED, EXIT_TERMINATED

SIGNALS = (signal.SIGINT, signal.SIGTERM)
QUIT_KEY = "q"  # the live view's key: stops the run as Ctrl-C does


class Interrupted(BaseException):
    """A stop asked for by a signal or by `q`; BaseException like KeyboardInterrupt, so
    `except Exception` cleanup code does not swallow it."""

    def __init__(self, signum: int, key: str | None = None) -> None:
        super().__init__(key or signal.Signals(signum).name)
        self.signum = signum
        self.key = key  # QUIT_KEY when the live view's key asked for it

    @staticmethod
    def named(name: str) -> Interrupted:
        """The Interrupted whose `name` is `name` (a timeline's meta["interrupted"])."""
        if name == QUIT_KEY:
            return Interrupted(signal.SIGINT, key=QUIT_KEY)
        return Interrupted(signal.Signals[name])

    @property
    def name(self) -> str:
        """SIGINT, SIGTERM, or `q`."""
        return self.key or signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED


def stopping_line(name: str) -> str:
    """What the terminal shows the moment a stop is asked for."""
    return f"stopping ({name}): shutting the engines down..."


class _Handler:
    def __init__(self, on_stop: Callable[[str], None] | None = None) -> None:
        self.first: int | None = None
        self.num_ignored = 0
        self.on_stop = on_stop

    def __call__(self, signum: int, frame: object) -> None:
        if self.first is not None:
            self.num_ignored += 1
            return
        self.first = signum
        interrupted = Interrupted(signum)
        if self.on_stop is not None:
            try:
                self.on_stop(interrupted.name)
            except Exception:  # a write cut in half by this very signal: the raw one instead
                os.write(2, (stopping_line(interrupted.name) + "\n").encode())
        raise interrupted


@contextlib.contextmanager
def interruptible(on_stop: Callable[[str], None] | None = None) -> Iterator[_Handler]:
    """SIGINT and SIGTERM raise Interrupted (once) inside the block, after on_stop(its
    name); the old handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield _Handler(on_stop)  # signals go to the main thread only: nothing to install
        return
    handler = _Handler(on_stop)
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield handler
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
