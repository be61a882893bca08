"""KV load failures: which requests lost KV to invalid blocks, and the prefix they keep. Runs in: engine-core process.

vLLM's Scheduler._update_requests_with_invalid_blocks, as a pure function: the
scheduler decides what to do with the affected requests (kv_load_failure_policy).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.utils import cdiv


def cut_back_to_valid_prefix(
    requests: Iterable[Request],
    invalid_block_ids: set[int],
    num_scheduled: dict[str, int],
    kv_cache_manager: KVCacheManager,
    marked: set[int],
) -> tuple[set[str], set[int]]:
    """Cut each request's num_computed_tokens back to before its first invalid block.

    Only blocks of tokens computed before this step count (num_scheduled: this step's
    tokens per id). An invalid block already `marked` by an earlier request is that
    request's to recompute: a request whose bad blocks are all marked keeps what it had
    before this step. Returns (affected ids, their blocks from the first invalid one on,
    which must not serve prefix hits); `marked` collects the invalid blocks seen.
    """
    affected: set[str] = set()
    to_evict: set[int] = set()
    block_size = kv_cache_manager.block_size
    for request in requests:
        block_ids = kv_cache_manager.get_block_ids(request.req_id)
        num_computed = request.num_computed_tokens - num_scheduled.get(request.req_id, 0)
        cut: int | None = None
        is_affected = False
        for idx, block_id in enumerate(block_ids[: cdiv(num_computed, block_size)]):
            if block_id not in invalid_block_ids:
                continue
            is_affected = True
            if block_id in marked:
                continue
            marked.add(block_id)
            if cut is None:
                cut = idx
                to_evict.update(block_ids[idx:])
        if is_affected:
            request.num_computed_tokens = cut * block_size if cut is not None else num_computed
            affected.add(request.req_id)
    return affected, to_evict
