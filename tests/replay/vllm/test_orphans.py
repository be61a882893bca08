"""The record of what an --engine vllm run started, and the sweep that stops what a killed run left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.proc.run_dir import process_start_time
from replay.vllm.orphans import (
    RECORD_FILE,
    RUN_PREFIX,
    Recorded,
    read_record,
    sweep_orphans,
    write_record,
)
from tests.proc_utils import running


@pytest.fixture
def run_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVDRAIN_RUN_ROOT", str(tmp_path))
    return tmp_path


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_record_reads_back_with_this_process_as_its_owner(tmp_path):
    processes = [
        Recorded(name="P", pid=12, start_time="34", leader=True),
        Recorded(name="P child", pid=13, start_time="35"),
    ]
    write_record(tmp_path, processes)
    owner, back = read_record(tmp_path)
    assert owner == (os.getpid(), process_start_time(os.getpid())) and back == processes
    (tmp_path / RECORD_FILE).write_text("{not json")
    assert read_record(tmp_path) is None


def test_a_dead_owners_processes_and_their_descendants_are_stopped_and_the_record_goes(run_root):
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    child = int(parent.stdout.readline())
    try:
        run_dir = run_root / (RUN_PREFIX + "killed")
        run_dir.mkdir(mode=0o700)
        write_record(
            run_dir, [Recorded(name="E", pid=parent.pid, start_time=process_start_time(parent.pid))]
        )
        record = json.loads((run_dir / RECORD_FILE).read_text())
        record["owner"] = {"pid": gone.pid, "start_time": "1"}
        (run_dir / RECORD_FILE).write_text(json.dumps(record))
        (swept,) = sweep_orphans(timeout_s=5)
        assert swept.run_dir == run_dir and [p.pid for p in swept.stopped] == [parent.pid]
        assert swept.num_stopped == 2  # the child was found below it, not recorded
        assert parent.wait(timeout=10) == -15 and not running(child)
        assert not (run_dir / RECORD_FILE).exists()
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_the_sweep_leaves_a_live_runs_processes_and_a_reused_pid_alone(run_root):
    bystander = sleeper()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    try:
        start = process_start_time(bystander.pid)
        live, dead = run_root / (RUN_PREFIX + "live"), run_root / (RUN_PREFIX + "dead")
        for run_dir in (live, dead):
            run_dir.mkdir(mode=0o700)
        write_record(live, [Recorded(name="E", pid=bystander.pid, start_time=start, leader=True)])
        write_record(
            dead,
            [Recorded(name="E", pid=bystander.pid, start_time=str(int(start) - 1), leader=True)],
        )
        record = json.loads((dead / RECORD_FILE).read_text())
        record["owner"] = {"pid": gone.pid, "start_time": "1"}  # an owner that is gone
        (dead / RECORD_FILE).write_text(json.dumps(record))
        assert sweep_orphans(timeout_s=1) == []
        assert running(
            bystander.pid
        )  # this test owns the live run; the dead run's pid is another process now
        assert (live / RECORD_FILE).exists() and not (dead / RECORD_FILE).exists()
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


@pytest.mark.parametrize("forgery", ["a directory others can write", "a record that is a link"])
def test_a_record_not_this_users_own_is_never_acted_on(run_root, tmp_path, forgery):
    """Anyone can write under a shared /tmp: a forged record naming a victim's pid and
    start time (public in /proc) must not have the sweep signal it."""
    victim = sleeper()
    try:
        run_dir = run_root / (RUN_PREFIX + "forged")
        run_dir.mkdir(mode=0o700)
        write_record(
            run_dir, [Recorded(name="E", pid=victim.pid, start_time=process_start_time(victim.pid))]
        )
        record = json.loads((run_dir / RECORD_FILE).read_text())
        record["owner"] = {"pid": 2**22 + 1, "start_time": "1"}  # beyond pid_max: gone
        if forgery == "a directory others can write":
            (run_dir / RECORD_FILE).write_text(json.dumps(record))
            run_dir.chmod(0o777)
        else:
            elsewhere = tmp_path / "elsewhere.json"
            elsewhere.write_text(json.dumps(record))
            (run_dir / RECORD_FILE).unlink()
            (run_dir / RECORD_FILE).symlink_to(elsewhere)
        assert read_record(run_dir) is None
        assert sweep_orphans(timeout_s=5) == [] and running(victim.pid)
    finally:
        victim.kill()
        victim.wait(10)
