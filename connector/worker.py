"""The connector worker process: one per engine; moves KV blocks and reports completions. Runs in: connector-worker process.

Prefill side: holds the finished requests whose blocks await a remote read, serves
reads (zmq transport) and the shm handshake, and reports finished_sending when the
decode side says "read done" or when the request's expiry fires (vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT). Decode side: pulls remote blocks into its engine's
blocks, tells the prefill worker, and reports finished_recving (with
invalid_block_ids when a pull fails). Reports go to the engine core at once; whether
the engine reads them is the engine loop's liveness policy.
"""
from __future__ import annotations

import heapq
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass

import zmq

from connector.messages import (CONNECTOR_CODEC, GetKVHandle, KVHandle, KVReport, ReadBlocks,
                                BlockData, ReadDone, RecvSpec, RegisterKVCache, StepMeta,
                                WorkerReady)
from connector.transfer import Puller, TransferError
from engine.kv_cache import KVCache, KVCacheHandle
from engine.messages import DecodeError


# How long an early read waits for its request to be registered: less than the decode
# side's 2 s read timeout (connector/transfer.py), so it gets an answer either way.
EARLY_HOLD_S = 1.0


@dataclass(frozen=True, slots=True)
class ConnectorWorkerConfig:
    engine_id: str
    agent_addr: str  # PAIR with the engine core's agent
    kv_addr: str  # ROUTER for peer workers
    transport: str = "shm"
    kv_expiry_s: float = 480.0
    pull_delay_ms: float = 0.0
    drop_read_done: bool = False


