"""One simulated engine: EngineCore's busy loop on the virtual clock. Runs in: frontend process.

Each engine is an EngineCore driven as engine/proc/core_proc.py drives it. A step starts by
draining the frontend input, schedules and runs its forward at that instant
(EngineCore.start_step), and processes its output `cost` later (step_base_s +
step_per_token_s * tokens, or a calibrated StepCost's cost of the step's shape,
replay/sim/cost.py; zero_step_s with no tokens) in finish_step, an abort that arrived
meanwhile first (as vLLM 0.13+ takes it); its outputs and its stats are published then.
Then `next_action` decides: STEP at once; SLEEP poll_interval_s (a wake-up);
WAIT_INPUT (only an input wakes it: connector reports pile up unread, no lease is
reaped); WAIT_ANY (an input, a report, or the connector's next timed action wakes it:
a lease to reap, a heartbeat due; core_proc's poll timeout). Each wake from a wait is
a wake-up, as in core_proc.

Fast-forward (SimOptions.fast_forward). A step is a no-op when it scheduled, shipped
(finished ids, connector metadata) and collected (reports) nothing, drained no input,
output nothing and left the stats unchanged. The scheduler is a pure function of its
state, so with nothing new in the input queue or the connector inbox the next step is
the same no-op, until the connector's next timed action (EngineCore.next_deadline_ns:
a heartbeat due, a lease to reap; the only things a step does by the clock alone). So
after a no-op step whose action is SLEEP (poll, or legacy waiting on a pending load)
or STEP, with both queues empty, the engine schedules only an event at that deadline
and keeps (s0, p): its steps would start at s0 + i*p, p = zero_step_s (+
poll_interval_s when sleeping). Only an input, a report or that deadline can change
anything; when one comes at T the k = ceil((T - s0) / p) steps that started before T
are counted (and, sleeping, the sleeps that began by T as wake-ups); if step k-1 is
still running at T, it is started late (its connector reading the clock as at its
start) and its output processed at its end, as usual, else the step at s0 + k*p is
(the first to start at or after T). Samples meanwhile count the same way.
Integer time makes s0 + k*p exactly what k additions give, so timelines are identical
with the shortcut off (tests/replay/sim/test_simulate.py compares both).

Decode runs (SimOptions.fast_forward too). After a model step that consumed no
connector reports, with nothing new in the input queue or the connector inbox, the
plain decode steps that follow (engine/core/decode_run.py: one token for every running
request, nothing else) are skipped as one run (replay/sim/decode_run.py): one event at the last one's end takes them all and
publishes each step's tokens at that step's end. An input or a report at T takes the
steps that started before T; the last of them, still running at T, is started late
like a fast-forward's and processes its output at its end (an abort that came
meanwhile first); an abort (the client's view) and the end of the simulation take
them the same way first. The connector worker tells its engine of a report before the
report lands, so a step started late never sees it.
tests/replay/sim/test_decode_runs.py compares the timelines with every step taken.

Engine faults (replay/trace/records.py TraceEngineFault): a paused engine takes no step
and no input until its pause ends (a SIGSTOP then SIGCONT of its engine core: its
connector worker runs on, its heartbeats stop); a step running then ends when it ends.
A killed engine is gone: its events come to nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.block_hash import BlockHash
from engine.core.decode_run import num_plain_decode_steps, take_plain_decode_steps
from engine.core.engine_core import EngineCore, StartedStep
from engine.core.kv_connector import KVConnectorBase, KVConnectorRole, import_factory
from engine.core.liveness import LOOP_STATES, LoopAction, next_action
from engine.core.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    StepOutputs,
)
from engine.core.request import Request
from engine.runner.mock_runner import MockModelRunner
from engine.utils import cdiv
from replay.sim.clock import DELIVER, NS, STEP_END, STEP_START, EventLoop, has_passed, to_ns
from replay.sim.cost import StepShape
from replay.sim.decode_run import DecodeRun, step_outputs
from replay.sim.kv_worker import SimKVWorker
from replay.sim.options import SimOptions
from replay.verify.timeline import EngineSample

_WAITS = (LoopAction.WAIT_INPUT, LoopAction.WAIT_ANY)
MAX_RUN_STEPS = 4096  # a run's steps are planned one by one: a bound on that work


class _TimedRunner:
    """The mock runner, noting what the step cost and the no-op test need."""

    def __init__(self, config: EngineConfig) -> None:
        # Every prompt reaches a simulated engine checked against the vocabulary (the
        # frontend's why_malformed, or EngineCore.add_request), sampled tokens are in it.
        self.runner = MockModelRunner(config, check_vocab=False)
        self.num_tokens = 0
        self.sched_out: SchedulerOutput | None = None  # the step's, if it ran the model

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_tokens = sched_out.total_num_scheduled_tokens
        self.sched_out = sched_out  # its shape (for a calibrated step cost), what it shipped
        return self.runner.execute(sched_out)

    def ran_nothing(self) -> bool:
        """The step scheduled, shipped (finished ids, connector metadata) and preempted nothing."""
        out = self.sched_out
        if out is None:
            return True
        meta = out.kv_connector_metadata
        return not (
            self.num_tokens
            or out.req_ids
            or out.preempted_req_ids
            or out.finished_req_ids
            or (meta is not None and not meta.is_empty())
        )


@dataclass(frozen=True, slots=True)
class AddInput:
    """A request for the engine's input queue (as the frontend's AddRequest)."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict | None
    # The prompt's, if the frontend computed them (then it also checked the prompt).
    block_hashes: list[BlockHash] | None = None


