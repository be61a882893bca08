"""A replay whose engines cannot finish starting: starved is inconclusive (exit 3), stopped is
a fault (exit 4), and however the start-up ends nothing the run spawned is left.

The finding: beside four CPU hogs at nice -15, `kvdrain replay examples/pd_idle.jsonl
--no-live` ended `fault: engine P not ready within 120.0 s` (exit 4) twice, and each run
left a spawned engine-side child and a resource tracker running 40 minutes later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cli import EXAMPLE
from engine.proc.lifetime import descendants
from engine.proc.run_dir import is_alive, process_start_time
from replay.runtime.starvation import read_machine
from tests.paths import ROOT
from tests.proc_utils import wait_until

pytestmark = pytest.mark.slow


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """n processes spinning on a core each, stopped on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)


def start_replay(run_root: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, KVDRAIN_RUN_ROOT=run_root)
    argv = [sys.executable, "-m", "cli", "replay", str(EXAMPLE), "--runner", "mock"]
    return subprocess.Popen(
        [*argv, "--no-live", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class Tree:
    """Every process seen below the replay (the resource trackers too), by pid and start."""

    def __init__(self, root: int) -> None:
        self.root, self.seen = root, {}

    def look(self) -> list[int]:
        for pid in descendants(self.root):
            if pid not in self.seen and (start := process_start_time(pid)) is not None:
                self.seen[pid] = start
        return list(self.seen)

    def left(self, timeout_s: float = 10.0) -> list[int]:
        """What is still running of them after timeout_s (a tracker exits on its own)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = [pid for pid, start in self.seen.items() if is_alive(pid, start)]
            if not alive:
                return []
            time.sleep(0.05)
        return alive

    def kill(self) -> None:
        for pid, start in self.seen.items():
            if is_alive(pid, start):
                os.kill(pid, signal.SIGKILL)


def until(predicate, timeout_s: float, what: str):
    return wait_until(predicate, timeout_s, what, every_s=0.005)  # a child caught at once


def engine_pids(tree: Tree, proc: subprocess.Popen) -> list[int]:
    """The replay's own children (its engine cores), once both are there."""
    tree.look()
    kids = [pid for pid in tree.seen if _ppid(pid) == proc.pid and not _tracker(pid)]
    return kids if len(kids) >= 2 else []


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except OSError:
        return None


def _tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


def finish(proc: subprocess.Popen, tree: Tree, timeout_s: float = 120) -> str:
    """The replay's output, once it exited, with every process it spawned watched to the end."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        tree.look()
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return out


def test_a_starting_engine_stopped_by_sigstop_is_a_fault_and_leaves_nothing(tmp_path):
    proc = start_replay(str(tmp_path), "--start-limit", "60")
    tree = Tree(proc.pid)
    try:
        for pid in until(lambda: engine_pids(tree, proc), 60, "two engine cores"):
            os.kill(pid, signal.SIGSTOP)
        out = finish(proc, tree)
        left = tree.left()
    finally:
        tree.kill()
        proc.kill()
    assert proc.returncode == 4, out
    assert "fault: engine" in out and "is stopped (state T: SIGSTOP" in out, out
    assert "Traceback" not in out, out
    assert left == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_while_engines_start_stops_every_process_started(tmp_path, signum, code):
    """The connector workers are held (SIGSTOP) before they arm their parent-death signal:
    the engines cannot finish starting, and only the frontend can stop what they spawned."""
    proc = start_replay(str(tmp_path), "--start-limit", "60")
    tree = Tree(proc.pid)
    try:
        engines = until(lambda: engine_pids(tree, proc), 60, "two engine cores")

        def workers() -> list[int]:
            tree.look()
            found = [p for p in tree.seen if _ppid(p) in engines and not _tracker(p)]
            return found if len(found) >= 2 else []

        for pid in until(workers, 60, "two connector workers"):
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signum)
        out = finish(proc, tree)
        left = tree.left()
    finally:
        tree.kill()
        proc.kill()
    assert proc.returncode == code, out
    assert "Traceback" not in out, out
    assert left == [] and os.listdir(tmp_path) == []


def test_engines_starved_of_cpu_at_start_up_make_the_run_inconclusive_never_a_fault(tmp_path):
    """The engines, at nice 19 beside two spinning processes, get about 1% of a core."""
    with hogs(2):
        try:
            until(lambda: read_machine().contended, 30, "the machine contended")
        except TimeoutError:
            pytest.skip("two spinning processes did not show as CPU load or pressure here")
        proc = start_replay(str(tmp_path), "--start-limit", "8")
        tree = Tree(proc.pid)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                for pid in tree.look():  # each child (and theirs) as soon as it is seen
                    if pid != proc.pid:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.setpriority(os.PRIO_PROCESS, pid, 19)
                time.sleep(0.005)
            out = finish(proc, tree)
            left = tree.left()
        finally:
            tree.kill()
            proc.kill()
    assert proc.returncode == 3, out
    assert "inconclusive: engine" in out and "starved of CPU" in out, out
    assert "--start-limit" in out and "fault" not in out, out
    assert left == [] and os.listdir(tmp_path) == []


def test_a_serve_whose_engines_cannot_start_says_so_in_one_line_and_leaves_nothing(tmp_path):
    """`kvdrain serve` printed a 30-line traceback and exited 1 (a violation, in the exit
    table) when its start-up was judged; it now ends as a replay's start-up does."""
    env = dict(os.environ, KVDRAIN_RUN_ROOT=str(tmp_path))
    argv = [sys.executable, "-m", "cli", "serve", "--runner", "mock", "--no-live"]
    proc = subprocess.Popen(
        [*argv, "--start-limit", "0.001"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tree = Tree(proc.pid)
    try:
        out = finish(proc, tree)
        left = tree.left()
    finally:
        tree.kill()
        proc.kill()
    assert proc.returncode == 4, out
    assert out.startswith("error: fault: engine") and "--start-limit" in out, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert left == [] and os.listdir(tmp_path) == []
