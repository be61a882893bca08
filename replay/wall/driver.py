"""The wall-clock replay driver: real engine processes, real time. Runs in: frontend process.

Each request is sent at origin + t, from one monotonic origin (never by adding up
sleeps), and its lateness is recorded. Every engine publishes a stats snapshot when
its counts or loop state change; the driver turns them into timeline samples on the
same clock (time.monotonic() is shared by processes on one host). An engine that does
not publish has not changed (nothing frees blocks without a step), so a sample holds
until the next one: the timeline shows idle periods as they are, including the legacy
policy's parked engine, which publishes nothing at all.

The faults a trace asks for are carried out here on a local router (PDRouter): a phased
abort and a request's fault by its routing (replay/deploy/pd_flow.py, whose RouteEvents
fill the requests' records), a pause or a kill on the engine processes
(replay/wall/engine_faults.py), which the FaultWatch is told to expect. A request's
read_t is when D's first token came: its load had ended by then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

from engine.core.outputs import RequestOutput
from engine.proc.client import EngineDeadError
from engine.proc.messages import StatsSnapshot
from replay.runtime.interrupt import Interrupted
from replay.runtime.starvation import StarvationJudge
from replay.trace.reader import (
    TraceAbort,
    TraceEngineFault,
    TraceRecord,
    TraceRequest,
    TraceSnapshot,
)
from replay.trace.synth import synth_prompt
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
from replay.wall.engine_faults import EngineSignals
from replay.wall.faults import FaultWatch, since_start

LEAD_IN_S = 0.1  # at most, between start-up and the trace's t = 0: see _lead_in


class ReplayTarget(Protocol):
    """What the driver sends a trace to: a local topology (PDRouter) or a serve (ServeClient)."""

    engines: list[str]
    vocab_size: int
    errors: list[tuple[str, str]]  # (engine, message), oldest first

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        pd: bool | None = None,
        trace_t: float | None = None,
    ) -> None:
        """trace_t: when the trace meant it sent (a serve's recording keeps it)."""

    def abort(self, req_id: str) -> None: ...
    def poll(self, timeout_s: float) -> list[RequestOutput]: ...
    def take_stats(self) -> list[StatsSnapshot]: ...
    def request_stats(self) -> None: ...
    def shutdown(self) -> None: ...


@dataclass(frozen=True, slots=True)
class WallOptions:
    tail_s: float = 3.0  # observed after the last request ends
    tick_interval_s: float = 0.25  # how often on_tick (the live view) is called
    request_timeout_s: float = 120.0  # a request still open this long after the tail: given up
    # The output check: what a single engine generates for (prompt, max_tokens)
    # (replay/verify/outputs.py); None: outputs are not checked.
    expected_tokens: Callable[[list[int], int], list[int]] | None = None

    def __post_init__(self) -> None:
        for name in ("tail_s", "tick_interval_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")


def sample_from_snapshot(t: float, snap: StatsSnapshot) -> EngineSample:
    c = snap.counts
    return EngineSample(
        t=t,
        engine=snap.engine_id,
        num_used_blocks=c["num_used_blocks"],
        num_cached_blocks=c["num_cached_blocks"],
        num_free_blocks=c["num_free_blocks"],
        num_usable_blocks=c["num_usable_blocks"],
        num_waiting=c["num_waiting"],
        num_skipped_waiting=c["num_skipped_waiting"],
        num_waiting_for_remote_kvs=c["num_waiting_for_remote_kvs"],
        num_running=c["num_running"],
        num_finished_awaiting_free=c["num_finished_awaiting_free"],
        loop_state=snap.loop_state,
        num_steps=snap.num_steps,
        num_wakeups=snap.num_wakeups,
    )


class WallClockReplay:
    def __init__(
        self,
        target: ReplayTarget,
        options: WallOptions,
        on_tick: Callable[[WallClockReplay], None] | None = None,
    ) -> None:
        self.target = target
        self.options = options
        self.on_tick = on_tick
        self.origin = time.monotonic() + LEAD_IN_S
        self.samples: list[EngineSample] = []
        self.latest: dict[str, StatsSnapshot] = {}
        self.first: dict[str, StatsSnapshot] = {}  # each engine's first: counts grow from it
        self.requests: dict[str, RequestRecord] = {}
        self.open: set[str] = set()
        self.arrivals: list[float] = []
        self.aborts: list[AbortRecord] = []
        self.snapshots: list[TraceSnapshot] = []
        self._tokens: dict[str, list[int]] = {}  # open request -> its tokens so far
        self._last_tick = 0.0
        self.num_sent = 0
        self.interrupted: str | None = None  # the signal that stopped the run early
        self.faults = FaultWatch(list(target.engines), judge=StarvationJudge(_engine_pids(target)))
        self.signals = EngineSignals(target)
        self.engine_faults: list[dict] = []  # carried out: Timeline.meta["engine_faults"]
        self.waiting_aborts: dict[str, TraceAbort] = {}  # phased, not yet carried out
        self.skipped_aborts: list[SkippedAbort] = []
        self.quiet_since: float | None = float(
            "-inf"
        )  # nothing of ours in flight since (None: some)
        self._num_errors = 0  # of target.errors, seen
        # (req_id, engine, t) the router told of, not yet recorded: stamped as it hands the
        # request over, before the engine can have it (an engine's sample never precedes it)
        self._moves: list[tuple[str, str, float]] = []
        if hasattr(target, "on_move"):  # a local router (PDRouter)
            target.on_move = lambda req_id, engine: self._moves.append((req_id, engine, self.now()))
        if getattr(target, "routing", None) is not None:  # its events fill the request records
            target.routing.listen()

    def now(self) -> float:
        return time.monotonic() - self.origin

    def run(self, records: Iterable[TraceRecord]) -> Timeline:
        """Send the trace and observe; on Ctrl-C or SIGTERM, stop there and return what was seen
        (meta "interrupted" names the signal; the caller shuts the target down)."""
        try:
            self._drive(records)
            self._finish()
        except Interrupted as e:
            self.interrupted = e.name
            self.end_t = self.now()
        except EngineDeadError as e:  # the run ends here; the verdict names the fault
            self.faults.on_error(self.now(), e.engine_id, str(e), "died")
            self.end_t = self.now()
        finally:
            self.signals.resume_all()  # no engine stays stopped, whatever ended the run
        return self._timeline()

    def _drive(self, records: Iterable[TraceRecord]) -> None:
        self._lead_in()
        for record in records:
            if isinstance(record, (TraceRequest, TraceAbort, TraceEngineFault)):
                self._wait_until(record.t)
            if isinstance(record, TraceRequest):
                self._send(record)
            elif isinstance(record, TraceAbort):
                self._abort(record)
            elif isinstance(record, TraceEngineFault):
                self._engine_fault(record)
            elif isinstance(record, TraceSnapshot):
                self.snapshots.append(record)

    def _abort(self, abort: TraceAbort) -> None:
        """A plain abort now (as today, to any target); a phased one by the local router."""
        if abort.when is None:
            self.target.abort(abort.req_id)
            self.aborts.append(AbortRecord(self.now(), abort.req_id))
        else:
            self.waiting_aborts[abort.req_id] = abort
            self.target.abort(abort.req_id, abort.when)
        self._take_events()

    def _engine_fault(self, fault: TraceEngineFault) -> None:
        """A pause or a kill of a local engine, expected by the fault watch."""
        now = self.now()
        self.faults.expect(now, fault.engine, fault.action, fault.for_s)
        if fault.action == "pause":
            self.signals.pause(fault.engine, now, fault.for_s)
        else:
            self.signals.kill(fault.engine)
            self._take_events()
        self.engine_faults.append(
            {"t": now, "engine": fault.engine, "action": fault.action, "for_s": fault.for_s}
        )

    def _lead_in(self) -> None:
        """The trace's t = 0 (the origin) comes once every engine has answered a first stats
        request (its sample before any traffic), or LEAD_IN_S after the start if one has not."""
        self.target.request_stats()
        first: list[StatsSnapshot] = []
        deadline = time.monotonic() + LEAD_IN_S
        while (
            not set(self.target.engines) <= {s.engine_id for s in first}
            and (left := deadline - time.monotonic()) > 0
        ):
            for output in self.target.poll(min(left, 0.01)):  # none: nothing was sent yet
                self._on_output(output)
            first.extend(self.target.take_stats())
        self.origin = min(time.monotonic(), self.origin)
        self._on_stats(first)

    def _wait_until(self, t: float) -> None:
        while (left := t - self.now()) > 0:
            self._pump(min(left, 0.05))

    def _send(self, req: TraceRequest) -> None:
        prompt = synth_prompt(req, self.target.vocab_size)
        fault = {} if req.fault is None else {"fault": req.fault}  # a local router's
        self.target.add_request(req.req_id, prompt, req.max_tokens, req.pd, trace_t=req.t, **fault)
        sent = self.now()
        self.num_sent += 1
        self.arrivals.append(req.t)
        self.open.add(req.req_id)
        self.quiet_since = None
        record = self.requests[req.req_id] = RequestRecord.sent(
            req.req_id, req.t, sent, len(prompt)
        )
        self._take_moves()
        if self.options.expected_tokens is not None:
            record.expected_digest = output_digest(
                self.options.expected_tokens(prompt, req.max_tokens)
            )
        self._tokens[req.req_id] = []
        self._take_events()

    def _take_events(self) -> None:
        """What a local router says became of requests, in their records."""
        routing = getattr(self.target, "routing", None)
        for event in routing.take_events() if routing is not None else ():
            now, record = self.now(), self.requests.get(event.req_id)
            if event.kind == "abort_skipped":
                self._skipped(event, now)
            elif record is None:
                continue
            elif event.kind == "prefill_done":  # its output may have ended it already
                record.prefill_done_t = now
                record.fault = event.fault or record.fault
            elif event.kind == "aborted":  # at its first token, that output ended it
                record.fault = f"abort_{event.phase}"
                if self.waiting_aborts.pop(event.req_id, None) is not None:
                    self.aborts.append(AbortRecord(record.end_t or now, event.req_id))
                if record.end_t is None:
                    self._end(record, now, "abort", None)
            elif record.end_t is None:  # lost with its engine
                self._end(record, now, "error", event.error)

    def _skipped(self, event, now: float) -> None:
        abort = self.waiting_aborts.pop(event.req_id, None)
        t, line = (abort.t, abort.line) if abort is not None else (now, 0)
        self.skipped_aborts.append(SkippedAbort(t, event.req_id, event.when, event.phase, line))

    def _take_moves(self) -> None:
        """Record the engines the router gave requests to since the last call (a local
        router only: a serve's routing is its own)."""
        for req_id, engine, t in self._moves:
            if req_id in self.requests:
                self.requests[req_id].enter(engine, t)
        self._moves.clear()

    def _pump(self, timeout_s: float) -> None:
        """Receive outputs and stats for up to timeout_s."""
        outputs = self.target.poll(timeout_s)
        self._take_moves()
        for output in outputs:
            self._on_output(output)
        self._take_events()
        now = self.now()
        self._note_quiet(now)
        self.signals.resume_due(now)
        self._on_stats(self.target.take_stats())
        self._watch_faults(now)
        if self.on_tick is not None and now - self._last_tick >= self.options.tick_interval_s:
            self._last_tick = now
            self.on_tick(self)

    def _on_stats(self, snapshots: list[StatsSnapshot]) -> None:
        for snap in snapshots:
            self.latest[snap.engine_id] = snap
            self.first.setdefault(snap.engine_id, snap)
            self.samples.append(sample_from_snapshot(snap.monotonic - self.origin, snap))
            self.faults.on_snapshot(self.now(), snap.engine_id, snap.counts)
            self.faults.on_activity(
                snap.monotonic - self.origin, snap.engine_id, snap.counts, self.quiet_since
            )

    def _on_output(self, output: RequestOutput) -> None:
        record = self.requests.get(output.req_id)
        if record is None or record.end_t is not None:
            return
        now = self.now()
        if output.new_token_ids and record.first_token_t is None and len(record.stages) > 1:
            record.read_t = now  # D's first token: P's blocks were read by then
        if output.new_token_ids:
            record.on_tokens(now)
            record.num_output_tokens += len(output.new_token_ids)
            self._tokens[output.req_id].extend(output.new_token_ids)
            record.num_prefix_hit_tokens = max(
                record.num_prefix_hit_tokens, output.num_cached_tokens
            )
        if output.finished:
            self._end(record, now, output.finish_reason, output.error)

    def _end(self, record: RequestRecord, now: float, reason: str | None, error: str | None):
        record.end_t, record.finish_reason, record.error = now, reason, error
        record.output_digest = output_digest(self._tokens.pop(record.req_id))
        self.open.discard(record.req_id)

    def _note_quiet(self, now: float) -> None:
        """Nothing of ours in flight from now: no open request, and (a local router) no
        request an engine is still finishing (one the client aborted, say)."""
        if self.quiet_since is None and not self.open:
            if not getattr(self.target, "has_pending", False):
                self.quiet_since = now

    def _watch_faults(self, now: float) -> None:
        """Engines' errors, and a stats probe for engines that have been silent a while."""
        errors = self.target.errors
        for engine, message in errors[self._num_errors :]:
            self.faults.on_error(now, engine, message)
        self._num_errors = len(errors)
        if self.faults.should_probe(now):
            self.target.request_stats()
        self.faults.check(now)

    def _finish(self) -> None:
        """Wait for open requests (bounded), then observe the tail."""
        deadline = self.now() + self.options.request_timeout_s
        while (self.open or self.signals.paused) and self.now() < deadline:
            self._pump(0.05)
        tail_end = self.now() + self.options.tail_s
        while self.now() < tail_end:
            self._pump(min(tail_end - self.now(), 0.05))
        self.target.request_stats()  # a last reading, on the same clock
        final = self.now() + 1.0
        while self.now() < final and not self._have_fresh_stats(tail_end):
            self._pump(0.05)
        self.end_t = self.now()

    def _have_fresh_stats(self, since: float) -> bool:
        gone = self.faults.gone  # killed: never fresh again
        return all(
            s.monotonic - self.origin >= since for e, s in self.latest.items() if e not in gone
        ) and set(self.latest) | gone >= set(self.target.engines)

    def _timeline(self) -> Timeline:
        self.samples.sort(key=lambda s: s.t)
        num_usable_blocks = {e: s.counts["num_usable_blocks"] for e, s in self.latest.items()}
        counters = {
            e: since_start(_counters(self.first[e]), _counters(s))  # a serve's outlive replays
            for e, s in self.latest.items()
        }
        routing = getattr(self.target, "routing", None)  # a local router: what each engine got
        for engine, n in routing.balancer.num_requests.items() if routing is not None else ():
            counters.setdefault(engine, {})["num_routed_requests"] = n
        return Timeline(
            engines=list(self.target.engines),
            num_usable_blocks=num_usable_blocks,
            samples=self.samples,
            requests=list(self.requests.values()),
            arrivals=self.arrivals,
            aborts=self.aborts,
            end_t=self.end_t,
            counters=counters,
            meta={
                "driver": "wall",
                **({"interrupted": self.interrupted} if self.interrupted else {}),
                "faults": [asdict(f) for f in self.faults.faults],
                "starved": [asdict(s) for s in self.faults.starved],
                "shared": [asdict(s) for s in self.faults.shared.values()],
                **self._fault_meta(),
            },
        )

    def _fault_meta(self) -> dict:
        """The engine faults carried out (and what they showed), the aborts skipped."""
        meta: dict[str, list] = {}
        if self.engine_faults:
            meta[ENGINE_FAULTS] = list(self.engine_faults)
            meta["expected_faults"] = [asdict(f) for f in self.faults.expected]
        if self.skipped_aborts:
            meta[SKIPPED_ABORTS] = [asdict(s) for s in self.skipped_aborts]
        return meta


def _engine_pids(target: ReplayTarget) -> dict[str, int]:
    """Each local engine process's pid (a router's MPClients); a serve's engines are not ours to read."""
    clients = getattr(target, "clients", {})
    return {
        e: c.process.pid
        for e, c in clients.items()
        if getattr(getattr(c, "process", None), "pid", None) is not None
    }


def _counters(snap: StatsSnapshot) -> dict[str, int]:
    return {"num_steps": snap.num_steps, "num_wakeups": snap.num_wakeups, **snap.counts}
