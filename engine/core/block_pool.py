"""Paged KV block pool with prefix caching. Runs in: engine-core process."""

from __future__ import annotations

from engine.core.block_hash import BlockHash


class KVCacheBlock:
    """One KV block: its id, reference count, prefix hash and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (LRU at the head).

    O(1) popleft, remove from the middle (a prefix hit revives a free block), append
    and prepend.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first n blocks, in queue order (n popleft()s, one splice)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks; only {self.num_free_blocks} free")
        head, blocks = self._head, [None] * n
        block = head.next_free
        for i in range(n):
            blocks[i], nxt = block, block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free, block.prev_free = block, head
        self.num_free_blocks -= n
        return blocks

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the tail, in list order (n append()s, one splice)."""
        if blocks:
            self._splice(self._tail.prev_free, blocks, self._tail)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the head, in list order (the first is popped first)."""
        if blocks:
            self._splice(self._head, blocks, self._head.next_free)

    def _splice(self, prev: KVCacheBlock, blocks: list[KVCacheBlock], nxt: KVCacheBlock) -> None:
        """Link `blocks`, in order, between the neighbours prev and nxt."""
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, nxt.prev_free = nxt, prev
        self.num_free_blocks += len(blocks)

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockHashToBlockMap:
    """Prefix hash -> the cached blocks holding it (vLLM's BlockHashToBlockMap).

    Not de-duplicated: two requests that compute the same prefix at once each cache
    their own block under the hash (block tables stay append-only), so a hash maps to
    one block or, rarely, to {block_id: block} in insertion order. A hit takes the
    earliest surviving one; an eviction removes only the evicted block.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self._cache.get(block_hash)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def get_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """get_one_block of each of the first max_blocks hashes, up to the first miss."""
        cache, hits = self._cache, []
        for i in range(min(max_blocks, len(block_hashes))):
            blocks = cache.get(block_hashes[i])
            if blocks is None:
                break
            hits.append(blocks if type(blocks) is KVCacheBlock else next(iter(blocks.values())))
        return hits

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        blocks = self._cache.setdefault(block_hash, block)
        if blocks is block:  # the common case: the hash was not cached
            return
        if isinstance(blocks, KVCacheBlock):
            self._cache[block_hash] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove `block_id` from under `block_hash`; the others stay cached."""
        blocks = self._cache.get(block_hash)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id != block_id:
                return None
            del self._cache[block_hash]
            return blocks
        block = blocks.pop(block_id, None)
        if len(blocks) == 1:
            (self._cache[block_hash],) = blocks.values()
        return block

    def evict(self, blocks: list[KVCacheBlock]) -> int:
        """pop() each hashed block from under its hash and clear its hash; how many had one."""
        cache, num_evicted = self._cache, 0
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            if cache.get(block_hash) is block:  # the hash's only block
                del cache[block_hash]
            else:
                self.pop(block_hash, block.block_id)
            block.block_hash = None
            num_evicted += 1
        return num_evicted

    def items(self):
        """(hash, block) for every cached block."""
        for block_hash, blocks in self._cache.items():
            if isinstance(blocks, KVCacheBlock):
                yield block_hash, blocks
            else:
                for block in blocks.values():
                    yield block_hash, block

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """`num_blocks` blocks (vLLM's num_gpu_blocks); block 0 is the null block, never
    allocated or freed, so `num_usable_blocks` (num_blocks - 1) are a request's to hold.

    A freed block keeps its hash and stays in the free queue, evictable: a later
    prefix hit takes it back (touch), a later allocation evicts it (its hash dropped).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - 1
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever, never in the free queue
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.num_cached_free_blocks = 0  # free blocks that still hold a hash
        # Blocks with ref_cnt > 0, counted apart from the free queue, so that
        # used + free == num_usable_blocks is a real check, not an identity.
        self.num_used_blocks = 0

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_cached_prefix(
        self, block_hashes: list[BlockHash], max_blocks: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest cached prefix of block_hashes[:max_blocks]."""
        return self.cached_block_hash_to_block.get_prefix(block_hashes, max_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """num_blocks from the free queue's head, their old hashes evicted, ref 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks; only {self.get_num_free_blocks()} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        # _maybe_evict_cached_block of each (all free, so each hashed one was cached-free).
        self.num_cached_free_blocks -= self.cached_block_hash_to_block.evict(blocks)
        for block in blocks:
            block.ref_cnt = 1
        self.num_used_blocks += num_blocks
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop the block's hash from the cache (this block only); True if it had one."""
        if block.block_hash is None:
            return False
        self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        block.block_hash = None
        if block.ref_cnt == 0:
            self.num_cached_free_blocks -= 1
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks' hashes (their KV is bad); blocks in use stay in use."""
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """ref++ on prefix-hit blocks; a hit on a free (ref 0) block takes it off the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_block_queue.remove(block)
                self.num_used_blocks += 1
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """ref--, blocks in eviction order (the first is evicted first); like vLLM,
        blocks reaching 0 without a hash go to the free queue's head (reused first, in
        the given order), hashed ones to its tail (kept for prefix hits, LRU)."""
        null_block, evict_first, evict_last = self.null_block, [], []
        for block in ordered_blocks:
            if block is null_block:
                continue
            ref_cnt = block.ref_cnt - 1
            if ref_cnt < 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                (evict_first if block.block_hash is None else evict_last).append(block)
        self.num_used_blocks -= len(evict_first) + len(evict_last)
        self.num_cached_free_blocks += len(evict_last)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] their prefix hashes.

        A hash that is already cached on another block is cached again on this one
        (vLLM does not de-duplicate; see BlockHashToBlockMap).
        """
        if not self.enable_caching:
            return
        cached = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is None:  # else a prefix hit: cached under this hash already
                block.block_hash = block_hashes[i]
                cached.insert(block.block_hash, block)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is in use, like vLLM."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for _, block in self.cached_block_hash_to_block.items():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        return self.num_used_blocks

    def check_invariants(self) -> None:
        """free + referenced == num_usable_blocks; no block both; hashes consistent."""
        free_ids = [b.block_id for b in self.free_block_queue]
        if len(free_ids) != self.free_block_queue.num_free_blocks:
            raise AssertionError("free queue length disagrees with its counter")
        if len(set(free_ids)) != len(free_ids) or 0 in free_ids:
            raise AssertionError("free queue holds a duplicate or the null block")
        referenced = [b for b in self.blocks[1:] if b.ref_cnt > 0]
        if any(b.ref_cnt < 0 for b in self.blocks):
            raise AssertionError("negative ref count")
        if set(free_ids) & {b.block_id for b in referenced}:
            raise AssertionError("a block is both free and referenced")
        if len(referenced) != self.num_used_blocks:
            raise AssertionError(
                f"used counter {self.num_used_blocks} != {len(referenced)} referenced"
            )
        if len(free_ids) + len(referenced) != self.num_usable_blocks:
            raise AssertionError(
                f"free {len(free_ids)} + used {len(referenced)} != {self.num_usable_blocks}"
            )
        cached = list(self.cached_block_hash_to_block.items())
        for block_hash, block in cached:
            if block.block_hash != block_hash:
                raise AssertionError(f"hash map points at {block} with another hash")
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if hashed != len(cached) or len({b.block_id for _, b in cached}) != len(cached):
            raise AssertionError("a block holds a hash the map does not know, or twice")
        cached_free = sum(1 for b in self.free_block_queue if b.block_hash is not None)
        if cached_free != self.num_cached_free_blocks:
            raise AssertionError("cached-free counter is off")
