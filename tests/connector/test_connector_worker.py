"""The prefill side's send ledger as plain calls with time passed in, then the connector worker process over ZMQ."""

from __future__ import annotations

import time

import pytest
import zmq

from connector import send_ledger
from connector.messages import (
    CONNECTOR_CODEC,
    BlockData,
    Heartbeat,
    HeartbeatSpec,
    KVReport,
    LeaseDue,
    LeasesReaped,
    ReadAbandoned,
    ReadBlocks,
    ReadDone,
    ReapLeases,
    RecvSpec,
    StepMeta,
)
from connector.send_ledger import (
    BLOCKS_NOT_HELD,
    EARLY_HOLD_NS,
    READ_LEASE_NS,
    UNKNOWN_REQUEST,
    ReadReply,
    ReapSchedule,
    SendLedger,
)
from connector.transfer import TransferError
from connector.worker_proc import ConnectorWorkerConfig, ConnectorWorkerProc
from tests.mp_utils import spawned_p_worker
from tests.paths import ROOT

LEASE = 9_000  # ns: small numbers read better; the ledger only adds and compares


def test_read_done_frees_a_held_send_once():
    ledger = SendLedger(LEASE)
    out = ledger.register("r1", [1, 2], now=0, deadline=LEASE)
    assert out.finished_sending == [] and out.hold_deadlines == []
    assert ledger.next_lease_deadline() == LEASE
    assert ledger.read_done("r1", now=5).finished_sending == ["r1"]
    assert ledger.counters["num_sent"] == 1 and not ledger.sends
    assert ledger.next_lease_deadline() is None  # the finished send's lease is gone
    assert ledger.reap(now=LEASE).finished_sending == []


def test_a_lease_ends_only_when_reaped_and_a_late_read_done_is_counted():
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1], now=0, deadline=LEASE)
    assert ledger.expire_holds(now=10 * LEASE).finished_sending == []  # not the worker's timer
    assert ledger.read("peer", "r1", [1], now=2 * LEASE).replies == [ReadReply("peer", "r1", [1])]
    assert ledger.reap(now=LEASE - 1).finished_sending == []
    assert ledger.reap(now=LEASE).finished_sending == ["r1"]  # now >= lease, as vLLM's
    assert (
        ledger.counters["num_expired"] == 1 and ledger.reap(now=10 * LEASE).finished_sending == []
    )
    assert ledger.read_done("r1", now=LEASE + 1).finished_sending == []  # P freed them already
    # r1's bytes were served while held: the late "read done" is only late news.
    assert ledger.counters["num_reads_after_expiry"] == 0 and not ledger.early
    ledger.register("r2", [2], now=0, deadline=LEASE)  # never asked for: read behind P's back
    assert ledger.reap(now=LEASE).finished_sending == ["r2"]
    assert ledger.read_done("r2", now=LEASE + 1).finished_sending == []
    assert (
        ledger.counters["num_reads_after_expiry"] == 1 and not ledger.early and not ledger.expired
    )


def test_a_duplicate_read_done_is_dropped_not_held_for_a_later_registration():
    ledger = SendLedger(30 * LEASE)
    ledger.register("a", [1], now=0)
    assert ledger.read_done("a", now=10).finished_sending == ["a"]
    out = ledger.read_done("a", now=20)  # a second one (or a release) for the same send
    assert out.finished_sending == [] and out.hold_deadlines == [] and not ledger.early
    assert ledger.counters["num_read_done_duplicates"] == 1 and ledger.counters["num_sent"] == 1
    out = ledger.register("a", [2], now=5 * LEASE)  # the id comes back: it waits for its read
    assert out.finished_sending == [] and "a" in ledger.sends
    ledger.register("b", [3], now=0, deadline=LEASE)
    ledger.reap(now=LEASE)  # expired, then released twice: the second is a duplicate too
    ledger.read_done("b", now=LEASE + 1, read=False)
    assert ledger.read_done("b", now=LEASE + 2, read=False).hold_deadlines == []
    assert ledger.counters["num_read_done_duplicates"] == 2 and not ledger.early


