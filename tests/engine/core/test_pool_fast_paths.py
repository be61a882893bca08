"""The block pool's and the request check's batched paths against their straightforward ones.

BlockPool takes and frees blocks a list at a time (popleft_n, append_n, evicting the
hashes of the blocks it takes in one pass) and looks up a cached prefix in one call.
ReferencePool below is the pool written one block at a time, as vLLM's; a seeded
random workload drives one of each through KVCacheManager, and after every operation
their free queues, ref counts, hashes, hash maps and counters must be identical.
"""

from __future__ import annotations

import random

import pytest

from engine.core.block_hash import hash_block_tokens, hash_request_blocks
from engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request_check import why_malformed
from tests.utils import make_request


class ReferencePool(BlockPool):
    """BlockPool, one block at a time."""

    num_evictions = 0

    def _maybe_evict_cached_block(self, block):
        evicted = super()._maybe_evict_cached_block(block)
        self.num_evictions += evicted
        return evicted

    def get_cached_prefix(self, block_hashes, max_blocks):
        hits = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_new_blocks(self, num_blocks):
        if num_blocks > self.get_num_free_blocks():
            raise ValueError("not enough free blocks")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        self.num_used_blocks += num_blocks
        return blocks

    def free_blocks(self, ordered_blocks):
        evict_first, evict_last = [], []
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_used_blocks -= 1
                if block.block_hash is None:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
                    self.num_cached_free_blocks += 1
        self.free_block_queue.prepend_n(evict_first)
        for block in evict_last:
            self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks, block_hashes, num_cached_blocks, num_full_blocks):
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i].block_hash is None:
                blocks[i].block_hash = block_hashes[i]
                self.cached_block_hash_to_block.insert(block_hashes[i], blocks[i])


def pool_state(pool: BlockPool) -> tuple:
    links = [
        (
            b.prev_free.block_id if b.prev_free else None,
            b.next_free.block_id if b.next_free else None,
        )
        for b in pool.blocks
    ]
    cached = sorted((h, b.block_id) for h, b in pool.cached_block_hash_to_block.items())
    return (
        [b.block_id for b in pool.free_block_queue],
        pool.free_block_queue.num_free_blocks,
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        links,
        cached,
        pool.num_cached_free_blocks,
        pool.num_used_blocks,
    )


def manager(pool_cls: type, num_blocks: int, block_size: int) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, block_size)
    kv.block_pool = pool_cls(num_blocks)
    return kv


PREFIXES = [[7] * 12, [9] * 20, list(range(40, 60))]


def random_prompt(rng: random.Random) -> list[int]:
    prompt = list(rng.choice(PREFIXES)) if rng.random() < 0.7 else []
    return prompt + [rng.randrange(100) for _ in range(rng.randint(1, 30))]


@pytest.mark.parametrize("seed", range(6))
def test_batched_pool_equals_the_block_by_block_pool(seed):
    """Admissions with prefix hits, hashes cached on two blocks, decodes, frees under pressure."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    kvs = [manager(BlockPool, 24, block_size), manager(ReferencePool, 24, block_size)]
    live: dict[str, list] = {}  # req_id -> the twin requests
    for i in range(400):
        if live and (rng.random() < 0.4 or len(live) > 6):
            req_id = rng.choice(sorted(live))
            for kv, request in zip(kvs, live.pop(req_id)):
                kv.free(request)
        elif live and rng.random() < 0.4:  # decode steps: a token, a slot, a hash
            req_id = rng.choice(sorted(live))
            token = rng.randrange(100)
            results = []
            for kv, request in zip(kvs, live[req_id]):
                request.num_computed_tokens = request.num_tokens
                request.append_output_token_ids(token)
                results.append(kv.allocate_slots(request, 1))
            assert [None if r is None else [b.block_id for b in r] for r in results] == [
                None if r is None else [b.block_id for b in r] for r in reversed(results)
            ]
        else:
            prompt = random_prompt(rng)
            twins = [make_request(f"r{i}", prompt=list(prompt), block_size=block_size) for _ in kvs]
            admitted, look_up = [], rng.random() < 0.7  # else: a hash cached twice (no hit)
            for kv, request in zip(kvs, twins):
                hits, num_hit = kv.get_computed_blocks(request) if look_up else ([], 0)
                request.num_computed_tokens = 0
                blocks = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
                admitted.append(None if blocks is None else [b.block_id for b in blocks])
                if blocks is not None:
                    request.num_computed_tokens = request.num_tokens
            assert admitted[0] == admitted[1]
            if admitted[0] is not None:
                live[f"r{i}"] = twins
        states = [pool_state(kv.block_pool) for kv in kvs]
        assert states[0] == states[1], f"op {i}"
        kvs[0].block_pool.check_invariants()
    assert kvs[1].block_pool.num_evictions > 10  # the workload reuses hashed blocks


def test_popleft_n_and_append_n_equal_one_at_a_time():
    for n in range(0, 6):
        blocks_a = [KVCacheBlock(i) for i in range(6)]
        blocks_b = [KVCacheBlock(i) for i in range(6)]
        qa, qb = FreeKVCacheBlockQueue(blocks_a), FreeKVCacheBlockQueue(blocks_b)
        taken_a = qa.popleft_n(n)
        taken_b = [qb.popleft() for _ in range(n)]
        assert [b.block_id for b in taken_a] == [b.block_id for b in taken_b]
        assert all(b.prev_free is None and b.next_free is None for b in taken_a)
        qa.append_n(taken_a[::-1])
        for block in taken_b[::-1]:
            qb.append(block)
        assert [b.block_id for b in qa] == [b.block_id for b in qb]
        assert qa.num_free_blocks == qb.num_free_blocks == 6
    with pytest.raises(ValueError):
        FreeKVCacheBlockQueue([KVCacheBlock(1)]).popleft_n(2)


def reference_why_malformed(prompt_token_ids, max_tokens, vocab_size):
    """why_malformed as first written: one type check per token in Python."""
    if type(max_tokens) is not int or max_tokens < 1:
        return f"max_tokens: must be an integer >= 1, got {max_tokens!r}"
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        return "prompt_token_ids: must be a non-empty list of token ids"
    if not all(type(t) is int for t in prompt_token_ids):
        return "prompt_token_ids: every token id must be an integer"
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None


class _Int(int):
    pass


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2, 3],
        (4, 5),
        [],
        [1, True],
        [1, 2.0],
        [_Int(3)],
        [1, "2"],
        [0, 511],
        [-1, 3],
        [512],
        [3, None],
        "abc",
        None,
        [1] * 1000 + [False],
    ],
)
def test_why_malformed_equals_the_per_token_check(prompt):
    for max_tokens in (1, 0, True, 2.0):
        assert why_malformed(prompt, max_tokens, 512) == reference_why_malformed(
            prompt, max_tokens, 512
        )


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_request_hashes_equal_block_by_block_hashes(block_size):
    """hash_request_blocks packs a request's tokens once: the same chain as one
    hash_block_tokens per block, from scratch and past known hashes."""
    rng = random.Random(block_size)
    for _ in range(50):
        tokens = [rng.randrange(-(2**40), 2**40) for _ in range(rng.randint(0, 70))]
        expected, parent = [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block_tokens(parent, tokens[start : start + block_size])
            expected.append(parent)
        assert hash_request_blocks(tokens, block_size, []) == expected
        known = expected[: rng.randint(0, len(expected))]
        assert hash_request_blocks(tokens, block_size, list(known)) == expected