@dataclass(frozen=True, slots=True)
class AbortInput:
    """An abort for the engine's input queue (as the frontend's Abort)."""

    req_id: str


@dataclass(frozen=True, slots=True)
class EngineSlot:
    """Where an engine sits in the simulation: its rank in ties, and who hears it."""

    rank: int
    on_outputs: Callable[[str, list[RequestOutput]], None]  # the router
    on_sample: Callable[[EngineSample], None]  # the timeline
    on_wake: Callable[[], None] = lambda: None  # the sample grid: an engine left a block
    # on_decode_steps(engine, req_ids, tokens, num_cached_tokens, end times): the plain
    # outputs of a run's skipped steps at once, as on_outputs of each step at its end
    # would give them; None: no runs, every step is taken.
    on_decode_steps: (
        Callable[[str, list[str], list[list[int]], list[int], list[int]], None] | None
    ) = None
    # on_read(engine, req_ids): a step took these requests' finished loads (D read P's
    # blocks); None: nobody asked.
    on_read: Callable[[str, list[str]], None] | None = None


def build_connector(config: EngineConfig) -> KVConnectorBase | None:
    """The scheduler side, from the factory the config names (as engine/proc/core_proc.py builds it)."""
    if config.kv_transfer is None:
        return None
    return import_factory(config.kv_transfer.kv_connector)(config, KVConnectorRole.SCHEDULER)


@dataclass(slots=True, kw_only=True)  # not frozen: one per step, and a frozen __init__ costs more
class _StepResult:
    """What a step hands to its end event: outputs and the liveness inputs."""

    outputs: list[RequestOutput]
    model_executed: bool
    can_progress: bool  # see engine/liveness.next_action
    must_poll: bool
    noop: bool  # changed nothing: the next step from here is the same no-op
    got_kv_reports: bool  # else the connector has nothing left to ship (engine/core/decode_run.py)
    stats: SchedulerStats  # published at the step's end