def test_recently_finished_ids_are_bounded(monkeypatch):
    monkeypatch.setattr(send_ledger, "MAX_RECENTLY_FINISHED", 2)
    ledger = SendLedger(LEASE)
    for i in range(3):
        ledger.register(f"r{i}", [1], now=0)
        ledger.read_done(f"r{i}", now=1)
    assert list(ledger.recently_finished) == ["r1", "r2"]
    assert ledger.read_done("r0", now=2).hold_deadlines == [2 + LEASE]  # forgotten: early again


def test_the_stamped_deadline_is_the_lease_and_the_default_runs_from_registration():
    ledger = SendLedger(LEASE)
    ledger.register("stamped", [1], now=100, deadline=50 + LEASE)  # P stamped it at 50
    ledger.register("plain", [2], now=100)
    assert ledger.reap(now=50 + LEASE).finished_sending == ["stamped"]
    assert ledger.reap(now=100 + LEASE).finished_sending == ["plain"]


def test_a_reused_request_id_does_not_inherit_an_old_lease():
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1], now=0)
    ledger.read_done("r1", now=1)
    ledger.register("r1", [2], now=5)  # the id comes back
    assert ledger.reap(now=LEASE).finished_sending == []  # the first registration's lease
    assert "r1" in ledger.sends and ledger.next_lease_deadline() == 5 + LEASE
    assert ledger.reap(now=5 + LEASE).finished_sending == ["r1"]
    assert ledger.counters == {
        "num_sent": 1,
        "num_expired": 1,
        "num_read_done_dropped": 0,
        "num_reads_after_expiry": 0,
        "num_heartbeats": 0,
        "num_released_unread": 0,
        "num_reads_refused": 0,
        "num_expiries_deferred": 0,
    }


def test_heartbeats_extend_held_leases_when_reaped():
    """vLLM's _handle_heartbeat, run in get_finished: max(lease, now + lease * 2 // 3)."""
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1], now=0, deadline=LEASE)
    ledger.register("r2", [2], now=0, deadline=LEASE)
    assert ledger.receive_heartbeat(["r1", "ghost"]) is True  # the first queued: tell the engine
    assert ledger.receive_heartbeat(["r1"]) is False
    assert ledger.next_lease_deadline() == LEASE  # queued, not applied: P has not stepped
    # Applied at the reap, with the reap's time: r1 -> 8000 + 6000; r2 lapses.
    assert ledger.reap(now=8_000).finished_sending == []
    assert ledger.next_lease_deadline() == LEASE and ledger.sends["r1"].deadline == 14_000
    assert ledger.reap(now=LEASE).finished_sending == ["r2"]
    assert ledger.next_lease_deadline() == 14_000 and "ghost" not in ledger.sends
    ledger.receive_heartbeat(["r1"])
    ledger.reap(now=1_000)  # now + 2/3 lease < the lease: a heartbeat never shortens it
    assert ledger.sends["r1"].deadline == 14_000
    assert ledger.reap(now=14_000).finished_sending == ["r1"]
    assert ledger.counters["num_heartbeats"] == 3 and not ledger.heartbeats


def test_reap_schedule_is_the_engine_sides_view():
    schedule = ReapSchedule()
    assert schedule.due(holds_sends=True) is None
    schedule.on_register(50)
    schedule.on_register(30)
    assert schedule.due(holds_sends=True) == 30 and schedule.due(holds_sends=False) is None
    schedule.heartbeats_queued = True  # a LeaseDue: reap at the next step
    assert schedule.due(holds_sends=False) == 0
    schedule.on_reaped(70)
    assert schedule.due(holds_sends=True) == 70 and not schedule.heartbeats_queued


