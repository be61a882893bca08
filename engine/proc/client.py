"""EngineClient: the frontend's handle on one engine core. Runs in: frontend process.

In-process (InprocClient) or in its own process (MPClient); both implement the EngineClient
protocol (start-up info, the four verbs, stats, what to wait on), so no caller branches on the
kind. Every wait is bounded, and an engine's death is an EngineDeadError, never a hang.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from typing import Protocol

import zmq

from engine.config import EngineAddresses, EngineConfig
from engine.core.outputs import RequestOutput
from engine.proc.core_proc import build_engine_core, kv_device, run_engine_core
from engine.proc.lifetime import descendants, parent_of
from engine.proc.messages import (
    Abort,
    AddRequest,
    DecodeError,
    EngineError,
    GetStats,
    Ready,
    RequestOutputs,
    Shutdown,
    StatsSnapshot,
    decode,
    encode,
    output_from_msg,
)
from engine.proc.run_dir import is_alive, make_run_dir, process_start_time
from engine.proc.socket_limits import engine_output_bytes, set_max_message_size
from engine.proc.stats_check import snapshot_problem

# Past the engine's start limit: the frontend judges a starved or stuck start-up first.
READY_GRACE_S = 30.0
WORKER_EXIT_S = 5.0  # an orphaned connector worker sees its engine gone well before this
SEND_TIMEOUT_S = 60.0  # a live engine in a long step drains its input well before this


class EngineDeadError(RuntimeError):
    """The engine core process `engine_id` died or reported a fatal error."""

    def __init__(self, engine_id: str, message: str) -> None:
        super().__init__(message)
        self.engine_id = engine_id


class EngineClient(Protocol):
    """The frontend's handle on one engine core; no caller needs to know which kind."""

    engine_id: str
    errors: list[str]  # fatal errors the engine reported, oldest first; callers pop them

    def wait_ready(self) -> Ready: ...

    def poll_ready(self, timeout_s: float) -> Ready | None: ...

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        kv_transfer_params: dict | None = None,
    ) -> None: ...

    def abort(self, req_ids: list[str]) -> None: ...

    def get_outputs(self, timeout_s: float) -> list[RequestOutput]: ...

    def wait_handles(self) -> list[zmq.Socket]: ...

    def request_stats(self) -> None: ...

    def take_stats(self) -> list[StatsSnapshot]: ...

    def shutdown(self) -> None: ...


