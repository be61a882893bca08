"""What an `--engine vllm` run started, recorded in its run directory, and stopping what a killed run left. Runs in: frontend process.

A `vllm serve` instance (and the proxy) runs in its own session, so when kvdrain's
frontend is SIGKILLed, which runs no code, they keep running: an API server, its engine
core and its worker, each holding cores and memory. So the deployment keeps a record,
`processes.json` in its run directory: its owner (the frontend's pid and start time) and
every process it started or saw below one (name, pid, start time, and whether it leads
its own session), rewritten as it learns of more and removed once all are stopped.

Every new deployment first sweeps: a run directory under the run root whose record's
owner is gone has its recorded processes stopped, each by its own id and only while
that id still names the same process (pid and start time; pids are reused), together
with the live descendants of those and, for a recorded session leader, its group:
SIGTERM, then SIGKILL after a bound. The record is then removed; the logs stay. Nothing
is ever looked up by name. The file is not named `owner`, so the ipc run directories'
sweep (engine/proc/run_dir.py), which shares the prefix, leaves these directories alone.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.proc.run_dir import is_alive, is_ours, process_start_time, run_root

RUN_PREFIX = "kvdrain-vllm-"  # not the ipc run dirs' prefix alone: these stay, with their logs
RECORD_FILE = "processes.json"
SWEEP_STOP_S = 10.0  # SIGTERM to SIGKILL, as for a deployment's own teardown


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """One process a deployment started (leader: it leads its own session) or saw below one."""

    name: str
    pid: int
    start_time: str
    leader: bool = False


def write_record(run_dir: Path, processes: list[Recorded]) -> None:
    """The record of run_dir's deployment, owned by this process; replaced atomically."""
    pid = os.getpid()
    record = {
        "owner": {"pid": pid, "start_time": process_start_time(pid)},
        "processes": [asdict(p) for p in processes],
    }
    tmp = run_dir / (RECORD_FILE + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, run_dir / RECORD_FILE)


def clear_record(run_dir: Path) -> None:
    (run_dir / RECORD_FILE).unlink(missing_ok=True)


def read_record(run_dir: Path) -> tuple[tuple[int, str | None], list[Recorded]] | None:
    """(owner pid, owner start time) and the processes; None without a readable record,
    or one that is not this user's own (run_dir.is_ours: a forged record would have the
    sweep signal someone else's processes)."""
    if not (is_ours(run_dir) and is_ours(run_dir / RECORD_FILE, directory=False)):
        return None
    try:
        record = json.loads((run_dir / RECORD_FILE).read_text())
        owner = (int(record["owner"]["pid"]), record["owner"]["start_time"])
        return owner, [Recorded(**p) for p in record["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first); None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rpartition(")")[2].split()
    except OSError:
        return None


def same_process(pid: int, start_time: str) -> bool:
    """pid still names the process that started at start_time, and it is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[19] == start_time and fields[0] != "Z"


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _group_members(pgid: int) -> list[int]:
    return [
        int(e)
        for e in os.listdir("/proc")
        if e.isdigit() and (f := _stat(int(e))) is not None and int(f[2]) == pgid and f[0] != "Z"
    ]


def orphans(processes: list[Recorded]) -> dict[int, str]:
    """pid -> start time of every process to stop: the recorded ones that are still
    themselves, the group of a recorded leader that still is, and all their descendants."""
    found: dict[int, str] = {}
    for p in processes:
        if same_process(p.pid, p.start_time):
            found[p.pid] = p.start_time
            for member in _group_members(p.pid) if p.leader else []:
                found.setdefault(member, process_start_time(member) or "")
    children, stack = _children(), list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            start = process_start_time(child)
            if child not in found and start is not None:
                found[child] = start
                stack.append(child)
    return {pid: start for pid, start in found.items() if start}


def owner_gone(pid: int, start_time: str | None) -> bool:
    """The recorded owner runs no more (a zombie runs no code either)."""
    return not (same_process(pid, start_time) if start_time else is_alive(pid))


def _signal_all(targets: dict[int, str], signum: int) -> None:
    for pid, start in targets.items():
        if same_process(pid, start):  # checked right before: never a reused pid
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def stop_orphans(targets: dict[int, str], timeout_s: float = SWEEP_STOP_S) -> None:
    """SIGTERM each, wait up to timeout_s for all, SIGKILL what is left (bounded too)."""
    _signal_all(targets, signal.SIGTERM)
    for signum in (signal.SIGKILL, None):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(same_process(p, s) for p, s in targets.items()):
            time.sleep(0.05)
        if signum is not None:
            _signal_all(targets, signum)


@dataclass(frozen=True, slots=True, kw_only=True)
class Swept:
    """A killed run's directory and the processes of it that were stopped."""

    run_dir: Path
    stopped: list[Recorded]
    num_stopped: int  # with their descendants


def sweep_orphans(root: str | None = None, timeout_s: float = SWEEP_STOP_S) -> list[Swept]:
    """Stop what every run under root (default: the run root) whose owner is gone left running."""
    swept = []
    for path in sorted(glob.glob(os.path.join(root or run_root(), RUN_PREFIX + "*"))):
        run_dir = Path(path)
        record = read_record(run_dir)
        if record is None or not owner_gone(*record[0]):
            continue
        processes = record[1]
        targets = orphans(processes)
        if targets:
            stop_orphans(targets, timeout_s)
        clear_record(run_dir)
        stopped = [p for p in processes if p.pid in targets]
        if stopped:
            swept.append(Swept(run_dir=run_dir, stopped=stopped, num_stopped=len(targets)))
    return swept