def test_a_read_done_before_the_send_is_registered_still_frees():
    """D can read and say "read done" before P's next step registers the send."""
    ledger = SendLedger(LEASE)
    out = ledger.read_done("r1", now=0)
    assert out.finished_sending == [] and out.hold_deadlines == [LEASE]  # held as long as a lease
    out = ledger.register("r1", [1, 2], now=3)
    assert out.finished_sending == ["r1"] and out.hold_deadlines == []
    assert ledger.counters["num_sent"] == 1 and not ledger.sends and not ledger.early
    assert ledger.next_lease_deadline() is None and ledger.next_hold_deadline() is None


def test_an_early_read_done_is_forgotten_after_a_lease():
    ledger = SendLedger(LEASE)
    ledger.read_done("r1", now=0)
    assert ledger.next_hold_deadline() == LEASE
    assert ledger.expire_holds(now=LEASE).replies == [] and not ledger.early
    ledger.register("r1", [1], now=LEASE + 1)  # too late: this send waits for its own read
    assert "r1" in ledger.sends and ledger.counters["num_sent"] == 0


def test_early_reads_are_answered_at_registration_and_strangers_refused_after_the_hold():
    ledger = SendLedger(LEASE, early_hold_ns=100)
    assert ledger.read("peer-a", "r1", [3], now=0).replies == []
    assert ledger.read("peer-b", "r1", [9], now=1).replies == []
    assert ledger.read("peer-c", "ghost", [1], now=2).hold_deadlines == [102]
    out = ledger.register("r1", [3, 4], now=50)
    assert out.replies == [
        ReadReply("peer-a", "r1", [3]),
        ReadReply("peer-b", "r1", [9], BLOCKS_NOT_HELD),
    ]
    assert ledger.expire_holds(now=101).replies == []
    assert ledger.expire_holds(now=102).replies == [
        ReadReply("peer-c", "ghost", [1], UNKNOWN_REQUEST)
    ]
    assert not ledger.early and "r1" in ledger.sends


def test_the_first_early_arrival_sets_the_hold():
    """An early read holds for early_hold_ns; a "read done" joining it does not extend it."""
    ledger = SendLedger(LEASE, early_hold_ns=100)
    ledger.read("peer", "r1", [1], now=0)
    assert ledger.read_done("r1", now=10).hold_deadlines == []
    out = ledger.expire_holds(now=100)
    assert out.replies == [ReadReply("peer", "r1", [1], UNKNOWN_REQUEST)] and not ledger.early
    ledger.register("r1", [1], now=101)
    assert "r1" in ledger.sends  # the forgotten "read done" does not free it


def test_drop_read_done_leaves_only_the_lease():
    ledger = SendLedger(LEASE, drop_read_done=True)
    ledger.register("r1", [1], now=0)
    assert ledger.read_done("r1", now=1).finished_sending == []
    assert ledger.counters["num_read_done_dropped"] == 1
    assert ledger.reap(now=LEASE).finished_sending == ["r1"]


def test_extend_moves_the_lease_of_a_held_send_only():
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1], now=0)
    ledger.extend("r1", 3 * LEASE)
    ledger.extend("ghost", 1)
    assert "ghost" not in ledger.early and "ghost" not in ledger.sends
    assert ledger.next_lease_deadline() == 3 * LEASE  # the old one is stale
    assert ledger.reap(now=2 * LEASE).finished_sending == []
    assert ledger.reap(now=3 * LEASE).finished_sending == ["r1"]


def test_oldest_registration():
    ledger = SendLedger(LEASE)
    assert ledger.oldest_registration() is None
    ledger.register("r1", [1], now=7)
    ledger.register("r2", [2], now=9)
    ledger.read_done("r1", now=10)
    assert ledger.oldest_registration() == 9


# ---- the process over ZMQ ---------------------------------------------------------------


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no message in time"
    return sock.recv_multipart()


