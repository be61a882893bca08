"""Virtual-clock replay: P/D or single engines on a deterministic discrete-event loop. Runs in: frontend process.

No sleeping and no wall clock: time is integer nanoseconds; events sit in a heap keyed
(time, class, engine rank, seq), seq a counter, so ties resolve the same way every run.
At one instant: deliveries (trace records, transfers, reports), then step ends (P before
D), then step starts, then samples. Engines are named as connector/router.py names them.

Each engine is an EngineCore driven as engine/core_proc.py drives it. A step starts by
draining the frontend input and runs at that instant; its outputs and its stats are
published `cost` later (step_base_s + step_per_token_s * tokens; zero_step_s with no
tokens). Then `next_action` decides: STEP at once; SLEEP poll_interval_s (a wake-up);
WAIT_INPUT (only an input wakes it: connector reports pile up unread); WAIT_ANY (an
input or a report wakes it). Each wake from a wait is a wake-up, as in core_proc.

Fast-forward (SimOptions.fast_forward). A step is a no-op when it scheduled, shipped
(finished ids, connector metadata) and collected (reports) nothing, drained no input,
output nothing and left the stats unchanged. The scheduler is a pure function of its
state, so with nothing new in the input queue or the connector inbox the next step is
the same no-op. So after a no-op step whose action is SLEEP (poll) or STEP (legacy
spinning on a pending load), with both queues empty, the engine schedules no events and
keeps (s0, p): its steps would start at s0 + i*p, p = zero_step_s (+ poll_interval_s
when polling). Only an input or a report can change anything; when one arrives at T the
k = ceil((T - s0) / p) steps that started before T are counted (and, polling, the sleeps
that began by T as wake-ups); if step k-1 is still running at T, its step-end event is
scheduled as usual, else the step at s0 + k*p is. Samples meanwhile count the same way.
Integer time makes s0 + k*p exactly what k additions give, so timelines are identical
with the shortcut off (tests/test_simulate.py compares both).
"""
from __future__ import annotations

import hashlib
import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from connector.pd import PDConnector, PDConnectorMetadata, ReqToRecv
from engine.config import EngineConfig, KVTransferConfig
from engine.core import EngineCore
from engine.kv_connector import KVConnectorWorkerBase
from engine.liveness import LOOP_STATES, LoopAction, next_action
from engine.mock_runner import MockModelRunner
from engine.outputs import (KVConnectorOutput, ModelRunnerOutput, RequestOutput, SchedulerOutput,
                            SchedulerStats)
from replay.synth import synth_prompt
from replay.timeline import AbortRecord, EngineSample, RequestRecord, Timeline
from replay.trace import TraceAbort, TraceHeader, TraceRecord, TraceRequest

