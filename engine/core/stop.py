"""Stop conditions: when a request that just sampled a token is finished. Runs in: engine-core process.

vLLM's vllm/v1/core/sched/utils.py `check_stop`: pure, so the scheduler only asks.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status and return True if the request must stop.

    vLLM's order: EOS, then stop ids (both FINISHED_STOPPED), then the length caps
    (max_model_len, max_tokens: FINISHED_LENGTH_CAPPED). So EOS on the last allowed
    token is a stop, not a length cap.
    """
    last = request.all_token_ids[-1]  # the token just sampled
    if last == request.eos_token_id or last in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
