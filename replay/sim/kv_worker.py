"""The virtual clock: a discrete-event loop and the KV connector worker on it. Runs in: frontend process.

No sleeping and no wall clock: time is integer nanoseconds; events sit in a heap keyed
(time, class, engine rank, seq), seq a counter, so ties resolve the same way every run.
At one instant: deliveries (trace records, transfers, reports), then step ends (P before
D), then step starts, then samples (the event classes below, in that order).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from connector.messages import RecvSpec
from connector.pd import PDConnectorMetadata
from engine.kv_connector import KVConnectorWorkerBase
from engine.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from replay.sim.simulation import SimOptions

NS = 1_000_000_000
DELIVER, STEP_END, STEP_START, TICK = range(4)  # event classes, in tie order


def to_ns(seconds: float) -> int:
    """Seconds as integer nanoseconds of virtual time."""
    return round(seconds * NS)


class EventLoop:
    """The event heap and the virtual time `now` (of the event being handled)."""

    def __init__(self) -> None:
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0
        self.num_pending = 0  # events other than sample ticks

    def push(self, t: int, cls: int, rank: int, fn: Callable, arg: object = None) -> None:
        self.seq += 1
        self.num_pending += cls != TICK
        heapq.heappush(self.heap, (t, cls, rank, self.seq, fn, arg))

    def pop(self) -> tuple[Callable, object]:
        t, cls, _, _, fn, arg = heapq.heappop(self.heap)
        self.now = t
        self.num_pending -= cls != TICK
        return fn, arg


class SimKVWorker(KVConnectorWorkerBase):
    """A P/D connector worker on the virtual clock; reports wait in the inbox for get_finished."""

    def __init__(self, name: str, loop: EventLoop, options: SimOptions,
                 peers: dict[str, SimKVWorker]) -> None:
        self.name, self.loop, self.options, self.peers = name, loop, options, peers
        peers[name] = self
        self.on_report: Callable[[], None] = lambda: None
        self.sending: set[str] = set()  # registered sends not yet read or expired
        self.early_read_done: set[str] = set()  # read before P registered the send
        self.expired: set[str] = set()
        self.inbox_sending: list[str] = []
        self.inbox_recving: list[str] = []
        self.num_expired = self.num_reads_after_expiry = 0

    def start_load_kv(self, metadata: object) -> None:
        if not isinstance(metadata, PDConnectorMetadata):
            return
        now, opts = self.loop.now, self.options
        for req_id in metadata.reqs_to_send:
            if req_id in self.early_read_done:
                self.early_read_done.remove(req_id)
                self._report(self.inbox_sending, req_id)
                continue
            self.sending.add(req_id)
            self.loop.push(now + to_ns(opts.kv_expiry_s), DELIVER, 0, self._expire, req_id)
        for recv in metadata.reqs_to_recv.values():
            if not recv.local_block_ids:  # nothing to read: just release P's blocks
                self._send_read_done(recv)
                continue
            done = (now + to_ns(opts.pull_delay_s)
                    + len(recv.local_block_ids) * to_ns(opts.per_block_s))
            self.loop.push(done, DELIVER, 0, self._pull_done, recv)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput(set(self.inbox_sending), set(self.inbox_recving))
        self.inbox_sending.clear()
        self.inbox_recving.clear()
        return out

    def has_reports(self) -> bool:
        return bool(self.inbox_sending or self.inbox_recving)

    def _report(self, inbox: list[str], req_id: str) -> None:
        inbox.append(req_id)
        self.on_report()

    def _expire(self, req_id: str) -> None:
        if req_id not in self.sending:
            return  # read first: a stale timer does nothing
        self.sending.remove(req_id)
        self.expired.add(req_id)
        self.num_expired += 1
        self._report(self.inbox_sending, req_id)

    def _pull_done(self, recv: RecvSpec) -> None:
        self._report(self.inbox_recving, recv.req_id)
        self._send_read_done(recv)

    def _send_read_done(self, recv: RecvSpec) -> None:
        peer = self.peers.get(recv.remote_engine_id)
        if peer is not None and not self.options.drop_read_done:
            self.loop.push(self.loop.now + to_ns(self.options.read_done_latency_s), DELIVER, 0,
                           peer._read_done, recv.remote_request_id)

    def _read_done(self, req_id: str) -> None:
        if req_id in self.sending:
            self.sending.remove(req_id)
            self._report(self.inbox_sending, req_id)
        elif req_id in self.expired:
            self.num_reads_after_expiry += 1
        else:
            self.early_read_done.add(req_id)
