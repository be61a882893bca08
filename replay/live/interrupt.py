"""Stopping a run on Ctrl-C or SIGTERM the same way: one exception, later signals noted. Runs in: frontend process.

Inside `interruptible()`, the first SIGINT or SIGTERM raises Interrupted in the main
thread (as Ctrl-C's KeyboardInterrupt does), so the run stops sending where it is and
its `finally` blocks shut the engines down and remove the run directory. Signals that
arrive after the first are only counted: the shutdown they would cut short is bounded
anyway. The exit status (replay/verify/verdict.py's table) is the shell's 128 + signal
number: 130 (interrupted) for Ctrl-C, 143 (terminated) for SIGTERM.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from replay.verify.verdict import EXIT_INTERRUPTED, EXIT_TERMINATED

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop asked for by a signal; BaseException like KeyboardInterrupt, so
    `except Exception` cleanup code does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED


class _Handler:
    def __init__(self) -> None:
        self.first: int | None = None
        self.num_ignored = 0

    def __call__(self, signum: int, frame: object) -> None:
        if self.first is not None:
            self.num_ignored += 1
            return
        self.first = signum
        raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[_Handler]:
    """SIGINT and SIGTERM raise Interrupted (once) inside the block; the old handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield _Handler()  # signals go to the main thread only: nothing to install
        return
    handler = _Handler()
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield handler
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
