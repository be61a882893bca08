"""The async scheduler: step N+1 is scheduled before step N's output is processed. Runs in: engine-core process.

vLLM's AsyncScheduler (vllm/v1/core/sched/async_scheduler.py) with the parts of its
Scheduler that only matter when a step is in flight (vLLM 0.32/0.33, no speculative
decoding, no pipeline parallelism):

- A decode scheduled while its previous token is still in flight computes a
  placeholder: `num_output_placeholders` counts tokens sampled in unprocessed steps,
  so the next decode is `num_tokens + placeholders - num_computed_tokens` tokens, and
  a request whose in-flight tokens already reach max_tokens is not scheduled again.
  The token ids of a placeholder are -1 in the SchedulerOutput; the engine's batch
  queue (engine/core/batch_queue.py) fills them from the step in flight, as vLLM's
  model runner does from its previous sampled tokens.
- Blocks a token fills are cached when its output arrives (up to num_computed_tokens
  minus placeholders), not when it is scheduled.
- Preemption marks the in-flight output stale (`num_stale_output_tokens`); stale
  output is still delivered (appended, checked for stop) unless `drop_stale_output`
  (a producer connector, whose hand-off needs the freed KV: requires_kv_delivery),
  and a preempted request with deliverable stale output is not readmitted until it
  drains.
- A consumer connector (D) defers block frees (`defer_block_free`): a step in flight
  may still write a freed request's blocks while a load refills them, so blocks of a
  request scheduled in an unprocessed step return to the pool only once that step's
  output is processed (sched_step_seq / processed_step_seq fences), and such a
  request is not preempted to make room.
"""

from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.core.block_pool import KVCacheBlock
from engine.core.kv_connector import KVConnectorBase
from engine.core.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput, StepOutputs
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.stop import check_stop

__all__ = ["AsyncScheduler", "PLACEHOLDER_TOKEN_ID"]

PLACEHOLDER_TOKEN_ID = -1  # a token sampled in a step in flight, not known yet

_CONSUMER_ROLES = ("kv_consumer", "kv_both")
_PRODUCER_ROLES = ("kv_producer", "kv_both")


