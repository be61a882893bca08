"""The engine core's batch queue: schedule step N+1 before step N's output is processed. Runs in: engine-core process.

vLLM's EngineCore.step_with_batch_queue (vllm/v1/engine/core.py, 0.32/0.33) with
async scheduling: a queue of max_concurrent_batches = 2. Each call

1. schedules a new batch if the scheduler has requests, submits it (here the runner
   runs it at once, and the connector worker starts its loads and reports what
   finished, as it would inside the forward) and queues it; if the queue is not
   full and the batch had tokens or the scheduler still has requests, it returns
   without output (filling the queue comes first);
2. otherwise processes the oldest batch: update_from_output with its output.

The engine loop steps while the scheduler has requests or a batch is queued (vLLM's
has_work), so the last batch in flight is always processed.

A placeholder (a token sampled by a batch still queued) is filled from that batch's
output before the new batch runs, as vLLM's model runner takes its previous sampled
tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.outputs import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    StepOutputs,
)
from engine.core.scheduler import Scheduler

BATCH_QUEUE_SIZE = 2  # vLLM's max_concurrent_batches with async scheduling, no PP


@dataclass(slots=True)
class QueuedBatch:
    sched_out: SchedulerOutput
    runner_out: ModelRunnerOutput
    got_kv_reports: bool


@dataclass(slots=True)
class BatchStep:
    """What one call did (EngineCore turns it into its EngineStepResult)."""

    scheduled: bool = False  # a new batch was scheduled and run
    processed: bool = False  # the oldest batch's output was processed
    outputs: list[RequestOutput] | StepOutputs = field(default_factory=list)
    model_executed: bool = False  # the new batch had tokens
    can_progress: bool = False
    got_kv_reports: bool = False
    # After start_batch_step: the oldest batch's output is to be processed (its second half).
    must_process: bool = False


class BatchQueue:
    def __init__(self, size: int = BATCH_QUEUE_SIZE) -> None:
        self.size = size
        self.batches: deque[QueuedBatch] = deque()  # oldest first

    def __len__(self) -> int:
        return len(self.batches)

    def has_pending_work(self) -> bool:
        """Processing a queued batch would change something: it ran tokens or carries
        connector reports. (An empty batch of a waiting engine changes nothing: the
        event policy may block with it queued, as with nothing queued.)"""
        return any(b.sched_out.total_num_scheduled_tokens or b.got_kv_reports for b in self.batches)

    def fill_placeholders(self, sched_out: SchedulerOutput) -> None:
        """Replace each placeholder with the token the batch in flight sampled."""
        tokens = sched_out.token_ids
        if PLACEHOLDER_TOKEN_ID not in tokens:
            return
        end = 0
        for req_id, num_new in zip(sched_out.req_ids, sched_out.num_scheduled_tokens):
            end += num_new
            if tokens[end - 1] != PLACEHOLDER_TOKEN_ID:
                continue
            for batch in reversed(self.batches):  # the newest batch that sampled it
                token = batch.runner_out.sampled_token_ids.get(req_id)
                if token is not None:
                    tokens[end - 1] = token
                    break


def step_with_batch_queue(
    scheduler: Scheduler,
    queue: BatchQueue,
    execute: Callable[[SchedulerOutput], tuple[ModelRunnerOutput, bool]],
    tell_time: Callable[[], None],
) -> BatchStep:
    """One call of vLLM's step_with_batch_queue (module docstring). `execute` runs a
    batch (the forward and the connector worker's part: EngineCore.execute)."""
    step = start_batch_step(scheduler, queue, execute, tell_time)
    return finish_batch_step(scheduler, queue, step, tell_time)


def start_batch_step(
    scheduler: Scheduler,
    queue: BatchQueue,
    execute: Callable[[SchedulerOutput], tuple[ModelRunnerOutput, bool]],
    tell_time: Callable[[], None],
) -> BatchStep:
    """The call up to the oldest batch's output (vLLM's future.result()): step 1, and
    whether step 2 follows (must_process)."""
    step = BatchStep()
    if scheduler.has_requests():
        tell_time()
        sched_out = scheduler.schedule()
        queue.fill_placeholders(sched_out)
        runner_out, got_kv_reports = execute(sched_out)
        step.scheduled = True
        step.model_executed = sched_out.total_num_scheduled_tokens > 0
        queue.batches.append(QueuedBatch(sched_out, runner_out, got_kv_reports))
        if len(queue) < queue.size and (step.model_executed or scheduler.has_requests()):
            step.can_progress = queue.has_pending_work() or scheduler.can_progress(sched_out, False)
            step.got_kv_reports = got_kv_reports
            return step
    elif not queue.batches:
        return step
    step.must_process = True
    return step


def finish_batch_step(
    scheduler: Scheduler, queue: BatchQueue, step: BatchStep, tell_time: Callable[[], None]
) -> BatchStep:
    """Step 2 if start_batch_step left it: the oldest batch's output processed."""
    if not step.must_process:
        return step
    batch = queue.batches.popleft()
    tell_time()  # request_finished stamps leases after the forward, as vLLM's
    step.must_process, step.processed = False, True
    step.outputs = scheduler.update_from_output(batch.sched_out, batch.runner_out)
    step.can_progress = queue.has_pending_work() or scheduler.can_progress(
        batch.sched_out, batch.got_kv_reports
    )
    step.got_kv_reports = batch.got_kv_reports
    return step
