"""Recordings replay as themselves.

The finding: `serve --record` wrote a header without the pool size, so a virtual replay of
the recording compared against the default profile's 28,671 blocks ("free 28671 !=
recorded 511", VIOLATION), the recorded liveness was ignored, and the recording kept the
serve's dead time before its first request (12 s here) for the replay to wait out. Now the
header carries the engines' config (written with the first record, once the pool is
known), t = 0 is the first request, and a replay adopts the header's config unless an
option says otherwise (a conflicting explicit option is exit 2 naming both).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from engine.core.outputs import RequestOutput
from engine.proc.messages import StatsSnapshot
from replay.serve.recorder import SETTLE_S, TraceRecorder, adopt_recorded
from tests.paths import ROOT

HEADER = {
    "kvdrain_trace": 1,
    "recorded_by": "kvdrain serve",
    "topology": "pd",
    "liveness": "event",
    "block_size": 16,
    "num_blocks": 512,
    "max_model_len": 4096,
}


def _idle(engine: str) -> StatsSnapshot:
    counts = dict.fromkeys(
        (
            "num_waiting",
            "num_skipped_waiting",
            "num_waiting_for_remote_kvs",
            "num_running",
            "num_finished_awaiting_free",
        ),
        0,
    )
    counts.update(num_used_blocks=0, num_free_blocks=511)
    return StatsSnapshot(
        engine_id=engine,
        seq=0,
        monotonic=time.monotonic(),
        loop_state="blocked",
        num_steps=0,
        num_wakeups=0,
        counts=counts,
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_header_has_the_pool_the_engines_allocated_and_t_starts_at_the_first_request(tmp_path):
    path = tmp_path / "rec.jsonl"
    recorder = TraceRecorder(path, {"topology": "pd", "liveness": "legacy", "block_size": 16})
    recorder.clock = clock = _Clock()
    recorder.configure(num_blocks=512, max_model_len=4096)
    recorder.snapshot({"P": _idle("P")})  # before any traffic: not part of the recording
    clock.now += 45  # the serve's dead time before its first request
    recorder.request("r1", [1, 2, 3], 4)
    for _ in range(2):
        recorder.snapshot({"P": _idle("P")})
        clock.now += SETTLE_S
    recorder.close()
    header, request, snapshot = (json.loads(line) for line in path.read_text().splitlines())
    assert header == {
        "kvdrain_trace": 1,
        "recorded_by": "kvdrain serve",
        "snapshot_settle_s": SETTLE_S,
        "topology": "pd",
        "liveness": "legacy",
        "block_size": 16,
        "num_blocks": 512,
        "max_model_len": 4096,
    }
    assert request["t"] == 0.0 and snapshot["t"] == SETTLE_S


def _busy(engine: str, used: int) -> StatsSnapshot:
    snap = _idle(engine)
    snap.counts.update(num_used_blocks=used, num_free_blocks=511 - used)
    return snap


def test_a_snapshot_is_written_only_once_the_counts_held_still_for_the_settle_time_with_nothing_in_flight(
    tmp_path,
):
    path = tmp_path / "rec.jsonl"
    recorder = TraceRecorder(path, {"topology": "pd"})
    recorder.clock = clock = _Clock()
    recorder.request("r1", [1, 2, 3], 4)
    steps = [
        ({"P": _busy("P", 9)}, True),  # in flight
        ({"P": _busy("P", 9)}, False),
        ({"P": _busy("P", 3)}, False),  # a drain under way
        ({"P": _idle("P")}, False),
        ({"P": _idle("P")}, True),  # a lull inside a burst
        ({"P": _idle("P")}, False),
        ({"P": _idle("P")}, False),
        ({"P": _idle("P")}, False),
    ]
    for latest, in_flight in steps:
        recorder.snapshot(latest, in_flight=in_flight)
        clock.now += SETTLE_S / 2
    recorder.close()
    snapshots = [json.loads(line) for line in path.read_text().splitlines() if '"kv"' in line]
    # Only the idle state that held a whole SETTLE_S, stamped when it had: from the 6th round
    # (t = 2.5 s) to the 8th (3.5 s); the drain's counts and the lull were never settled.
    assert [(s["t"], s["kv"]["P"]["used"]) for s in snapshots] == [(5 * SETTLE_S / 2 + SETTLE_S, 0)]


def test_a_recording_with_no_traffic_is_its_header_alone(tmp_path):
    path = tmp_path / "rec.jsonl"
    recorder = TraceRecorder(path, {"topology": "pd"})
    recorder.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {
            "kvdrain_trace": 1,
            "recorded_by": "kvdrain serve",
            "snapshot_settle_s": SETTLE_S,
            "topology": "pd",
        }
    ]


def test_a_replay_adopts_the_recorded_config_that_no_option_set():
    given = {
        "num_blocks": None,
        "block_size": 16,
        "liveness": "event",
        "topology": "pd",
        "max_model_len": 2048,
    }
    assert adopt_recorded(HEADER | {"liveness": "legacy"}, given, explicit=set()) == {
        "num_blocks": 512,
        "block_size": 16,
        "liveness": "legacy",
        "topology": "pd",
        "max_model_len": 4096,
    }
    assert "liveness" not in adopt_recorded(
        HEADER, given | {"liveness": "event"}, explicit={"liveness"}
    )


def test_an_explicit_option_that_conflicts_with_the_recording_names_both():
    with pytest.raises(
        ValueError, match="--liveness legacy conflicts with the recording's liveness event"
    ):
        adopt_recorded(HEADER, {"liveness": "legacy"}, explicit={"liveness"})


def _recording(tmp_path, header: dict):
    lines = [
        header,
        {"t": 0.0, "id": "r1", "prompt_len": 64, "max_tokens": 4},
        {"t": 0.0, "id": "r2", "prompt_len": 64, "max_tokens": 4},
        {"t": 5.0, "kv": {"P": {"used": 0, "free": 511}, "D": {"used": 0, "free": 511}}},
        {"t": 6.0, "id": "r3", "prompt_len": 64, "max_tokens": 4},
    ]
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", "replay", *args, "--no-live"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_virtual_replay_of_a_recording_runs_the_recorded_pool_and_matches_its_snapshots(tmp_path):
    done = _replay(str(_recording(tmp_path, HEADER)), "--clock", "virtual")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "28671" not in done.stdout


def test_a_replay_of_a_recording_with_a_conflicting_pool_size_is_refused_naming_both(tmp_path):
    done = _replay(str(_recording(tmp_path, HEADER)), "--clock", "virtual", "--num-blocks", "1024")
    assert done.returncode == 2
    assert "--num-blocks 1024 conflicts with the recording's num_blocks 512" in done.stderr


def test_a_recording_read_through_a_pipe_is_adopted_as_from_a_file(tmp_path):
    recording = _recording(tmp_path, HEADER)
    done = subprocess.run(
        [
            "bash",
            "-c",
            '"$0" -m cli replay <(cat "$1") --clock virtual --no-live',
            sys.executable,
            str(recording),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "28671" not in done.stdout


class _AnsweringRouter:
    """A serve's router with no engines: every request ends at once with one token."""

    engines = ["P", "D"]
    has_pending = False

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []

    def add_request(self, req_id, prompt_token_ids, max_tokens) -> None:
        self.outputs.append(RequestOutput(req_id, [1], "length"))

    def abort(self, req_id: str) -> None: ...

    def poll(self, timeout_s):
        out, self.outputs = self.outputs, []
        return out

    def take_stats(self):
        return []

    def request_stats(self) -> None: ...


