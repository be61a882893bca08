"""The engine-core process: the busy loop, its sockets, its liveness. Runs in: engine-core process.

The loop's policy (step, sleep or block, and on what) is engine/core/liveness.py's next_action,
shared with the simulator; this module does the I/O around it. The frontend's death (its process
sentinel) always wakes the loop, which then exits.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import fields
from operator import attrgetter
from typing import TYPE_CHECKING

import zmq

from engine.config import EngineAddresses, EngineConfig
from engine.core.engine_core import EngineCore, EngineStepResult
from engine.core.kv_connector import KVConnectorRole, import_factory
from engine.core.liveness import LOOP_STATES, LoopAction, next_action
from engine.core.outputs import RequestOutput, SchedulerStats
from engine.proc.lifetime import die_with_parent
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
    output_to_msg,
)
from engine.proc.socket_limits import engine_input_bytes, set_max_message_size
from engine.runner.mock_runner import MockModelRunner
from engine.utils import cdiv

if TYPE_CHECKING:
    from engine.runner.kv_cache import KVCache

STATS_FIELDS = tuple(f.name for f in fields(SchedulerStats))
_stats_values = attrgetter(*STATS_FIELDS)  # SchedulerStats -> its counts, in field order


class SignalWakeup:
    """SIGTERM sets a flag and writes to a pipe the loop's poller watches, so a blocked
    loop wakes at once and the shutdown starts between steps, never inside one."""

    def __init__(self) -> None:
        self.requested = False
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested = True


def build_engine_core(config: EngineConfig) -> tuple[EngineCore, KVCache | None]:
    """The runner, the KV cache and both connector halves, composed from the config."""
    kv_cache = None
    if config.runner == "torch":
        from engine.runner.model_runner import ModelRunner  # torch only where it is needed

        runner = ModelRunner(config)
        kv_cache = runner.kv_cache
        config = runner.config  # num_blocks as allocated (sized from GPU memory, maybe)
    else:
        if config.kv_transfer is not None:  # real memory, so transfers move real bytes
            from engine.runner.kv_cache import KVCache

            kv_cache = KVCache.allocate(config.model, config.num_blocks, config.block_size, "cpu")
        runner = MockModelRunner(config, kv_cache)  # it stamps tokens into the KV it has
    connector = agent = None
    if config.kv_transfer is not None:
        factory = import_factory(config.kv_transfer.kv_connector)
        connector = factory(config, KVConnectorRole.SCHEDULER)
        agent = factory(config, KVConnectorRole.WORKER, kv_cache.handle.to_dict())
    return EngineCore(config, runner, connector, agent), kv_cache


def stats_counts(stats: SchedulerStats) -> dict[str, int]:
    """dataclasses.asdict(stats) for a flat record of ints, without its deep copies."""
    return dict(zip(STATS_FIELDS, _stats_values(stats)))


def kv_device(config: EngineConfig, kv_cache: KVCache | None) -> str:
    """Where the model runs, for Ready: the torch runner's KV device, else "cpu" (no torch)."""
    if config.runner != "torch" or kv_cache is None:
        return "cpu"
    return str(kv_cache.tensor.device)