TOPOLOGIES = ("pd", "single")
NS = 1_000_000_000
_DELIVER, _STEP_END, _STEP_START, _TICK = range(4)  # event classes, in tie order
_WAITS = (LoopAction.WAIT_INPUT, LoopAction.WAIT_ANY)


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Topology, engine sizes, liveness policy, and the latency model (seconds)."""

    liveness: str = "event"
    topology: str = "pd"
    num_blocks: int = 4096  # per engine, the null block included
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    kv_expiry_s: float = 480.0  # P frees an unread send after this
    pull_delay_s: float = 0.002  # D waits before reading
    per_block_s: float = 0.00005  # D's read time per block
    read_done_latency_s: float = 0.0005  # D's worker -> P's worker
    drop_read_done: bool = False  # P never hears back; only expiry frees
    poll_interval_s: float = 0.001
    step_base_s: float = 0.004
    step_per_token_s: float = 0.00002
    zero_step_s: float = 0.0001  # a step with no forward: the worker round trip
    sample_interval_s: float = 0.1
    tail_s: float = 5.0  # observed after the last request ends
    fast_forward: bool = True  # skip provably idle poll/spin steps (module docstring)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology: must be one of {TOPOLOGIES}, got {self.topology!r}")
        for name in ("zero_step_s", "sample_interval_s"):
            if not getattr(self, name) >= 1e-9:
                raise ValueError(f"{name}: must be >= 1e-9 s, got {getattr(self, name)!r}")
        for name in ("pull_delay_s", "per_block_s", "read_done_latency_s", "step_base_s",
                     "step_per_token_s", "tail_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")

    def engine_config(self, name: str, role: str | None) -> EngineConfig:
        """The config of engine `name`; role None means no connector."""
        kv = None if role is None else KVTransferConfig(
            kv_role=role, kv_expiry_s=self.kv_expiry_s, pull_delay_ms=self.pull_delay_s * 1e3,
            drop_read_done=self.drop_read_done, kv_addr=f"sim://{name}")
        return EngineConfig(
            engine_id=name, num_blocks=self.num_blocks, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            liveness=self.liveness, poll_interval_s=self.poll_interval_s, kv_transfer=kv)


def _ns(seconds: float) -> int:
    return round(seconds * NS)


class _EventLoop:
    def __init__(self) -> None:
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0
        self.num_pending = 0  # events other than sample ticks

    def push(self, t: int, cls: int, rank: int, fn: Callable, arg: object = None) -> None:
        self.seq += 1
        self.num_pending += cls != _TICK
        heapq.heappush(self.heap, (t, cls, rank, self.seq, fn, arg))

    def pop(self) -> tuple[Callable, object]:
        t, cls, _, _, fn, arg = heapq.heappop(self.heap)
        self.now = t
        self.num_pending -= cls != _TICK
        return fn, arg


class _TimedRunner:
    """The mock runner, noting what the cost model and the no-op test need."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = MockModelRunner(config)
        self.num_tokens = 0
        self.is_noop = False

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        meta = sched_out.kv_connector_metadata
        self.num_tokens = sched_out.total_num_scheduled_tokens
        self.is_noop = not (self.num_tokens or sched_out.scheduled or sched_out.preempted_req_ids
                            or sched_out.finished_req_ids or (meta is not None and not meta.is_empty()))
        return self.runner.execute(sched_out)


