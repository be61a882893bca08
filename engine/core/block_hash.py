"""Chained prefix hashes of full KV blocks. Runs in: engine-core process.

A block's hash covers its own tokens and, through the parent hash, every token before
it. sha256 with a fixed seed gives the same hashes in every process and every run
(Python's hash() is randomised per process, so it is never used here).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

BlockHash = bytes

NONE_HASH: BlockHash = hashlib.sha256(b"kvdrain/none-hash/v1").digest()

# Packs n token ids as native-order int64s (the bytes array("q", ids) holds), one
# struct per block length: a block is hashed on every block boundary of every request.
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _packer(num_tokens: int) -> Callable[..., bytes]:
    pack = _PACKERS.get(num_tokens)
    if pack is None:
        pack = _PACKERS[num_tokens] = struct.Struct(f"={num_tokens}q").pack
    return pack


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """Hash of one full block given its parent's hash: sha256(parent + int64 token ids)."""
    data = (parent_hash if parent_hash is not None else NONE_HASH) + _packer(len(token_ids))(
        *token_ids
    )
    return hashlib.sha256(data).digest()[:16]


def hash_request_blocks(
    token_ids: list[int], block_size: int, known: list[BlockHash]
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` past the `known` ones (returned appended)."""
    hashes = known
    start, end = len(hashes) * block_size, len(token_ids) // block_size * block_size
    if end <= start:
        return hashes
    # hash_block_tokens of each block, the tokens packed once: the same bytes per block.
    num_tokens = end - start  # one block (a decode filled it): its cached packer
    pack = (
        _packer(num_tokens) if num_tokens == block_size else struct.Struct(f"={num_tokens}q").pack
    )
    data = pack(*token_ids[start:end])
    parent, sha256, size = hashes[-1] if hashes else NONE_HASH, hashlib.sha256, 8 * block_size
    for offset in range(0, len(data), size):
        parent = sha256(parent + data[offset : offset + size]).digest()[:16]
        hashes.append(parent)
    return hashes
