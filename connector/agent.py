"""The connector's worker side inside the engine core: spawns and talks to the connector worker process. Runs in: engine-core process.

start_load_kv ships each step's metadata; get_finished drains the reports the worker
has sent since (never blocking). Reports wait in the socket until then, so an engine
that stops stepping never sees them. If the worker process dies, every transfer it
owned is resolved here: held sends are released, pending loads fail (their blocks
become invalid and kv_load_failure_policy decides), and `error` says what died.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time

import zmq

from connector.messages import CONNECTOR_CODEC, KVReport, RegisterKVCache, StepMeta, WorkerReady
from connector.pd import PDConnectorMetadata
from connector.worker_proc import ConnectorWorkerConfig, run_connector_worker
from engine.config import EngineConfig
from engine.kv_connector import KVConnectorWorkerBase
from engine.messages import DecodeError
from engine.outputs import KVConnectorOutput

READY_TIMEOUT_S = 60.0


class PendingTransfers:
    """The transfers the worker process owns, as the agent sees them: its reports merge
    in, and a dead worker's are resolved (held sends released, pending loads failed)."""

    def __init__(self) -> None:
        self.sends: set[str] = set()
        self.recvs: dict[str, list[int]] = {}  # req_id -> the local blocks it fills
        self.counters: dict[str, int] = {"num_bad_reports": 0}

    def start(self, metadata: PDConnectorMetadata) -> None:
        self.sends.update(metadata.reqs_to_send)
        # Empty receives only tell P "read done"; no finished_recving ever comes for them.
        self.recvs.update((s.req_id, s.local_block_ids)
                          for s in metadata.reqs_to_recv.values() if s.local_block_ids)

    def merge(self, data: bytes, out: KVConnectorOutput) -> None:
        """One report from the worker into `out`; garbage is counted and dropped."""
        try:
            report = CONNECTOR_CODEC.decode(data)
            if not isinstance(report, KVReport):
                raise DecodeError(f"unexpected {type(report).__name__}")
        except DecodeError:
            self.counters["num_bad_reports"] += 1
            return
        out.finished_sending.update(report.finished_sending)
        out.finished_recving.update(report.finished_recving)
        out.invalid_block_ids.update(report.invalid_block_ids)
        self.sends.difference_update(report.finished_sending)
        for req_id in report.finished_recving:
            self.recvs.pop(req_id, None)
        self.counters.update(report.counters)

    def resolve_orphans(self, out: KVConnectorOutput) -> None:
        """The worker is dead: every transfer it owned ends now, loads as failures."""
        out.finished_sending.update(self.sends)
        out.finished_recving.update(self.recvs)
        for block_ids in self.recvs.values():
            out.invalid_block_ids.update(block_ids)
        self.sends.clear()
        self.recvs.clear()


class PDConnectorAgent(KVConnectorWorkerBase):
    def __init__(self, config: EngineConfig, kv_cache_handle: dict) -> None:
        kv = config.kv_transfer
        assert kv is not None
        self.engine_id = config.engine_id
        self.ctx = zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)  # reports wait here while the loop is parked
        worker_config = ConnectorWorkerConfig(
            config.engine_id, kv.agent_addr, kv.kv_addr, kv.transport, kv.kv_expiry_s,
            kv.pull_delay_ms, kv.drop_read_done)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_connector_worker, args=(worker_config,), name=f"kvdrain-connector-{self.engine_id}")
        self.process.start()
        self.socket.connect(kv.agent_addr)
        worker_pid = self._wait_ready()
        self.socket.send(CONNECTOR_CODEC.encode(RegisterKVCache(self.engine_id, kv_cache_handle)))
        # Transfers the worker owns, so a dead worker's can be resolved here.
        self.pending = PendingTransfers()
        self.pending.counters["connector_worker_pid"] = worker_pid
        self.error: str | None = None

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.socket.poll(100, zmq.POLLIN):
                msg = CONNECTOR_CODEC.decode(self.socket.recv())
                if isinstance(msg, WorkerReady):
                    return msg.pid
            if not self.process.is_alive():
                raise RuntimeError(f"connector worker of engine {self.engine_id} exited with code "
                                   f"{self.process.exitcode} before it was ready")
        self.process.kill()
        raise RuntimeError(f"connector worker of engine {self.engine_id} not ready in {READY_TIMEOUT_S} s")

    def start_load_kv(self, metadata: PDConnectorMetadata | None) -> None:
        if metadata is None or metadata.is_empty():
            return
        self.pending.start(metadata)
        if self.error is None:
            specs = list(metadata.reqs_to_recv.values())
            self.socket.send(CONNECTOR_CODEC.encode(StepMeta(metadata.reqs_to_send, specs)))

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        while self.error is None and self.socket.poll(0, zmq.POLLIN):
            self.pending.merge(self.socket.recv(), out)
        # The sentinel (not is_alive) decides: it is readable as soon as the worker's
        # fds close, a moment before waitpid can reap it.
        if self.error is None and multiprocessing.connection.wait([self.process.sentinel], 0):
            self.process.join(1.0)
            self.error = (f"connector worker of engine {self.engine_id} (pid {self.process.pid}) "
                          f"died with exit code {self.process.exitcode}")
        if self.error is not None:
            self.pending.resolve_orphans(out)
            out.worker_error = self.error
        return out

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
        self.socket.close(linger=0)
