"""The async scheduler: step N+1 is scheduled before step N's output is processed. Runs in: engine-core process.

vLLM's AsyncScheduler (vllm/v1/core/sched/async_scheduler.py), without speculative
decoding or pipeline parallelism: it counts the placeholders of tokens sampled in
steps in flight. What else a step in flight needs is Scheduler's, as in vLLM.
"""

from __future__ import annotations

from engine.core.outputs import SchedulerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """A chunk that reaches the end of the known tokens samples one, a placeholder
        until its step's output is processed."""
        super()._update_after_schedule(out)
        requests = self.requests
        for req_id in out.req_ids:
            request = requests[req_id]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _update_request_with_output(self, request: Request, token: int, is_stale: bool) -> bool:
        """vLLM 0.32's: a running request's blocks the token completes are cached when it
        lands. From 0.33 update_from_output caches them (engine/core/release.py)."""
        status_before = request.status
        stopped = super()._update_request_with_output(request, token, is_stale)
        if not self.caches_blocks_early and status_before == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return stopped
