"""Virtual-clock replay: P/D or single engines on a deterministic discrete-event loop. Runs in: frontend process.

No sleeping and no wall clock: replay/sim/clock.py is the event loop (integer
nanoseconds, ties resolved the same way every run); replay/sim/kv_worker.py the KV
connector worker on it; replay/sim/engine.py drives each engine's EngineCore as
engine/proc/core_proc.py does, with a step cost and the fast-forward over provably
idle steps; replay/sim/options.py is what a run is set by. Here: the frontend (its
request records; the P/D proxy is replay/deploy/pd_flow.py's Routing, the live router's
too), and the run that feeds the trace one record at a time. The faults a trace asks for
(replay/trace/records.py) are carried out here: the routing's (phased aborts, a dropped
or refused D leg: replay/deploy/pd_flow.py) and the engines' (a pause, a kill:
replay/sim/engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from engine.core.block_hash import BlockHash, hash_request_blocks
from engine.core.outputs import RequestOutput, StepOutputs
from engine.core.request_check import why_malformed
from replay.deploy.pd_flow import (
    ABORTED,
    LOST,
    PREFILL_DONE,
    AddTo,
    Command,
    RouteEvent,
    Routing,
    engine_roles,
)
from replay.runtime.heap import no_full_collections
from replay.sim.clock import DELIVER, NS, TICK, EventLoop, to_ns
from replay.sim.engine import AbortInput, AddInput, EngineSlot, SimEngine
from replay.sim.gone_worker import GoneWorker
from replay.sim.kv_worker import SimKVWorker
from replay.sim.options import SimOptions
from replay.trace.reader import (
    TraceAbort,
    TraceEngineFault,
    TraceHeader,
    TraceRecord,
    TraceRequest,
)
from replay.trace.synth import BlockMemo, synth_prompt
from replay.verify.timeline import (
    ENGINE_FAULTS,
    SKIPPED_ABORTS,
    AbortRecord,
    EngineSample,
    RequestRecord,
    SkippedAbort,
    Timeline,
    output_digest,
)

PROGRESS_EVERY = 64  # requests fed between two on_progress calls

# on_progress(requests fed so far, virtual seconds): a live view's progress bar. It
# only reads; the run is the same with or without it.
ProgressCallback = Callable[[int, float], None]


@dataclass(slots=True)
class _Flight:
    """What the client sees of a request the engines have not finished yet."""

    record: RequestRecord
    tokens: list[int] = field(default_factory=list)
    # The prompt's block hashes, computed once here for every engine that takes it
    # (each would compute the same: engine/core/block_hash.py over the same tokens); only
    # for a well-formed prompt (engine/core/request_check.py why_malformed, checked here once).
    block_hashes: list[BlockHash] | None = None


class _Frontend:
    """The client side: trace records in, routed by replay/deploy/pd_flow.py, request records out."""

    def __init__(self, sim: Simulation, vocab_size: int) -> None:
        self.sim = sim
        self.routing = Routing.for_topology(
            sim.options.topology, sim.options.router, sim.options.engine.block_size
        )
        self.routing.listen()  # its events fill the request records
        self.flights: dict[str, _Flight] = {}  # one per route in flight
        self.seen: set[str] = set()
        self.records: list[RequestRecord] = []
        self.vocab_size = vocab_size
        self.block_size = sim.options.engine.block_size  # every engine's (SimOptions.engine_config)
        self.share_hashes = True  # False: each engine hashes its prompt itself (the same hashes)
        self.memo = BlockMemo()  # this replay's hash blocks, freed with it
        self.waiting_aborts: dict[str, TraceAbort] = {}  # phased aborts not yet carried out
        self.skipped_aborts: list[SkippedAbort] = []

    def on_request(self, req: TraceRequest) -> None:
        if req.req_id in self.seen:
            raise ValueError(f"id: duplicate request id {req.req_id!r} (line {req.line})")
        self.seen.add(req.req_id)
        prompt, t = synth_prompt(req, self.vocab_size, self.memo), self.sim.loop.now / NS
        record = RequestRecord.sent(req.req_id, t, t, len(prompt))
        self.records.append(record)
        hashes = None  # for a prompt checked here once, as every engine core would check it
        if self.share_hashes and self._is_well_formed(req, prompt):
            hashes = hash_request_blocks(prompt, self.block_size, [])
        self.flights[req.req_id] = _Flight(record, block_hashes=hashes)
        self._send(self.routing.add(req.req_id, prompt, req.max_tokens, req.pd, hashes, req.fault))
        self._take_events()

    def _is_well_formed(self, req: TraceRequest, prompt: list[int]) -> bool:
        """why_malformed(prompt, ...) is None. A synthesised prompt (no token ids in the
        trace) is plain ints in [0, vocab_size) by construction (synth_prompt), so its
        first token stands for all of them: the per-token pass is skipped."""
        checked = prompt[:1] if req.prompt_token_ids is None else prompt
        return why_malformed(checked, req.max_tokens, self.vocab_size) is None

    def on_abort(self, abort: TraceAbort) -> None:
        self.sim.leave_runs(self.sim.loop.now)  # the tokens the client had by now
        if abort.when is None:
            self.sim.aborts.append(AbortRecord(self.sim.loop.now / NS, abort.req_id))
        else:
            self.waiting_aborts[abort.req_id] = abort
        # The client is done at once (ABORTED); the engine hears next step, and P's late
        # output, if any, is still routed (replay/deploy/pd_flow.py after_prefill).
        self._send(self.routing.abort(abort.req_id, abort.when))
        self._take_events()

    def on_engine_gone(self, engine: str) -> None:
        """`engine` was killed: the requests there are lost."""
        self.sim.leave_runs(self.sim.loop.now)
        self.routing.engine_gone(engine)
        self._take_events()

    def on_read(self, engine: str, req_ids: list[str]) -> None:
        """D's step took these requests' finished loads: D read P's blocks now."""
        for req_id in req_ids:
            route, flight = self.routing.routes.get(req_id), self.flights.get(req_id)
            if route is not None and route.engine == engine and flight.record.read_t is None:
                flight.record.read_t = self.sim.loop.now / NS

    def _take_events(self) -> None:
        """What the routing says became of requests, in their records."""
        for event in self.routing.take_events():
            if event.kind == "abort_skipped":
                self._skipped(event)
                continue
            flight = self.flights.get(event.req_id)
            if flight is None:
                continue
            self._on_event(flight, event)
            if event.kind == LOST and event.req_id not in self.routing.routes:
                del self.flights[event.req_id]

    def _on_event(self, flight: _Flight, event: RouteEvent) -> None:
        record, t = flight.record, self.sim.loop.now / NS
        if event.kind == PREFILL_DONE:
            record.prefill_done_t = t
            record.fault = event.fault or record.fault
        elif event.kind == ABORTED:  # at its first token, that output ended it
            record.fault = f"abort_{event.phase}"
            if self.waiting_aborts.pop(event.req_id, None) is not None:
                self.sim.aborts.append(AbortRecord(t, event.req_id))
            if record.end_t is None:
                self._end(flight, "abort", None)
        elif event.kind == LOST and record.end_t is None:
            self._end(flight, "error", event.error)

    def _skipped(self, event: RouteEvent) -> None:
        abort = self.waiting_aborts.pop(event.req_id, None)
        t, line = (abort.t, abort.line) if abort is not None else (self.sim.loop.now / NS, 0)
        self.skipped_aborts.append(SkippedAbort(t, event.req_id, event.when, event.phase, line))

    def on_outputs(self, engine: str, outputs: list[RequestOutput] | StepOutputs) -> None:
        if type(outputs) is StepOutputs:
            if outputs.req_ids:
                self._on_plain_outputs(engine, outputs)
            outputs = outputs.records
        for out in outputs:
            route = self.routing.routes.get(out.req_id)
            if route is None:
                continue  # finished already
            flight = self.flights[out.req_id]
            routed = self.routing.on_output(engine, out)
            self._send(routed.commands)
            if routed.action is not None:  # P's final output
                flight.record.num_prefix_hit_tokens = out.num_cached_tokens
            if routed.output is not None and flight.record.end_t is None:  # else: aborted
                if routed.action is not None:  # P's token is dropped: D samples the first token
                    self._end(flight, routed.output.finish_reason, routed.output.error)
                else:
                    self._on_tokens(flight, routed.output, route.via_prefill)
            if self.routing.events:
                self._take_events()
            if out.req_id not in self.routing.routes:
                self.flights.pop(out.req_id, None)

    def _on_plain_outputs(self, engine: str, outputs: StepOutputs) -> None:
        """on_outputs of the plain outputs (StepOutputs' columns: one token, not finished),
        without their records: what Routing.on_output and _on_tokens do with one. P's
        unfinished output means nothing to the client; D's or a lone engine's is its
        tokens, unless the request moved on or the client aborted it."""
        routing = self.routing
        if engine in routing.prefill:
            return
        routes, flights, t = routing.routes, self.flights, self.sim.loop.now / NS
        for req_id, token, num_cached in zip(
            outputs.req_ids, outputs.new_token_ids, outputs.num_cached_tokens
        ):
            route = routes.get(req_id)
            if route is None or route.engine != engine or route.aborted:
                continue
            flight = flights[req_id]
            first = flight.record.first_token_t is None
            flight.record.on_tokens(t)
            flight.tokens.append(token)
            if not route.via_prefill:
                flight.record.num_prefix_hit_tokens = num_cached
            if first:
                self._streamed(req_id)

    def on_decode_steps(
        self,
        engine: str,
        req_ids: list[str],
        tokens: list[list[int]],
        num_cached_tokens: list[int],
        end_times: list[int],
    ) -> None:
        """_on_plain_outputs of several steps of one engine at once: each request's
        tokens, the i-th at end_times[i] (ns); nothing else moves in between."""
        routing = self.routing
        if engine in routing.prefill:
            return
        routes, flights, times = routing.routes, self.flights, [t / NS for t in end_times]
        for req_id, sampled, num_cached in zip(req_ids, tokens, num_cached_tokens):
            route = routes.get(req_id)
            if route is None or route.engine != engine or route.aborted:
                continue
            flight = flights[req_id]
            first = flight.record.first_token_t is None
            for t in times:
                flight.record.on_tokens(t)
            flight.tokens += sampled
            if not route.via_prefill:
                flight.record.num_prefix_hit_tokens = num_cached
            if first:
                self._streamed(req_id)

    def _streamed(self, req_id: str) -> None:
        """The request's first token reached the client: its decode phase began."""
        self._send(self.routing.streamed(req_id))
        if self.routing.events:
            self._take_events()

    def _send(self, commands: list[Command] | tuple[Command, ...]) -> None:
        for command in commands:
            engine = self.sim.engines[command.engine]
            if isinstance(command, AddTo):
                flight = self.flights.get(command.req_id)
                if flight is not None:
                    flight.record.enter(command.engine, self.sim.loop.now / NS)
                engine.deliver(
                    AddInput(
                        command.req_id,
                        command.prompt_token_ids,
                        command.max_tokens,
                        command.kv_transfer_params,
                        flight.block_hashes if flight is not None else None,
                    )
                )
            else:
                engine.deliver(AbortInput(command.req_id))

    def _on_tokens(self, flight: _Flight, out: RequestOutput, via_prefill: bool) -> None:
        if out.new_token_ids:
            flight.record.on_tokens(self.sim.loop.now / NS)
            flight.tokens += out.new_token_ids
        if not via_prefill:
            flight.record.num_prefix_hit_tokens = out.num_cached_tokens
        if out.finished:
            self._end(flight, out.finish_reason, out.error)

    def _end(self, flight: _Flight, reason: str | None, error: str | None) -> None:
        record = flight.record
        record.end_t, record.finish_reason, record.error = self.sim.loop.now / NS, reason, error
        record.num_output_tokens = len(flight.tokens)
        record.output_digest = output_digest(flight.tokens)


