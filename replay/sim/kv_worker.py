"""The KV connector worker on the virtual clock: the process's SendLedger, with simulated transfer times. Runs in: frontend process.

P side: connector/send_ledger.py decides, as in the connector worker process (leases
stamped by P's scheduler side, heartbeats, "read done", early arrivals,
drop_read_done; the HoldRules of the release the engines follow). Leases are reaped
only in get_finished, i.e. when P's engine steps, once the agent's view of them
(ReapSchedule, the same as connector/agent.py keeps) says one may be due; early holds
end on clock events, as on the worker's own timer. D side:
a pull starts pull_delay after its step and reads through P's ledger as the process
does (SendLedger.read: a pin for shm, the bytes for zmq; the round trip takes no
virtual time, an early read waits for P's answer); a granted read takes per_block *
blocks, and a pin's copy must end inside its read lease. The outcome
(connector/pull_outcome.py, as the process's) is finished_recving, with the local
blocks invalid if the read was refused or ran late, and "read done" (or, after a
failure, a release unread) reaching P's worker read_done_latency later; so do
heartbeats. Pulls here run side by side (a step's NIXL reads, posted together), each
ending after its own copy; the process pulls one after another and sends a batch's
ReadDones together once it is read (connector/worker_proc.py), so its P frees a
batch at the batch's end. Reports wait in the inbox until the engine's
get_finished; on_report tells the engine one came (what a message on the socket does
to a blocked engine loop), a heartbeat's LeaseDue included, just before it lands: an
engine that takes a skipped step late (replay/sim/engine.py) takes it without it.
"""

from __future__ import annotations

from collections.abc import Callable

from connector.messages import HeartbeatSpec, RecvSpec
from connector.pd import PDConnectorMetadata
from connector.pull_outcome import copy_within_read_lease, pull_outcome
from connector.send_ledger import HoldRules, LedgerOutput, ReadReply, ReapSchedule, SendLedger
from engine.core.kv_connector import KVConnectorAgentBase
from engine.core.outputs import KVConnectorOutput
from replay.sim.clock import DELIVER, EventLoop, to_ns
from replay.sim.options import SimOptions


