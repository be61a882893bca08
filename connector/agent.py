"""The connector's agent in the engine core (vLLM's worker role). Runs in: engine-core process.

It spawns the connector worker process and talks to it: start_load_kv ships each step's metadata,
get_finished takes the worker's reports (never blocking), so an engine that stops stepping sees
none and reaps no lease. If the worker dies, every transfer it owned is resolved here: held sends
released, pending loads failed (kv_load_failure_policy decides), and `error` says what died.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import select
import time
from typing import Literal

import zmq

from connector.messages import (
    CONNECTOR_CODEC,
    KVCacheRegistered,
    KVReport,
    LeaseDue,
    LeasesReaped,
    ReadAbandoned,
    ReapLeases,
    RecvSpec,
    RegisterKVCache,
    StepMeta,
    WorkerReady,
)
from connector.pd import PDConnectorMetadata
from connector.send_ledger import READ_LEASE_NS, HoldRules, ReapSchedule
from connector.worker_proc import ConnectorWorkerConfig, run_connector_worker
from engine.config import EngineConfig
from engine.core.kv_connector import KVConnectorAgentBase
from engine.core.outputs import KVConnectorOutput
from engine.proc.messages import DecodeError
from engine.proc.socket_limits import connector_control_bytes, set_max_message_size

READY_GRACE_S = 15.0  # past the engine's start limit (the frontend judges first)
SLOW_NS = 1_000_000_000  # a load or a reap that waits longer: a worker stopped or stuck
REAP_TIMEOUT_S = 10.0  # a live worker answers a reap at once; only a hung one takes this


class PendingTransfers:
    """The transfers the worker process owns, as the agent sees them: its reports merge
    in, and a dead worker's are resolved (held sends released, pending loads failed)."""

    def __init__(
        self, lease_ns: int = 30 * 10**9, pull_delay_ns: int = 0, reap_on_finish: bool = False
    ) -> None:
        self.sends: set[str] = set()
        self.recvs: dict[str, RecvSpec] = {}  # loads in flight, by request id
        self.recv_started: dict[str, int] = {}  # when each load was handed over (ns)
        self.counters: dict[str, int] = {"num_bad_reports": 0}
        self.lease_ns, self.pull_delay_ns = lease_ns, pull_delay_ns
        self.reaps = ReapSchedule(reap_on_finish=reap_on_finish)
        self.orphaned_at: int | None = None  # when the worker's death was seen (ns)

    def start(self, metadata: PDConnectorMetadata, now: int = 0) -> None:
        self.sends.update(metadata.reqs_to_send)
        for req_id in metadata.reqs_to_send:  # no stamp: the worker leases from registration
            self.reaps.on_register(metadata.send_deadlines.get(req_id, now + self.lease_ns))
        # Empty receives only tell P "read done"; no finished_recving ever comes for them.
        for spec in metadata.reqs_to_recv.values():
            if spec.local_block_ids:
                self.recvs[spec.req_id] = spec
                self.recv_started[spec.req_id] = now

    def reap_due(self) -> int | None:
        """When a step must ask the worker to reap (monotonic ns); None: no need."""
        return self.reaps.due(bool(self.sends))

    def merge(self, data: bytes, out: KVConnectorOutput) -> LeasesReaped | None:
        """One message from the worker: a report into `out`, a LeaseDue noted; a reap's
        answer is noted and returned. Garbage is counted and dropped. A load reported
        over SLOW_NS after its pull delay (the report's own send time, report_ns, so the
        engine's step length does not count) is noted (note_wait): only a stopped
        or stuck worker, P's or ours, takes that long."""
        try:
            report = CONNECTOR_CODEC.decode(data)
            if not isinstance(report, (KVReport, LeaseDue, LeasesReaped)):
                raise DecodeError(f"unexpected {type(report).__name__}")
        except DecodeError:
            self.counters["num_bad_reports"] += 1
            return None
        if isinstance(report, LeaseDue):
            self.reaps.heartbeats_queued = True
            return None
        if isinstance(report, LeasesReaped):
            self.reaps.on_reaped(None if report.next_deadline_ns < 0 else report.next_deadline_ns)
            return report
        out.finished_sending.update(report.finished_sending)
        out.finished_recving.update(report.finished_recving)
        out.invalid_block_ids.update(report.invalid_block_ids)
        self.sends.difference_update(report.finished_sending)
        if report.finished_sending:
            self.reaps.on_finished()
        counters = dict(report.counters)
        reported = counters.pop("report_ns", None)
        for req_id in report.finished_recving:
            self.recvs.pop(req_id, None)
            started = self.recv_started.pop(req_id, None)
            if type(reported) is int and started is not None:
                self.note_wait("recv", reported - started - self.pull_delay_ns)
        self.counters.update(counters)
        return None

    def note_wait(self, kind: Literal["recv", "reap"], waited_ns: int) -> None:
        """A wait over SLOW_NS (a load, a reap): counted in num_slow_{kind}s, the latest
        and the longest in ms in last_/max_{kind}_wait_ms. Counts only grow, so a replay
        tells the stalls it saw from older ones by their change (replay/wall/faults.py)."""
        if waited_ns > SLOW_NS:
            waited_ms, counters = waited_ns // 1_000_000, self.counters
            counters[f"max_{kind}_wait_ms"] = max(counters.get(f"max_{kind}_wait_ms", 0), waited_ms)
            counters[f"last_{kind}_wait_ms"] = waited_ms
            counters[f"num_slow_{kind}s"] = counters.get(f"num_slow_{kind}s", 0) + 1

    def resolve_orphans(self, out: KVConnectorOutput, now: int) -> list[RecvSpec]:
        """The worker is dead: every load it owned fails now (returned, so that their
        prefill engines are told to free them); its held sends are released once no read
        lease it granted can still run (READ_LEASE_NS after the death was seen: a decode
        worker may be copying them out of this engine's memory)."""
        if self.orphaned_at is None:
            self.orphaned_at = now
        failed = list(self.recvs.values())
        out.finished_recving.update(self.recvs)
        for spec in failed:
            out.invalid_block_ids.update(spec.local_block_ids)
        self.recvs.clear()
        self.recv_started.clear()
        if now >= self.orphaned_at + READ_LEASE_NS:
            out.finished_sending.update(self.sends)
            self.sends.clear()
        return failed

    def orphans_due(self) -> int | None:
        """When resolve_orphans releases the held sends (ns); None: nothing waits."""
        return (
            None if self.orphaned_at is None or not self.sends else self.orphaned_at + READ_LEASE_NS
        )


