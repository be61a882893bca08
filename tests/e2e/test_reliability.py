"""Signals, bounded resources, credentials and errors before start."""

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

from cli import EXAMPLE
from engine.proc.run_dir import (
    is_alive,
    make_run_dir,
    process_start_time,
    read_owner,
    sweep_dead_runs,
)
from replay.runtime.interrupt import Interrupted, interruptible
from tests.paths import ROOT
from tests.proc_utils import descendants, wait_until

# ---- helpers -------------------------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def run_root(monkeypatch):
    """A private root for run directories (short: ipc paths must stay under ~100 chars)."""
    root = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    monkeypatch.setenv("KVDRAIN_RUN_ROOT", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---- signals, the run dir, leftovers ------------------------------------------


def test_interruptible_raises_once_then_only_counts():
    with interruptible() as handler:
        with pytest.raises(Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this returns
        assert caught.value.exit_code == 143 and caught.value.name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # during cleanup: noted, not raised
        os.kill(os.getpid(), signal.SIGTERM)
    assert handler.num_ignored == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert Interrupted(signal.SIGINT).exit_code == 130


def test_run_dir_records_its_owner_and_is_private(run_root):
    path = make_run_dir()
    assert os.path.dirname(path) == run_root
    assert os.stat(path).st_mode & 0o777 == 0o700  # only this uid reaches the ipc sockets
    assert read_owner(path) == (os.getpid(), process_start_time(os.getpid()))


def test_next_start_sweeps_leftovers_of_dead_runs(run_root):
    dead = dead_pid()
    stale = Path(run_root, "kvdrain-stale")
    stale.mkdir(mode=0o700)
    (stale / "owner").write_text(f"{dead} 1\n")
    (stale / "P-in").write_text("")
    reused = Path(run_root, "kvdrain-reused")  # the owner's pid runs again, another process
    reused.mkdir(mode=0o700)
    (reused / "owner").write_text(f"{os.getpid()} 0\n")
    live = Path(make_run_dir())
    foreign = Path(run_root, "kvdrain-noowner")  # not ours to judge: no owner record
    foreign.mkdir()
    public = Path(run_root, "kvdrain-public")  # anyone could have written it: not kvdrain's
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    (public / "owner").write_text(f"{dead} 1\n")
    segment_dir = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    dead_segment = Path(segment_dir, f"kvdrain-kv-{dead}-0123456789ab")
    live_segment = Path(segment_dir, f"kvdrain-kv-{os.getpid()}-0123456789ab")
    dead_segment.write_bytes(b"x")
    live_segment.write_bytes(b"x")
    try:
        make_run_dir()
        assert not stale.exists() and not reused.exists() and not dead_segment.exists()
        assert live.exists() and foreign.exists() and public.exists() and live_segment.exists()
        assert sweep_dead_runs() == []
    finally:
        for path in (dead_segment, live_segment):
            path.unlink(missing_ok=True)
    assert not is_alive(dead) and is_alive(os.getpid())


def _replay_process(run_root: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, KVDRAIN_RUN_ROOT=run_root)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "replay",
            str(EXAMPLE),
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "256",
            *args,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
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


def _kill_all(proc: subprocess.Popen, children: list[tuple[int, str | None]]) -> None:
    for pid, start in [(proc.pid, None), *children]:
        if is_alive(pid, start):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.slow
def test_sigterm_stops_the_replay_shuts_engines_down_and_removes_the_run_dir(run_root):
    proc = _replay_process(run_root)
    children: list[tuple[int, str | None]] = []
    try:  # two engines, each with its connector worker, and their ipc sockets
        children = wait_until(
            lambda: (lambda d: d if len(d) >= 4 else None)(descendants(proc.pid)),
            90,
            "4 child processes",
        )
        wait_until(lambda: any(Path(run_root).glob("kvdrain-*/D-kv")), 90, "the workers' sockets")
        children = sorted({*children, *descendants(proc.pid)})  # with any that settled since
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        leftovers = _leftovers(run_root, children)  # at once: nothing may linger after exit
    finally:
        _kill_all(proc, children)
    assert proc.returncode == 143, out
    assert "TERMINATED: by SIGTERM" in out, out
    assert "Traceback" not in out, out
    assert leftovers == {"processes": [], "run dirs": [], "segments": []}


@pytest.mark.slow
def test_sigkill_leftovers_are_swept_by_the_next_start(run_root):
    proc = _replay_process(run_root)
    children: list[tuple[int, str | None]] = []
    try:
        children = wait_until(
            lambda: (lambda d: d if len(d) >= 4 else None)(descendants(proc.pid)),
            90,
            "4 child processes",
        )
        wait_until(lambda: any(Path(run_root).glob("kvdrain-*/D-kv")), 90, "the workers' sockets")
        children = sorted({*children, *descendants(proc.pid)})  # with any that settled since
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # The children notice their parent is gone (its sentinel) and exit on their own.
        wait_until(lambda: not _leftovers(run_root, children)["processes"], 30, "children exit")
        assert os.listdir(run_root)  # a SIGKILL runs no cleanup: the run dir stays ...
        make_run_dir()  # ... until the next start
        assert len(os.listdir(run_root)) == 1
    finally:
        _kill_all(proc, children)
    assert not _leftovers(run_root, children)["segments"]


@pytest.mark.slow
def test_an_interrupted_replay_prints_its_partial_verdict(run_root, tmp_path, monkeypatch):
    """SIGTERM once the first output arrived: the verdict of what ran, report says so, 143."""
    from click.testing import CliRunner

    from cli import cli
    from replay.wall.driver import WallClockReplay

    on_output = WallClockReplay._on_output

    def signal_on_first_output(self, output):
        on_output(self, output)
        if output.finished and not self.interrupted:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(WallClockReplay, "_on_output", signal_on_first_output)
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(EXAMPLE),
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "256",
            "--report",
            str(report),
        ],
    )
    assert result.exit_code == 143, result.output
    assert "TERMINATED: by SIGTERM after" in result.output and "of 32 requests" in result.output
    data = json.loads(report.read_text())
    assert data["interrupted"] == "SIGTERM" and data["exit_code"] == 143
    assert os.listdir(run_root) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ---- errors before start ----------------------------------------------------