def test_worker_process_serves_holds_refuses_and_reports(tmp_path):
    """One real worker: an early read is served at registration, a stranger's read is
    refused after the early hold, and "read done" comes back as finished_sending."""
    with spawned_p_worker(tmp_path, transport="zmq") as (config, cache, agent, peer):
        cache.tensor[:, :, 3].fill_(7.0)
        start = time.monotonic()
        peer.send(CONNECTOR_CODEC.encode(ReadBlocks("r1", [3])))
        peer.send(CONNECTOR_CODEC.encode(ReadBlocks("ghost", [1])))
        assert not peer.poll(100)  # both held: neither is registered yet
        agent.send(CONNECTOR_CODEC.encode(StepMeta({"r1": [3]}, [])))
        reply, data = _recv(peer)
        assert CONNECTOR_CODEC.decode(reply) == BlockData("r1", True, "", 0, 1)
        assert len(data) == cache.num_bytes_per_block and set(data[:4]) != {0}
        (refusal,) = _recv(peer)
        assert CONNECTOR_CODEC.decode(refusal) == BlockData("ghost", False, UNKNOWN_REQUEST)
        assert time.monotonic() - start >= EARLY_HOLD_NS / 1e9 - 0.01
        peer.send(CONNECTOR_CODEC.encode(ReadDone("r1")))
        report = CONNECTOR_CODEC.decode(_recv(agent)[0])
        assert isinstance(report, KVReport) and report.finished_sending == ["r1"]
        assert report.counters["num_sent"] == 1 and report.counters["num_sends_pending"] == 0


def test_worker_process_reaps_leases_only_when_the_engine_asks(tmp_path):
    """A lease past its deadline is still held (and read) until the engine's step sends
    ReapLeases; a heartbeat queues (LeaseDue) and is applied at that reap."""
    with spawned_p_worker(tmp_path, transport="zmq", kv_lease_s=0.6) as (
        config,
        cache,
        agent,
        peer,
    ):
        now = time.monotonic_ns()
        agent.send(
            CONNECTOR_CODEC.encode(
                StepMeta(
                    {"r1": [3], "r2": [4]}, [], {"r1": now + 200_000_000, "r2": now + 200_000_000}
                )
            )
        )
        peer.send(CONNECTOR_CODEC.encode(Heartbeat(["r2"])))
        assert CONNECTOR_CODEC.decode(_recv(agent)[0]) == LeaseDue()
        assert not agent.poll(400)  # both deadlines passed: nothing expires on its own
        peer.send(CONNECTOR_CODEC.encode(ReadBlocks("r1", [3])))
        reply, _ = _recv(peer)
        assert CONNECTOR_CODEC.decode(reply) == BlockData("r1", True, "", 0, 1)  # still held
        agent.send(CONNECTOR_CODEC.encode(ReapLeases()))
        asked = time.monotonic_ns()
        report = CONNECTOR_CODEC.decode(_recv(agent)[0])
        assert isinstance(report, KVReport) and report.finished_sending == ["r1"]
        assert report.counters["num_expired"] == 1 and report.counters["num_heartbeats"] == 1
        answer = CONNECTOR_CODEC.decode(_recv(agent)[0])
        # r2's heartbeat was applied at the reap: reap time + 0.4 s, not arrival + 0.4 s.
        assert isinstance(answer, LeasesReaped)
        assert (
            asked + 400_000_000 - 50_000_000
            < answer.next_deadline_ns
            <= time.monotonic_ns() + 400_000_000
        )
        agent.send(CONNECTOR_CODEC.encode(ReapLeases()))  # nothing due: just the answer
        assert CONNECTOR_CODEC.decode(_recv(agent)[0]) == answer


