"""Faults are named, and the fault-injection suite.

The finding: SIGKILL of P's connector worker mid-run gave exit 0, VERIFIED, no message,
while D silently re-prefilled; SIGKILL of D's worker, or SIGSTOP of P's worker, gave
"leak on P" with no cause, P's blocks pinned until the lease ended; router.errors was
filled but never shown. Now every engine or connector worker that dies or stalls is a
named fault (replay/wall/faults.py) in the live view, the summary and the report, the
run's status is `fault` (exit 4), a leak after a fault is the fault's (fault_leak), and
D releases P on every failed or abandoned pull, its agent doing it when its worker is
gone.

The suite: during a P/D wall replay with the mock runner, each process in turn (P's and
D's engine core, P's and D's connector worker) gets SIGKILL, or SIGSTOP and SIGCONT 4 s
later; the replay must name the fault, exit 4, leave no process, run dir or KV segment
behind, and, where the engine survives, end with no block held.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine.proc.run_dir import is_alive
from replay.verify.rules import verify
from replay.verify.timeline import EngineSample, RequestRecord, Timeline
from replay.verify.verdict import EXIT_FAULT
from replay.wall.faults import FaultWatch, since_start
from tests.paths import ROOT
from tests.proc_utils import descendants, wait_until

# ---- the watch: what becomes a fault --------------------------------------------------------


def test_errors_and_stall_counters_become_named_faults_once_each():
    watch = FaultWatch(["P", "D"])
    watch.on_snapshot(0.0, "D", {"num_pull_timeouts": 0})
    watch.on_snapshot(0.0, "P", {})
    watch.on_error(1.0, "P", "connector worker of engine P (pid 7) died with exit code -9")
    watch.on_snapshot(1.5, "D", {"num_pull_timeouts": 1})
    watch.on_snapshot(
        2.5, "D", {"num_pull_timeouts": 3, "num_slow_recvs": 1, "last_recv_wait_ms": 2100}
    )
    watch.on_snapshot(2.6, "P", {"num_slow_reaps": 0})
    assert [(f.t, f.engine, f.kind) for f in watch.faults] == [
        (1.0, "P", "error"),
        (1.5, "D", "transfer_timeout"),
        (2.5, "D", "slow_load"),
    ]
    assert "3 reads of the prefill engine's KV timed out" in watch.faults[1].cause
    assert "2.100 s" in watch.faults[2].cause


def test_stalls_counted_before_the_replay_began_are_no_fault_of_it():
    """A serve's counts outlive replays: an engine's first snapshot is the baseline."""
    watch = FaultWatch(["P", "D"])
    before = {
        "num_pull_timeouts": 2,
        "num_slow_recvs": 1,
        "last_recv_wait_ms": 2400,
        "max_recv_wait_ms": 2400,
    }
    watch.on_snapshot(0.0, "D", before)
    watch.on_snapshot(0.0, "P", {"num_slow_reaps": 1, "last_reap_wait_ms": 1500})
    watch.on_snapshot(3.0, "D", before)
    assert watch.faults == []
    watch.on_snapshot(4.0, "D", {**before, "num_slow_recvs": 3, "last_recv_wait_ms": 1200})
    (slow,) = watch.faults
    assert (slow.t, slow.engine, slow.kind) == (4.0, "D", "slow_load")
    assert (
        "2 KV loads waited over a second (the latest 1.200 s) past their pull delay" in slow.cause
    )


def test_requests_on_an_engine_while_the_replay_has_none_in_flight_are_another_clients():
    watch = FaultWatch(["P", "D"])
    busy = {"num_waiting": 0, "num_skipped_waiting": 1, "num_running": 2, "num_used_blocks": 9}
    watch.on_activity(1.0, "P", busy, quiet_since=None)  # ours in flight: they may be ours
    watch.on_activity(2.0, "P", busy, quiet_since=2.0)  # taken before ours ended
    watch.on_activity(2.5, "P", {**busy, "num_skipped_waiting": 0, "num_running": 0}, 2.0)
    assert watch.shared == {}
    watch.on_activity(2.6, "D", busy, quiet_since=2.0)
    watch.on_activity(3.0, "D", busy, quiet_since=2.0)  # the first sign is the one kept
    (shared,) = watch.shared.values()
    assert (shared.t, shared.engine) == (2.6, "D") and watch.faults == []  # not a fault
    assert "3 requests of another client" in shared.cause and "the serve is shared" in shared.cause


def test_a_replays_counters_are_what_grew_since_its_start():
    first = {"num_steps": 900, "num_reads_after_expiry": 1, "num_expired": 4, "num_used_blocks": 3}
    latest = {"num_steps": 950, "num_reads_after_expiry": 1, "num_expired": 6, "num_used_blocks": 0}
    assert since_start(first, latest) == {
        "num_steps": 50,
        "num_reads_after_expiry": 0,
        "num_expired": 2,
        "num_used_blocks": 0,
    }


def test_an_engine_that_answers_no_probe_is_stalled_until_it_answers():
    watch = FaultWatch(["P", "D"], stall_s=3.0, probe_interval_s=1.0)
    watch.on_snapshot(0.0, "P", {})
    watch.on_snapshot(0.0, "D", {})
    assert not watch.should_probe(0.5)
    assert watch.should_probe(1.0) and not watch.should_probe(1.5)  # once per interval
    watch.on_snapshot(1.1, "D", {})  # D answers; P does not
    watch.check(2.9)
    assert watch.faults == []
    watch.check(3.0)  # silent for 3 s since t=0, a probe unanswered for over a second
    (stall,) = watch.faults
    assert (stall.t, stall.engine, stall.kind, stall.end_t) == (0.0, "P", "stalled", None)
    watch.check(4.0)
    watch.on_snapshot(5.2, "P", {})
    assert stall.end_t == 5.2 and "answered no stats request for 4.000 s" in stall.cause


def _timeline(faults: list[dict]) -> Timeline:
    used = [
        EngineSample(
            t=t,
            engine="P",
            num_used_blocks=n,
            num_cached_blocks=0,
            num_free_blocks=10 - n,
            num_usable_blocks=10,
            num_waiting=0,
            num_skipped_waiting=0,
            num_waiting_for_remote_kvs=0,
            num_running=0,
            num_finished_awaiting_free=0,
            loop_state="blocked",
            num_steps=0,
            num_wakeups=0,
        )
        for t, n in ((0.0, 4), (1.0, 4), (9.0, 4))
    ]
    record = RequestRecord(
        req_id="r",
        arrival_t=0.0,
        send_t=0.0,
        send_lateness_s=0.0,
        first_token_t=0.1,
        end_t=0.5,
        num_prompt_tokens=8,
        num_output_tokens=1,
        num_prefix_hit_tokens=0,
        finish_reason="length",
    )
    return Timeline(
        engines=["P"],
        num_usable_blocks={"P": 10},
        samples=used,
        requests=[record],
        arrivals=[0.0],
        aborts=[],
        end_t=10.0,
        meta={"faults": faults},
    )


def test_a_leak_after_a_fault_is_the_faults_and_the_status_is_fault():
    fault = {
        "t": 2.0,
        "engine": "P",
        "kind": "error",
        "cause": "connector worker died",
        "end_t": None,
    }
    verdict = verify(_timeline([fault]), [])
    (leak,) = verdict.violations
    assert leak.kind == "fault_leak"
    assert "caused by a fault at 2.000 s (P: connector worker died)" in leak.detail
    assert verdict.status == "fault" and verdict.exit_code == EXIT_FAULT
    assert verdict.to_dict()["faults"] == [fault]
    plain = verify(_timeline([]), [])  # the same leak with no fault: the liveness policy's
    assert [v.kind for v in plain.violations] == ["leak"] and plain.status == "violation"


# ---- the suite: real processes, real signals ------------------------------------------------


def _proc_table() -> dict[int, int]:
    """pid -> parent pid, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                table[int(entry)] = int(
                    Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1]
                )
            except (OSError, ValueError, IndexError):
                continue
    return table