class PDConnectorAgent(KVConnectorAgentBase):
    def __init__(self, config: EngineConfig, kv_cache_handle: dict) -> None:
        kv = config.kv_transfer
        assert kv is not None
        self.engine_id = config.engine_id
        self.ready_timeout_s = config.start_limit_s + READY_GRACE_S
        self.ctx = zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)  # reports wait here while the loop is parked
        control_bytes = connector_control_bytes(config.num_blocks, config.max_num_seqs)
        set_max_message_size(self.socket, control_bytes)
        worker_config = ConnectorWorkerConfig(
            engine_id=config.engine_id,
            agent_addr=kv.agent_addr,
            kv_addr=kv.kv_addr,
            transport=kv.transport,
            kv_lease_s=kv.kv_lease_s,
            vllm_release=config.vllm_release,
            pull_delay_ms=kv.pull_delay_ms,
            drop_read_done=kv.drop_read_done,
            max_control_bytes=control_bytes,
        )
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_connector_worker,
            args=(worker_config,),
            name=f"kvdrain-connector-{self.engine_id}",
        )
        self.process.start()
        self.socket.connect(kv.agent_addr)
        worker_pid = self._wait_for(WorkerReady).pid
        # Mapped before the engine says Ready: on CUDA the worker's context and the IPC
        # open are slow, and the first KV loads would otherwise wait for them.
        self.socket.send(CONNECTOR_CODEC.encode(RegisterKVCache(self.engine_id, kv_cache_handle)))
        self._wait_for(KVCacheRegistered)
        # Transfers the worker owns, so a dead worker's can be resolved here.
        rules = HoldRules.of(config.vllm_release, kv.kv_lease_s)
        self.pending = PendingTransfers(
            rules.hold_ns, round(kv.pull_delay_ms * 1e6), not rules.reaper_scans_all
        )
        self.pending.counters["connector_worker_pid"] = worker_pid
        self.error: str | None = None
        self._peer_links: dict[str, zmq.Socket] = {}  # to prefill workers, once ours is gone
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)
        self._sentinel_poll = select.poll()
        self._sentinel_poll.register(self.process.sentinel, select.POLLIN)

    def _wait_for(self, kind: type) -> object:
        """The worker's next `kind` message (start-up: WorkerReady, KVCacheRegistered)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.socket.poll(100, zmq.POLLIN):
                msg = CONNECTOR_CODEC.decode(self.socket.recv())
                if isinstance(msg, kind):
                    return msg
            if not self.process.is_alive():
                raise RuntimeError(
                    f"connector worker of engine {self.engine_id} exited with code "
                    f"{self.process.exitcode} before {kind.__name__}"
                )
        self.process.kill()
        raise RuntimeError(
            f"connector worker of engine {self.engine_id}: no {kind.__name__} in "
            f"{self.ready_timeout_s:g} s"
        )

    def start_load_kv(self, metadata: PDConnectorMetadata | None) -> None:
        if metadata is None or metadata.is_empty():
            return
        self.pending.start(metadata, time.monotonic_ns())
        specs = [*metadata.reqs_to_recv.values(), *metadata.reqs_to_release]  # empty: releases
        if self.error is None:
            self.socket.send(
                CONNECTOR_CODEC.encode(
                    StepMeta(
                        metadata.reqs_to_send, specs, metadata.send_deadlines, metadata.heartbeats
                    )
                )
            )
        else:  # no worker to say it: the loads fail in get_finished, which tells P for them
            self._release_at_peers([s for s in specs if not s.local_block_ids])

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """The reports the worker sent since the last step. Once a lease may have passed (or
        heartbeats wait to be applied), it also asks the worker to reap and waits for the
        answer, so what expired comes back in this same call, as in vLLM."""
        out = KVConnectorOutput()
        while self.error is None and self._poller.poll(0):  # every step: a poller made once
            self.pending.merge(self.socket.recv(), out)
        due = self.pending.reap_due()
        if self.error is None and due is not None and time.monotonic_ns() >= due:
            self._reap(out)
        # The sentinel (not is_alive) decides: it is readable as soon as the worker's
        # fds close, a moment before waitpid can reap it. One poll object, made once.
        if self.error is None and self._sentinel_poll.poll(0):
            self.process.join(1.0)
            self.error = (
                f"connector worker of engine {self.engine_id} (pid {self.process.pid}) "
                f"died with exit code {self.process.exitcode}"
            )
        if self.error is not None:
            self._release_at_peers(self.pending.resolve_orphans(out, time.monotonic_ns()))
            out.worker_error = self.error
        return out

    def _release_at_peers(self, specs: list[RecvSpec]) -> None:
        """The worker is gone: tell each prefill worker ourselves that these sends will
        never be read (ReadAbandoned), so P frees them now, not when its lease ends (the
        NIXL rule: every way a load ends on D releases P). Fire and forget."""
        for spec in specs:
            if not spec.remote_addr:
                continue
            link = self._peer_links.get(spec.remote_addr)
            if link is None:
                link = self._peer_links[spec.remote_addr] = self.ctx.socket(zmq.DEALER)
                link.setsockopt(zmq.LINGER, 1000)  # let the last ones out at shutdown
                link.connect(spec.remote_addr)
            try:
                link.send(
                    CONNECTOR_CODEC.encode(ReadAbandoned(spec.remote_request_id)), zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass  # P is gone or flooded: its lease frees them

    def _reap(self, out: KVConnectorOutput) -> None:
        """Ask the worker to reap its leases and wait (bounded) for its answer; the
        reports before it (what expired) merge into `out`."""
        self.socket.send(CONNECTOR_CODEC.encode(ReapLeases()))
        asked = time.monotonic_ns()
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.socket.poll(100, zmq.POLLIN):
                if self.pending.merge(self.socket.recv(), out) is not None:
                    self.pending.note_wait("reap", time.monotonic_ns() - asked)
                    return
            elif multiprocessing.connection.wait([self.process.sentinel], 0):
                return  # dead: get_finished resolves what it owned
        # Stuck: killed, so that it never serves a read (nor grants a pin) of blocks this
        # engine frees from now on.
        self.process.kill()
        self.error = (
            f"connector worker of engine {self.engine_id} (pid {self.process.pid}) "
            f"did not answer a lease reap in {REAP_TIMEOUT_S} s (killed)"
        )

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def next_deadline_ns(self) -> int | None:
        return self.pending.orphans_due() if self.error is not None else self.pending.reap_due()

    def get_counters(self) -> dict[str, int]:
        return self.pending.counters

    def wait_handles(self) -> list[object]:
        """What an event-driven loop blocks on: reports, and the worker's death."""
        return [] if self.error is not None else [self.socket, self.process.sentinel]

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for link in self._peer_links.values():
            link.close()
        self.socket.close(linger=0)