class AsyncScheduler(Scheduler):
    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None) -> None:
        super().__init__(config, connector)
        self.fast_path = False  # the fast paths assume no token in flight
        role = config.kv_transfer.kv_role if config.kv_transfer is not None and connector else None
        # vLLM: max_concurrent_batches > 1 and kv_transfer_config.is_kv_consumer.
        self.defer_block_free = role in _CONSUMER_ROLES
        # vLLM's KVConnectorBase_V1.requires_kv_delivery: the producer role.
        self.requires_kv_delivery = role in _PRODUCER_ROLES
        self.sched_step_seq = 0  # steps with tokens scheduled
        self.processed_step_seq = 0  # of those, steps whose output was processed
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock]]] = deque()

    # ---- schedule ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if self.defer_block_free and out.total_num_scheduled_tokens > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """vLLM's Scheduler._update_after_schedule (num_computed_tokens already moved
        in _add_scheduled) and AsyncScheduler's: a chunk that reaches the end samples
        a token that is a placeholder until its output is processed."""
        for req_id, num_new in zip(out.req_ids, out.num_scheduled_tokens):
            request = self.requests[req_id]
            request.num_in_flight_tokens += num_new
            if self.defer_block_free:
                request.last_sched_seq = self.sched_step_seq
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _schedule_running(self, out: SchedulerOutput, budget: int, req_index: int = 0) -> int:
        max_computed = self.config.max_model_len - 1
        while req_index < len(self.running) and budget > 0:
            request = self.running[req_index]
            placeholders = request.num_output_placeholders
            if (
                placeholders > 0
                and request.num_computed_tokens + 2 - placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                req_index += 1  # its tokens in flight already reach max_tokens
                continue
            num_new = min(
                request.num_tokens + placeholders - request.num_computed_tokens,
                budget,
                max_computed - request.num_computed_tokens,
            )
            if num_new <= 0:
                req_index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, out)
            if new_blocks is None:
                break
            self._add_scheduled(out, request, num_new, [b.block_id for b in new_blocks], False)
            budget -= num_new
            req_index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput):
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            if not self._blocks_can_be_freed(victim):
                return None  # a deferred free would not help now
            self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return None

    def _add_scheduled(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new: int,
        new_block_ids: list[int],
        is_new: bool,
    ) -> None:
        start = request.num_computed_tokens
        super()._add_scheduled(out, request, num_new, new_block_ids, is_new)
        missing = start + num_new - request.num_tokens  # positions of tokens in flight
        if missing > 0:
            out.token_ids.extend([PLACEHOLDER_TOKEN_ID] * missing)
            out.num_scheduled_tokens[-1] = num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        super()._preempt(request, out)
        # Its in-flight output is stale: still delivered on return (unless a producer
        # connector's hand-off needs it recomputed), but it must not move the counters
        # the preemption just reset.
        request.drop_stale_output = self.requires_kv_delivery or (
            request.drop_stale_output and request.num_stale_output_tokens > 0
        )
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0

    def _must_wait_for_output(self, request: Request) -> bool:
        # Resuming now could resample a position that stale output later delivers.
        return bool(request.num_stale_output_tokens) and not request.drop_stale_output

    # ---- block frees ------------------------------------------------------------

    def _blocks_can_be_freed(self, request: Request) -> bool:
        return not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq

    def _release_blocks(self, request: Request) -> None:
        if self._blocks_can_be_freed(request):
            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _drain_deferred_frees(self) -> None:
        pool = self.kv_cache_manager.block_pool
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            pool.free_blocks(blocks[::-1])  # tail first: tail blocks are evicted first

    def has_deferred_frees(self) -> bool:
        return bool(self.deferred_frees)

    # ---- update --------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> StepOutputs:
        # Every write of this and earlier steps is done: deferred blocks may go back.
        if self.defer_block_free and sched_out.total_num_scheduled_tokens > 0:
            self.processed_step_seq += 1
            self._drain_deferred_frees()
        return super().update_from_output(sched_out, runner_out)

    def _update_scheduled(
        self,
        sched_out: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        failed_ids: set[str],
        outputs: StepOutputs,
    ) -> bool:
        any_finished = False
        stopped_waiting: list[Request] = []
        for req_id, num_new in zip(sched_out.req_ids, sched_out.num_scheduled_tokens):
            request = self.requests.get(req_id)
            is_stale = False
            if request is not None:
                request.num_in_flight_tokens -= num_new
                if request.num_stale_output_tokens > 0:
                    is_stale = True
                    request.num_stale_output_tokens -= num_new
            if request is None or request.is_finished() or req_id in failed_ids:
                continue
            if is_stale and request.drop_stale_output:
                continue
            status_before = request.status
            token = runner_out.sampled_token_ids.get(req_id)
            if req_id in runner_out.failed or token is None:
                output = self._update_request(request, runner_out)  # an error, or a partial chunk
            else:
                output = self._deliver(request, token, is_stale, status_before)
            if output is None:
                continue
            outputs.append(output)
            if request.is_finished():
                if status_before == RequestStatus.RUNNING:
                    any_finished = True
                else:
                    stopped_waiting.append(request)
        for request in stopped_waiting:  # stale output stopped a preempted request
            self._remove_from_waiting(request)
        return any_finished

    def _deliver(
        self, request: Request, token: int, is_stale: bool, status_before: RequestStatus
    ) -> RequestOutput:
        """Append a sampled token; cache what it completes before a stop frees the
        blocks (vLLM's order: _update_request_with_output, then _free_request)."""
        request.append_output_token_ids(token)
        stopped = check_stop(request, self.config.max_model_len)
        if not is_stale:  # stale output predates the preemption's reset
            request.num_output_placeholders -= 1
        if status_before == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        params = self._free_request(request) if stopped else None
        return RequestOutput(
            request.req_id,
            [token],
            request.get_finished_reason(),
            params,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _remove_from_waiting(self, request: Request) -> None:
        if request in self.skipped_waiting:
            self.skipped_waiting.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
