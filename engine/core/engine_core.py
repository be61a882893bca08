"""EngineCore: one engine's in-process logic, no sockets and no clock. Runs in: engine-core process.

The process shell (core_proc.py) and the virtual-clock simulator both drive this
class, so the simulator reproduces the real engine's decisions exactly. A step is two
halves, start_step (schedule, the forward) and finish_step (the output processed), so
that both can hand it the aborts that arrived during the forward (`aborts_queue`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.core.async_scheduler import AsyncScheduler
from engine.core.batch_queue import BatchQueue, BatchStep, finish_batch_step, start_batch_step
from engine.core.kv_connector import KVConnectorAgentBase, KVConnectorBase
from engine.core.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    StepOutputs,
)
from engine.core.release import VllmRelease, aborts_before_output
from engine.core.request import Request, RequestStatus
from engine.core.request_check import why_malformed
from engine.core.scheduler import Scheduler


class ModelRunnerProtocol(Protocol):
    """What EngineCore needs from a model runner: one forward pass per scheduler output.

    Satisfied structurally by engine/model_runner.ModelRunner (torch) and
    engine/mock_runner.MockModelRunner (deterministic tokens, no torch).
    """

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(frozen=True, slots=True)
class EngineStepResult:
    """What one step did, for the loop's liveness question (engine/liveness.next_action)."""

    outputs: list[RequestOutput] | StepOutputs  # a step's are a StepOutputs
    model_executed: bool  # some tokens were scheduled
    # The next schedule() has work it can do without a new report: the step consumed
    # connector reports while unfinished requests remain (freed blocks may admit one,
    # a finished receive is promoted), preempted, or left finished ids behind. A report
    # that only frees a finished request's blocks leaves nothing for another step.
    can_progress: bool
    got_kv_reports: bool  # the step consumed connector reports


