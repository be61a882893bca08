"""Chained prefix hashes of full KV blocks. Runs in: engine-core process.

A block's hash covers its own tokens and, through the parent hash, every token before
it. sha256 with a fixed seed gives the same hashes in every process and every run
(Python's hash() is randomised per process, so it is never used here).
"""
from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes

NONE_HASH: BlockHash = hashlib.sha256(b"kvdrain/none-hash/v1").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()[:16]


def hash_request_blocks(
    token_ids: list[int], block_size: int, known: list[BlockHash]
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` past the `known` ones (returned appended)."""
    hashes = known
    start = len(hashes) * block_size
    parent = hashes[-1] if hashes else None
    while start + block_size <= len(token_ids):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
        start += block_size
    return hashes
