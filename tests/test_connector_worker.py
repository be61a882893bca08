"""The prefill side's send ledger as plain calls with time passed in, then the connector worker process over ZMQ."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import zmq

from connector.messages import (CONNECTOR_CODEC, BlockData, KVReport, ReadBlocks, ReadDone,
                                RegisterKVCache, StepMeta, WorkerReady)
from connector.send_ledger import (BLOCKS_NOT_HELD, EARLY_HOLD_NS, UNKNOWN_REQUEST, ReadReply,
                                   SendLedger)
from connector.worker_proc import ConnectorWorkerConfig, ConnectorWorkerProc, run_connector_worker
from engine.config import ModelConfig
from engine.kv_cache import KVCache

EXPIRY = 10_000  # ns: small numbers read better; the ledger only adds and compares


def test_read_done_frees_a_held_send_once():
    ledger = SendLedger(EXPIRY)
    out = ledger.register("r1", [1, 2], now=0)
    assert out.finished_sending == [] and out.deadlines == [EXPIRY]
    assert ledger.read_done("r1", now=5).finished_sending == ["r1"]
    assert ledger.counters["num_sent"] == 1 and not ledger.sends
    assert ledger.next_deadline() is None  # the finished send's deadline is gone
    assert ledger.expire(now=EXPIRY).finished_sending == []


def test_expiry_reports_once_and_a_late_read_done_is_counted():
    ledger = SendLedger(EXPIRY)
    ledger.register("r1", [1], now=0)
    assert ledger.expire(now=EXPIRY - 1).finished_sending == []
    assert ledger.expire(now=EXPIRY).finished_sending == ["r1"]
    assert ledger.counters["num_expired"] == 1 and ledger.expire(now=10 * EXPIRY).finished_sending == []
    assert ledger.read_done("r1", now=EXPIRY + 1).finished_sending == []  # P freed them already
    assert ledger.counters["num_reads_after_expiry"] == 1 and not ledger.early


def test_a_reused_request_id_does_not_inherit_an_old_expiry():
    ledger = SendLedger(EXPIRY)
    ledger.register("r1", [1], now=0)
    ledger.read_done("r1", now=1)
    ledger.register("r1", [2], now=5)  # the id comes back
    assert ledger.expire(now=EXPIRY).finished_sending == []  # the first registration's deadline
    assert "r1" in ledger.sends and ledger.next_deadline() == 5 + EXPIRY
    assert ledger.expire(now=5 + EXPIRY).finished_sending == ["r1"]
    assert ledger.counters == {"num_sent": 1, "num_expired": 1, "num_read_done_dropped": 0,
                               "num_reads_after_expiry": 0}


def test_a_read_done_before_the_send_is_registered_still_frees():
    """D can read and say "read done" before P's next step registers the send."""
    ledger = SendLedger(EXPIRY)
    out = ledger.read_done("r1", now=0)
    assert out.finished_sending == [] and out.deadlines == [EXPIRY]  # held as long as a send
    out = ledger.register("r1", [1, 2], now=3)
    assert out.finished_sending == ["r1"] and out.deadlines == []
    assert ledger.counters["num_sent"] == 1 and not ledger.sends and not ledger.early
    assert ledger.next_deadline() is None


def test_an_early_read_done_is_forgotten_after_the_expiry():
    ledger = SendLedger(EXPIRY)
    ledger.read_done("r1", now=0)
    assert ledger.expire(now=EXPIRY).replies == [] and not ledger.early
    ledger.register("r1", [1], now=EXPIRY + 1)  # too late: this send waits for its own read
    assert "r1" in ledger.sends and ledger.counters["num_sent"] == 0


def test_early_reads_are_answered_at_registration_and_strangers_refused_after_the_hold():
    ledger = SendLedger(EXPIRY, early_hold_ns=100)
    assert ledger.read("peer-a", "r1", [3], now=0).replies == []
    assert ledger.read("peer-b", "r1", [9], now=1).replies == []
    assert ledger.read("peer-c", "ghost", [1], now=2).deadlines == [102]
    out = ledger.register("r1", [3, 4], now=50)
    assert out.replies == [ReadReply("peer-a", "r1", [3]),
                           ReadReply("peer-b", "r1", [9], BLOCKS_NOT_HELD)]
    assert ledger.expire(now=101).replies == []
    assert ledger.expire(now=102).replies == [ReadReply("peer-c", "ghost", [1], UNKNOWN_REQUEST)]
    assert not ledger.early and "r1" in ledger.sends