def _serve_without_engines(monkeypatch, *args: str):
    """`kvdrain serve ARGS`, failing the test if it gets as far as starting engines."""
    from click.testing import CliRunner

    import replay.commands.serve
    from cli import cli

    def no_engines(*a, **k):
        raise AssertionError("the engines were started before the check")

    monkeypatch.setattr(replay.commands.serve, "start_topology", no_engines)
    return CliRunner().invoke(
        cli, ["serve", "--runner", "mock", "--no-live", *args], catch_exceptions=False
    )


def test_serve_on_an_address_in_use_fails_before_any_engine_starts(monkeypatch):
    import zmq

    taken = zmq.Context.instance().socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    try:
        taken.bind("tcp://127.0.0.1:0")
        address = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        result = _serve_without_engines(monkeypatch, "--address", address)
    finally:
        taken.close()
    assert result.exit_code == 2, result.output
    assert f"--address {address}: Address already in use" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_serve_http_on_a_port_in_use_fails_before_any_engine_starts(monkeypatch):
    """It printed "listening", then a 55-line traceback and exit 1 (read as a violation)."""
    import socket

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        result = _serve_without_engines(monkeypatch, "--http", str(port))
    finally:
        taken.close()
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: --http 127.0.0.1:{port}: Address already in use"


def test_serve_with_an_unwritable_record_path_fails_before_any_engine_starts(monkeypatch, tmp_path):
    path = tmp_path / "no-such-dir" / "traffic.jsonl"
    result = _serve_without_engines(monkeypatch, "--record", str(path))
    assert result.exit_code == 2, result.output
    assert f"--record {path}: cannot write: No such file or directory" in result.output
    assert len(result.output.strip().splitlines()) == 1


# ---- bounded resources --------------------------------------------------------


class _QuietRouter:
    """A router with no engines: the serve's client side alone."""

    engines = ["P", "D"]
    has_pending = False

    def poll(self, timeout_s):
        return []

    def take_stats(self):
        return []

    def request_stats(self):
        return None


def _counts(num_usable_blocks: int = 8, used: int = 0) -> dict[str, int]:
    from engine.proc.stats_check import REQUIRED_COUNTS

    counts = dict.fromkeys(REQUIRED_COUNTS, 0)
    counts.update(
        num_usable_blocks=num_usable_blocks,
        num_used_blocks=used,
        num_free_blocks=num_usable_blocks - used,
    )
    return counts


