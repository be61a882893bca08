"""Per-request block tables on top of the block pool. Runs in: engine-core process."""

from __future__ import annotations

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request
from engine.utils import cdiv


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.block_size = block_size
        # Caps the full-sequence admission check (None: no cap).
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request that already carry their hash.
        self.num_cached_block: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, and its token count.

        Capped at num_tokens - 1: the last token is always recomputed to get logits.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.block_pool.get_cached_prefix(request.block_hashes, max_hit_blocks)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_external_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Blocks for this step's tokens, or None (nothing changed) when the pool is short.

        Token regions of the request after this call:

        |<- computed ->|<- new computed ->|<- external ->|<- new tokens ->|
        | in its table |  local prefix    | loaded by the connector       |
        |              |  hits (touched)  | and computed now: new blocks  |

        delay_cache_blocks: the external region is loaded asynchronously, so its
        blocks get their hashes only once the load has finished.
        full_sequence_must_fit: first refuse unless blocks for the request's whole
        current sequence (num_tokens: the prompt plus outputs so far, capped at
        max_model_len; not future tokens) are free (vLLM's admission with
        scheduler_reserve_full_isl). Local prefix hits count as held; tokens the
        connector will load do not.
        """
        hits = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.req_id, ())
        # A hit on a free block takes it off the free queue too.
        num_revived = sum(1 for block in hits if block.ref_cnt == 0) if hits else 0
        num_free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            need = self._num_new_blocks(full_num_tokens, len(req_blocks) + len(hits))
            if need + num_revived > num_free:
                return None
        num_total = (
            request.num_computed_tokens
            + len(hits) * self.block_size
            + num_external_tokens
            + num_new_tokens
        )
        num_new_blocks = self._num_new_blocks(num_total, len(req_blocks) + len(hits))
        if num_new_blocks + num_revived > num_free:
            return None
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        if hits:
            self.block_pool.touch(hits)
            req_blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(num_total, request.num_tokens))
        return new_blocks

    def append_slot(self, req_id: str, num_computed_tokens: int) -> list[int] | None:
        """allocate_slots(request, 1) for a running decode, without its bookkeeping.

        The ids of the blocks appended to the table: none while the slot at
        `num_computed_tokens` is in the table, else one from the pool. None when the
        slow path must decide (no table, a table short by more than a block, an empty
        pool: it preempts). The caller caches a block the token fills.
        """
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return None
        capacity = len(blocks) * self.block_size
        if num_computed_tokens < capacity:
            return []
        if (
            num_computed_tokens >= capacity + self.block_size
            or not self.block_pool.get_num_free_blocks()
        ):
            return None
        (block,) = self.block_pool.get_new_blocks(1)
        blocks.append(block)
        return [block.block_id]

    def _num_new_blocks(self, num_tokens: int, num_held_blocks: int) -> int:
        return max(cdiv(num_tokens, self.block_size) - num_held_blocks, 0)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash the request's full blocks up to `num_computed_tokens`."""
        if not self.enable_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block.get(request.req_id, 0)
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request.req_id]
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
        self.num_cached_block[request.req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: tail blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_block.pop(request.req_id, None)
        self.block_pool.free_blocks(blocks[::-1])

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Drop the request's table and return its blocks, in allocation order, without
        freeing them (vLLM's: a step in flight may still write them; the caller frees
        them later, tail first)."""
        self.num_cached_block.pop(request.req_id, None)
        return self.req_to_blocks.pop(request.req_id, [])

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks' prefix hashes (a failed load wrote bad KV into them)."""
        self.block_pool.evict_blocks(block_ids)

    def has_blocks(self, req_id: str) -> bool:
        return bool(self.req_to_blocks.get(req_id))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def get_num_blocks_to_allocate(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
