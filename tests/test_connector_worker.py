"""The connector worker's handlers as plain functions (no processes), then its races."""
from __future__ import annotations

import zmq

from connector.messages import (CONNECTOR_CODEC, BlockData, ReadBlocks, ReadDone,
                                RegisterKVCache, StepMeta)
from connector.worker import ConnectorWorker, ConnectorWorkerConfig
from engine.config import ModelConfig
from engine.kv_cache import KVCache


def make_worker(tmp_path, **overrides) -> ConnectorWorker:
    config = ConnectorWorkerConfig("P", f"ipc://{tmp_path}/agent", f"ipc://{tmp_path}/kv", **overrides)
    return ConnectorWorker(config)


def frames(*parts: bytes) -> list[zmq.Frame]:
    return [zmq.Frame(p) for p in parts]


def agent_says(worker: ConnectorWorker, msg: object) -> None:
    worker._on_agent_message(frames(CONNECTOR_CODEC.encode(msg)))


def peer_says(worker: ConnectorWorker, msg: object, identity: bytes = b"peer") -> None:
    worker._on_peer_message(frames(identity, CONNECTOR_CODEC.encode(msg)))


def test_read_done_before_the_send_is_registered_still_frees(tmp_path):
    """D can read and say "read done" before P's next step registers the send."""
    worker = make_worker(tmp_path)
    try:
        peer_says(worker, ReadDone("r1"))
        assert worker.report.finished_sending == []
        agent_says(worker, StepMeta({"r1": [1, 2]}, []))
        assert worker.report.finished_sending == ["r1"]
        assert worker.counters["num_sent"] == 1 and "r1" not in worker.sends
        assert not worker.early_read_done
    finally:
        worker.close()


def test_early_read_is_served_once_registered_and_a_stranger_gets_refused(tmp_path):
    worker = make_worker(tmp_path)
    cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=4)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        agent_says(worker, RegisterKVCache("P", cache.handle.to_dict()))
        cache.tensor[:, :, 3].fill_(7.0)
        client.connect(worker.config.kv_addr)
        client.send(CONNECTOR_CODEC.encode(ReadBlocks("r1", [3])))
        client.send(CONNECTOR_CODEC.encode(ReadBlocks("ghost", [1])))
        assert worker.peers.poll(2000)
        worker._drain(worker.peers, worker._on_peer_message)
        assert not client.poll(50)  # held: neither is registered yet
        agent_says(worker, StepMeta({"r1": [3]}, []))
        assert client.poll(2000)
        reply, data = client.recv_multipart()
        assert CONNECTOR_CODEC.decode(reply) == BlockData("r1", True, "")
        assert len(data) == cache.num_bytes_per_block and set(data[:4]) != {0}
        worker._forget_early(("ghost", worker.early_since["ghost"]))  # what the hold timer does
        assert client.poll(2000)
        assert CONNECTOR_CODEC.decode(client.recv()).ok is False
    finally:
        client.close()
        worker.close()
        cache.close()


def test_expiry_reports_once_and_a_late_read_done_is_stale(tmp_path):
    worker = make_worker(tmp_path, kv_expiry_s=0.001)
    try:
        agent_says(worker, StepMeta({"r1": [1]}, []))
        while worker.timers and worker.timers[0][2] == "expire":
            worker._fire_timers()
        assert worker.report.finished_sending == ["r1"] and worker.counters["num_expired"] == 1
        peer_says(worker, ReadDone("r1"))  # too late: P freed the blocks already
        assert worker.counters["num_reads_after_expiry"] == 1 and not worker.early_read_done
        assert worker.report.finished_sending == ["r1"]
    finally:
        worker.close()


def test_garbage_from_a_peer_is_dropped_and_counted(tmp_path):
    worker = make_worker(tmp_path)
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    try:
        stranger.connect(worker.config.kv_addr)
        stranger.send(b"\xc1 not msgpack")
        stranger.send_multipart([b"two", b"frames"])
        stranger.send(CONNECTOR_CODEC.encode(StepMeta({}, [])))  # valid, wrong socket
        stranger.send(CONNECTOR_CODEC.encode(ReadDone("r9")))  # and one good message
        for _ in range(4):
            assert worker.peers.poll(2000)
            worker._drain(worker.peers, worker._on_peer_message)
            if worker.early_read_done:
                break
        assert worker.counters["num_bad_messages"] == 3
        assert "r9" in worker.early_read_done  # still serving after the garbage
    finally:
        stranger.close()
        worker.close()


def test_a_reused_request_id_does_not_inherit_an_old_expiry(tmp_path):
    worker = make_worker(tmp_path, kv_expiry_s=60)
    try:
        agent_says(worker, StepMeta({"r1": [1]}, []))
        peer_says(worker, ReadDone("r1"))
        agent_says(worker, StepMeta({"r1": [2]}, []))  # the id comes back
        old_due, _, _, payload = worker.timers[0]
        assert payload[0] == "r1"
        worker.timers[0] = (0.0, *worker.timers[0][1:])  # make the first timer due now
        worker._fire_timers()
        assert worker.report.finished_sending == ["r1"] and "r1" in worker.sends
        assert worker.counters["num_expired"] == 0
    finally:
        worker.close()