class SimEngine:
    """One engine's busy loop on the virtual clock, following engine/core/liveness.py."""

    def __init__(
        self,
        config: EngineConfig,
        slot: EngineSlot,
        loop: EventLoop,
        options: SimOptions,
        worker: SimKVWorker | None = None,
    ) -> None:
        """`worker` is the simulated connector worker, the engine's agent too; with one,
        config must name a connector."""
        self.options, self.slot, self.loop = options, slot, loop
        self.name, self.rank = config.engine_id, slot.rank
        self.worker = worker
        if worker is not None:
            worker.on_report = self.on_report
        self.runner = _TimedRunner(config)
        self.core = EngineCore(config, self.runner, build_connector(config), worker)
        self.zero, self.poll = to_ns(options.zero_step_s), to_ns(config.poll_interval_s)
        self.base, self.per_token = to_ns(options.step_base_s), to_ns(options.step_per_token_s)
        self.input: deque[AddInput | AbortInput] = deque()
        self.blocked_on: LoopAction | None = LoopAction.WAIT_INPUT
        self.state = "blocked"
        self.num_steps = self.num_wakeups = 0
        self.ff: tuple[int, int, int] | None = None  # (next step start, period, wakeups/step)
        self.run: DecodeRun | None = None  # plain decode steps being skipped
        self.num_pauses = 0  # counts blocks, fast-forwards and runs: a timer belongs to one
        self.stats = self.core.make_stats()  # as last published: at a step's end, or a drain
        self.sampled: tuple | None = None
        self.paused_until: int | None = None  # a pause's end (ns)
        self.is_gone = False  # killed

    def deliver(self, msg: AddInput | AbortInput) -> None:
        if self.is_gone:
            return
        self.input.append(msg)
        if self.paused_until is not None:
            return  # taken when the pause ends
        if self.blocked_on is not None:
            self._wake()
        elif self.ff is not None:
            self._leave_ff()
        elif self.run is not None:
            self.leave_run(self.loop.now)

    def on_report(self) -> None:
        if self.is_gone or self.paused_until is not None:
            return
        if self.blocked_on is LoopAction.WAIT_ANY:
            self._wake()
        elif self.ff is not None:
            self._leave_ff()
        elif self.run is not None:
            self.leave_run(self.loop.now)

    def _wake(self) -> None:
        self.blocked_on = None
        self.num_wakeups += 1
        self._enter("stepping")
        self.loop.push(self.loop.now, STEP_START, self.rank, self._step_start)
        self.slot.on_wake()

    @property
    def is_blocked(self) -> bool:
        """Parked on a wait: its samples stay the same until something wakes it."""
        return self.blocked_on is not None

    def _drain(self) -> list[RequestOutput]:
        outputs = []
        while self.input:
            msg = self.input.popleft()
            if isinstance(msg, AddInput):
                outputs += self._add(msg)
            else:
                outputs += self.core.abort_requests([msg.req_id])
        return outputs

    def _add(self, msg: AddInput) -> list[RequestOutput]:
        """EngineCore.add_request, with the prompt's block hashes computed (and the prompt
        checked) once for every engine: the same Request (the same hashes, as Request
        would chain them itself). Anything else goes through add_request itself."""
        config, params = self.core.config, msg.kv_transfer_params
        if msg.block_hashes is None or type(msg.max_tokens) is not int or msg.max_tokens < 1:
            return self.core.add_request(msg.req_id, msg.prompt, msg.max_tokens, params)
        try:
            # The prompt by reference: a Request keeps its own all_token_ids and never
            # changes prompt_token_ids, nor does the frontend.
            request = Request(
                msg.req_id,
                msg.prompt,
                msg.max_tokens,
                config.block_size,
                eos_token_id=config.eos_token_id,
                kv_transfer_params=dict(params) if params else None,
                block_hashes=list(msg.block_hashes),
            )
        except ValueError:
            return self.core.add_request(msg.req_id, msg.prompt, msg.max_tokens, params)
        return self.core.add(request)

    def pause(self, until: int) -> None:
        """No step and no input until `until` (ns); what is running or due meanwhile waits
        for it (module docstring)."""
        if self.is_gone:
            return
        if self.run is not None:
            self.leave_run(self.loop.now)
        elif self.ff is not None:
            self._leave_ff()
        self.paused_until = max(until, self.paused_until or 0)
        self.loop.push(self.paused_until, DELIVER, self.rank, self._resume, self.paused_until)

    def _resume(self, until: int) -> None:
        if self.is_gone or self.paused_until != until:
            return  # a later pause lasts longer
        self.paused_until = None
        if self.blocked_on is None:
            return
        reports = self.worker is not None and self.worker.has_reports()
        if self.input or (self.blocked_on is LoopAction.WAIT_ANY and reports):
            self._wake()
        elif self.blocked_on is LoopAction.WAIT_ANY:
            self._arm_timer()

    def kill(self) -> None:
        """The engine is gone: its input, its steps and its timers come to nothing."""
        if self.run is not None:
            self.run = None
            self.loop.cancel()  # its end event is void
        self.num_pauses += 1
        self.is_gone, self.ff, self.paused_until = True, None, None
        self.input.clear()
        self.blocked_on = LoopAction.WAIT_INPUT  # never woken again

    def _deferred(self, cls: int, fn: Callable, arg: object) -> bool:
        """A step event of a gone engine (dropped) or a paused one (again at the pause's end)."""
        if self.is_gone:
            return True
        if self.paused_until is None:
            return False
        self.loop.push(self.paused_until, cls, self.rank, fn, arg)
        return True

    def _step_start(self, _: object) -> None:
        if (self.is_gone or self.paused_until is not None) and self._deferred(
            STEP_START, self._step_start, None
        ):
            return
        num_inputs = len(self.input)
        drained = self._drain() if num_inputs else None
        if drained:
            self.slot.on_outputs(self.name, drained)
        if not self.core.has_work():
            self.stats = self.core.make_stats()
            self._block(LoopAction.WAIT_INPUT)
            return
        self.num_steps += 1
        self.runner.num_tokens, self.runner.sched_out = 0, None  # a step may only process a batch
        started = self.core.start_step()
        cost = self._cost(self.runner.num_tokens)
        self.loop.push(
            self.loop.now + cost, STEP_END, self.rank, self._finish_step, (started, num_inputs)
        )

    def _finish_step(self, arg: tuple[StartedStep, int]) -> None:
        """The step's output, processed as its forward ends: the aborts that arrived
        meanwhile first (EngineCore.aborts_queue; they stay in the input too)."""
        started, num_inputs = arg
        self.core.aborts_queue.extend(m.req_id for m in self.input if type(m) is AbortInput)
        step = self.core.finish_step(started)
        if self.slot.on_read is not None and self.core.scheduler.finished_recving_kv_req_ids:
            self.slot.on_read(self.name, list(self.core.scheduler.finished_recving_kv_req_ids))
        outputs = step.outputs
        stats = self.core.make_stats()  # published now, with its outputs
        noop = (
            not outputs
            and not num_inputs
            and not step.got_kv_reports
            and not step.can_progress
            and self.runner.ran_nothing()
            and stats == self.stats
            and not (self.core.batch_queue and self.core.batch_queue.has_pending_work())
        )
        self._step_end(
            _StepResult(
                outputs=outputs,
                model_executed=step.model_executed,
                can_progress=step.can_progress,
                must_poll=self.core.must_poll(),
                noop=noop,
                got_kv_reports=step.got_kv_reports,
                stats=stats,
            )
        )

    def _cost(self, tokens: int) -> int:
        """The step's virtual ns: zero_step_s without tokens, else its step cost."""
        step_cost = self.options.step_cost
        if not tokens:
            return self.zero
        if step_cost is None:
            return self.base + self.per_token * tokens
        return to_ns(step_cost.cost_s(StepShape.of(self.runner.sched_out)))

    def _decode_cost(self, num_decodes: int, num_context_tokens: int) -> int:
        """_cost of a plain decode step of that shape."""
        step_cost = self.options.step_cost
        if step_cost is None:
            return self.base + self.per_token * num_decodes
        return to_ns(step_cost.cost_s(StepShape(0, num_decodes, num_context_tokens)))

    def _step_end(self, result: _StepResult) -> None:
        if (self.is_gone or self.paused_until is not None) and self._deferred(
            STEP_END, self._step_end, result
        ):
            return
        self.stats = result.stats
        if result.outputs:
            self.slot.on_outputs(self.name, result.outputs)
        action = next_action(
            self.core.config.liveness,
            self.core.has_work(),
            result.model_executed,
            result.can_progress,
            result.must_poll,
            has_unfinished=self.core.has_unfinished_requests(),
            only_in_flight=self.core.only_in_flight(),
        )
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
        skip = self.options.fast_forward and not self.input and not reports
        if skip and result.noop:
            polling = action is LoopAction.SLEEP
            self.ff = (nxt, self.zero + (self.poll if polling else 0), int(polling))
            self._arm_timer()
        elif not (
            skip and action is LoopAction.STEP and not result.got_kv_reports and self._start_run()
        ):
            self.loop.push(nxt, STEP_START, self.rank, self._step_start)

    def _start_run(self) -> bool:
        """After a model step that consumed no reports, with nothing new since: skip the
        plain decode steps that follow, as one run whose end is its last step's end
        (engine/core/decode_run.py, replay/sim/decode_run.py)."""
        scheduler = self.core.scheduler
        if self.slot.on_decode_steps is None or self.core.batch_queue is not None:
            return False
        num_steps = num_plain_decode_steps(
            scheduler, self.runner.runner.decode_token_ids, MAX_RUN_STEPS
        )
        if not num_steps:
            return False
        num_context_tokens = sum(request.num_computed_tokens for request in scheduler.running)
        self.run = DecodeRun.plan(
            self.loop.now,
            num_steps,
            len(scheduler.running),
            num_context_tokens,
            self._decode_cost,
            self.core.next_deadline_ns(),
        )
        if self.run is None:
            return False
        self.num_pauses += 1  # the run's ticket: its end event's
        self.loop.push(self.run.end, STEP_END, self.rank, self._end_run, self.num_pauses)
        return True

    def _end_run(self, pause: int) -> None:
        if pause != self.num_pauses:
            self.loop.on_cancelled()  # an input or a report ended that run earlier
            return
        if (self.is_gone or self.paused_until is not None) and self._deferred(
            STEP_END, self._end_run, pause
        ):
            return
        run, self.run = self.run, None
        last = self._take_run_steps(run, len(run.starts))
        self._step_end(self._run_step_result(last))

    def leave_run(self, until: int) -> None:
        """Something came at `until` (an input, a report), or someone must see the run's
        effects then: take the steps that started before it; the last of them ends as
        any step does. If that one has not processed its output by `until`, it is taken
        as a step of its own (start_step now, its output at its end), so that an abort
        arriving meanwhile is taken before its output as in every step."""
        run, self.run = self.run, None
        self.num_pauses += 1  # its end event is void
        self.loop.cancel()
        num_steps = run.num_started_before(until)
        if until == self.loop.now and has_passed(self.loop, self.rank):
            num_steps = run.num_started_by(until)  # the step starting now missed this event
        if not num_steps:
            self.loop.push(run.starts[0], STEP_START, self.rank, self._step_start)
            return
        end = run.end_of(num_steps - 1)
        if not self._has_ended(end, until):
            if num_steps > 1:
                self._take_run_steps(run, num_steps - 1, publish_last=True)
            self.num_steps += 1
            self.runner.num_tokens, self.runner.sched_out = 0, None
            started = self._start_step_at(run.starts[num_steps - 1])
            self.loop.push(end, STEP_END, self.rank, self._finish_step, (started, 0))
            return
        last = self._take_run_steps(run, num_steps)
        self.loop.push(end, STEP_END, self.rank, self._step_end, self._run_step_result(last))

    def _start_step_at(self, t: int) -> StartedStep:
        """start_step of a step that started at t, earlier: its connector reads the clock
        as then (the input and the reports are as then: nothing came since)."""
        if self.worker is None:
            return self.core.start_step()
        self.worker.step_started_at = t
        try:
            return self.core.start_step()
        finally:
            self.worker.step_started_at = None

    def _has_ended(self, end: int, until: int) -> bool:
        """A step that ends at `end` has processed its output by `until`, as an event at
        `until` sees it (at one instant, step ends come after deliveries, in rank order)."""
        if end != until:
            return end < until
        return until == self.loop.now and has_passed(self.loop, self.rank, STEP_END)

    def _run_step_result(self, outputs: StepOutputs) -> _StepResult:
        """What a run's last step hands to its end (a plain decode step's)."""
        return _StepResult(
            outputs=outputs,
            model_executed=True,
            can_progress=False,
            must_poll=self.core.must_poll(),
            noop=False,
            got_kv_reports=False,
            stats=self.stats,
        )

    def _take_run_steps(
        self, run: DecodeRun, num_steps: int, publish_last: bool = False
    ) -> StepOutputs:
        """Make the run's first num_steps steps; publish the outputs of all but the
        last (of all with publish_last), each at its step's end, and return the last one's."""
        scheduler, core = self.core.scheduler, self.core
        req_ids = [request.req_id for request in scheduler.running]
        num_cached = [max(request.num_cached_tokens, 0) for request in scheduler.running]
        tokens = take_plain_decode_steps(scheduler, self.runner.runner.decode_token_ids, num_steps)
        self.num_steps += num_steps
        core.num_steps += num_steps
        core.num_model_steps += num_steps
        num_published = num_steps if publish_last else num_steps - 1
        if num_published:
            self.slot.on_decode_steps(
                self.name,
                req_ids,
                [sampled[:num_published] for sampled in tokens],
                num_cached,
                run.starts[1 : num_published + 1],
            )
        return step_outputs(req_ids, tokens, num_cached, num_steps - 1)

    def _leave_ff(self) -> None:
        """An input, a report or the connector's deadline came at `now`: resume real
        steps (module docstring)."""
        (s0, period, wakeups), now = self.ff, self.loop.now
        self.ff = None
        k = cdiv(now - s0, period) if now > s0 else 0
        if now >= s0 and (now - s0) % period == 0 and has_passed(self.loop, self.rank):
            k += 1  # the step starting now started before this event: it missed it
        if k == 0:
            self.loop.push(s0, STEP_START, self.rank, self._step_start)
            return
        self.num_steps += k
        last_start = s0 + (k - 1) * period
        last_end = last_start + self.zero
        ended = self._has_ended(last_end, now)
        self.num_wakeups += wakeups * (k if ended else k - 1)
        if not ended:  # that step is still running: taken late, its end decides as it would
            self.runner.num_tokens, self.runner.sched_out = 0, None
            started = self._start_step_at(last_start)
            self.loop.push(last_end, STEP_END, self.rank, self._finish_step, (started, 0))
        else:
            self.loop.push(s0 + k * period, STEP_START, self.rank, self._step_start)

    def _block(self, action: LoopAction) -> None:
        self.blocked_on = action
        self._enter("blocked")
        if action is LoopAction.WAIT_ANY:
            self._arm_timer()

    def _arm_timer(self) -> None:
        """Wake this block, or end this fast-forward, at the connector's next timed action."""
        self.num_pauses += 1
        due = self.core.next_deadline_ns()
        if due is not None:
            self.loop.push(
                max(due, self.loop.now), DELIVER, self.rank, self._on_timer, self.num_pauses
            )

    def _on_timer(self, pause: int) -> None:
        if pause != self.num_pauses or self.is_gone or self.paused_until is not None:
            return  # that block or fast-forward ended already, or a pause's end re-arms it
        if self.blocked_on is LoopAction.WAIT_ANY:
            self._wake()
        elif self.ff is not None:
            self._leave_ff()

    def _enter(self, state: str) -> None:
        self.state = state
        if (self.stats, state) != self.sampled:
            self.sample()

    def sample(self) -> EngineSample:
        t, s = self.loop.now, self.stats
        steps, wakeups = self.num_steps, self.num_wakeups
        if self.run is not None:
            steps += self.run.num_started_by(t)
        if self.ff is not None:  # the skipped steps that started (and ended) by t
            s0, period, per_step = self.ff
            steps += (t - s0) // period + 1 if t >= s0 else 0
            wakeups += per_step * ((t - s0 - self.zero) // period + 1) if t >= s0 + self.zero else 0
        self.sampled = (s, self.state)
        sample = EngineSample(
            t=t / NS,
            engine=self.name,
            num_used_blocks=s.num_used_blocks,
            num_cached_blocks=s.num_cached_blocks,
            num_free_blocks=s.num_free_blocks,
            num_usable_blocks=s.num_usable_blocks,
            num_waiting=s.num_waiting,
            num_skipped_waiting=s.num_skipped_waiting,
            num_waiting_for_remote_kvs=s.num_waiting_for_remote_kvs,
            num_running=s.num_running,
            num_finished_awaiting_free=s.num_finished_awaiting_free,
            loop_state=self.state,
            num_steps=steps,
            num_wakeups=wakeups,
        )
        self.slot.on_sample(sample)
        return sample

    def counters(self, last: EngineSample) -> dict[str, int]:
        """Totals at the end, from its final sample."""
        connector, worker = self.core.scheduler.connector, self.worker
        kv = {
            **(connector.get_counters() if connector is not None else {}),
            **(worker.get_counters() if worker is not None else {}),
        }
        return {
            "num_steps": last.num_steps,
            "num_wakeups": last.num_wakeups,
            "num_model_steps": self.core.num_model_steps,
            **{
                name: kv.get(name, 0)
                for name in (
                    "num_expired",
                    "num_reads_after_expiry",
                    "num_read_done_dropped",
                    "num_bad_params",
                )
            },
            "num_stale_kv_reports": self.stats.num_stale_kv_reports,
            "num_preemptions": self.stats.num_preemptions,
            "num_prefix_hit_tokens": self.stats.num_prefix_hit_tokens,
        }