def test_decode_worker_sends_the_heartbeats_of_its_step(tmp_path):
    """D's worker forwards each HeartbeatSpec of a StepMeta to that P worker."""
    proc = ConnectorWorkerProc(
        ConnectorWorkerConfig(
            engine_id="D", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"
        )
    )
    p_kv = zmq.Context.instance().socket(zmq.ROUTER)
    p_kv.setsockopt(zmq.LINGER, 0)
    try:
        p_kv.bind(f"ipc://{tmp_path}/p-kv")
        proc._on_step_meta(
            StepMeta({}, [], {}, [HeartbeatSpec("P", f"ipc://{tmp_path}/p-kv", ["a", "b"])])
        )
        _, payload = _recv(p_kv)
        assert CONNECTOR_CODEC.decode(payload) == Heartbeat(["a", "b"])
        assert proc.counters["num_heartbeats_sent"] == 1
    finally:
        p_kv.close()
        proc.close()


@pytest.fixture
def worker_proc(tmp_path):
    proc = ConnectorWorkerProc(
        ConnectorWorkerConfig(
            engine_id="P", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"
        )
    )
    yield proc
    proc.close()


def test_garbage_from_a_peer_is_dropped_and_counted(worker_proc):
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    try:
        stranger.connect(worker_proc.config.kv_addr)
        stranger.send(b"\xc1 not msgpack")
        stranger.send_multipart([b"two", b"frames"])
        stranger.send(CONNECTOR_CODEC.encode(StepMeta({}, [])))  # valid, wrong socket
        stranger.send(CONNECTOR_CODEC.encode(ReadDone("r9")))  # and one good message
        for _ in range(4):
            assert worker_proc.peers.poll(2000)
            worker_proc._drain(worker_proc.peers, worker_proc._on_peer_message)
            if worker_proc.ledger.early:
                break
        assert worker_proc.counters["num_bad_messages"] == 3
        assert worker_proc.ledger.early["r9"].read_done  # still serving after the garbage
    finally:
        stranger.close()


def test_a_dead_workers_transfers_are_resolved_by_the_agent():
    """Held sends are released; pending loads finish with their blocks invalid; empty ones never wait."""
    from connector.agent import PendingTransfers
    from connector.messages import RecvSpec
    from connector.pd import PDConnectorMetadata
    from engine.core.outputs import KVConnectorOutput

    pending = PendingTransfers()
    pending.start(
        PDConnectorMetadata(
            {"s1": [1]},
            {
                "d1": RecvSpec("d1", [4, 5], [7, 8], "P", "p1", "a"),
                "d2": RecvSpec("d2", [], [], "P", "p2", "a"),
            },
        )
    )
    out = KVConnectorOutput()
    pending.resolve_orphans(out, now=10)
    assert out.finished_sending == set() and out.finished_recving == {"d1"}
    assert out.invalid_block_ids == {4, 5} and not pending.recvs
    # A decode worker may still copy s1 under a read lease the dead worker granted.
    assert pending.orphans_due() == 10 + READ_LEASE_NS
    out = KVConnectorOutput()
    pending.resolve_orphans(out, now=10 + READ_LEASE_NS)
    assert out.finished_sending == {"s1"} and not pending.sends and pending.orphans_due() is None


def test_the_agent_asks_for_a_reap_once_a_lease_may_have_passed():
    """PendingTransfers' ReapSchedule: stamped deadlines, a LeaseDue, the worker's answer."""
    from connector.agent import PendingTransfers
    from connector.pd import PDConnectorMetadata
    from engine.core.outputs import KVConnectorOutput

    pending = PendingTransfers(lease_ns=100)
    assert pending.reap_due() is None
    pending.start(PDConnectorMetadata({"s1": [1], "s2": [2]}, send_deadlines={"s2": 150}), now=10)
    assert pending.reap_due() == 110  # s1 unstamped: leased from now, as the worker does
    out = KVConnectorOutput()
    assert pending.merge(CONNECTOR_CODEC.encode(LeaseDue()), out) is None
    assert pending.reap_due() == 0  # heartbeats wait: the next step reaps
    assert pending.merge(CONNECTOR_CODEC.encode(LeasesReaped(150)), out) == LeasesReaped(150)
    assert pending.reap_due() == 150
    pending.merge(CONNECTOR_CODEC.encode(KVReport(["s1", "s2"], [], [], {})), out)
    assert pending.reap_due() is None and out.finished_sending == {"s1", "s2"}


