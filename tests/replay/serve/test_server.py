"""`kvdrain serve`'s client side (replay/serve/server.py): clients that do not read, or have left."""

from __future__ import annotations

import time

import pytest
import zmq

import replay.serve.server as serve
from engine.core.outputs import RequestOutput
from engine.proc.messages import AddRequest, GetStats, StatsSnapshot
from engine.proc.stats_check import REQUIRED_COUNTS
from replay.serve.messages import ServeInfo, encode
from replay.serve.server import ServeOptions, Server


class _ScriptedRouter:
    """A router with no engines: outputs and snapshots as the test hands them over."""

    engines = ["P", "D"]
    has_pending = False

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.outputs: list[RequestOutput] = []
        self.stats: list[StatsSnapshot] = []

    def add_request(self, req_id, prompt_token_ids, max_tokens) -> None:
        self.added.append(req_id)

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    def poll(self, timeout_s):
        out, self.outputs = self.outputs, []
        return out

    def take_stats(self):
        out, self.stats = self.stats, []
        return out

    def request_stats(self) -> None:
        return None


def _snapshot(seq: int) -> StatsSnapshot:
    return StatsSnapshot(
        "P", seq, time.monotonic(), "stepping", seq, 0, dict.fromkeys(REQUIRED_COUNTS, 0)
    )


def _client(address: str, rcvhwm: int = 0) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(address)
    return sock


def _run_until(server: Server, until, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the serve did not get there in time"
        server.run_once(5)


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "MAX_QUEUED_PER_CLIENT", 200)
    router = _ScriptedRouter()
    server = Server(
        router,
        ServeOptions(f"ipc://{tmp_path}/serve"),
        ServeInfo(["P", "D"], "pd", "event", 512, 4),
    )
    yield server
    server.close()


def test_a_subscriber_that_does_not_read_is_dropped_and_its_requests_aborted(server):
    idle = _client(server.address, rcvhwm=1)
    try:
        idle.send(encode(GetStats()))
        for i in range(3):
            idle.send(encode(AddRequest(f"q{i}", [1, 2, 3], 8)))
        _run_until(server, lambda: len(server.router.added) == 3 and server.subscribers)
        seq = 0
        while server.num_dropped_clients == 0:  # the fan-out fills its queue: it is dropped
            assert seq < 200_000, "a subscriber that never reads was never dropped"
            server.router.stats = [_snapshot(seq := seq + 1) for _ in range(100)]
            server.run_once(0)
        assert not server.subscribers and server.num_dropped_clients == 1
        assert sorted(server.router.aborted) == sorted(server.router.added)
        assert server.owners == {} and server.internal_ids == {}
    finally:
        idle.close()


def test_a_client_that_left_has_its_requests_aborted_at_their_next_output(server):
    gone = _client(server.address)
    stays = _client(server.address)
    try:
        for sock, name in ((gone, "g"), (stays, "s")):
            sock.send(encode(AddRequest(f"{name}0", [1, 2, 3], 8)))
            sock.send(encode(AddRequest(f"{name}1", [1, 2, 3], 8)))
        _run_until(server, lambda: len(server.router.added) == 4)
        ids = {server.owners[r][1]: r for r in server.router.added}
        gone.close()
        deadline = time.monotonic() + 10
        while not server.router.aborted:  # each output finds the client gone once its pipe is
            assert time.monotonic() < deadline, "a departed client's requests were never aborted"
            server.router.outputs = [RequestOutput(ids["g0"], [7])]
            server.run_once(10)
        assert sorted(server.router.aborted) == sorted([ids["g0"], ids["g1"]])
        server.router.outputs = [RequestOutput(ids["s0"], [7])]
        server.run_once(10)
        assert stays.poll(5000) and server.num_dropped_clients == 1
        assert set(server.owners) == {ids["s0"], ids["s1"]}
    finally:
        gone.close()
        stays.close()


def test_every_serve_start_has_its_own_id(server, tmp_path):
    other = Server(
        _ScriptedRouter(),
        ServeOptions(f"ipc://{tmp_path}/other"),
        ServeInfo(["P", "D"], "pd", "event", 512, 4),
    )
    try:
        assert len(server.info.serve_id) == 16 and other.info.serve_id != server.info.serve_id
    finally:
        other.close()


def _fake_serve(address: str) -> zmq.Socket:
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.setsockopt(zmq.RCVTIMEO, 5000)  # every wait bounded
    fake.bind(address)
    return fake