class SimKVWorker(KVConnectorWorkerBase):
    """A P/D connector worker on the virtual clock; reports wait in the inbox for get_finished."""

    def __init__(self, name: str, loop: _EventLoop, options: SimOptions,
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
            self.loop.push(now + _ns(opts.kv_expiry_s), _DELIVER, 0, self._expire, req_id)
        for recv in metadata.reqs_to_recv.values():
            done = now + _ns(opts.pull_delay_s) + len(recv.local_block_ids) * _ns(opts.per_block_s)
            self.loop.push(done, _DELIVER, 0, self._pull_done, recv)

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

    def _pull_done(self, recv: ReqToRecv) -> None:
        self._report(self.inbox_recving, recv.req_id)
        peer = self.peers.get(recv.remote_engine_id)
        if peer is not None and not self.options.drop_read_done:
            self.loop.push(self.loop.now + _ns(self.options.read_done_latency_s), _DELIVER, 0,
                           peer._read_done, recv.remote_request_id)

    def _read_done(self, req_id: str) -> None:
        if req_id in self.sending:
            self.sending.remove(req_id)
            self._report(self.inbox_sending, req_id)
        elif req_id in self.expired:
            self.num_reads_after_expiry += 1
        else:
            self.early_read_done.add(req_id)


@dataclass(frozen=True, slots=True)
class _Add:
    req_id: str
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict | None


@dataclass(frozen=True, slots=True)
class _Abort:
    req_id: str


@dataclass(frozen=True, slots=True)
class _StepResult:
    """What a step hands to its end event: outputs and the liveness inputs."""

    outputs: list[RequestOutput]
    model_executed: bool
    got_kv_reports: bool
    noop: bool  # changed nothing: the next step from here is the same no-op
    stats: SchedulerStats  # published at the step's end


class _SimEngine:
    """One engine's busy loop on the virtual clock, following engine/liveness.py."""

    def __init__(self, sim: _Simulation, name: str, rank: int, role: str | None) -> None:
        opts, self.sim, self.name, self.rank, self.loop = sim.options, sim, name, rank, sim.loop
        config = opts.engine_config(name, role)
        self.worker = None if role is None else SimKVWorker(name, sim.loop, opts, sim.workers)
        if self.worker is not None:
            self.worker.on_report = self.on_report
        self.runner = _TimedRunner(config)
        self.core = EngineCore(config, self.runner, PDConnector(config) if role else None,
                               self.worker)
        self.zero, self.poll = _ns(opts.zero_step_s), _ns(opts.poll_interval_s)
        self.base, self.per_token = _ns(opts.step_base_s), _ns(opts.step_per_token_s)
        self.input: deque[_Add | _Abort] = deque()
        self.blocked_on: LoopAction | None = LoopAction.WAIT_INPUT
        self.state = "blocked"
        self.num_steps = self.num_wakeups = 0
        self.ff: tuple[int, int, int] | None = None  # (next step start, period, wakeups/step)
        self.stats = self.core.make_stats()  # as last published: at a step's end, or a drain
        self.sampled: tuple | None = None

    def deliver(self, msg: _Add | _Abort) -> None:
        self.input.append(msg)
        if self.blocked_on is not None:
            self._wake()
        elif self.ff is not None:
            self._leave_ff()

    def on_report(self) -> None:
        if self.blocked_on is LoopAction.WAIT_ANY:
            self._wake()
        elif self.ff is not None:
            self._leave_ff()

    def _wake(self) -> None:
        self.blocked_on = None
        self.num_wakeups += 1
        self._enter("stepping")
        self.loop.push(self.loop.now, _STEP_START, self.rank, self._step_start)

    def _drain(self) -> list[RequestOutput]:
        outputs = []
        while self.input:
            msg = self.input.popleft()
            if isinstance(msg, _Add):
                outputs += self.core.add_request(msg.req_id, msg.prompt, msg.max_tokens,
                                                 msg.kv_transfer_params)
            else:
                outputs += self.core.abort_requests([msg.req_id])
        return outputs

    def _step_start(self, _: object) -> None:
        num_inputs = len(self.input)
        drained = self._drain()
        if drained:
            self.sim.router.on_outputs(self.name, drained)
        if not self.core.has_work():
            self.stats = self.core.make_stats()
            self._block(LoopAction.WAIT_INPUT)
            return
        self.num_steps += 1
        outputs, model_executed = self.core.step()
        stats = self.core.make_stats()  # published when the step ends, with its outputs
        reports = self.core.got_kv_reports
        noop = (self.runner.is_noop and not outputs and not num_inputs and not reports
                and stats == self.stats)
        tokens = self.runner.num_tokens
        cost = self.base + self.per_token * tokens if tokens else self.zero
        self.loop.push(self.loop.now + cost, _STEP_END, self.rank, self._step_end,
                       _StepResult(outputs, model_executed, reports, noop, stats))

    def _step_end(self, result: _StepResult) -> None:
        self.stats = result.stats
        if result.outputs:
            self.sim.router.on_outputs(self.name, result.outputs)
        action = next_action(self.core.config.liveness, self.core.has_work(),
                             result.model_executed, result.got_kv_reports)
        reports = self.worker is not None and self.worker.has_reports()
        if action in _WAITS:
            if not (self.input or (action is LoopAction.WAIT_ANY and reports)):
                self._block(action)
                return
            self.num_wakeups += 1  # the poller returns at once, as in core_proc's _wait
            action = LoopAction.STEP
        nxt = self.loop.now
        if action is LoopAction.SLEEP:
            self.num_wakeups += 1
            nxt += self.poll
        self._enter(LOOP_STATES[action])
        if result.noop and self.sim.options.fast_forward and not self.input and not reports:
            polling = action is LoopAction.SLEEP
            self.ff = (nxt, self.zero + (self.poll if polling else 0), int(polling))
        else:
            self.loop.push(nxt, _STEP_START, self.rank, self._step_start)

    def _leave_ff(self) -> None:
        """An input or report arrived at `now`: resume real steps (module docstring)."""
        (s0, period, wakeups), now = self.ff, self.loop.now
        self.ff = None
        k = -(-(now - s0) // period) if now > s0 else 0
        if k == 0:
            self.loop.push(s0, _STEP_START, self.rank, self._step_start)
            return
        self.num_steps += k
        last_end = s0 + (k - 1) * period + self.zero
        self.num_wakeups += wakeups * (k if last_end <= now else k - 1)
        if last_end > now:  # that step is still running: let its end decide, as it would
            self.loop.push(last_end, _STEP_END, self.rank, self._step_end,
                           _StepResult([], False, False, True, self.stats))
        else:
            self.loop.push(s0 + k * period, _STEP_START, self.rank, self._step_start)

    def _block(self, action: LoopAction) -> None:
        self.blocked_on = action
        self._enter("blocked")

    def _enter(self, state: str) -> None:
        self.state = state
        if (self.stats, state) != self.sampled:
            self.sample()

    def sample(self) -> EngineSample:
        t, s = self.loop.now, self.stats
        steps, wakeups = self.num_steps, self.num_wakeups
        if self.ff is not None:  # the skipped steps that started (and ended) by t
            s0, period, per_step = self.ff
            steps += (t - s0) // period + 1 if t >= s0 else 0
            wakeups += per_step * ((t - s0 - self.zero) // period + 1) if t >= s0 + self.zero else 0
        self.sampled = (s, self.state)
        sample = EngineSample(
            t / NS, self.name, s.num_used_blocks, s.num_cached_blocks, s.num_free_blocks,
            s.num_blocks, s.num_waiting, s.num_skipped_waiting, s.num_waiting_for_remote_kvs,
            s.num_running, s.num_finished_awaiting_free, self.state, steps, wakeups)
        self.sim.samples.append(sample)
        return sample

    def counters(self, last: EngineSample) -> dict[str, int]:
        """Totals at the end, from its final sample."""
        w = self.worker
        return {"num_steps": last.num_steps, "num_wakeups": last.num_wakeups,
                "num_model_steps": self.core.num_model_steps,
                "num_expired": w.num_expired if w else 0,
                "num_reads_after_expiry": w.num_reads_after_expiry if w else 0,
                "num_stale_kv_reports": self.stats.num_stale_kv_reports,
                "num_preemptions": self.stats.num_preemptions,
                "num_prefix_hit_tokens": self.stats.num_prefix_hit_tokens}


@dataclass(slots=True)
class _Flight:
    """A request the router has not finished yet."""

    record: RequestRecord
    prompt: list[int]
    max_tokens: int
    engine: str  # where it is now
    via_prefill: bool
    tokens: list[int] = field(default_factory=list)


class _Router:
    """The frontend and vLLM's P/D proxy: P with max_tokens=1, then D with P's params."""

    def __init__(self, sim: _Simulation) -> None:
        self.sim = sim
        self.flights: dict[str, _Flight] = {}
        self.seen: set[str] = set()
        self.records: list[RequestRecord] = []
        self.vocab_size = next(iter(sim.engines.values())).core.config.model.vocab_size

    def on_request(self, req: TraceRequest) -> None:
        if req.req_id in self.seen:
            raise ValueError(f"id: duplicate request id {req.req_id!r} (line {req.line})")
        self.seen.add(req.req_id)
        prompt, t = synth_prompt(req, self.vocab_size), self.sim.loop.now / NS
        record = RequestRecord(req.req_id, t, t, 0.0, None, None, len(prompt), 0, 0, None)
        self.records.append(record)
        pd = self.sim.options.topology == "pd"
        via_prefill = pd and req.pd is not False
        engine = "P" if via_prefill else "D" if pd else "E"
        self.flights[req.req_id] = _Flight(record, prompt, req.max_tokens, engine, via_prefill)
        if via_prefill:
            self.sim.engines["P"].deliver(_Add(req.req_id, prompt, 1, {"do_remote_decode": True}))
        else:
            self.sim.engines[engine].deliver(_Add(req.req_id, prompt, req.max_tokens, None))

    def on_abort(self, abort: TraceAbort) -> None:
        flight = self.flights.get(abort.req_id)
        self.sim.aborts.append(AbortRecord(self.sim.loop.now / NS, abort.req_id))
        if flight is not None:  # the client is done at once; the engine hears next step
            self._end(flight, "abort", None)
            self.sim.engines[flight.engine].deliver(_Abort(abort.req_id))

    def on_outputs(self, engine: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            flight = self.flights.get(out.req_id)
            if flight is None:
                continue  # finished or aborted from the client's view already
            if engine == "P":
                self._on_prefilled(flight, out)
            else:
                self._on_tokens(flight, out)

    def _on_prefilled(self, flight: _Flight, out: RequestOutput) -> None:
        if not out.finished:
            return
        flight.record.num_prefix_hit_tokens = out.num_cached_tokens
        if out.finish_reason != "length" or not out.kv_transfer_params:
            self._end(flight, out.finish_reason, out.error or "prefill returned no KV params")
            return
        flight.engine = "D"  # P's token is dropped: D samples the first token itself
        self.sim.engines["D"].deliver(_Add(out.req_id, flight.prompt, flight.max_tokens,
                                           out.kv_transfer_params))

    def _on_tokens(self, flight: _Flight, out: RequestOutput) -> None:
        if out.new_token_ids:
            if flight.record.first_token_t is None:
                flight.record.first_token_t = self.sim.loop.now / NS
            flight.tokens += out.new_token_ids
        if not flight.via_prefill:
            flight.record.num_prefix_hit_tokens = out.num_cached_tokens
        if out.finished:
            self._end(flight, out.finish_reason, out.error)

    def _end(self, flight: _Flight, reason: str | None, error: str | None) -> None:
        record = flight.record
        record.end_t, record.finish_reason, record.error = self.sim.loop.now / NS, reason, error
        record.num_output_tokens = len(flight.tokens)
        text = ",".join(map(str, flight.tokens)).encode()
        record.output_digest = hashlib.sha256(text).hexdigest()[:16]
        del self.flights[record.req_id]


class _Simulation:
    def __init__(self, records: Iterable[TraceRecord], options: SimOptions) -> None:
        self.options, self.loop = options, _EventLoop()
        self.trace, self.last_t, self.trace_done = iter(records), 0, False
        self.samples: list[EngineSample] = []
        self.arrivals: list[float] = []
        self.aborts: list[AbortRecord] = []
        self.workers: dict[str, SimKVWorker] = {}
        roles = [("P", "kv_producer"), ("D", "kv_consumer")] if options.topology == "pd" \
            else [("E", None)]
        self.engines = {name: _SimEngine(self, name, rank, role)
                        for rank, (name, role) in enumerate(roles)}
        self.router = _Router(self)
        self.end: int | None = None
        self.last_tick = -1

    def run(self) -> Timeline:
        self._feed()
        self.loop.push(0, _TICK, 0, self._tick)
        loop = self.loop
        while loop.heap and (self.end is None or loop.heap[0][0] <= self.end):
            fn, arg = loop.pop()
            fn(arg)
            if self.end is None and self.trace_done and (
                    not self.router.flights or loop.num_pending == 0):
                self.end = loop.now + _ns(self.options.tail_s)
        return self._finish()

    def _feed(self) -> None:
        """Push the next trace record (one at a time: traces stream)."""
        rec = next(self.trace, None)
        while isinstance(rec, TraceHeader):
            rec = next(self.trace, None)
        if rec is None:
            self.trace_done = True
            return
        t = _ns(rec.t)
        if t < self.last_t:
            raise ValueError(f"t: times must be non-decreasing, got {rec.t} after "
                             f"{self.last_t / NS} (line {rec.line})")
        self.last_t = t
        self.loop.push(t, _DELIVER, 0, self._on_record, rec)

    def _on_record(self, rec: TraceRecord) -> None:
        if isinstance(rec, TraceRequest):
            self.arrivals.append(self.loop.now / NS)
            self.router.on_request(rec)
        elif isinstance(rec, TraceAbort):
            self.router.on_abort(rec)
        self._feed()  # snapshots are verify()'s business

    def _tick(self, _: object) -> None:
        self.last_tick = self.loop.now
        for engine in self.engines.values():
            engine.sample()
        nxt = self.loop.now + _ns(self.options.sample_interval_s)
        if self.end is None or nxt <= self.end:
            self.loop.push(nxt, _TICK, 0, self._tick)

    def _finish(self) -> Timeline:
        self.loop.now = self.end if self.end is not None else self.loop.now
        counters = {}
        for name, engine in self.engines.items():
            last = engine.sample() if self.last_tick != self.loop.now else \
                next(s for s in reversed(self.samples) if s.engine == name)
            counters[name] = engine.counters(last)
        return Timeline(
            engines=list(self.engines), num_blocks={n: self.options.num_blocks - 1
                                                    for n in self.engines},
            samples=self.samples, requests=self.router.records, arrivals=self.arrivals,
            aborts=self.aborts, end_t=self.loop.now / NS, counters=counters,
            meta={"driver": "virtual", **asdict(self.options)})


def simulate(records: Iterable[TraceRecord], options: SimOptions) -> Timeline:
    """Replay `records` (times in replay seconds) on the virtual clock."""
    return _Simulation(records, options).run()
