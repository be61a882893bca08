"""Runs of plain decode steps: how many the scheduler takes in a row, and taking them at once. Runs in: frontend process (the virtual clock's engines).

A plain decode step schedules exactly one token for every running request and
changes nothing else that anyone sees: no request is admitted, finished or
preempted, no block leaves the pool, no finished id or connector metadata is
shipped, no report comes back; its stats are the previous step's. What it does change
is each request's own: the sampled token, the computed count, and where a token
fills a block, that block's hash and its place in the prefix cache.

Whether the next steps are plain is a question of the scheduler's state alone once
the connector has nothing to ship: no request finished since the last schedule() (its
finished id, a delayed send) and no report came in the last step (what a report starts
goes out in the next one); the caller knows the second, and that nothing arrives
meanwhile. With every running request a decode and no queue, the steps are plain
until a request reaches a block boundary (its next slot starts a block: the pool may
give one) or stops (a token it will sample meets a stop condition; the tokens are
known ahead, `next_tokens`). `num_plain_decode_steps` counts them; `take_plain_decode_steps`
makes k of them at once with the effects k schedule() and update_from_output() calls
would have, in the same order: the block caching of a step before its sampled tokens,
request by request in running order, step by step (two requests that fill blocks of
the same hash cache them in that order). replay/sim/engine.py skips the steps in
between; tests/replay/sim/test_decode_runs.py compares the timelines with every step
taken.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.block_hash import hash_request_blocks
from engine.core.request import Request
from engine.core.scheduler import Scheduler

# next_tokens(request, k): the k tokens the request samples in its next k decode steps.
NextTokens = Callable[[Request, int], list[int]]


def num_plain_decode_steps(scheduler: Scheduler, next_tokens: NextTokens, limit: int) -> int:
    """How many of the next steps are plain decode steps (at most `limit`), given that
    the last step consumed no connector report and nothing has arrived since."""
    if (
        not scheduler.running
        or scheduler.waiting
        or scheduler.skipped_waiting
        or scheduler.finished_req_ids
        or len(scheduler.running) > scheduler.config.max_num_batched_tokens
    ):
        return 0
    num_steps, bs = limit, scheduler.block_size
    for request in scheduler.running:
        num_computed = request.num_computed_tokens
        if request.num_tokens - num_computed != 1:
            return 0
        # The step whose slot starts a block may take one from the pool: not plain.
        num_steps = min(
            num_steps, -num_computed % bs, _num_steps_before_length_cap(scheduler, request)
        )
        if num_steps > 0:
            num_steps = _num_steps_before_stop_token(request, next_tokens(request, num_steps))
        if num_steps <= 0:
            return 0
    return num_steps


def _num_steps_before_length_cap(scheduler: Scheduler, request: Request) -> int:
    """Steps before the one whose token reaches max_model_len or max_tokens (it stops)."""
    last_num_tokens = min(
        scheduler.config.max_model_len, request.num_prompt_tokens + request.max_tokens
    )
    return last_num_tokens - request.num_tokens - 1


def _num_steps_before_stop_token(request: Request, tokens: list[int]) -> int:
    """Steps before the one that samples EOS or a stop token (check_stop's first test)."""
    eos, stop_token_ids = request.eos_token_id, request.stop_token_ids
    for i, token in enumerate(tokens):
        if token == eos or token in stop_token_ids:
            return i
    return len(tokens)


def take_plain_decode_steps(
    scheduler: Scheduler, next_tokens: NextTokens, num_steps: int
) -> list[list[int]]:
    """Make `num_steps` plain decode steps (num_plain_decode_steps said so); returns each
    running request's sampled tokens, in running order."""
    bs, kv = scheduler.block_size, scheduler.kv_cache_manager
    sampled, fills = [], []
    for index, request in enumerate(scheduler.running):
        num_computed = request.num_computed_tokens
        # The step (0-based) whose token fills a block, if any: it caches that block.
        fill_step = bs - 1 - num_computed % bs
        if fill_step < num_steps:
            fills.append((fill_step, index, request, num_computed + fill_step + 1))
        tokens = next_tokens(request, num_steps)
        request.num_computed_tokens = num_computed + num_steps
        request.all_token_ids += tokens
        request.num_tokens += num_steps
        sampled.append(tokens)
    for request in scheduler.running:  # every block its tokens filled, chained as one by one
        hash_request_blocks(request.all_token_ids, bs, request.block_hashes)
    # The filled blocks cached in step order (a block's hash depends on its own tokens only).
    for _, _, request, num_computed in sorted(fills, key=lambda fill: fill[:2]):
        kv.cache_blocks(request, num_computed)
    return sampled
