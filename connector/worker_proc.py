"""The connector worker process, one per engine: moves KV blocks. Runs in: connector-worker process.

P's side: the sockets and the monotonic clock around send_ledger.py (reads served, shm reads
pinned, finished_sending reported). Leases are reaped only when the engine's step asks
(ReapLeases), as vLLM 0.32 reaps in get_finished, so behind a parked engine none lapses. D's side:
pulls, finished_recving (invalid_block_ids when a pull fails) and heartbeats. Reports go to the
engine core at once; whether it reads them is its loop's liveness policy.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from connector.messages import (
    CONNECTOR_CODEC,
    BlockData,
    GetKVHandle,
    Heartbeat,
    KVCacheRegistered,
    KVHandle,
    KVReport,
    LeaseDue,
    LeasesReaped,
    PinSend,
    ReadAbandoned,
    ReadBlocks,
    ReadDone,
    ReadGranted,
    ReapLeases,
    RecvSpec,
    RegisterKVCache,
    StepMeta,
    WorkerReady,
)
from connector.pull_outcome import pull_outcome
from connector.send_ledger import (
    UNKNOWN_REQUEST,
    HoldRules,
    LedgerOutput,
    ReadReply,
    SendLedger,
)
from connector.transfer import (
    SLOW_REPLY_MS,
    PeerTimeout,
    Puller,
    TransferError,
    keep_freed_buffers,
    send_blocks,
)
from engine.core.release import DEFAULT_RELEASE
from engine.proc.lifetime import die_with_parent
from engine.proc.messages import DecodeError
from engine.proc.socket_limits import block_payload_bytes, set_max_message_size
from engine.runner.kv_cache import KVCache, KVCacheHandle

# A pull's ReadDone is held back for the pulls due with it at most about this long
# (then sent, even while a reply is awaited: transfer.SLOW_REPLY_MS), a small part of
# any lease (a read lease is send_ledger.READ_LEASE_NS).
NOTIFY_BATCH_NS = SLOW_REPLY_MS * 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorWorkerConfig:
    engine_id: str
    agent_addr: str  # PAIR with the engine core's agent
    kv_addr: str  # ROUTER for peer workers
    transport: str = "shm"
    kv_lease_s: float = 30.0  # only for sends registered without a deadline
    vllm_release: str = str(DEFAULT_RELEASE)  # how an unread send is let go (HoldRules)
    pull_delay_ms: float = 0.0
    drop_read_done: bool = False
    max_control_bytes: int = (
        -1
    )  # ZMQ_MAXMSGSIZE of both sockets (engine/proc/socket_limits.py); -1: none


class ConnectorWorkerProc:
    """The connector worker's loop and sockets (vLLM's EngineCoreProc, for the connector).

    This process never expires a send on its own clock. Heartbeats from D queue in the ledger
    for the next reap; the first one queued tells the engine (LeaseDue), so its next step
    reaps. An shm read asks first (PinSend) and gets ReadGranted with the memory's handle,
    or a refusal if the send is not held.
    """

    def __init__(self, config: ConnectorWorkerConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        # No high-water mark: a parked (legacy) engine reads no reports for as long as
        # it likes, and a full queue must not look like a dead engine.
        self.agent = self._bind(zmq.PAIR, config.agent_addr, hwm=0)
        self.peers = self._bind(zmq.ROUTER, config.kv_addr)
        self.puller = Puller(self.ctx, config.transport)
        self.puller.on_slow_reply = _weak_call(
            self._send_held
        )  # a slow peer holds back no one's news
        self.held: deque[tuple[str, ReadDone | ReadAbandoned]] = deque()  # (P's address, its news)
        self.kv_cache: KVCache | None = None
        # Time is time.monotonic_ns() throughout: the ledger's clock.
        rules = HoldRules.of(config.vllm_release, config.kv_lease_s)
        self.ledger = SendLedger(rules.hold_ns, config.drop_read_done, rules=rules)
        self.pulls: list[tuple[int, int, RecvSpec]] = []  # heap of (due, seq, spec)
        self._seq = 0
        self.report = KVReport([], [], [], {})
        self._reads_after_expiry_reported = 0
        self._counters_sent: dict[str, int] = {}  # as of the last report (the agent's copy)
        self.counters = dict.fromkeys(
            (
                "num_recved",
                "num_failed_recvs",
                "num_recvs_in_flight",
                "num_bad_messages",
                "num_bytes_pulled",
                "num_heartbeats_sent",
                "num_pull_timeouts",
            ),
            0,
        )

    def _bind(self, kind: int, addr: str, hwm: int = 1000) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        set_max_message_size(sock, self.config.max_control_bytes)
        sock.bind(addr)
        return sock

    # ---- the loop ------------------------------------------------------------------

    def run(self) -> None:
        self.agent.send(
            CONNECTOR_CODEC.encode(
                WorkerReady(self.config.engine_id, os.getpid(), self.config.kv_addr)
            )
        )
        poller = zmq.Poller()
        poller.register(self.agent, zmq.POLLIN)
        poller.register(self.peers, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN | zmq.POLLERR)  # EOF is POLLHUP: ERR to zmq
        while True:
            ready = dict(poller.poll(self._poll_timeout_ms()))
            if parent is not None and parent.sentinel in ready:
                return  # the engine core is gone
            if self.agent in ready:
                self._drain(self.agent, self._on_agent_message)
            if self.peers in ready:
                self._drain(self.peers, self._on_peer_message)
            self._fire_timers()
            self._flush_report()

    def _poll_timeout_ms(self) -> float | None:
        """Until the next deadline of this process's own (an early hold's or a pull's;
        never a lease's: the engine reaps those); None: block."""
        dues = [
            t
            for t in (self.ledger.next_hold_deadline(), self.pulls[0][0] if self.pulls else None)
            if t is not None
        ]
        return None if not dues else max(0, (min(dues) - time.monotonic_ns()) / 1e6)

    def _drain(self, sock: zmq.Socket, handle) -> None:
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(copy=False)
            try:
                handle(frames)
            except (DecodeError, ValueError):
                self.counters["num_bad_messages"] += 1

    def _fire_timers(self) -> None:
        now = time.monotonic_ns()
        self._apply(self.ledger.expire_holds(now))
        # The pulls due together tell their prefill workers together, once read: one
        # burst of ReadDones, so P's worker sends one report and an event-driven P wakes
        # once, not once per pull (vLLM's P gets that from its step: get_finished takes
        # every NIXL notification that came since the last). Nothing is held longer than
        # about NOTIFY_BATCH_NS past its pull, nor past an error: the loop's exit sends it.
        # (Slow work that is no wait for a reply, a long copy, still delays the news
        # before it until the pull returns.)
        started = now
        try:
            while self.pulls and self.pulls[0][0] <= now:
                news = self._pull(heapq.heappop(self.pulls)[2])  # may send what is held
                self.held.append(news)
                if time.monotonic_ns() - started >= NOTIFY_BATCH_NS:
                    self._send_held()
                    started = time.monotonic_ns()
        finally:
            self._send_held()

    def _send_held(self) -> None:
        """Tell each prefill worker what was read (or never will be) so far. Each item
        leaves `held` once sent: a signal mid-send leaves the rest for close()."""
        held = self.held
        while held:
            remote_addr, msg = held[0]
            self.puller.link(remote_addr).send(msg)
            held.popleft()

    # ---- engine side ---------------------------------------------------------------

    def _on_agent_message(self, frames: list[zmq.Frame]) -> None:
        msg = CONNECTOR_CODEC.decode(frames[0].bytes)
        if isinstance(msg, RegisterKVCache):
            try:
                self.kv_cache = KVCache.open(KVCacheHandle.from_dict(msg.handle))
            except (
                ValueError,
                OSError,
            ) as e:  # the agent waits for KVCacheRegistered: exit, say why
                raise SystemExit(
                    f"connector worker of engine {self.config.engine_id}: "
                    f"cannot map the KV cache: {e}"
                ) from None
            # A pull fills local blocks: its bytes never exceed this cache's.
            self.puller.max_message_bytes = block_payload_bytes(self.kv_cache.nbytes)
            self._send_to_agent(KVCacheRegistered(self.config.engine_id, self.kv_cache.num_blocks))
        elif isinstance(msg, StepMeta):
            self._on_step_meta(msg)
        elif isinstance(msg, ReapLeases):  # the engine steps: reap, then say when next
            self._apply(self.ledger.reap(time.monotonic_ns()))
            self._flush_report()
            due = self.ledger.next_lease_deadline()
            self._send_to_agent(LeasesReaped(-1 if due is None else due))
        else:
            raise DecodeError(f"unexpected {type(msg).__name__} from the engine core")

    def _on_step_meta(self, msg: StepMeta) -> None:
        now = time.monotonic_ns()
        for req_id, block_ids in msg.reqs_to_send.items():
            self._apply(
                self.ledger.register(req_id, block_ids, now, msg.send_deadlines.get(req_id))
            )
        for spec in msg.reqs_to_recv:
            if not spec.local_block_ids:  # nothing to read: just release P's blocks
                self.puller.link(spec.remote_addr).send(ReadAbandoned(spec.remote_request_id))
                continue
            self.counters["num_recvs_in_flight"] += 1
            self._seq += 1
            due = now + round(self.config.pull_delay_ms * 1e6)
            heapq.heappush(self.pulls, (due, self._seq, spec))
        for heartbeat in msg.heartbeats:  # vLLM's _send_heartbeats, after the loads start
            self.puller.link(heartbeat.remote_addr).send(Heartbeat(heartbeat.req_ids))
            self.counters["num_heartbeats_sent"] += 1

    def _apply(self, out: LedgerOutput) -> None:
        """Do what the ledger decided: report finished sends, answer reads."""
        self.report.finished_sending.extend(out.finished_sending)
        for reply in out.replies:
            self._reply(reply)

    def _pull(self, spec: RecvSpec) -> tuple[str, ReadDone | ReadAbandoned]:
        """One pull, reported to the engine; returns what P's worker must hear, and where."""
        self.counters["num_recvs_in_flight"] -= 1
        try:
            if self.kv_cache is None:
                raise TransferError("no KV cache registered")
            self.puller.pull(self.kv_cache, spec)
        except TransferError as e:
            ok = False
            self.counters["num_failed_recvs"] += 1
            if isinstance(e, PeerTimeout):  # the prefill worker is stopped, stuck or dead
                self.counters["num_pull_timeouts"] += 1
        else:
            ok = True
            self.counters["num_recved"] += 1
        self.counters["num_bytes_pulled"] = self.puller.num_bytes_pulled
        outcome = pull_outcome(spec, ok)
        self.report.invalid_block_ids.extend(outcome.invalid_block_ids)
        self.report.finished_recving.append(outcome.req_id)
        # Failed: D never reads it now, so P frees it at once, not at the lease's end (if
        # P is stopped, the message waits in its socket; if P is gone, it is dropped).
        news = (
            ReadDone(spec.remote_request_id)
            if outcome.read
            else ReadAbandoned(spec.remote_request_id)
        )
        return spec.remote_addr, news

    def _flush_report(self) -> None:
        r = self.report
        if not (
            r.finished_sending
            or r.finished_recving
            or r.invalid_block_ids
            or self.ledger.counters["num_reads_after_expiry"] != self._reads_after_expiry_reported
        ):
            return  # a read after expiry is reported even alone: the verdict reads it
        self._reads_after_expiry_reported = self.ledger.counters["num_reads_after_expiry"]
        counters = dict(
            self.counters,
            **self.ledger.counters,
            num_sends_pending=len(self.ledger.sends),
            oldest_send_age_ms=self._oldest_send_age_ms(),
            report_ns=time.monotonic_ns(),
        )  # the agent times loads by it
        self._send_to_agent(
            KVReport(
                r.finished_sending, r.finished_recving, r.invalid_block_ids, self._changed(counters)
            )
        )
        self.report = KVReport([], [], [], {})

    def _changed(self, counters: dict[str, int]) -> dict[str, int]:
        """The counters whose value changed since the last report (the first: all). The
        agent merges each report's into its copy, so its copy stays whole and the engine
        decodes a few counters per report, not every one."""
        sent = self._counters_sent
        changed = {name: value for name, value in counters.items() if sent.get(name) != value}
        sent.update(changed)
        return changed

    def _send_to_agent(self, msg: object) -> None:
        try:
            self.agent.send(CONNECTOR_CODEC.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the engine core is gone (a PAIR with no peer): so are we
            raise SystemExit(0) from None

    def _oldest_send_age_ms(self) -> int:
        oldest = self.ledger.oldest_registration()
        return 0 if oldest is None else (time.monotonic_ns() - oldest) // 1_000_000

    # ---- peer side -----------------------------------------------------------------

    def _on_peer_message(self, frames: list[zmq.Frame]) -> None:
        identity, payload = frames[0], frames[-1]
        if len(frames) != 2:
            raise DecodeError(f"expected [identity, message], got {len(frames)} frames")
        msg = CONNECTOR_CODEC.decode(payload.bytes)
        if isinstance(msg, (ReadDone, ReadAbandoned)):
            self._apply(
                self.ledger.read_done(
                    msg.req_id, time.monotonic_ns(), read=isinstance(msg, ReadDone)
                )
            )
        elif isinstance(msg, Heartbeat):
            if self.ledger.receive_heartbeat(msg.req_ids):
                self._send_to_agent(LeaseDue())
        elif isinstance(msg, (ReadBlocks, PinSend)):
            pin = isinstance(msg, PinSend)  # shm: D copies from our memory under a read lease
            if self.kv_cache is None:  # nothing to read from: no hold either
                self._reply(ReadReply(identity, msg.req_id, msg.block_ids, UNKNOWN_REQUEST, pin))
            else:
                self._apply(
                    self.ledger.read(identity, msg.req_id, msg.block_ids, time.monotonic_ns(), pin)
                )
        elif isinstance(msg, GetKVHandle) and self.kv_cache is not None:
            reply = KVHandle(self.config.engine_id, self.kv_cache.handle.to_dict())
            self.peers.send_multipart([identity, CONNECTOR_CODEC.encode(reply)])
        else:
            raise DecodeError(f"unexpected {type(msg).__name__} from a peer")

    def _reply(self, reply: ReadReply) -> None:
        if not reply.ok or self.kv_cache is None:
            msg = BlockData(reply.req_id, False, reply.error or UNKNOWN_REQUEST)
            self.peers.send_multipart([reply.reply_to, CONNECTOR_CODEC.encode(msg)])
            return
        if reply.pin:  # the reader copies the blocks itself, until read_until
            granted = ReadGranted(reply.req_id, self.kv_cache.handle.to_dict(), reply.read_until)
            self.peers.send_multipart([reply.reply_to, CONNECTOR_CODEC.encode(granted)])
            return
        send_blocks(self.peers, reply.reply_to, reply.req_id, self.kv_cache, reply.block_ids)

    def close(self) -> None:
        """Send what is held, close every socket, end the Context; whatever raises on the
        way (a second signal), the sockets close and the Context ends."""
        try:
            self._send_held()  # a signal ended a batch while its news was going out
        except zmq.ZMQError:
            pass
        finally:
            try:
                self.puller.close()  # lingers a moment: that news still leaves
            finally:
                self.agent.close(linger=0)
                self.peers.close(linger=0)
                self.ctx.destroy(linger=0)  # term(), after closing any socket still open


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """method, called through a weak reference to its object: a hook that the object's
    own Puller holds makes no reference cycle (in one, the collector would finalize the
    Context before its sockets, and pyzmq's term() would wait for them forever)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _exit_on_signal(signum: int, frame: object) -> None:
    """The first SIGTERM ends the worker; a second one (a group SIGTERM, then the engine's
    own on its way down) finds the exit under way and is ignored: raised again, it would
    cut close() or the exit handlers short with a traceback. The engine's kill bounds it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def run_connector_worker(config: ConnectorWorkerConfig) -> None:
    """Process entry point (spawned by the engine core's connector agent)."""
    parent = multiprocessing.parent_process()
    die_with_parent(None if parent is None else parent.pid)
    # Block copies are memory-bound; idle OpenMP spinners would steal the CPU from the
    # engines on a small machine. Only CUDA memory imports torch here (engine/runner/kv_cache.py).
    os.environ["OMP_NUM_THREADS"] = "1"
    keep_freed_buffers()  # zmq pulls: no page faults on every chunk (connector/transfer.py)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C
    proc = ConnectorWorkerProc(config)
    try:
        proc.run()
    finally:
        proc.close()