def _serve(tmp_path, address: str | None = None, **options):
    from replay.serve.messages import ServeInfo
    from replay.serve.server import ServeOptions, Server

    return Server(
        _QuietRouter(),
        ServeOptions(address or f"ipc://{tmp_path}/serve", **options),
        ServeInfo(["P", "D"], "pd", "event", 512, 4),
    )


def _drive(server, until, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the serve did not get there in time"
        server.run_once(10)


def _dealer(address: str):
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_serve_drops_stats_subscribers_that_left(tmp_path):
    from engine.proc.messages import GetStats, encode

    server = _serve(tmp_path)
    now = [1000.0]
    server.clock = lambda: now[0]
    clients = [_dealer(server.address) for _ in range(201)]
    try:
        for sock in clients:  # 200 subscribe and leave; the last one stays and renews
            sock.send(encode(GetStats()))
        _drive(server, lambda: len(server.subscribers) == 201)
        for sock in clients[:200]:
            sock.close()
        now[0] += 31.0  # past SUBSCRIBER_TTL_S; the sweep is held off until the renewal is in
        server._last_expiry = now[0]  # (on a loaded machine it can take longer than one poll)
        clients[-1].send(encode(GetStats()))
        _drive(server, lambda: 1031.0 in server.subscribers.values())
        now[0] += 1.0  # the next once-a-second sweep
        _drive(server, lambda: server.num_expired_subscribers > 0)
        assert server.num_expired_subscribers == 200
        assert list(server.subscribers.values()) == [1031.0]
    finally:
        for sock in clients:
            sock.close()
        server.close()


def _fake_serve(tmp_path):
    import zmq

    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.setsockopt(zmq.RCVTIMEO, 5000)  # every wait bounded
    fake.bind(f"ipc://{tmp_path}/fake")
    return fake


def test_serve_client_renews_its_subscription(tmp_path, monkeypatch):
    """ServeClient sends GetStats every SUBSCRIPTION_RENEW_S while it polls."""
    import replay.serve.client as serve_client

    fake = _fake_serve(tmp_path)
    client = None
    try:
        client, identity = _dealer_answering(
            fake, lambda: serve_client.ServeClient(f"ipc://{tmp_path}/fake")
        )
        monkeypatch.setattr(serve_client, "SUBSCRIPTION_RENEW_S", 0.0)
        client.poll(0)
        assert fake.recv_multipart()[0] == identity
    finally:
        if client is not None:
            client.shutdown()
        fake.close()


def test_forged_stats_are_dropped_and_counted_by_the_serve_client(tmp_path):
    """A StatsSnapshot of an unknown engine or with counts missing never reaches the replay."""
    from engine.proc.messages import StatsSnapshot, encode
    from replay.serve.client import ServeClient

    fake = _fake_serve(tmp_path)
    client = None
    good = StatsSnapshot("P", 3, 1.0, "blocked", 5, 1, _counts(used=2))
    try:
        client, identity = _dealer_answering(fake, lambda: ServeClient(f"ipc://{tmp_path}/fake"))
        for snap in (
            StatsSnapshot("X", 1, 1.0, "blocked", 5, 1, _counts()),
            StatsSnapshot("P", 2, 1.0, "blocked", 5, 1, {}),
            StatsSnapshot("P", 2, 1.0, "blocked", 5, 1, {**_counts(), "num_used_blocks": -1}),
            StatsSnapshot("P", 2, 1.0, "dancing", 5, 1, _counts()),
            good,
        ):
            fake.send_multipart([identity, encode(snap)])
        deadline = time.monotonic() + 10
        while "P" not in client.latest and time.monotonic() < deadline:
            client.poll(0.05)
        assert client.take_stats() == [good] and client.num_bad_messages == 4
    finally:
        if client is not None:
            client.shutdown()
        fake.close()


def _dealer_answering(fake, make_client):
    """make_client() in a thread while fake answers its GetStats with a ServeInfo;
    returns the client and its identity at the fake serve."""
    import threading

    from replay.serve.messages import ServeInfo, encode

    made: list = []
    thread = threading.Thread(target=lambda: made.append(make_client()))
    thread.start()
    identity, _ = fake.recv_multipart()
    fake.send_multipart([identity, encode(ServeInfo(["P", "D"], "pd", "event", 512, 4))])
    thread.join(10)
    return made[0], identity


def test_a_frame_over_the_largest_request_drops_its_connection_unread(tmp_path):
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from engine.proc.messages import AddRequest, encode
    from engine.proc.socket_limits import request_bytes

    server = _serve(tmp_path, max_model_len=64)
    assert server.socket.getsockopt(zmq.MAXMSGSIZE) == request_bytes(64)
    monitor = server.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    monitor.setsockopt(zmq.RCVTIMEO, 10000)
    big = _dealer(server.address)
    try:
        big.send(b"\x00" * (request_bytes(64) + 1))  # never read whole: the connection goes
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        server.run_once(0)
        assert server.num_bad_messages == 0 and server.num_requests == 0
        legit = _dealer(server.address)  # the largest legitimate request still gets in
        legit.send(encode(AddRequest("r", [7] * 64, 1)))
        server.router.add_request = lambda *a: None
        _drive(server, lambda: server.num_requests == 1)
        legit.close()
    finally:
        big.close()
        server.socket.disable_monitor()
        monitor.close()
        server.close()


@pytest.mark.slow
def test_forged_stats_on_an_engine_output_socket_are_dropped_and_counted(run_root):
    import zmq

    from engine.proc.messages import StatsSnapshot, encode
    from tests.mp_utils import topology

    with topology() as h:
        client = h.clients["P"]
        forger = _dealer_like(zmq.PUSH, client.addrs.output)
        try:  # stamped in the future, so a harness waiting for fresh stats would take them
            for snap in (
                StatsSnapshot("P", 99, time.monotonic() + 1e6, "blocked", 1, 1, {}),
                StatsSnapshot("X", 99, time.monotonic() + 1e6, "blocked", 1, 1, _counts()),
            ):
                forger.send(encode(snap))
            deadline = time.monotonic() + 20
            while client.num_bad_messages < 2 and time.monotonic() < deadline:
                h.poll(0.05)
        finally:
            forger.close()
        snap = h.stats("P")
        assert client.num_bad_messages == 2
        assert snap.engine_id == "P" and snap.counts["num_usable_blocks"] == 127
        assert snap.monotonic < time.monotonic()


def _dealer_like(kind: int, address: str):
    import zmq

    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


# ---- credentials -------------------------------------------------------------


@pytest.mark.parametrize(
    "address,local",
    [
        ("tcp://127.0.0.1:0", True),
        ("tcp://127.9.9.9:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("ipc:///tmp/x/serve", True),
        ("tcp://0.0.0.0:0", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://example.com:5555", False),
    ],
)
def test_what_counts_as_loopback(address: str, local: bool):
    from replay.serve.auth import is_loopback

    assert is_loopback(address) is local


def test_serve_beyond_loopback_without_keys_is_refused_before_any_engine_starts(monkeypatch):
    result = _serve_without_engines(monkeypatch, "--address", "tcp://0.0.0.0:0")
    assert result.exit_code == 2, result.output
    assert "listens beyond this machine: give --curve-keys DIR" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_insecure_serve_beyond_loopback_warns(tmp_path):
    from replay.serve.auth import AuthOptions
    from replay.serve.server import ServeOptions, open_front

    front = open_front(ServeOptions("tcp://0.0.0.0:0", auth=AuthOptions(insecure=True)), {})
    try:
        assert front.warnings and "WARNING: --insecure" in front.warnings[0]
    finally:
        front.close()


def test_keys_command_makes_private_pairs_and_never_overwrites(tmp_path):
    from click.testing import CliRunner

    from cli import cli

    keys = tmp_path / "keys"
    result = CliRunner().invoke(cli, ["keys", str(keys)])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in keys.iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert keys.stat().st_mode & 0o777 == 0o700
    assert all((keys / n).stat().st_mode & 0o077 == 0 for n in names if n.endswith("_secret"))
    again = CliRunner().invoke(cli, ["keys", str(keys)])
    assert again.exit_code == 2 and "not overwritten" in again.output


class _Serving:
    """A Server (no engines) run by a thread until the block ends."""

    def __init__(self, server) -> None:
        import threading

        self.server = server
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.server.run_once(10)

    def __enter__(self):
        self.thread.start()
        return self.server

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        self.server.close()


def _try_client(address: str, auth) -> str:
    from replay.serve.client import ServeClient

    try:
        client = ServeClient(address, timeout_s=1.5, auth=auth)
    except ConnectionError as e:
        return f"refused: {e}"
    client.shutdown()
    return "served"


@pytest.mark.slow
def test_curve_serve_answers_only_clients_with_its_keys(tmp_path):
    from replay.serve.auth import AuthOptions, generate_keys

    generate_keys(tmp_path / "keys")
    generate_keys(tmp_path / "other")
    server = _serve(tmp_path, "tcp://0.0.0.0:0", auth=AuthOptions(curve_keys=tmp_path / "keys"))
    with _Serving(server):  # listening on every interface; reached here over loopback
        address = f"tcp://127.0.0.1:{server.address.rpartition(':')[2]}"
        assert _try_client(address, AuthOptions(curve_keys=tmp_path / "keys")) == "served"
        assert _try_client(address, None).startswith("refused: no kvdrain serve answered")
        assert _try_client(address, AuthOptions(curve_keys=tmp_path / "other")).startswith(
            "refused"
        )
        missing = _try_client(address, AuthOptions(curve_keys=tmp_path / "none"))
        assert "cannot read client.key_secret" in missing


@pytest.mark.slow
def test_token_serve_answers_only_clients_with_the_token(tmp_path):
    from replay.serve.auth import AuthOptions

    server = _serve(tmp_path, auth=AuthOptions(token="s3cret"))
    with _Serving(server):
        assert _try_client(server.address, AuthOptions(token="s3cret")) == "served"
        assert _try_client(server.address, None).startswith("refused")
        assert _try_client(server.address, AuthOptions(token="guess")).startswith("refused")
    assert server.num_requests == 0 and server.num_bad_messages == 0


def test_the_engines_sockets_are_reachable_by_this_uid_only(run_root):
    """GetKVHandle answers whoever can connect to a worker's ipc socket: the run dir is 0700."""
    from engine.config import EngineConfig, KVTransferConfig
    from replay.deploy.topology import engine_configs

    run_dir = make_run_dir()
    configs = engine_configs(EngineConfig(), KVTransferConfig(), "pd", run_dir)
    for config in configs:
        for addr in (config.kv_transfer.kv_addr, config.kv_transfer.agent_addr):
            assert os.path.dirname(addr.removeprefix("ipc://")) == run_dir
    assert os.stat(run_dir).st_mode & 0o777 == 0o700


def test_early_arrivals_of_unknown_ids_are_capped_and_counted():
    """300k ReadDones for ids P never registered grew its worker by 87 MB: now at most
    MAX_EARLY_HOLDS are held, the rest dropped and counted; reads are refused at once."""
    from connector.send_ledger import MAX_EARLY_HOLDS, UNKNOWN_REQUEST, SendLedger

    ledger = SendLedger(30 * 10**9)
    for i in range(MAX_EARLY_HOLDS + 1000):
        ledger.read_done(f"stranger-{i}", 0)
    assert len(ledger.early) == MAX_EARLY_HOLDS
    assert ledger.counters["num_early_dropped"] == 1000
    refused = ledger.read("peer", "another-stranger", [1], 0)
    assert [r.error for r in refused.replies] == [UNKNOWN_REQUEST]
    ledger.register("r", [1, 2], 0)  # a registered send is served as before
    assert [r.ok for r in ledger.read("peer", "r", [1, 2], 0).replies] == [True]


def test_socket_caps_cover_the_largest_legitimate_messages():
    from engine.core.outputs import RequestOutput
    from engine.proc.messages import AddRequest, RequestOutputs, encode, output_to_msg
    from engine.proc.socket_limits import engine_input_bytes, engine_output_bytes, request_bytes

    max_model_len, max_num_seqs, block_size = 32768, 256, 16
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "r" * 256,
        "remote_block_ids": list(range(2**20, 2**20 + max_model_len // block_size)),
        "remote_addr": "ipc:///tmp/kvdrain-xxxxxxxx/P-kv",
    }
    request = AddRequest(
        "r" * 300, [2**31 - 1] * max_model_len, 2**31 - 1, params, [2**31 - 1] * 64
    )
    assert len(encode(request)) < request_bytes(max_model_len) <= engine_input_bytes(max_model_len)
    outputs = [
        RequestOutput(f"{'r' * 300}{i}", [2**31 - 1], "length", kv_transfer_params=params)
        for i in range(max_num_seqs)
    ]
    batch = RequestOutputs("P", [output_to_msg(o) for o in outputs])
    assert len(encode(batch)) < engine_output_bytes(max_model_len, max_num_seqs)