class EngineCoreProc:
    def __init__(
        self, config: EngineConfig, addrs: EngineAddresses, wakeup: SignalWakeup | None = None
    ) -> None:
        self.config = config
        self.wakeup = wakeup
        # The process's one context, shared with the connector agent: one I/O thread
        # wakes for a report and its snapshot, not one per context.
        self.ctx = zmq.Context.instance()
        self.input = self._socket(zmq.PULL, addrs.input, engine_input_bytes(config.max_model_len))
        self.output = self._socket(zmq.PUSH, addrs.output)
        self.core, self.kv_cache = build_engine_core(config)
        self.config = config = self.core.config  # num_blocks as the runner allocated them
        self.parent = multiprocessing.parent_process()
        self.num_wakeups = 0
        # Wake-ups whose only input was a stats probe (GetStats: the frontend's 1 Hz
        # liveness check, top): counted apart, so a parked engine's wake count is its own.
        self.num_probe_wakeups = 0
        self._woke_for_input = False  # the last wait saw the input readable
        self.num_bad_messages = 0
        self.loop_state = "stepping"
        self.shutdown_timeout_s: float | None = None
        self._stats_seq = 0
        self._error_sent = False
        self.poll_interval_ms = max(1, round(config.poll_interval_s * 1000))
        self._last_published: tuple[str, dict[str, int]] | None = None  # (loop state, counts)
        self._deferred = False  # the last step's snapshot was left to the next step
        self._pollers: dict[tuple, zmq.Poller] = {}
        self._input_poller = zmq.Poller()
        self._input_poller.register(self.input, zmq.POLLIN)
        self._taken: list[object] = []  # taken off the input during a step, not yet handled
        self._send(
            Ready(
                engine_id=config.engine_id,
                pid=os.getpid(),
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_model_len=config.max_model_len,
                vocab_size=config.model.vocab_size,
                device=self._device(),
            )
        )

    def _socket(self, kind: int, addr: str, max_message_bytes: int = -1) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 1000)  # let a final error or output escape
        set_max_message_size(sock, max_message_bytes)  # engine/proc/socket_limits.py
        sock.connect(addr)
        return sock

    def _device(self) -> str:
        return kv_device(self.config, self.kv_cache)

    def _send(self, msg: object) -> None:
        self.output.send(encode(msg))

    # ---- the busy loop -------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Drain the input without blocking, step if there is work, then step, sleep or block.

        Sleeping is poll_interval (poll, and legacy while unfinished requests wait). Blocking
        watches the frontend input only, with no timeout (legacy with only delayed frees left,
        every policy when idle), or also the connector worker's socket and process sentinel
        until the connector's next timed action (event, while a transfer is pending: a lease
        to reap, a heartbeat due).
        """
        liveness = self.config.liveness
        input_ready = True  # the frontend input may hold messages: drain it
        while self.shutdown_timeout_s is None:
            if self.wakeup is not None and self.wakeup.requested:
                self.shutdown_timeout_s = 5.0  # SIGTERM: the same graceful path as Shutdown
                break
            if input_ready:
                self._process_input()
                if self.shutdown_timeout_s is not None:
                    break
            model_executed = can_progress = False
            if self.core.has_work():
                result = self._step()
                self._send_outputs(result.outputs)
                model_executed, can_progress = result.model_executed, result.can_progress
            # must_poll matters under event only, has_unfinished under legacy only.
            action = next_action(
                liveness,
                self.core.has_work(),
                model_executed,
                can_progress,
                liveness == "event" and self.core.must_poll(),
                has_unfinished=liveness == "legacy" and self.core.has_unfinished_requests(),
                only_in_flight=self.core.only_in_flight(),
            )
            self.loop_state = LOOP_STATES[action]
            # One snapshot per step at most: a zero-token step followed at once by
            # another step (a report consumed, finished ids to ship) leaves its
            # snapshot to that step's end, microseconds later.
            if action is not LoopAction.STEP or model_executed or self._deferred:
                self._publish_stats()
            else:
                self._deferred = True
            # A wait that watched the input says whether it is readable; skipping a drain
            # it is not is safe: whatever lands meanwhile wakes the next wait at once.
            input_ready = True
            if self._taken:  # messages taken off the input during the step: theirs first
                continue
            if action is LoopAction.SLEEP:  # vLLM's time.sleep(0.001), but still watching
                self._wait(with_connector=False, timeout_ms=self.poll_interval_ms, with_input=False)
            elif action is LoopAction.WAIT_ANY:
                input_ready = self._wait(with_connector=True, timeout_ms=self._until_deadline_ms())
            elif action is LoopAction.WAIT_INPUT:
                input_ready = self._wait(with_connector=False)

    def _step(self) -> EngineStepResult:
        """EngineCore.step; from vLLM 0.13 the aborts that arrived during its forward are
        taken before its output is processed (vLLM's input thread and aborts_queue)."""
        started = self.core.start_step()
        if self.core.takes_aborts_before_output:
            self._take_input_during_step()
        return self.core.finish_step(started)

    def _take_input_during_step(self) -> None:
        """What reached the input during the forward, kept for the next drain; the aborts
        also go to the core's aborts_queue (aborting twice changes nothing)."""
        while self._input_poller.poll(0):
            try:
                msg = decode(self.input.recv())
            except DecodeError:
                self.num_bad_messages += 1
                continue
            self._taken.append(msg)
            if isinstance(msg, Abort):
                self.core.aborts_queue.extend(msg.req_ids)

    def _until_deadline_ms(self) -> int | None:
        """Until the connector's next timed action (rounded up); None: none is timed."""
        due = self.core.next_deadline_ns()
        if due is None:
            return None
        return max(0, cdiv(due - time.monotonic_ns(), 1_000_000))

    def _wait(
        self, with_connector: bool, timeout_ms: int | None = None, with_input: bool = True
    ) -> bool:
        """Block until a watched socket or fd is ready (or timeout_ms); counts a wake-up.

        The parent's sentinel and the SIGTERM wakeup fd are always watched. Returns
        whether the frontend input may hold messages: True when it was not watched.
        """
        agent = self.core.connector_agent
        handles = tuple(agent.wait_handles()) if with_connector and agent is not None else ()
        events = self._poller(with_input, handles).poll(timeout_ms)
        self.num_wakeups += 1
        if not events:  # the timeout
            return not with_input
        ready = dict(events)
        self._woke_for_input = with_input and self.input in ready and len(ready) == 1
        if self.wakeup is not None and self.wakeup.read_fd in ready:
            os.read(self.wakeup.read_fd, 512)  # drain the signal bytes
        if self.parent is not None and self.parent.sentinel in ready:
            raise SystemExit("the frontend is gone")
        return not with_input or self.input in ready

    def _poller(self, with_input: bool, handles: tuple) -> zmq.Poller:
        """The poller for one kind of wait, built once (a wait happens per report)."""
        key = (with_input, handles)
        poller = self._pollers.get(key)
        if poller is None:
            poller = self._pollers[key] = zmq.Poller()
            if with_input:
                poller.register(self.input, zmq.POLLIN)
            if self.wakeup is not None:
                poller.register(self.wakeup.read_fd, zmq.POLLIN)
            if self.parent is not None:
                poller.register(
                    self.parent.sentinel, zmq.POLLIN | zmq.POLLERR
                )  # EOF is POLLHUP: ERR to zmq
            for handle in handles:
                poller.register(handle, zmq.POLLIN | zmq.POLLERR)
        return poller

    def _process_input(self) -> None:
        woke_for_input, self._woke_for_input = self._woke_for_input, False
        messages, self._taken = self._taken, []
        while self._input_poller.poll(0):  # a poller made once: cheaper than socket.poll
            data = self.input.recv()
            try:
                messages.append(decode(data))
            except DecodeError:
                self.num_bad_messages += 1  # drop it, keep serving
                woke_for_input = False
        if woke_for_input and messages and all(isinstance(m, GetStats) for m in messages):
            self.num_wakeups -= 1  # the wake-up was the probe's, not the engine's
            self.num_probe_wakeups += 1
        for msg in messages:
            self._handle(msg)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            self._send_outputs(
                self.core.add_request(
                    msg.req_id,
                    msg.prompt_token_ids,
                    msg.max_tokens,
                    msg.kv_transfer_params,
                    tuple(msg.stop_token_ids or ()),
                )
            )
        elif isinstance(msg, Abort):
            self._send_outputs(self.core.abort_requests(msg.req_ids))
        elif isinstance(msg, GetStats):
            self._publish_stats(force=True)
        elif isinstance(msg, Shutdown):
            self.shutdown_timeout_s = msg.timeout_s
        else:
            self.num_bad_messages += 1  # a well-formed message the engine never takes

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._send(RequestOutputs(self.config.engine_id, [output_to_msg(o) for o in outputs]))

    def _publish_stats(self, force: bool = False) -> None:
        """A snapshot whenever counts or the loop state changed (and on request)."""
        self._deferred = False
        counts = self._counts()
        # Built in C (zip, update) and compared as dicts: most iterations change nothing.
        key = (self.loop_state, counts)
        if not force and key == self._last_published:
            return
        self._last_published = key
        agent = self.core.connector_agent
        self._stats_seq += 1
        self._send(
            StatsSnapshot(
                engine_id=self.config.engine_id,
                seq=self._stats_seq,
                monotonic=time.monotonic(),
                loop_state=self.loop_state,
                num_steps=self.core.num_steps,
                num_wakeups=self.num_wakeups,
                counts=counts,
            )
        )
        if agent is not None and agent.error is not None and not self._error_sent:
            self._error_sent = True
            self._send(EngineError(self.config.engine_id, agent.error))

    def _counts(self) -> dict[str, int]:
        """What a snapshot shows: SchedulerStats, then the connector's and its agent's
        counters, then the loop's own (a later name wins, as dict.update)."""
        core = self.core
        counts = stats_counts(core.make_stats())
        connector, agent = core.scheduler.connector, core.connector_agent
        if connector is not None:
            counts.update(connector.get_counters())
        if agent is not None:
            counts.update(agent.get_counters())
        counts["num_bad_messages"] = self.num_bad_messages
        counts["num_probe_wakeups"] = self.num_probe_wakeups
        return counts

    # ---- shutdown ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Abort what is in flight, wait (bounded) for outstanding connector reports."""
        timeout = self.shutdown_timeout_s if self.shutdown_timeout_s is not None else 5.0
        unfinished = [
            r.req_id for r in self.core.scheduler.requests.values() if not r.is_finished()
        ]
        self._send_outputs(self.core.abort_requests(unfinished))
        deadline = time.monotonic() + timeout
        # Like vLLM: drain while has_work(). Under legacy that excludes delayed frees, so
        # a legacy engine exits with them still held, as vLLM did before #43433.
        while self.core.has_work() and time.monotonic() < deadline:
            if not self.core.step().model_executed:
                self._wait(with_connector=True, timeout_ms=10)
        self.loop_state = "stopped"
        self._publish_stats(force=True)

    def close(self) -> None:
        self.core.shutdown()
        close_runner = getattr(self.core.model_runner, "close", None)
        if close_runner is not None:
            close_runner()
        if self.kv_cache is not None:
            self.kv_cache.close()
        self.input.close()
        self.output.close()  # its linger lets the last messages out: see run_engine_core


def run_engine_core(config: EngineConfig, addrs: EngineAddresses) -> None:
    """Process entry point: build the core, send Ready, loop until Shutdown."""
    parent = multiprocessing.parent_process()
    die_with_parent(None if parent is None else parent.pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C
    wakeup = SignalWakeup()
    proc = None
    try:
        proc = EngineCoreProc(config, addrs, wakeup)
        proc.run_busy_loop()
        proc.shutdown()
    except SystemExit:
        pass
    except BaseException:
        _report_fatal(config, addrs, proc, traceback.format_exc())
        raise
    finally:
        if proc is not None:
            proc.close()
            proc.ctx.term()  # every socket is closed: waits (each linger) for the last sends


def _report_fatal(config: EngineConfig, addrs: EngineAddresses, proc, text: str) -> None:
    """Tell the frontend why we die (vLLM's ENGINE_CORE_DEAD), best effort."""
    try:
        if proc is not None:
            proc._send(EngineError(config.engine_id, text))
            return
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(addrs.output)
        sock.send(encode(EngineError(config.engine_id, text)))
        sock.close()
    except Exception:
        pass
