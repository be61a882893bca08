from __future__ import annotations

import pytest

from engine.core.block_hash import hash_block_tokens, hash_request_blocks
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.utils import cdiv
from tests.utils import make_request


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored
    pool.check_invariants()


def test_freed_blocks_without_a_hash_are_reused_first():
    """vLLM's free_blocks: unhashed blocks go to the free queue's head, in order."""
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.free_blocks(list(reversed(a)))
    pool.check_invariants()
    order = [b.block_id for b in pool.free_block_queue]
    assert order == [3, 2, 1, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]


def test_double_free_raises():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_hashes_are_deterministic_and_chained():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    hashes = hash_request_blocks(list(range(10)), 4, [])
    assert len(hashes) == 2 and hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_free_sends_unhashed_blocks_to_the_head_and_hashed_to_the_tail():
    """vLLM (block_pool.free_blocks over reversed(req_blocks)): the request's unhashed
    blocks are reused next, last one first; its hashed blocks wait at the tail for
    prefix hits, last one first (evicted before its parents)."""
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", num_tokens=10)  # blocks 1, 2 full (hashed), 3 partial
    blocks = mgr.allocate_slots(req, 10)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    mgr.free(req)
    mgr.block_pool.check_invariants()
    free = [b.block_id for b in mgr.block_pool.free_block_queue]
    assert free == [3, 4, 5, 6, 7, 8, 9, 2, 1]


def test_prefix_hit_across_requests_and_capped_at_num_tokens_minus_one():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", num_tokens=12)
    mgr.allocate_slots(a, 12)
    b = make_request("b", num_tokens=14)  # same first 12 tokens
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and [x.block_id for x in hits] == mgr.get_block_ids("a")
    c = make_request("c", num_tokens=12)  # fully cached: the last block is recomputed
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8
    mgr.allocate_slots(b, 2, hits_b := mgr.get_computed_blocks(b)[0])
    assert [x.ref_cnt for x in hits_b] == [2, 2, 2]
    mgr.block_pool.check_invariants()


def test_freed_blocks_stay_cached_until_evicted():
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    a = make_request("a", num_tokens=8)
    mgr.allocate_slots(a, 8)
    mgr.free(a)
    pool = mgr.block_pool
    assert pool.num_cached_free_blocks == 2 and pool.get_num_free_blocks() == 4
    b = make_request("b", num_tokens=9)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8  # hit on free blocks: they are revived
    mgr.allocate_slots(b, 1, hits)
    assert pool.num_cached_free_blocks == 0 and pool.get_num_free_blocks() == 1
    pool.check_invariants()
    mgr.free(b)
    other = make_request("c", num_tokens=16, start=100)
    mgr.allocate_slots(other, 16)  # evicts every cached block
    assert pool.get_cached_block(a.block_hashes[0]) is None
    pool.check_invariants()


def test_allocate_refuses_when_short_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", num_tokens=12)
    assert mgr.allocate_slots(a, 13) is None
    assert not mgr.has_blocks("a") and mgr.block_pool.get_num_free_blocks() == 3
    assert mgr.allocate_slots(a, 12) is not None
    mgr.block_pool.check_invariants()


def test_revived_hits_count_against_free_blocks():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", num_tokens=8)
    mgr.allocate_slots(a, 8)
    mgr.free(a)
    b = make_request("b", num_tokens=20)
    hits, _ = mgr.get_computed_blocks(b)
    assert len(hits) == 2
    # 2 revived + 3 new > 3 free
    assert mgr.allocate_slots(b, 12, hits) is None
    mgr.block_pool.check_invariants()


def test_reset_prefix_cache_refused_while_in_use():
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    a = make_request("a", num_tokens=8)
    mgr.allocate_slots(a, 8)
    assert not mgr.block_pool.reset_prefix_cache()
    mgr.free(a)
    assert mgr.block_pool.reset_prefix_cache()
    assert mgr.block_pool.num_cached_free_blocks == 0
    mgr.block_pool.check_invariants()


def test_cdiv_is_ceiling_division():
    for a in range(0, 40):
        for b in range(1, 9):
            assert cdiv(a, b) == (a + b - 1) // b


def test_a_hash_computed_twice_keeps_both_blocks_and_hits_take_the_first():
    """vLLM's BlockHashToBlockMap: no de-duplication; eviction is per block."""
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    pool = mgr.block_pool
    a, b = make_request("a", num_tokens=9), make_request("b", num_tokens=9)
    mgr.allocate_slots(a, 9)
    mgr.allocate_slots(b, 9)  # the same prefix, computed at the same time: no hit
    a_ids, b_ids = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert sum(blk.block_hash is not None for blk in pool.blocks) == 4
    c = make_request("c", num_tokens=9)
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 and [blk.block_id for blk in hits] == a_ids[:2]
    mgr.free(a)
    # Evict a's cached blocks: b's copies still serve the whole prefix.
    pool.evict_blocks(set(a_ids[:2]))
    assert [blk.block_hash for blk in pool.blocks if blk.block_id in a_ids] == [None] * 3
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 and [blk.block_id for blk in hits] == b_ids[:2]
    pool.check_invariants()


def test_eviction_on_reuse_drops_only_the_reused_block():
    mgr = KVCacheManager(num_blocks=7, block_size=4)
    pool = mgr.block_pool
    a, b = make_request("a", num_tokens=8), make_request("b", num_tokens=8)
    mgr.allocate_slots(a, 8)
    mgr.allocate_slots(b, 8)
    mgr.free(a)  # a's two hashed blocks join the tail, behind the untouched ones
    mgr.allocate_slots(make_request("x", num_tokens=16, start=100), 16)  # 2 untouched + a's 2
    assert pool.get_cached_block(a.block_hashes[0]).block_id == mgr.get_block_ids("b")[0]
    assert pool.get_cached_block(a.block_hashes[1]).block_id == mgr.get_block_ids("b")[1]
    pool.check_invariants()


def test_evict_blocks_keeps_blocks_in_use():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", num_tokens=8)
    mgr.allocate_slots(a, 8)
    mgr.evict_blocks(set(mgr.get_block_ids("a")))
    pool = mgr.block_pool
    assert pool.get_cached_block(a.block_hashes[0]) is None
    assert pool.get_num_used_blocks() == 2 and pool.num_cached_free_blocks == 0
    mgr.free(a)
    assert [blk.block_id for blk in pool.free_block_queue][:2] == [2, 1]  # unhashed now
    pool.check_invariants()


def test_full_sequence_must_fit_counts_the_whole_current_sequence():
    """vLLM's admission check (scheduler_reserve_full_isl): blocks for num_tokens, not
    for this step's chunk; local prefix hits count as held."""
    mgr = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable
    req = make_request("a", num_tokens=24)  # 6 blocks in all
    assert mgr.allocate_slots(req, 8, full_sequence_must_fit=True) is None
    assert not mgr.has_blocks("a") and mgr.block_pool.get_num_free_blocks() == 5
    assert len(mgr.allocate_slots(req, 8)) == 2  # the first chunk alone fits
    # A preempted request resumes with its outputs: they count too (not max_tokens).
    mgr = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable
    resumed = make_request("r", num_tokens=4, max_tokens=100)
    for token in range(9):
        resumed.append_output_token_ids(token)
    assert mgr.allocate_slots(resumed, 4, full_sequence_must_fit=True) is None  # 13 tokens: 4
    resumed = make_request("s", num_tokens=4, max_tokens=100)
    for token in range(8):
        resumed.append_output_token_ids(token)
    assert len(mgr.allocate_slots(resumed, 4, full_sequence_must_fit=True)) == 1  # 12: 3