class Simulation:
    """One run: the trace fed a record at a time, the engines, the frontend, the sample ticks."""

    def __init__(
        self,
        records: Iterable[TraceRecord],
        options: SimOptions,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.options, self.loop = options, EventLoop()
        self.on_progress = on_progress
        self.trace, self.last_t, self.trace_done = iter(records), 0, False
        self.samples: list[EngineSample] = []
        self.arrivals: list[float] = []
        self.aborts: list[AbortRecord] = []
        self.engine_faults: list[dict] = []  # carried out: Timeline.meta["engine_faults"]
        self.workers: dict[str, SimKVWorker | GoneWorker] = {}
        self.frontend = _Frontend(self, options.engine.model.vocab_size)
        self.engines = {
            name: self._engine(name, rank, role)
            for rank, (name, role) in enumerate(engine_roles(options.topology))
        }
        self.end: int | None = None
        self.last_tick = -1
        self.grid = to_ns(options.sample_interval_s)
        self.is_grid_paused = False

    def _engine(self, name: str, rank: int, role: str | None) -> SimEngine:
        config = self.options.engine_config(name, role)
        worker = None if role is None else SimKVWorker(name, self.loop, self.options, self.workers)
        slot = EngineSlot(
            rank,
            self.frontend.on_outputs,
            self.samples.append,
            self._resume_grid,
            self.frontend.on_decode_steps,
            self.frontend.on_read if role == "kv_consumer" else None,
        )
        return SimEngine(config, slot, self.loop, self.options, worker)

    def run(self) -> Timeline:
        with no_full_collections():
            self._feed()
            self.loop.push(0, TICK, 0, self._tick)
            loop = self.loop
            while loop.heap and (self.end is None or loop.heap[0][0] <= self.end):
                fn, arg = loop.pop()
                fn(arg)
                if (
                    self.end is None
                    and self.trace_done
                    and (not self.frontend.flights or loop.num_pending == 0)
                ):
                    self.end = loop.now + to_ns(self.options.tail_s)
            return self._finish()

    def _feed(self) -> None:
        """Push the next trace record (one at a time: traces stream)."""
        rec = next(self.trace, None)
        while isinstance(rec, TraceHeader):
            rec = next(self.trace, None)
        if rec is None:
            self.trace_done = True
            return
        t = to_ns(rec.t)
        if t < self.last_t:
            raise ValueError(
                f"t: times must be non-decreasing, got {rec.t} after "
                f"{self.last_t / NS} (line {rec.line})"
            )
        self.last_t = t
        self.loop.push(t, DELIVER, 0, self._on_record, rec)

    def _on_record(self, rec: TraceRecord) -> None:
        if isinstance(rec, TraceRequest):
            self.arrivals.append(self.loop.now / NS)
            self.frontend.on_request(rec)
            if self.on_progress is not None and len(self.arrivals) % PROGRESS_EVERY == 0:
                self.on_progress(len(self.arrivals), self.loop.now / NS)
        elif isinstance(rec, TraceAbort):
            self.frontend.on_abort(rec)
        elif isinstance(rec, TraceEngineFault):
            self._carry_out(rec)
        self._feed()  # snapshots are verify()'s business

    def _carry_out(self, fault: TraceEngineFault) -> None:
        """A pause or a kill of an engine, at its time."""
        engine = self.engines.get(fault.engine)
        if engine is None:
            raise ValueError(
                f"{fault.action}: no engine {fault.engine!r} in this topology, it has "
                f"{', '.join(self.engines)} (line {fault.line})"
            )
        if fault.action == "pause":
            engine.pause(self.loop.now + to_ns(fault.for_s))
        elif not engine.is_gone:
            engine.kill()
            if fault.engine in self.workers:
                self.workers[fault.engine] = GoneWorker(fault.engine)
            self.frontend.on_engine_gone(fault.engine)
        self.engine_faults.append(
            {
                "t": self.loop.now / NS,
                "engine": fault.engine,
                "action": fault.action,
                "for_s": fault.for_s,
            }
        )

    def _tick(self, _: object) -> None:
        """Sample every engine; the next tick one grid step on, unless every engine is
        blocked: then nothing a sample shows can change until one wakes (_resume_grid),
        so an idle stretch costs one tick, however long it is."""
        self.last_tick = self.loop.now
        for engine in self.engines.values():
            if not engine.is_gone:
                engine.sample()
        if all(engine.is_blocked for engine in self.engines.values()):
            self.is_grid_paused = True
            return
        self._push_tick(self.loop.now + self.grid)

    def _resume_grid(self) -> None:
        """An engine woke: the grid goes on from its next point at or after now."""
        if self.is_grid_paused:
            self.is_grid_paused = False
            self._push_tick(-(-self.loop.now // self.grid) * self.grid)

    def _push_tick(self, t: int) -> None:
        if self.end is None or t <= self.end:
            self.loop.push(t, TICK, 0, self._tick)

    def stopped(self, signal_name: str) -> Timeline:
        """The timeline so far of a run that a signal stopped (meta "interrupted" names it)."""
        timeline = self._finish()
        timeline.meta["interrupted"] = signal_name
        return timeline

    def leave_runs(self, until: int) -> None:
        """Every engine's skipped decode steps that started before `until`, taken (replay/sim/decode_run.py)."""
        for engine in self.engines.values():
            if engine.run is not None:
                engine.leave_run(until)

    def _finish(self) -> Timeline:
        self.loop.now = self.end if self.end is not None else self.loop.now
        self.leave_runs(self.loop.now + 1)  # what the events up to now did
        if self.on_progress is not None:
            self.on_progress(len(self.arrivals), self.loop.now / NS)
        counters = {}
        for name, engine in self.engines.items():
            last = (
                engine.sample()
                if self.last_tick != self.loop.now and not engine.is_gone
                else next(s for s in reversed(self.samples) if s.engine == name)
            )
            counters[name] = engine.counters(last)
            counters[name]["num_routed_requests"] = self.frontend.routing.balancer.num_requests[
                name
            ]
        return Timeline(
            engines=list(self.engines),
            num_usable_blocks={n: self.options.engine.num_blocks - 1 for n in self.engines},
            samples=self.samples,
            requests=self.frontend.records,
            arrivals=self.arrivals,
            aborts=self.aborts,
            end_t=self.loop.now / NS,
            counters=counters,
            meta={"driver": "virtual", **asdict(self.options), **self._fault_meta()},
        )

    def _fault_meta(self) -> dict:
        """The engine faults carried out and the aborts skipped, where there are any."""
        meta = {}
        if self.engine_faults:
            meta[ENGINE_FAULTS] = list(self.engine_faults)
        if self.frontend.skipped_aborts:
            meta[SKIPPED_ABORTS] = [asdict(s) for s in self.frontend.skipped_aborts]
        return meta


def simulate(
    records: Iterable[TraceRecord], options: SimOptions, on_progress: ProgressCallback | None = None
) -> Timeline:
    """Replay `records` (times in replay seconds) on the virtual clock."""
    return Simulation(records, options, on_progress).run()
