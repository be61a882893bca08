"""Prompt token ids synthesised from trace requests. Runs in: frontend process.

Deterministic in every process and every run: tokens are drawn from a SHAKE-128 stream
keyed by a hash id or a request id (never Python's hash(), which is salted per process),
and sent as token ids, never text, so no re-tokenisation can move a block edge.
- hash_ids: block i holds the first `hash_block_size` tokens of the stream of id i; the
  last block holds only `prompt_len - (n - 1) * hash_block_size`. Requests that share
  leading ids therefore share exactly those tokens and hit the engine's prefix cache. An
  id's stream does not depend on the block size, so a shorter block is a prefix of a
  longer one (what `--scale-tokens` relies on).
- Engine blocks are not hash blocks: a 512-token Mooncake block is 32 engine blocks of 16.
  Every engine block size that divides the hash block size sees each shared hash block
  as whole cached engine blocks; with any other size the engine block straddling the end
  of the shared prefix misses, so the hits are floor(shared tokens / engine block size).
- prompt_len only: `prompt_len` tokens of the request id's stream, unique to the request.
- prompt_token_ids: used as given; each must be below vocab_size.
"""

from __future__ import annotations

import hashlib

import numpy as np

from replay.trace.reader import TraceRequest

# The memo below keeps blocks of at most MEMO_MAX_BLOCK tokens (2 KiB); longer blocks (the
# reader allows up to 2**20 tokens) are made afresh each time. A memo holds at most
# MEMO_BYTES, counting each block's words and MEMO_ENTRY_BYTES of bookkeeping, and starts
# over when full: the whole Mooncake trace at --scale-tokens 1/32 (182,790 ids of 16
# tokens) fits in one.
MEMO_MAX_BLOCK = 512
MEMO_BYTES = 32 << 20
MEMO_ENTRY_BYTES = 100


class BlockMemo:
    """Hash blocks' words already drawn, per block size, within MEMO_BYTES.

    A pure function's memo (bytes are immutable), so what it holds never changes a prompt;
    a replay keeps its own (replay/sim/simulation.py), other callers share the module's."""

    __slots__ = ("by_size", "nbytes")

    def __init__(self) -> None:
        self.by_size: dict[int, dict[int, bytes]] = {}
        self.nbytes = 0

    def words(self, hash_ids: tuple[int, ...], block_size: int) -> list[bytes]:
        """Each id's first block_size words, drawing only those not held yet."""
        held = self.by_size.setdefault(block_size, {})
        parts = list(map(held.get, hash_ids))
        if None in parts:
            self._draw_missing(held, hash_ids, parts, block_size)
            if self.nbytes > MEMO_BYTES:
                self.by_size, self.nbytes = {}, 0
        return parts

    def _draw_missing(
        self,
        held: dict[int, bytes],
        hash_ids: tuple[int, ...],
        parts: list[bytes | None],
        block_size: int,
    ) -> None:
        """Fill the holes of `parts` (an id twice in a prompt: drawn once), _words inlined:
        this loop runs once per distinct id of a replay."""
        num_bytes, num_drawn, shake = 4 * block_size, 0, hashlib.shake_128
        for i, part in enumerate(parts):
            if part is None:
                hash_id = hash_ids[i]
                part = held.get(hash_id)
                if part is None:
                    part = held[hash_id] = shake(b"kvdrain/hash/%d" % hash_id).digest(num_bytes)
                    num_drawn += 1
                parts[i] = part
        self.nbytes += num_drawn * (num_bytes + MEMO_ENTRY_BYTES)


def _words(key: bytes, num_tokens: int) -> bytes:
    """The stream named by `key`: num_tokens little-endian uint32 words (a token is a
    word mod vocab_size, so one stream serves every vocabulary)."""
    return hashlib.shake_128(key).digest(4 * num_tokens)


def _tokens(words: bytes, num_tokens: int, vocab_size: int) -> list[int]:
    """The first num_tokens words, each mod vocab_size, in one vectorised pass."""
    return (np.frombuffer(words, dtype="<u4", count=num_tokens) % vocab_size).tolist()


_SHARED_MEMO = BlockMemo()  # for callers that bring none (the live and HTTP drivers)


def _hash_prompt(req: TraceRequest, vocab_size: int, memo: BlockMemo) -> list[int]:
    hash_ids, block = req.hash_ids or (), req.hash_block_size
    tail = req.prompt_len - (len(hash_ids) - 1) * block
    if not hash_ids or not 1 <= tail <= block:
        raise ValueError(
            f"hash_ids: request {req.req_id!r}: {len(hash_ids)} ids of "
            f"{block} tokens cannot hold {req.prompt_len} tokens"
        )
    # Whole blocks joined, cut at prompt_len: the last block keeps its first `tail`.
    if block <= MEMO_MAX_BLOCK:
        parts = memo.words(hash_ids, block)
    else:
        parts = [_words(b"kvdrain/hash/%d" % hash_id, block) for hash_id in hash_ids]
    return _tokens(b"".join(parts), req.prompt_len, vocab_size)


def synth_prompt(req: TraceRequest, vocab_size: int, memo: BlockMemo | None = None) -> list[int]:
    """The prompt token ids of a trace request, all in [0, vocab_size); `memo` keeps the
    hash blocks drawn (default: one shared by the process)."""
    if type(vocab_size) is not int or vocab_size < 1:
        raise ValueError(f"vocab_size: must be an integer >= 1, got {vocab_size!r}")
    if req.prompt_token_ids is not None:
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: request {req.req_id!r}: token {bad[0]} is "
                f"outside [0, vocab_size={vocab_size})"
            )
        return list(req.prompt_token_ids)
    if req.hash_ids is not None:
        return _hash_prompt(req, vocab_size, _SHARED_MEMO if memo is None else memo)
    key = b"kvdrain/request/" + req.req_id.encode()
    return _tokens(_words(key, req.prompt_len), req.prompt_len, vocab_size)