@dataclass(frozen=True, slots=True)
class StartedStep:
    """A step whose forward ran and whose output is not processed yet (start_step)."""

    sched_out: SchedulerOutput | None = None  # the batch it ran; None: nothing to step
    runner_out: ModelRunnerOutput | None = None
    got_kv_reports: bool = False
    batch: BatchStep | None = None  # async scheduling: the batch queue's call so far


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunnerProtocol,
        connector: KVConnectorBase | None = None,
        connector_agent: KVConnectorAgentBase | None = None,
    ) -> None:
        self.config = config
        # vLLM's async scheduling: its AsyncScheduler and the engine core's batch queue.
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(config, connector)
        self.batch_queue = BatchQueue() if config.async_scheduling else None
        self.model_runner = model_runner
        self.connector_agent = connector_agent
        self.num_steps = 0
        self.num_model_steps = 0
        # vLLM's EngineCore.aborts_queue: ids whose abort arrived during a step's forward,
        # taken right before its output is processed (vLLM 0.13+, #29987); before, the
        # abort waited for the next input drain, after the output. The driver (core_proc,
        # the simulator) puts them here and keeps them in its input too (aborts are
        # idempotent), as vLLM's input thread puts them on both queues.
        self.aborts_queue: list[str] = []
        self.takes_aborts_before_output = aborts_before_output(
            VllmRelease.parse(config.vllm_release)
        )

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        kv_transfer_params: dict | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> list[RequestOutput]:
        """Queue a request; returns an output at once only if it can never run.

        A malformed request (empty prompt, max_tokens < 1, a token outside the
        vocabulary) fails alone, like vLLM's per-request errors: the engine keeps
        serving the others, and whatever its params hold elsewhere is released (a
        remote prefill's blocks on P: engine/core/scheduler.py reject_request).
        """
        params = dict(kv_transfer_params) if kv_transfer_params else None
        why = why_malformed(prompt_token_ids, max_tokens, self.config.model.vocab_size)
        if why is not None:
            return [self.scheduler.reject_request(req_id, params, why)]
        try:
            request = Request(
                req_id,
                list(prompt_token_ids),
                max_tokens,
                self.config.block_size,
                eos_token_id=self.config.eos_token_id,
                stop_token_ids=tuple(stop_token_ids),
                kv_transfer_params=params,
            )
        except ValueError as e:
            return [self.scheduler.reject_request(req_id, params, str(e))]
        return self.add(request)

    def add(self, request: Request) -> list[RequestOutput]:
        """Queue a built request (vLLM's EngineCore.add_request(Request)); an output at
        once only if it can never run."""
        output = self.scheduler.add_request(request)
        return [output] if output is not None else []

    def abort_requests(self, req_ids: list[str]) -> list[RequestOutput]:
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        """vLLM's EngineCore.has_work: requests, or a batch in flight to process."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def only_in_flight(self) -> bool:
        """The only work is a batch in flight (async scheduling): the next step processes
        it at once (engine/core/liveness.py next_action)."""
        return bool(self.batch_queue) and not self.scheduler.has_requests()

    def step(self) -> EngineStepResult:
        """schedule -> execute -> update; the outputs and what the step did.

        A zero-token step is still a full round trip: finished ids and connector
        metadata reach the connector's agent, and its reports come back.
        """
        return self.finish_step(self.start_step())

    def start_step(self) -> StartedStep:
        """The step up to its output: schedule and the forward (with the connector
        agent's part). Aborts that arrive before finish_step go to aborts_queue."""
        if self.batch_queue is not None:
            return StartedStep(
                batch=start_batch_step(
                    self.scheduler, self.batch_queue, self.execute, self._tell_time
                )
            )
        if not self.scheduler.has_requests():
            return StartedStep()
        self._tell_time()
        sched_out = self.scheduler.schedule()
        runner_out, got_kv_reports = self.execute(sched_out)
        return StartedStep(sched_out, runner_out, got_kv_reports)

    def finish_step(self, started: StartedStep) -> EngineStepResult:
        """The step's output processed: the aborts that came during the forward first
        (vLLM's _process_aborts_queue, from 0.13), then update_from_output."""
        if started.batch is not None:
            return self._finish_batch_step(started.batch)
        if started.sched_out is None:
            self.aborts_queue.clear()  # no output to process: the input takes them
            return EngineStepResult([], False, False, False)
        sched_out = started.sched_out
        aborted = self._process_aborts_queue()
        self._tell_time()  # request_finished stamps leases after the forward, as vLLM's
        outputs = self.scheduler.update_from_output(sched_out, started.runner_out)
        outputs.extend(aborted)
        can_progress = self.scheduler.can_progress(sched_out, started.got_kv_reports)
        self.num_steps += 1
        model_executed = sched_out.total_num_scheduled_tokens > 0
        self.num_model_steps += model_executed
        return EngineStepResult(outputs, model_executed, can_progress, started.got_kv_reports)

    def _finish_batch_step(self, step: BatchStep) -> EngineStepResult:
        # Before the oldest batch's output; in a call that processes none (the queue
        # fills), as the next input drain would take them, before anything else.
        aborted = self._process_aborts_queue()
        finish_batch_step(self.scheduler, self.batch_queue, step, self._tell_time)
        step.outputs.extend(aborted)
        self.num_steps += step.processed  # a step: one batch's output processed
        self.num_model_steps += step.model_executed
        return EngineStepResult(
            step.outputs, step.model_executed, step.can_progress, step.got_kv_reports
        )

    def _process_aborts_queue(self) -> list[RequestOutput]:
        """Abort what aborts_queue holds, if the release takes aborts before the output;
        the queue is emptied either way."""
        req_ids, self.aborts_queue = self.aborts_queue, []
        if not (req_ids and self.takes_aborts_before_output):
            return []
        return self.abort_requests(req_ids)

    def execute(self, sched_out: SchedulerOutput) -> tuple[ModelRunnerOutput, bool]:
        """The forward pass with the connector agent's part: its loads start, and
        what finished comes back in the output. Also: whether it reported anything."""
        agent = self.connector_agent
        if agent is not None:
            agent.start_load_kv(sched_out.kv_connector_metadata)
        runner_out = self.model_runner.execute(sched_out)
        got_kv_reports = False
        if agent is not None:
            kv_out = agent.get_finished(sched_out.finished_req_ids)
            runner_out.kv_connector_output = kv_out
            got_kv_reports = not kv_out.is_empty()
        return runner_out, got_kv_reports

    def _tell_time(self) -> None:
        """The scheduler side's clock is the agent's (engine/core/kv_connector.py)."""
        connector, agent = self.scheduler.connector, self.connector_agent
        now = agent.now_ns() if agent is not None else None
        if connector is not None and now is not None:
            connector.set_time(now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def next_deadline_ns(self) -> int | None:
        """When either connector half next acts on time alone (a heartbeat due, a lease
        to reap), on the agent's clock; None: nothing timed."""
        connector, agent = self.scheduler.connector, self.connector_agent
        due = connector.next_deadline_ns() if connector is not None else None
        agent_due = agent.next_deadline_ns() if agent is not None else None
        if due is None or agent_due is None:  # asked after every report: no list, no min()
            return agent_due if due is None else due
        return min(due, agent_due)

    def must_poll(self) -> bool:
        """A connector deferred a request and will not say when to ask again."""
        return self.scheduler.has_deferred_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        if self.connector_agent is not None:
            self.connector_agent.shutdown()