class _LateClient:
    """A ServeClient that sends one request LATE_S after the driver meant to (a busy client)."""

    def __init__(self, client, late_id: str) -> None:
        self.client, self.late_id = client, late_id

    def __getattr__(self, name):
        return getattr(self.client, name)

    def add_request(self, req_id, prompt_token_ids, max_tokens, pd=None, trace_t=None) -> None:
        if req_id == self.late_id:
            time.sleep(LATE_S)  # the lateness itself, not a wait for anything
        extra = {} if trace_t is None else {"trace_t": trace_t}
        self.client.add_request(req_id, prompt_token_ids, max_tokens, pd, **extra)


LATE_S = 0.4


def test_a_replay_client_that_sends_late_is_recorded_at_its_traces_times(tmp_path):
    from replay.serve.client import ServeClient
    from replay.serve.messages import ServeInfo
    from replay.serve.server import ServeOptions, Server
    from replay.trace.reader import TraceRequest
    from replay.wall.driver import WallClockReplay, WallOptions

    path = tmp_path / "rec.jsonl"
    server = Server(
        _AnsweringRouter(),
        ServeOptions(f"ipc://{tmp_path}/serve", record=path),
        ServeInfo(["P", "D"], "pd", "event", 512, 16),
    )
    stop = threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"should_stop": stop.is_set})
    thread.start()
    client = None
    try:
        client = ServeClient(server.address)
        trace = [
            TraceRequest(t=t, req_id=f"r{i}", max_tokens=1, prompt_len=8)
            for i, t in enumerate((0.0, 0.2, 1.0))
        ]
        timeline = WallClockReplay(_LateClient(client, "r1"), WallOptions(tail_s=0.05)).run(trace)
    finally:
        if client is not None:
            client.shutdown()
        stop.set()
        thread.join(10)
        server.close()
    late = {r.req_id: r.send_t - r.arrival_t for r in timeline.requests}
    assert late["r1"] >= LATE_S and late["r0"] < LATE_S / 2  # the client was late with r1
    recorded = [json.loads(line) for line in path.read_text().splitlines()[1:] if "id" in line]
    assert [r["id"].split("@")[0] for r in recorded] == ["r0", "r1", "r2"]
    # The trace's times on the recording's clock, from the client's first request (r0):
    # r1's lateness is not a gap; stamped at its arrival it would sit at 0.2 + 0.4 s.
    assert [r["t"] for r in recorded] == [0.0, 0.2, 1.0]