def test_the_first_early_arrival_sets_the_hold():
    """An early read holds for early_hold_ns; a "read done" joining it does not extend it."""
    ledger = SendLedger(EXPIRY, early_hold_ns=100)
    ledger.read("peer", "r1", [1], now=0)
    assert ledger.read_done("r1", now=10).deadlines == []
    out = ledger.expire(now=100)
    assert out.replies == [ReadReply("peer", "r1", [1], UNKNOWN_REQUEST)] and not ledger.early
    ledger.register("r1", [1], now=101)
    assert "r1" in ledger.sends  # the forgotten "read done" does not free it


def test_drop_read_done_leaves_only_expiry():
    ledger = SendLedger(EXPIRY, drop_read_done=True)
    ledger.register("r1", [1], now=0)
    assert ledger.read_done("r1", now=1).finished_sending == []
    assert ledger.counters["num_read_done_dropped"] == 1
    assert ledger.expire(now=EXPIRY).finished_sending == ["r1"]


def test_extend_moves_the_deadline_of_a_held_send_only():
    ledger = SendLedger(EXPIRY)
    ledger.register("r1", [1], now=0)
    assert ledger.extend("r1", 3 * EXPIRY).deadlines == [3 * EXPIRY]
    assert ledger.extend("ghost", 1).deadlines == [] and "ghost" not in ledger.early
    assert ledger.next_deadline() == 3 * EXPIRY  # the old one is stale
    assert ledger.expire(now=2 * EXPIRY).finished_sending == []
    assert ledger.expire(now=3 * EXPIRY).finished_sending == ["r1"]


def test_oldest_registration():
    ledger = SendLedger(EXPIRY)
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
    ctx = zmq.Context.instance()
    config = ConnectorWorkerConfig("P", f"ipc://{tmp_path}/agent", f"ipc://{tmp_path}/kv", transport="zmq")
    cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=4)
    agent, peer = ctx.socket(zmq.PAIR), ctx.socket(zmq.DEALER)
    proc = multiprocessing.get_context("spawn").Process(target=run_connector_worker, args=(config,))
    proc.start()
    try:
        for sock, addr in ((agent, config.agent_addr), (peer, config.kv_addr)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
        assert isinstance(CONNECTOR_CODEC.decode(_recv(agent, 60)[0]), WorkerReady)
        agent.send(CONNECTOR_CODEC.encode(RegisterKVCache("P", cache.handle.to_dict())))
        cache.tensor[:, :, 3].fill_(7.0)
        start = time.monotonic()
        peer.send(CONNECTOR_CODEC.encode(ReadBlocks("r1", [3])))
        peer.send(CONNECTOR_CODEC.encode(ReadBlocks("ghost", [1])))
        assert not peer.poll(100)  # both held: neither is registered yet
        agent.send(CONNECTOR_CODEC.encode(StepMeta({"r1": [3]}, [])))
        reply, data = _recv(peer)
        assert CONNECTOR_CODEC.decode(reply) == BlockData("r1", True, "")
        assert len(data) == cache.num_bytes_per_block and set(data[:4]) != {0}
        (refusal,) = _recv(peer)
        assert CONNECTOR_CODEC.decode(refusal) == BlockData("ghost", False, UNKNOWN_REQUEST)
        assert time.monotonic() - start >= EARLY_HOLD_NS / 1e9 - 0.01
        peer.send(CONNECTOR_CODEC.encode(ReadDone("r1")))
        report = CONNECTOR_CODEC.decode(_recv(agent)[0])
        assert isinstance(report, KVReport) and report.finished_sending == ["r1"]
        assert report.counters["num_sent"] == 1 and report.counters["num_sends_pending"] == 0
    finally:
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        agent.close()
        peer.close()
        cache.close()


@pytest.fixture
def worker_proc(tmp_path):
    proc = ConnectorWorkerProc(ConnectorWorkerConfig("P", f"ipc://{tmp_path}/agent", f"ipc://{tmp_path}/kv"))
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
    from engine.outputs import KVConnectorOutput
    pending = PendingTransfers()
    pending.start(PDConnectorMetadata({"s1": [1]}, {"d1": RecvSpec("d1", [4, 5], [7, 8], "P", "p1", "a"),
                                                    "d2": RecvSpec("d2", [], [], "P", "p2", "a")}))
    out = KVConnectorOutput()
    pending.resolve_orphans(out)
    assert out.finished_sending == {"s1"} and out.finished_recving == {"d1"}
    assert out.invalid_block_ids == {4, 5} and not pending.sends and not pending.recvs
