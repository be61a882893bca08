"""Private run directories for ipc sockets, and sweeping dead runs'. Runs in: frontend process.

A run directory is /tmp/kvdrain-XXXXXXXX, mode 0700 (KVDRAIN_RUN_ROOT moves it, for tests), with
an `owner` file: its creator's pid and start time. Every exit of a run removes it and its engines'
KV segments but a SIGKILL of the frontend, which runs no code; so each new run first sweeps.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import stat
import tempfile

RUN_PREFIX = "kvdrain-"
OWNER_FILE = "owner"
KV_SEGMENT = re.compile(r"kvdrain-kv-(\d+)-[0-9a-f]+$")  # engine/runner/kv_cache.py's names


def run_root() -> str:
    """Where run directories go: /tmp (short ipc paths: the limit is ~100 chars)."""
    return os.environ.get("KVDRAIN_RUN_ROOT", "/tmp")


def process_start_time(pid: int) -> str | None:
    """The process's start time (ticks since boot, /proc/PID/stat field 22); None: no process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields after the command name start at 3


def is_alive(pid: int, start_time: str | None = None) -> bool:
    """pid runs (and, if start_time is given, is the same process: pids are reused)."""
    if pid <= 0:
        return False
    if not os.path.exists("/proc/self/stat"):  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def make_run_dir() -> str:
    """A new private run directory owned by this process (after sweeping dead runs')."""
    sweep_dead_runs()
    path = tempfile.mkdtemp(prefix=RUN_PREFIX, dir=run_root())
    pid = os.getpid()
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(f"{pid} {process_start_time(pid) or ''}\n")
    return path


def read_owner(path: str) -> tuple[int, str | None] | None:
    """(pid, start time) from a run directory's owner file; None if it has none."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            fields = f.read().split()
        return int(fields[0]), (fields[1] if len(fields) > 1 else None)
    except (OSError, ValueError, IndexError):
        return None


def is_ours(path: str | os.PathLike, directory: bool = True) -> bool:
    """path is this user's own, as kvdrain makes it: not a link, owned by this uid, and
    (a directory) reachable by no one else (mode 0700, as mkdtemp makes it). A sweep acts
    on nothing else: anyone can write under a shared /tmp."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    private = not directory or st.st_mode & 0o077 == 0
    return kind_ok and private and st.st_uid == os.geteuid()


def sweep_dead_runs() -> list[str]:
    """Remove run directories and KV segments whose owner process is gone; returns their paths.

    A KV segment (/dev/shm/kvdrain-kv-<engine pid>-*) is its engine's. Directories without an
    owner record (older kvdrain, other tools) are left alone.
    """
    removed = []
    for path in glob.glob(os.path.join(run_root(), RUN_PREFIX + "*")):
        owner = read_owner(path) if is_ours(path) else None
        if owner is not None and not is_alive(*owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for directory in ("/dev/shm", tempfile.gettempdir()):
        for path in glob.glob(os.path.join(directory, "kvdrain-kv-*")):
            match = KV_SEGMENT.search(os.path.basename(path))
            if match is not None and not is_alive(int(match.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(path)
    return removed
