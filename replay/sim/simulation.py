"""Virtual-clock replay: P/D or single engines on a deterministic discrete-event loop. Runs in: frontend process.

No sleeping and no wall clock: replay/sim/clock.py is the event loop (integer
nanoseconds, ties resolved the same way every run); replay/sim/kv_worker.py the KV
connector worker on it; replay/sim/engine.py drives each engine's EngineCore as
engine/core_proc.py does, with a step cost model and the fast-forward over provably
idle steps; replay/sim/options.py is what a run is set by. Here: the frontend and P/D
proxy (routing as connector/routing.py decides, engines named as it names them), and
the run that feeds the trace one record at a time.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from connector.routing import (END, PREFILL_MAX_TOKENS, RELEASE, after_prefill, engine_roles,
                               prefill_params)
from engine.outputs import RequestOutput
from replay.sim.clock import DELIVER, NS, TICK, EventLoop, to_ns
from replay.sim.engine import AbortInput, AddInput, EngineSlot, SimEngine
from replay.sim.kv_worker import SimKVWorker
from replay.sim.options import SimOptions
from replay.trace.synth import synth_prompt
from replay.verify.timeline import AbortRecord, EngineSample, RequestRecord, Timeline, output_digest
from replay.trace.reader import TraceAbort, TraceHeader, TraceRecord, TraceRequest

@dataclass(slots=True)
class _Flight:
    """A request the router has not finished yet."""

    record: RequestRecord
    prompt: list[int]
    max_tokens: int
    engine: str  # where it is now
    via_prefill: bool
    tokens: list[int] = field(default_factory=list)
    aborted: bool = False  # over for the client; the engines may still be finishing it


class _Router:
    """The frontend and vLLM's P/D proxy: P with max_tokens=1, then D with P's params."""

    def __init__(self, sim: Simulation, vocab_size: int) -> None:
        self.sim = sim
        self.flights: dict[str, _Flight] = {}
        self.seen: set[str] = set()
        self.records: list[RequestRecord] = []
        self.vocab_size = vocab_size

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
            self.sim.engines["P"].deliver(AddInput(req.req_id, prompt, PREFILL_MAX_TOKENS,
                                                   prefill_params()))
        else:
            self.sim.engines[engine].deliver(AddInput(req.req_id, prompt, req.max_tokens, None))

    def on_abort(self, abort: TraceAbort) -> None:
        flight = self.flights.get(abort.req_id)
        self.sim.aborts.append(AbortRecord(self.sim.loop.now / NS, abort.req_id))
        if flight is not None and not flight.aborted:
            # The client is done at once; the engine hears next step, and P's late
            # output, if any, is still routed (connector/routing.after_prefill).
            self._end(flight, "abort", None)
            flight.aborted = True
            self.flights[abort.req_id] = flight
            self.sim.engines[flight.engine].deliver(AbortInput(abort.req_id))

    def on_outputs(self, engine: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            flight = self.flights.get(out.req_id)
            if flight is None:
                continue  # finished already
            if flight.aborted and (engine != "P" or flight.engine != "P"):
                if out.finished:  # the engines are done with a request the client left
                    del self.flights[out.req_id]
                continue
            if engine == "P":
                self._on_prefilled(flight, out)
            else:
                self._on_tokens(flight, out)

    def _on_prefilled(self, flight: _Flight, out: RequestOutput) -> None:
        if not out.finished:
            return
        flight.record.num_prefix_hit_tokens = out.num_cached_tokens
        action, params = after_prefill(out, flight.aborted)
        if action == END:
            if flight.aborted:
                del self.flights[out.req_id]
            else:
                self._end(flight, out.finish_reason, out.error)
            return
        flight.engine = "D"  # P's token is dropped: D samples the first token itself
        d = self.sim.engines["D"]
        d.deliver(AddInput(out.req_id, flight.prompt, flight.max_tokens, params))
        if action == RELEASE:
            d.deliver(AbortInput(out.req_id))

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
        record.output_digest = output_digest(flight.tokens)
        del self.flights[record.req_id]


class Simulation:
    """One run: the trace fed a record at a time, the engines, the router, the sample ticks."""

    def __init__(self, records: Iterable[TraceRecord], options: SimOptions) -> None:
        self.options, self.loop = options, EventLoop()
        self.trace, self.last_t, self.trace_done = iter(records), 0, False
        self.samples: list[EngineSample] = []
        self.arrivals: list[float] = []
        self.aborts: list[AbortRecord] = []
        self.workers: dict[str, SimKVWorker] = {}
        self.router = _Router(self, options.engine.model.vocab_size)
        self.engines = {name: self._engine(name, rank, role)
                        for rank, (name, role) in enumerate(engine_roles(options.topology))}
        self.end: int | None = None
        self.last_tick = -1

    def _engine(self, name: str, rank: int, role: str | None) -> SimEngine:
        config = self.options.engine_config(name, role)
        worker = None if role is None else SimKVWorker(name, self.loop, self.options, self.workers)
        slot = EngineSlot(rank, self.router.on_outputs, self.samples.append)
        return SimEngine(config, slot, self.loop, self.options, worker)

    def run(self) -> Timeline:
        self._feed()
        self.loop.push(0, TICK, 0, self._tick)
        loop = self.loop
        while loop.heap and (self.end is None or loop.heap[0][0] <= self.end):
            fn, arg = loop.pop()
            fn(arg)
            if self.end is None and self.trace_done and (
                    not self.router.flights or loop.num_pending == 0):
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
            raise ValueError(f"t: times must be non-decreasing, got {rec.t} after "
                             f"{self.last_t / NS} (line {rec.line})")
        self.last_t = t
        self.loop.push(t, DELIVER, 0, self._on_record, rec)

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
        nxt = self.loop.now + to_ns(self.options.sample_interval_s)
        if self.end is None or nxt <= self.end:
            self.loop.push(nxt, TICK, 0, self._tick)

    def _finish(self) -> Timeline:
        self.loop.now = self.end if self.end is not None else self.loop.now
        counters = {}
        for name, engine in self.engines.items():
            last = engine.sample() if self.last_tick != self.loop.now else \
                next(s for s in reversed(self.samples) if s.engine == name)
            counters[name] = engine.counters(last)
        return Timeline(
            engines=list(self.engines), num_blocks={n: self.options.engine.num_blocks - 1
                                                    for n in self.engines},
            samples=self.samples, requests=self.router.records, arrivals=self.arrivals,
            aborts=self.aborts, end_t=self.loop.now / NS, counters=counters,
            meta={"driver": "virtual", **asdict(self.options)})


def simulate(records: Iterable[TraceRecord], options: SimOptions) -> Timeline:
    """Replay `records` (times in replay seconds) on the virtual clock."""
    return Simulation(records, options).run()