def test_a_report_carries_only_the_counters_that_changed_and_the_agent_keeps_them_all(
    worker_proc, tmp_path
):
    """The first report carries every counter, later ones only those that changed (an
    unchanged counter is not resent); merged by the agent they equal the worker's own."""
    from connector.agent import PendingTransfers
    from engine.core.outputs import KVConnectorOutput

    agent = zmq.Context.instance().socket(zmq.PAIR)
    agent.setsockopt(zmq.LINGER, 0)
    agent.connect(worker_proc.config.agent_addr)
    agent.send(b"hello")  # once the worker has it, the pair is connected both ways
    assert worker_proc.agent.poll(5000) and worker_proc.agent.recv() == b"hello"
    pending = PendingTransfers()
    try:
        worker_proc._on_step_meta(StepMeta({"r1": [1], "r2": [2]}, []))
        reports = []
        for req_id in ("r1", "r2"):
            worker_proc._apply(worker_proc.ledger.read_done(req_id, time.monotonic_ns()))
            worker_proc._flush_report()
            data = _recv(agent)[0]
            reports.append(CONNECTOR_CODEC.decode(data))
            pending.merge(data, KVConnectorOutput())
        expected = dict(worker_proc.counters, **worker_proc.ledger.counters, num_sends_pending=0)
        first, second = reports
        assert first.finished_sending == ["r1"] and second.finished_sending == ["r2"]
        assert set(expected) <= set(first.counters) and first.counters["num_sent"] == 1
        assert {"num_sent", "num_sends_pending"} <= set(second.counters)
        unchanged = {"num_recved", "num_failed_recvs", "num_expired", "num_bad_messages"}
        assert not unchanged & set(second.counters)
        assert {name: pending.counters[name] for name in expected} == expected
        assert expected["num_sent"] == 2 and not agent.poll(0)  # nothing more to report
    finally:
        agent.close()


def test_the_worker_has_mapped_the_kv_cache_before_the_engine_goes_on(tmp_path) -> None:
    """PDConnectorAgent returns (and so the engine core says Ready) only once its worker
    has mapped the KV cache: on CUDA that is the worker's context and an IPC open, seconds
    on a big GPU, which the first KV loads used to wait for (a false 'stuck worker' fault
    on an H200). Seen from outside: the segment is in the worker's memory map at once."""
    from connector.agent import PDConnectorAgent
    from engine.config import EngineConfig, KVTransferConfig, ModelConfig
    from engine.runner.kv_cache import KVCache

    config = EngineConfig(
        engine_id="P",
        num_blocks=8,
        kv_transfer=KVTransferConfig(
            kv_role="kv_producer",
            agent_addr=f"ipc://{tmp_path}/agent",
            kv_addr=f"ipc://{tmp_path}/kv",
        ),
    )
    cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=16)
    agent = PDConnectorAgent(config, cache.handle.to_dict())
    try:
        with open(f"/proc/{agent.process.pid}/maps") as maps:
            assert cache.handle.name in maps.read()
    finally:
        agent.shutdown()
        cache.close()