def _bound_unix_paths() -> dict[int, str]:
    """Listening unix socket inode -> its path, from /proc/net/unix."""
    out = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8:
            out[int(parts[6])] = parts[7]
    return out


def _roles(pids: list[int]) -> dict[str, int]:
    """{"P worker", "D worker", "P engine", "D engine"} -> pid: a worker is the process
    bound to <run dir>/<engine>-kv, its engine the worker's parent."""
    paths, table, roles = _bound_unix_paths(), _proc_table(), {}
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:["):
                path = paths.get(int(link[8:-1]), "")
                for engine in ("P", "D"):
                    if path.endswith(f"/{engine}-kv"):
                        roles[f"{engine} worker"] = pid
                        roles[f"{engine} engine"] = table[pid]
    return roles


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "steady.jsonl"
    path.write_text(
        "".join(
            json.dumps({"t": round(0.1 * i, 3), "id": f"r{i}", "prompt_len": 48, "max_tokens": 8})
            + "\n"
            for i in range(30)
        )
    )
    return path


@pytest.fixture
def run_root(monkeypatch):
    root = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")  # short: ipc paths stay under ~100 chars
    monkeypatch.setenv("KVDRAIN_RUN_ROOT", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# (process, signal, words the fault line must hold); SIGSTOP is followed by SIGCONT.
CASES = [
    ("P engine", signal.SIGKILL, ("P", "died")),
    ("D engine", signal.SIGKILL, ("D", "died")),
    ("P worker", signal.SIGKILL, ("connector worker of engine P", "died")),
    ("D worker", signal.SIGKILL, ("connector worker of engine D", "died")),
    ("P engine", signal.SIGSTOP, ("engine P answered no stats request",)),
    ("D engine", signal.SIGSTOP, ("engine D answered no stats request",)),
    ("P worker", signal.SIGSTOP, ("D: ", "timed out")),
    ("D worker", signal.SIGSTOP, ("D: ", "KV load", "past")),
]
STOP_S = 4.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "role,sig,words", CASES, ids=[f"{r.replace(' ', '-')}-{s.name}" for r, s, _ in CASES]
)
def test_a_fault_is_named_exits_4_and_leaves_nothing(tmp_path, run_root, role, sig, words):
    report = tmp_path / "report.json"
    env = dict(os.environ, KVDRAIN_RUN_ROOT=run_root)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "replay",
            str(_trace(tmp_path)),
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "256",
            "--pull-delay-ms",
            "100",
            "--report",
            str(report),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    children: list[tuple[int, str | None]] = []
    try:
        # /proc is read afresh each time: a child caught between fork and exec still shows its
        # parent's command line (a resource tracker then looks like an engine)
        roles = wait_until(
            lambda: (lambda r: r if len(r) == 4 else None)(
                _roles([p for p, _ in descendants(proc.pid)])
            ),
            90,
            "both connector workers' sockets",
        )
        children = descendants(proc.pid)
        time.sleep(1.0)  # the fault lands mid-trace (the trace runs 3 s), transfers in flight
        os.kill(roles[role], sig)
        if sig == signal.SIGSTOP:
            time.sleep(STOP_S)
            os.kill(roles[role], signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
        leftovers = _leftovers(run_root, children)
    finally:
        for pid, start in [(proc.pid, None), *(children or descendants(proc.pid))]:
            if is_alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == EXIT_FAULT, out
    assert "Traceback" not in out, out
    fault_lines = [line for line in out.splitlines() if line.startswith("fault: ")]
    assert any(all(w in line for w in words) for line in fault_lines), out
    assert leftovers == {"processes": [], "run dirs": [], "segments": []}
    data = json.loads(report.read_text())
    assert data["status"] == "fault" and data["exit_code"] == EXIT_FAULT and data["faults"]
    if sig == signal.SIGSTOP or "worker" in role:  # the engines survived: nothing held at the end
        assert {e["engine"]: e["final_used_blocks"] for e in data["engines"]} == {"P": 0, "D": 0}, (
            out
        )


def _leftovers(run_root: str, children: list[tuple[int, str | None]]) -> dict:
    segments = [
        p
        for pid, _ in children
        for d in ("/dev/shm", tempfile.gettempdir())
        for p in Path(d).glob(f"kvdrain-kv-{pid}-*")
    ]
    return {
        "processes": [pid for pid, start in children if is_alive(pid, start)],
        "run dirs": os.listdir(run_root),
        "segments": segments,
    }