class SimKVWorker(KVConnectorAgentBase):
    """A P/D connector worker on the virtual clock, which is its engine's agent too (no
    socket between them); `peers` holds every engine's, by name."""

    def __init__(
        self, name: str, loop: EventLoop, options: SimOptions, peers: dict[str, SimKVWorker]
    ) -> None:
        self.name, self.loop, self.options, self.peers = name, loop, options, peers
        peers[name] = self
        self.on_report: Callable[[], None] = lambda: None
        rules = HoldRules.of(options.engine.vllm_release, options.kv.kv_lease_s)
        self.ledger = SendLedger(rules.hold_ns, options.kv.drop_read_done, rules=rules)
        self.inbox_sending: list[str] = []
        self.inbox_recving: list[str] = []
        self.inbox_invalid: list[int] = []  # local blocks of failed loads
        self.inbox_lease_due = False  # a LeaseDue waits in the socket
        # The engine side's view (connector/agent.py's PendingTransfers): its sends not
        # yet reported finished, and when a step must reap.
        self.sends: set[str] = set()
        self.reaps = ReapSchedule(reap_on_finish=not rules.reaper_scans_all)
        # When the step being started really started, if earlier than now: a decode
        # run's step in progress that the engine takes late (replay/sim/engine.py
        # leave_run) reads the clock as it would have then.
        self.step_started_at: int | None = None

    def start_load_kv(self, metadata: object) -> None:
        if not isinstance(metadata, PDConnectorMetadata):
            return
        now, opts = self.loop.now, self.options
        for req_id, block_ids in metadata.reqs_to_send.items():
            deadline = metadata.send_deadlines.get(req_id, now + self.ledger.lease_ns)
            self.sends.add(req_id)
            self.reaps.on_register(deadline)
            self._apply(self.ledger.register(req_id, block_ids, now, deadline))
        for recv in [*metadata.reqs_to_recv.values(), *metadata.reqs_to_release]:
            if not recv.local_block_ids:  # nothing to read: just release P's blocks
                self._send_read_done(recv, read=False)
                continue
            self.loop.push(now + to_ns(opts.pull_delay()), DELIVER, 0, self._start_pull, recv)
        for heartbeat in metadata.heartbeats:
            self._send_heartbeat(heartbeat)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput(
            set(self.inbox_sending), set(self.inbox_recving), set(self.inbox_invalid)
        )
        self.inbox_sending.clear()
        self.inbox_recving.clear()
        self.inbox_invalid.clear()
        if self.inbox_lease_due:
            self.inbox_lease_due, self.reaps.heartbeats_queued = False, True
        self.sends.difference_update(out.finished_sending)
        if out.finished_sending:
            self.reaps.on_finished()
        due, now = self.reaps.due(bool(self.sends)), self.now_ns()
        if due is not None and now >= due:  # the agent's reap round trip
            reaped = self.ledger.reap(now).finished_sending
            self.reaps.on_reaped(self.ledger.next_lease_deadline())
            out.finished_sending.update(reaped)
            self.sends.difference_update(reaped)
        return out

    def now_ns(self) -> int:
        return self.loop.now if self.step_started_at is None else self.step_started_at

    def next_deadline_ns(self) -> int | None:
        return self.reaps.due(bool(self.sends))

    def get_counters(self) -> dict[str, int]:
        return dict(self.ledger.counters)

    def has_reports(self) -> bool:
        return bool(self.inbox_sending or self.inbox_recving or self.inbox_lease_due)

    def _apply(self, out: LedgerOutput) -> None:
        """Arm the ledger's new hold deadlines; report the sends it finished; answer reads."""
        for reply in out.replies:  # reply_to: the reading worker and its pull
            reader, recv = reply.reply_to
            reader._on_read_reply(recv, reply)
        for deadline in out.hold_deadlines:
            self.loop.push(deadline, DELIVER, 0, self._on_hold_deadline)
        for req_id in out.finished_sending:
            self._report(self.inbox_sending, req_id)

    def _on_hold_deadline(self, _: object) -> None:
        self._apply(self.ledger.expire_holds(self.loop.now))

    def _report(self, inbox: list[str], req_id: str) -> None:
        self.on_report()  # first: an engine that leaves a decode run steps without it
        inbox.append(req_id)

    def _start_pull(self, recv: RecvSpec) -> None:
        """Ask P's worker for the read (the process's PinSend or ReadBlocks)."""
        peer = self.peers.get(recv.remote_engine_id)
        if peer is None:  # no such engine in the topology: simulated as read, as before
            self._on_read_reply(
                recv, ReadReply(None, recv.remote_request_id, recv.remote_block_ids)
            )
            return
        pin = self.options.kv.transport == "shm"
        peer._apply(
            peer.ledger.read(
                (self, recv),
                recv.remote_request_id,
                list(recv.remote_block_ids),
                self.loop.now,
                pin,
            )
        )

    def _on_read_reply(self, recv: RecvSpec, reply: ReadReply) -> None:
        """Granted: the copy takes per_block * blocks; refused: the load fails now."""
        took = len(recv.local_block_ids) * to_ns(self.options.per_block_s) if reply.ok else 0
        self.loop.push(self.loop.now + took, DELIVER, 0, self._pull_done, (recv, reply))

    def _pull_done(self, arg: tuple[RecvSpec, ReadReply]) -> None:
        recv, reply = arg
        ok = reply.ok and (not reply.pin or copy_within_read_lease(reply.read_until, self.loop.now))
        outcome = pull_outcome(recv, ok)
        self.inbox_invalid.extend(outcome.invalid_block_ids)
        self._report(self.inbox_recving, outcome.req_id)
        self._send_read_done(recv, outcome.read)

    def _send_read_done(self, recv: RecvSpec, read: bool = True) -> None:
        """ "read done" after a pull; read=False: a release without reading (ReadAbandoned)."""
        peer = self.peers.get(recv.remote_engine_id)
        if peer is not None:
            self.loop.push(
                self.loop.now + to_ns(self.options.read_done_latency_s),
                DELIVER,
                0,
                peer._on_read_done if read else peer._on_abandoned,
                recv.remote_request_id,
            )

    def _on_read_done(self, req_id: str) -> None:
        self._apply(self.ledger.read_done(req_id, self.loop.now))

    def _on_abandoned(self, req_id: str) -> None:
        self._apply(self.ledger.read_done(req_id, self.loop.now, read=False))

    def _send_heartbeat(self, heartbeat: HeartbeatSpec) -> None:
        peer = self.peers.get(heartbeat.remote_engine_id)
        if peer is not None:
            self.loop.push(
                self.loop.now + to_ns(self.options.read_done_latency_s),
                DELIVER,
                0,
                peer._on_heartbeat,
                heartbeat.req_ids,
            )

    def _on_heartbeat(self, req_ids: list[str]) -> None:
        if self.ledger.receive_heartbeat(req_ids):  # the worker's LeaseDue to its engine
            self.on_report()
            self.inbox_lease_due = True