def test_the_pulls_due_together_tell_the_prefill_worker_once_all_are_read(tmp_path, monkeypatch):
    """A batch of due pulls: every ReadDone (or ReadAbandoned, for a failed pull) goes
    out after the batch's last pull, so P's worker reports them together and P's engine
    wakes once; with NOTIFY_BATCH_NS passed, each goes out after its own pull (the
    straightforward order, which the batch keeps: same messages, same peers)."""
    from connector import worker_proc as wp

    def run(batch_ns: int) -> tuple[list[tuple], list[str]]:
        monkeypatch.setattr(wp, "NOTIFY_BATCH_NS", batch_ns)
        proc = ConnectorWorkerProc(
            ConnectorWorkerConfig(
                engine_id="D",
                agent_addr=f"ipc://{tmp_path}/a{batch_ns}",
                kv_addr=f"ipc://{tmp_path}/k{batch_ns}",
            )
        )
        events: list[tuple] = []

        class Link:
            def __init__(self, addr: str) -> None:
                self.addr = addr

            def send(self, msg: object) -> bool:
                events.append(("tell", self.addr, msg))
                return True

        def pull(local, spec: RecvSpec) -> None:
            events.append(("pull", spec.req_id))
            if spec.req_id == "b":
                raise TransferError("refused")

        try:
            monkeypatch.setattr(proc.puller, "pull", pull)
            monkeypatch.setattr(proc.puller, "link", Link)
            proc.kv_cache = object()  # mapped (the pulls are the fakes above)
            specs = [
                RecvSpec(r, [i + 1], [i + 5], "P", f"p-{r}", "ipc://p1" if r != "c" else "ipc://p2")
                for i, r in enumerate("abc")
            ]
            proc._on_step_meta(StepMeta({}, specs))
            proc._fire_timers()
            return events, list(proc.report.finished_recving)
        finally:
            proc.close()

    batched, recving = run(10**12)
    told = [
        ("tell", "ipc://p1", ReadDone("p-a")),
        ("tell", "ipc://p1", ReadAbandoned("p-b")),
        ("tell", "ipc://p2", ReadDone("p-c")),
    ]
    assert batched == [("pull", "a"), ("pull", "b"), ("pull", "c"), *told]
    assert recving == ["a", "b", "c"]
    one_by_one, recving = run(0)
    assert one_by_one == [("pull", "a"), told[0], ("pull", "b"), told[1], ("pull", "c"), told[2]]
    assert recving == ["a", "b", "c"]


def test_a_slow_peer_holds_back_no_news_of_the_pulls_before_it(tmp_path, monkeypatch):
    """The next pull's peer is silent: the ReadDone held for the pull before it goes out
    once that reply is SLOW_REPLY_MS late, not when the pull times out (2 s by default,
    a read lease: P would reap a send D read in time). A pull that dies mid-batch
    (SystemExit: SIGTERM) still lets the held news out."""
    from connector.transfer import PeerLink

    ctx = zmq.Context.instance()
    proc = ConnectorWorkerProc(
        ConnectorWorkerConfig(
            engine_id="D", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"
        )
    )
    peers = {name: ctx.socket(zmq.ROUTER) for name in ("p1", "silent")}
    events: list[tuple] = []
    real_pull, real_send = proc.puller.pull, PeerLink.send

    def pull(local, spec: RecvSpec) -> None:
        try:
            if spec.req_id == "b":
                real_pull(local, spec)  # a pin that no one answers
            elif spec.req_id == "c":
                raise SystemExit(0)
        finally:
            events.append(("pulled", spec.req_id))

    def send(link: PeerLink, msg: object) -> bool:
        if isinstance(msg, (ReadDone, ReadAbandoned)):
            events.append(("tell", link.addr.rsplit("/", 1)[1], msg))
        return real_send(link, msg)

    try:
        for name, sock in peers.items():
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{tmp_path}/{name}")
        monkeypatch.setattr(proc.puller, "pull", pull)
        monkeypatch.setattr(PeerLink, "send", send)
        proc.puller.timeout_s = 0.3
        proc.kv_cache = object()  # mapped (pull "a" is a fake success)
        specs = [
            RecvSpec(r, [1], [2], "P", f"p-{r}", f"ipc://{tmp_path}/{peer}")
            for r, peer in (("a", "p1"), ("b", "silent"))
        ]
        proc._on_step_meta(StepMeta({}, specs))
        proc._fire_timers()
        assert events == [
            ("pulled", "a"),
            ("tell", "p1", ReadDone("p-a")),
            ("pulled", "b"),
            ("tell", "silent", ReadAbandoned("p-b")),
        ]
        assert proc.report.invalid_block_ids == [1] and proc.counters["num_pull_timeouts"] == 1
        events.clear()
        proc._on_step_meta(
            StepMeta(
                {},
                [RecvSpec(r, [1], [2], "P", f"p-{r}", f"ipc://{tmp_path}/p1") for r in ("d", "c")],
            )
        )
        with pytest.raises(SystemExit):
            proc._fire_timers()
        assert events == [("pulled", "d"), ("pulled", "c"), ("tell", "p1", ReadDone("p-d"))]
    finally:
        for sock in peers.values():
            sock.close()
        proc.close()


