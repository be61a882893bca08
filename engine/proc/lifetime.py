"""A child process's life bound to its parent's, and a process's descendants. Runs in: every process.

A child that is still importing when its parent dies (killed mid start-up) would outlive
it: its own loop, which watches the parent, has not started. The kernel's parent-death
signal ends it then; where there is no prctl (not Linux) the loops' watch is all there is.
A parent that kills a child also stops the descendants it saw, by their own ids.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL this process when the thread that spawned it exits; exit at once if the
    parent (`parent_pid`) is already gone."""
    if not _set_pdeathsig(signal.SIGKILL):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)  # reparented before the signal was armed: the parent is gone


def _set_pdeathsig(signum: int) -> bool:
    if not os.uname().sysname == "Linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, theirs, ...), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            parent = parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().decode(errors="replace").rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
