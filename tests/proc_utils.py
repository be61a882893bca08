"""Test helpers for whole process trees: their descendants from /proc, and bounded waits on outside conditions."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine.proc.run_dir import process_start_time


def descendants(pid: int) -> list[tuple[int, str | None]]:
    """Every process below pid, as (pid, start time), from /proc; multiprocessing's
    resource tracker is left out (it exits on its own when its parent's pipe closes), and
    so is a child caught between fork and exec (it still shows its parent's command line:
    kvdrain starts every process with spawn, so no settled child shares it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child in children.get(parent, []):
            todo.append(child)
            cmdline = _cmdline(child)
            if cmdline is None or b"resource_tracker" in cmdline or cmdline == _cmdline(parent):
                continue
            found.append((child, process_start_time(child)))
    return found


def running(pid: int) -> bool:
    """pid names a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)  # polling an outside condition (/proc), not syncing with our code
    raise TimeoutError(f"{what} not within {timeout_s} s")