def test_news_a_signal_interrupts_is_sent_at_close(tmp_path, monkeypatch):
    """SIGTERM (SystemExit) in the middle of sending a batch's news: what was not sent
    stays held (the item being sent included), and close() sends it before the links go."""
    proc = ConnectorWorkerProc(
        ConnectorWorkerConfig(
            engine_id="D", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"
        )
    )
    sent: list[object] = []
    signals = [SystemExit(0)]

    class Link:
        def send(self, msg: object) -> bool:
            if signals:
                raise signals.pop()
            sent.append(msg)
            return True

    monkeypatch.setattr(proc.puller, "link", lambda addr: Link())
    news = [
        ("ipc://p1", ReadDone("p-a")),
        ("ipc://p1", ReadAbandoned("p-b")),
        ("ipc://p2", ReadDone("p-c")),
    ]
    proc.held.extend(news)
    try:
        with pytest.raises(SystemExit):
            proc._send_held()
        assert list(proc.held) == news and sent == []
    finally:
        proc.close()
    assert sent == [msg for _, msg in news] and not proc.held


def test_a_second_sigterm_finds_the_worker_already_leaving():
    """A group SIGTERM, then the engine's own terminate(): raising again would cut close()
    or the exit handlers short ("Exception ignored in atexit callback ... SystemExit")."""
    import signal

    from connector.worker_proc import _exit_on_signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _exit_on_signal)
        with pytest.raises(SystemExit):
            _exit_on_signal(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_worker_dropped_without_close_leaves_no_context_for_the_collector(tmp_path):
    """Dropped unclosed (a failed test, an error before close()), the worker's sockets go
    by reference counting before its Context. In a reference cycle the collector would
    finalize them together: pyzmq's Context.__del__ finds its weak set of sockets already
    cleared and term() waits for them forever, on whichever thread collected. A fresh
    process, bounded: the hang must not be this one."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import gc, weakref
        from connector.worker_proc import ConnectorWorkerConfig, ConnectorWorkerProc
        gc.disable()
        proc = ConnectorWorkerProc(ConnectorWorkerConfig(
            engine_id="D", agent_addr="ipc://{tmp_path}/agent", kv_addr="ipc://{tmp_path}/kv"))
        proc.puller.link("ipc://{tmp_path}/peer")  # a link's socket open too
        ctx = weakref.ref(proc.ctx)
        del proc
        assert ctx() is None, "the worker's Context outlived it: it is in a reference cycle"
        gc.collect()
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, timeout=60, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_close_cut_by_a_signal_still_closes_every_socket_and_the_context(tmp_path):
    proc = ConnectorWorkerProc(
        ConnectorWorkerConfig(
            engine_id="D", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"
        )
    )
    link = proc.puller.link(f"ipc://{tmp_path}/peer")

    def signalled() -> None:
        raise SystemExit(0)

    proc._send_held = signalled
    with pytest.raises(SystemExit):
        proc.close()
    assert proc.agent.closed and proc.peers.closed and link.socket.closed and proc.ctx.closed