class ConnectorWorker:
    def __init__(self, config: ConnectorWorkerConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        # No high-water mark: a parked (legacy) engine reads no reports for as long as
        # it likes, and a full queue must not look like a dead engine.
        self.agent = self._bind(zmq.PAIR, config.agent_addr, hwm=0)
        self.peers = self._bind(zmq.ROUTER, config.kv_addr)
        self.puller = Puller(self.ctx, config.transport)
        self.kv_cache: KVCache | None = None
        self.sends: dict[str, tuple[list[int], float]] = {}  # req_id -> (blocks, since)
        # Reads and "read done"s that arrived before their request was registered.
        self.early_reads: dict[str, list[tuple[zmq.Frame, ReadBlocks]]] = {}
        self.early_read_done: dict[str, float] = {}
        self.early_since: dict[str, float] = {}  # req_id -> when its first early item came
        self.expired: set[str] = set()  # sends that expired unread (a late "read done" is stale)
        self.timers: list[tuple[float, int, str, object]] = []  # (due, seq, kind, payload)
        self._seq = 0
        self.report = KVReport([], [], [], {})
        self.counters = dict.fromkeys(("num_sent", "num_expired", "num_recved", "num_failed_recvs",
                                       "num_recvs_in_flight", "num_bad_messages",
                                       "num_read_done_dropped", "num_bytes_pulled",
                                       "num_reads_after_expiry"), 0)

    def _bind(self, kind: int, addr: str, hwm: int = 1000) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.bind(addr)
        return sock

    # ---- the loop ------------------------------------------------------------------

    def run(self) -> None:
        self.agent.send(CONNECTOR_CODEC.encode(
            WorkerReady(self.config.engine_id, os.getpid(), self.config.kv_addr)))
        poller = zmq.Poller()
        poller.register(self.agent, zmq.POLLIN)
        poller.register(self.peers, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN | zmq.POLLERR)  # EOF is POLLHUP: ERR to zmq
        while True:
            timeout = None if not self.timers else max(0, 1000 * (self.timers[0][0] - time.monotonic()))
            ready = dict(poller.poll(timeout))
            if parent is not None and parent.sentinel in ready:
                return  # the engine core is gone
            if self.agent in ready:
                self._drain(self.agent, self._on_agent_message)
            if self.peers in ready:
                self._drain(self.peers, self._on_peer_message)
            self._fire_timers()
            self._flush_report()

    def _drain(self, sock: zmq.Socket, handle) -> None:
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(copy=False)
            try:
                handle(frames)
            except (DecodeError, ValueError):
                self.counters["num_bad_messages"] += 1

    # ---- engine side ---------------------------------------------------------------

    def _on_agent_message(self, frames: list[zmq.Frame]) -> None:
        msg = CONNECTOR_CODEC.decode(frames[0].bytes)
        if isinstance(msg, RegisterKVCache):
            self.kv_cache = KVCache.open(KVCacheHandle.from_dict(msg.handle))
        elif isinstance(msg, StepMeta):
            now = time.monotonic()
            for req_id, block_ids in msg.reqs_to_send.items():
                self._register_send(req_id, block_ids, now)
            for spec in msg.reqs_to_recv:
                if not spec.local_block_ids:  # nothing to read: just release P's blocks
                    self.puller.link(spec.remote_addr).send(ReadDone(spec.remote_request_id))
                    continue
                self.counters["num_recvs_in_flight"] += 1
                self._add_timer(now + self.config.pull_delay_ms / 1000, "pull", spec)
        else:
            raise DecodeError(f"unexpected {type(msg).__name__} from the engine core")

    def _register_send(self, req_id: str, block_ids: list[int], now: float) -> None:
        """P's engine says: these blocks wait for a remote read.

        The decode side can get there first: P's final output reaches the frontend at
        the end of the step in which the request finished, but its blocks are
        registered here only in P's next step. A read or a "read done" that arrived
        early was kept for this moment (vLLM's NIXL keeps early notifications too).
        """
        self.sends[req_id] = (block_ids, now)
        self.expired.discard(req_id)
        self.early_since.pop(req_id, None)
        for identity, read in self.early_reads.pop(req_id, []):
            self._serve_read(identity, read)
        if self.early_read_done.pop(req_id, None) is not None:
            self._finish_send(req_id, expired=False)
        else:
            # Keyed by (id, registration time): a reused id must not inherit an old timer.
            self._add_timer(now + self.config.kv_expiry_s, "expire", (req_id, now))

    def _add_timer(self, due: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (due, self._seq, kind, payload))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, kind, payload = heapq.heappop(self.timers)
            if kind == "expire":
                req_id, since = payload
                send = self.sends.get(req_id)
                if send is not None and send[1] == since:
                    self._finish_send(req_id, expired=True)
            elif kind == "forget_early":
                self._forget_early(payload)
            else:
                self._pull(payload)

    def _finish_send(self, req_id: str, expired: bool) -> None:
        if self.sends.pop(req_id, None) is None:
            return  # already read (a stale expiry) or never registered
        self.counters["num_expired" if expired else "num_sent"] += 1
        if expired:
            self.expired.add(req_id)
        self.report.finished_sending.append(req_id)

    def _pull(self, spec: RecvSpec) -> None:
        self.counters["num_recvs_in_flight"] -= 1
        try:
            if self.kv_cache is None:
                raise TransferError("no KV cache registered")
            self.puller.pull(self.kv_cache, spec)
        except TransferError:
            self.counters["num_failed_recvs"] += 1
            self.report.invalid_block_ids.extend(spec.local_block_ids)
        else:
            self.counters["num_recved"] += 1
            self.puller.link(spec.remote_addr).send(ReadDone(spec.remote_request_id))
        self.counters["num_bytes_pulled"] = self.puller.num_bytes_pulled
        self.report.finished_recving.append(spec.req_id)

    def _flush_report(self) -> None:
        r = self.report
        if not (r.finished_sending or r.finished_recving or r.invalid_block_ids):
            return
        counters = dict(self.counters, num_sends_pending=len(self.sends),
                        oldest_send_age_ms=self._oldest_send_age_ms())
        report = KVReport(r.finished_sending, r.finished_recving, r.invalid_block_ids, counters)
        try:
            self.agent.send(CONNECTOR_CODEC.encode(report), zmq.NOBLOCK)
        except zmq.Again:  # the engine core is gone (a PAIR with no peer): so are we
            raise SystemExit(0) from None
        self.report = KVReport([], [], [], {})

    def _oldest_send_age_ms(self) -> int:
        if not self.sends:
            return 0
        return int(1000 * (time.monotonic() - min(since for _, since in self.sends.values())))

    # ---- peer side -----------------------------------------------------------------

    def _on_peer_message(self, frames: list[zmq.Frame]) -> None:
        identity, payload = frames[0], frames[-1]
        if len(frames) != 2:
            raise DecodeError(f"expected [identity, message], got {len(frames)} frames")
        msg = CONNECTOR_CODEC.decode(payload.bytes)
        if isinstance(msg, ReadDone):
            if self.config.drop_read_done:
                self.counters["num_read_done_dropped"] += 1
            elif msg.req_id in self.sends:
                self._finish_send(msg.req_id, expired=False)
            elif msg.req_id in self.expired:
                self.expired.discard(msg.req_id)
                self.counters["num_reads_after_expiry"] += 1  # P freed them already
            else:
                # Held as long as a send could wait: P registers it in its next step.
                self._keep_early(msg.req_id, self.early_read_done, time.monotonic(),
                                 self.config.kv_expiry_s)
        elif isinstance(msg, ReadBlocks):
            self._serve_read(identity, msg)
        elif isinstance(msg, GetKVHandle) and self.kv_cache is not None:
            reply = KVHandle(self.config.engine_id, self.kv_cache.handle.to_dict())
            self.peers.send_multipart([identity, CONNECTOR_CODEC.encode(reply)])
        else:
            raise DecodeError(f"unexpected {type(msg).__name__} from a peer")

    def _keep_early(self, req_id: str, into: dict, value: object, hold_s: float) -> None:
        """Hold something that came before its request was registered, for hold_s."""
        if req_id not in self.early_since:
            since = self.early_since[req_id] = time.monotonic()
            self._add_timer(since + hold_s, "forget_early", (req_id, since))
        if into is self.early_reads:
            into.setdefault(req_id, []).append(value)
        else:
            into[req_id] = value

    def _forget_early(self, key: tuple[str, float]) -> None:
        """The request never got registered (aborted on P, or a stranger's id)."""
        req_id, since = key
        if self.early_since.get(req_id) != since:
            return  # registered meanwhile (and perhaps held again): not this hold
        del self.early_since[req_id]
        self.early_read_done.pop(req_id, None)
        for identity, read in self.early_reads.pop(req_id, []):
            reply = BlockData(read.req_id, False, "unknown or expired request")
            self.peers.send_multipart([identity, CONNECTOR_CODEC.encode(reply)])

    def _serve_read(self, identity: zmq.Frame, msg: ReadBlocks) -> None:
        send = self.sends.get(msg.req_id)
        if send is None and self.kv_cache is not None:
            self._keep_early(msg.req_id, self.early_reads, (identity, msg), EARLY_HOLD_S)
            return
        if send is None or self.kv_cache is None:
            reply = BlockData(msg.req_id, False, "unknown or expired request")
            self.peers.send_multipart([identity, CONNECTOR_CODEC.encode(reply)])
            return
        if not set(msg.block_ids) <= set(send[0]):
            reply = BlockData(msg.req_id, False, "blocks not held for this request")
            self.peers.send_multipart([identity, CONNECTOR_CODEC.encode(reply)])
            return
        data = self.kv_cache.gather_blocks(msg.block_ids).numpy()  # sent without a copy
        self.peers.send_multipart([identity, CONNECTOR_CODEC.encode(BlockData(msg.req_id, True, "")),
                                   data], copy=False)

    def close(self) -> None:
        self.puller.close()
        self.agent.close(linger=0)
        self.peers.close(linger=0)
        self.ctx.term()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run_connector_worker(config: ConnectorWorkerConfig) -> None:
    """Process entry point (spawned by the engine core's connector agent)."""
    import torch
    torch.set_num_threads(1)  # block copies are memory-bound; idle OpenMP spinners
    # would steal the CPU from the engines on a small machine
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C
    worker = ConnectorWorker(config)
    try:
        worker.run()
    finally:
        worker.close()