@pytest.mark.slow
def test_a_live_recording_replays_as_itself_its_snapshots_matched_exactly_on_both_clocks(tmp_path):
    """What a live recording promises (replay/serve/recorder.py): its settled snapshots are
    matched at tolerance 0, the default for such a recording, by a replay that keeps up."""
    from tests.e2e.test_cli import Serve, invoke

    trace, recording = tmp_path / "two_bursts.jsonl", tmp_path / "recorded.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"t": t, "id": f"r{i}", "prompt_len": 64, "max_tokens": 4}) + "\n"
            for i, t in enumerate((0.0, 0.05, 0.1, 0.15, 2.5, 2.55))
        )
    )
    serve = Serve("--liveness", "event", "--record", str(recording))
    try:
        sent = invoke("replay", str(trace), "--target", serve.address, "--no-live", "--tail", "1.5")
        assert sent.exit_code == 0, sent.output
    finally:
        assert serve.stop() == 0
    snapshots = [json.loads(line) for line in recording.read_text().splitlines() if '"kv"' in line]
    assert snapshots and all(s["kv"]["P"]["used"] == s["kv"]["D"]["used"] == 0 for s in snapshots)
    for clock in ("virtual", "wall"):
        report = tmp_path / f"{clock}.json"
        replayed = invoke(
            "replay",
            str(recording),
            "--clock",
            clock,
            "--runner",
            "mock",
            "--no-live",
            "--report",
            str(report),
        )
        data = json.loads(report.read_text())
        assert data["settings"]["verify"]["snapshot_tolerance_blocks"] == 0
        lagged = [
            r
            for r in data.get("reasons", [])
            if r.startswith(("recorded snapshot not reached", "starved"))
        ]
        if clock == "wall" and replayed.exit_code == 3 and lagged:
            pytest.skip(f"the wall replay lagged the recording on this loaded machine: {lagged[0]}")
        assert replayed.exit_code == 0, (clock, replayed.output)
        assert not [v for v in data["violations"] if v["kind"] == "snapshot"]


def test_a_line_after_a_traced_request_that_leads_the_clock_keeps_the_times_in_order(tmp_path):
    path = tmp_path / "rec.jsonl"
    recorder = TraceRecorder(path, {"topology": "pd"})
    recorder.clock = clock = _Clock()
    recorder.request("r1", [1], 1, trace_t=0.0, source=b"c")  # late by 0.3 s: placed at 0
    clock.now += 0.2
    recorder.request("r2", [1], 1, trace_t=0.5, source=b"c")  # on time: placed at 0.5, now is 0.2
    recorder.abort("r2@2")  # at now (0.2): not before r2's line
    recorder.close()
    assert [json.loads(line)["t"] for line in path.read_text().splitlines()[1:]] == [0.0, 0.5, 0.5]