class InprocClient:
    """The engine core in this process; get_outputs steps it."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_id = config.engine_id
        self.core, self.kv_cache = build_engine_core(config)
        self._pending: list[RequestOutput] = []
        self.errors: list[str] = []  # stays empty: an in-process engine's failure raises here
        self.ready = Ready(
            engine_id=config.engine_id,
            pid=os.getpid(),
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            vocab_size=config.model.vocab_size,
            device=kv_device(config, self.kv_cache),
        )

    def wait_ready(self) -> Ready:
        return self.ready

    def poll_ready(self, timeout_s: float = 0.0) -> Ready:
        return self.ready

    def add_request(self, req_id, prompt_token_ids, max_tokens, kv_transfer_params=None) -> None:
        self._pending.extend(
            self.core.add_request(req_id, prompt_token_ids, max_tokens, kv_transfer_params)
        )

    def abort(self, req_ids: list[str]) -> None:
        self._pending.extend(self.core.abort_requests(req_ids))

    def get_outputs(self, timeout_s: float = 0.0) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.core.has_work():
            outputs.extend(self.core.step().outputs)
        return outputs

    def wait_handles(self) -> list[zmq.Socket]:
        """Empty: output comes only from get_outputs stepping the core; nothing to wait on."""
        return []

    def request_stats(self) -> None:
        """No-op: an in-process engine has no busy loop to publish snapshots from."""

    def take_stats(self) -> list[StatsSnapshot]:
        return []

    def shutdown(self) -> None:
        self.core.shutdown()
        if self.kv_cache is not None:
            self.kv_cache.close()


class MPClient:
    """The engine core in a spawned child process, over ZMQ + msgpack.

    Spawns run_engine_core, binds the two sockets (ipc in a private run directory by default),
    waits for Ready with a timeout, and notices a dead child through its process sentinel.
    """

    def __init__(self, config: EngineConfig, run_dir: str | None = None, wait: bool = True) -> None:
        self.engine_id = config.engine_id
        self._own_run_dir = run_dir is None
        self.run_dir = run_dir or make_run_dir()
        self.addrs = EngineAddresses(
            input=f"ipc://{self.run_dir}/{self.engine_id}-in",
            output=f"ipc://{self.run_dir}/{self.engine_id}-out",
        )
        self.ctx = zmq.Context.instance()
        self.input = self._bind(zmq.PUSH, self.addrs.input)
        self.output = self._bind(
            zmq.PULL,
            self.addrs.output,
            engine_output_bytes(config.max_model_len, config.max_num_seqs),
        )
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, self.addrs),
            name=f"kvdrain-engine-{self.engine_id}",
        )
        self.process.start()
        self.ready_timeout_s = config.start_limit_s + READY_GRACE_S
        self.ready_deadline = time.monotonic() + self.ready_timeout_s
        self.latest_stats: StatsSnapshot | None = None
        self.new_stats: list[StatsSnapshot] = []  # since the last take_stats()
        self.errors: list[str] = []
        self.num_bad_messages = 0
        self.ready: Ready | None = None
        self.worker: tuple[int, str | None] | None = (
            None  # the engine's connector worker: (pid, start time)
        )
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int | None:
        """The engine core process's pid (its start-up is judged from /proc by it)."""
        return self.process.pid

    def _bind(self, kind: int, addr: str, max_message_bytes: int = -1) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        set_max_message_size(sock, max_message_bytes)
        sock.bind(addr)
        return sock

    def wait_ready(self) -> Ready:
        """Wait (bounded) for the child's Ready; several children may start at once."""
        while (ready := self.poll_ready(0.1)) is None:
            pass
        return ready

    def poll_ready(self, timeout_s: float) -> Ready | None:
        """The child's Ready if it came within timeout_s, else None; EngineDeadError if it
        died, failed, or is not ready ready_timeout_s after its start."""
        if self.ready is not None:
            return self.ready
        msg = self._recv(timeout_s)
        if isinstance(msg, Ready):
            self.ready = msg
            return msg
        if isinstance(msg, EngineError):
            self.kill()
            raise EngineDeadError(
                self.engine_id, f"engine {self.engine_id} failed to start:\n{msg.message}"
            )
        self._check_alive()
        if time.monotonic() > self.ready_deadline:
            self.kill()
            raise EngineDeadError(
                self.engine_id,
                f"engine {self.engine_id} not ready within {self.ready_timeout_s:g} s",
            )
        return None

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            raise EngineDeadError(
                self.engine_id,
                f"engine core {self.engine_id} (pid {self.process.pid}) "
                f"died with exit code {self.process.exitcode}",
            )

    def _recv(self, timeout_s: float) -> object | None:
        if not self.output.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        try:
            return decode(self.output.recv())
        except DecodeError:
            self.num_bad_messages += 1
            return None

    def _send(self, msg: object) -> None:
        """Send, or raise EngineDeadError: a PUSH to a dead child would block forever."""
        data = encode(msg)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        while True:
            try:
                self.input.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        self.engine_id,
                        f"engine {self.engine_id} takes no input for {SEND_TIMEOUT_S} s",
                    ) from None
                self.input.poll(50, zmq.POLLOUT)

    def add_request(self, req_id, prompt_token_ids, max_tokens, kv_transfer_params=None) -> None:
        self._send(AddRequest(req_id, list(prompt_token_ids), max_tokens, kv_transfer_params))

    def abort(self, req_ids: list[str]) -> None:
        self._send(Abort(list(req_ids)))

    def wait_handles(self) -> list[zmq.Socket]:
        return [self.output]

    def take_stats(self) -> list[StatsSnapshot]:
        stats, self.new_stats = self.new_stats, []
        return stats

    def request_stats(self) -> None:
        self._send(GetStats())

    def get_outputs(self, timeout_s: float) -> list[RequestOutput]:
        """Outputs that arrive within timeout_s (stats snapshots are kept aside)."""
        msg = self._recv(timeout_s)
        outputs: list[RequestOutput] = []
        while msg is not None:
            outputs.extend(self._on_message(msg))
            msg = self._recv(0)
        if not outputs:
            self._check_alive()
        return outputs

    def _on_message(self, msg: object) -> list[RequestOutput]:
        if isinstance(msg, RequestOutputs):
            return [output_from_msg(o) for o in msg.outputs]
        if isinstance(msg, StatsSnapshot):
            if snapshot_problem(msg, (self.engine_id,)) is not None:  # forged or broken
                self.num_bad_messages += 1
                return []
            self.latest_stats = msg
            self.new_stats.append(msg)
            if self.worker is None:
                self._note_worker(msg.counts.get("connector_worker_pid"))
        elif isinstance(msg, EngineError):
            self.errors.append(msg.message)
        return []

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Graceful: Shutdown message, bounded join, then kill; removes the ipc dir. An
        engine still starting (no Ready yet) has nothing to drain: it is killed at once."""
        try:
            if self.process.is_alive() and self._has_started():
                self.input.send(encode(Shutdown(timeout_s)), zmq.NOBLOCK)
                deadline = time.monotonic() + timeout_s + 5
                while self.process.is_alive() and time.monotonic() < deadline:
                    self.drain()
                    self.process.join(0.05)
        except zmq.ZMQError:
            pass
        finally:
            self.kill()

    def _has_started(self) -> bool:
        """Ready came (read now if it is waiting unread): never raises."""
        with contextlib.suppress(EngineDeadError):
            self.poll_ready(0)
        return self.ready is not None

    def drain(self) -> list[RequestOutput]:
        """Whatever has arrived, without waiting and without raising for a dead child."""
        outputs: list[RequestOutput] = []
        msg = self._recv(0)
        while msg is not None:
            outputs.extend(self._on_message(msg))
            msg = self._recv(0)
        return outputs

    def _tree(self) -> list[tuple[int, str | None]]:
        if self.process.pid is None or not self.process.is_alive():
            return []
        return [(pid, process_start_time(pid)) for pid in descendants(self.process.pid)]

    def _note_worker(self, pid: object) -> None:
        """Remember the connector worker the engine reported, if it is the engine's child."""
        if type(pid) is int and pid > 0 and parent_of(pid) == self.process.pid:
            self.worker = (pid, process_start_time(pid))

    def _stop_worker(self) -> None:
        """The engine is gone: its connector worker leaves on its own when it sees that
        (bounded wait); one still running then is stopped by its own id."""
        if self.worker is None:
            return
        pid, start = self.worker
        deadline = time.monotonic() + WORKER_EXIT_S
        while is_alive(pid, start) and time.monotonic() < deadline:
            time.sleep(0.02)
        if is_alive(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the engine, then every descendant of it seen just before (a connector
        worker still starting has no parent watch yet), by pid and start time."""
        try:
            tree = self._tree()
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            self._stop_worker()
            _kill_tree(tree)
        finally:  # even if a signal cut the join short
            _remove_kv_segments(self.process.pid)
            self.input.close(linger=0)
            self.output.close(linger=0)
            if self._own_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)


def _kill_tree(tree: list[tuple[int, str | None]]) -> None:
    """SIGKILL what is still alive of processes seen below a killed engine, and wait
    (bounded) until they are gone and reaped."""
    alive = [(pid, start) for pid, start in tree if start is not None and is_alive(pid, start)]
    for pid, _ in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + WORKER_EXIT_S
    while any(is_alive(*p) for p in alive) and time.monotonic() < deadline:
        time.sleep(0.02)


def wait_for_output(clients: list[EngineClient], timeout_s: float) -> None:
    """Block until any client's engine has sent something, or timeout_s passes.

    Returns at once if a client has nothing to wait on (in-process: its get_outputs steps).
    """
    handles = [client.wait_handles() for client in clients]
    if timeout_s <= 0 or not all(handles):
        return
    poller = zmq.Poller()
    for handle in (h for client_handles in handles for h in client_handles):
        poller.register(handle, zmq.POLLIN)
    poller.poll(int(timeout_s * 1000))


def _remove_kv_segments(pid: int | None) -> None:
    """Unlink KV-cache segments a dead child could not (SIGKILL skips its cleanup).

    Names follow engine/runner/kv_cache.py: <shm dir>/kvdrain-kv-<owner pid>-<random>.
    """
    if pid is None:
        return
    for directory in ("/dev/shm", tempfile.gettempdir()):
        for path in glob.glob(os.path.join(directory, f"kvdrain-kv-{pid}-*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