def _answered_client(fake: zmq.Socket, address: str, info: ServeInfo):
    """A ServeClient made in a thread while `fake` answers its GetStats with info."""
    import threading

    from replay.serve.client import ServeClient

    made: list = []
    thread = threading.Thread(target=lambda: made.append(ServeClient(address)))
    thread.start()
    identity, _ = fake.recv_multipart()
    fake.send_multipart([identity, encode(info)])
    thread.join(10)
    return made[0], identity


def test_a_serve_restarted_at_the_same_address_is_noticed_not_spliced(tmp_path):
    from dataclasses import replace

    from replay.ui.dashboard import DashboardState
    from replay.ui.monitor import ServeMonitor

    address = f"ipc://{tmp_path}/fake"
    info = ServeInfo(["P", "D"], "pd", "event", 512, 4, serve_id="first")
    fake = _fake_serve(address)
    client = None
    try:
        client, identity = _answered_client(fake, address, info)
        old = StatsSnapshot(
            "P", 900, time.monotonic(), "blocked", 900, 1, dict.fromkeys(REQUIRED_COUNTS, 0)
        )
        fake.send_multipart([identity, encode(old)])
        fake.send_multipart([identity, encode(info)])  # a renewal's answer: the same serve
        new = _snapshot(1)
        for msg in (replace(info, serve_id="second"), new):
            fake.send_multipart([identity, encode(msg)])
        deadline = time.monotonic() + 10
        while client.latest.get("P") != new:
            assert time.monotonic() < deadline, "the new serve's snapshot never came"
            client.poll(0.05)
        assert len(client.restarts) == 1 and "restarted" in client.restarts[0]
        assert client.errors == [("", client.restarts[0])] and client.info.serve_id == "second"
        state = DashboardState(title="kvdrain top")
        monitor = ServeMonitor(state, view=type("View", (), {"tick": lambda self: None})())
        monitor.on_restarts(client.restarts)
        monitor.on_restarts(client.restarts)  # said once
        assert state.messages == client.restarts and state.title.endswith("(restarted)")
    finally:
        if client is not None:
            client.shutdown()
        fake.close()


class _DyingRouter(_ScriptedRouter):
    """Its engines die at the first poll (a SIGTERM to the whole process group)."""

    def poll(self, timeout_s):
        from engine.proc.client import EngineDeadError

        raise EngineDeadError("P", "engine core P (pid 1) died with exit code 0")


def test_engines_that_die_once_a_stop_was_asked_for_end_the_serve_quietly(tmp_path):
    from engine.proc.client import EngineDeadError

    server = Server(
        _DyingRouter(),
        ServeOptions(f"ipc://{tmp_path}/serve"),
        ServeInfo(["P", "D"], "pd", "event", 512, 4),
    )
    try:
        asked = iter([False, True])  # the stop comes while the round runs
        server.serve_forever(should_stop=lambda: next(asked, True))
        with pytest.raises(EngineDeadError):  # no stop asked: the death is the serve's error
            server.serve_forever(should_stop=lambda: False)
    finally:
        server.close()


@pytest.mark.slow
def test_a_group_sigterm_stops_the_serve_with_exit_143_and_no_traceback():
    import os
    import re
    import signal
    import subprocess
    import sys

    from replay.verify.verdict import EXIT_TERMINATED
    from tests.paths import ROOT

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "64",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not re.search("listening on", proc.stdout.readline() or ""):
            assert time.monotonic() < deadline and proc.poll() is None, "the serve did not start"
        os.killpg(proc.pid, signal.SIGTERM)  # the serve and every engine and worker at once
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == EXIT_TERMINATED, out
    assert "Traceback" not in out and "stopped after 0 requests" in out, out


def test_a_traced_request_at_no_time_a_trace_can_hold_is_dropped_and_the_serve_goes_on(server):
    """trace_t NaN, infinite, negative or past the trace format's bound would be written into
    a recording the reader then refuses; the message is dropped as bad, the next one runs."""
    from replay.serve.messages import TracedRequest

    client = _client(server.address)
    try:
        for i, t in enumerate([float("nan"), float("inf"), -1.0, 1e8, 2.5]):
            client.send(encode(TracedRequest(AddRequest(f"r{i}", [1, 2], 1), t)))
        _run_until(server, lambda: server.router.added)
        assert server.num_bad_messages == 4 and server.router.added == ["r4@1"]
    finally:
        client.close()
