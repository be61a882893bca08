"""Paged attention over packed tokens of many requests. Runs in: engine-core process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.utils import cdiv


class AttentionMetadata(Protocol):
    """What a layer needs to attend: how the step's packed tokens map onto KV memory."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor | None
    ) -> torch.Tensor:
        """Store the new tokens' K/V, then attend: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        ...


@dataclass(slots=True)
class CausalAttentionMetadata:
    """The reference path: one whole sequence, full causal attention, no cache."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor | None
    ) -> torch.Tensor:
        """Full causal attention over the sequence; kv_layer is ignored."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


@dataclass(slots=True)
class PagedAttentionMetadata:
    """One step's packed layout over the paged cache; built once, read by every layer.

    Rows are requests. The first `num_decodes` rows have one query token each and attend
    in one batched gather; the others (prefill chunks) attend one request at a time. Row
    i's queries are tokens query_start_loc[i]:query_start_loc[i+1] of the packed batch, at
    positions seq_lens[i]-query_len .. seq_lens[i]-1.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token: block_id*block_size+offset
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with the null block 0
    query_start_loc: list[int]  # [B+1] offsets of each request's tokens in the batch
    seq_lens: list[int]  # [B] context length after this step
    positions: torch.Tensor  # [T] position of each new token
    num_decodes: int
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_ctx]: 0 where key j < seq_len, else -inf
    decode_block_ids: torch.Tensor  # [num_decodes * max_ctx / block_size]: what decodes gather
    # Per prefill row: [query_len, seq_len] causal mask, or None for a fresh prompt.
    prefill_masks: list[torch.Tensor | None]
    workspace: torch.Tensor  # [2, >= gathered elements]: reused by every layer's gathers

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor | None
    ) -> torch.Tensor:
        """Write the new tokens' K/V into their slots, then attend through block tables."""
        if kv_layer is None:
            raise ValueError("paged attention needs a KV cache layer")
        num_kv_heads, head_dim = kv_layer.shape[-2:]
        kv_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, k)
        kv_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        if self.num_decodes:
            out[: self.num_decodes] = self._decode(q[: self.num_decodes], kv_layer)
        for row in range(self.num_decodes, len(self.seq_lens)):
            start, end = self.query_start_loc[row], self.query_start_loc[row + 1]
            mask = self.prefill_masks[row - self.num_decodes]
            if mask is None:  # nothing cached before this chunk: its own K/V is the context
                out[start:end] = _attention(q[start:end], k[start:end], v[start:end], None)
            else:
                out[start:end] = self._prefill(row, q[start:end], kv_layer, mask)
        return out

    def _gather(
        self, kv_layer: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks, into the workspace: two [n, block_size, Hkv, D] views."""
        shape = (block_ids.shape[0], *kv_layer.shape[2:])
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        k = torch.index_select(kv_layer[0], 0, block_ids, out=self.workspace[0, :numel].view(shape))
        v = torch.index_select(kv_layer[1], 0, block_ids, out=self.workspace[1, :numel].view(shape))
        return k, v

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """One query token per request, batched: gather [D, max_ctx] keys via block tables."""
        num_decodes, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_layer.shape[2:4]
        blocks_per_seq = self.decode_mask.shape[-1] // block_size
        k, v = self._gather(kv_layer, self.decode_block_ids)
        # [D*blocks, block_size, Hkv, hd] -> [D, Hkv, ctx, hd]
        k = k.view(num_decodes, blocks_per_seq * block_size, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(num_decodes, blocks_per_seq * block_size, num_kv_heads, head_dim).transpose(1, 2)
        # GQA without copying K/V: a KV head's query group plays the role of query rows.
        q = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.decode_mask)
        return out.reshape(num_decodes, num_heads, head_dim)

    def _prefill(
        self, row: int, q: torch.Tensor, kv_layer: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One request's chunk after cached context: queries see keys at positions <= theirs."""
        seq_len, block_size = self.seq_lens[row], kv_layer.shape[2]
        k, v = self._gather(kv_layer, self.block_tables[row, : cdiv(seq_len, block_size)])
        return _attention(q, k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len], mask)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [L, Hq, D], k/v [S, Hkv, D] -> [L, Hq, D]; causal (top-left) when mask is None.

    K/V heads are repeated for their query groups: SDPA's enable_gqa falls back to the
    slow math kernel on the CPU, and the copy is small next to the attention itself.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
    )
    return out[0].transpose(0, 1)


class PagedAttentionBuilder:
    """Builds each step's PagedAttentionMetadata for one KV cache; owns the gather workspace."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.block_size = kv_cache.shape[3]
        self.block_numel = kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.shape[5]
        self.device = kv_cache.device
        # Kept across steps: fresh multi-MB buffers each layer cost page faults on the CPU.
        self.workspace = torch.empty(2, 0, dtype=kv_cache.dtype, device=self.device)

    def build(
        self, num_computed_tokens: list[int], query_lens: list[int], block_tables: list[list[int]]
    ) -> PagedAttentionMetadata:
        """Lay out one step: row i computes query_lens[i] tokens after num_computed_tokens[i]."""
        num_reqs, block_size = len(query_lens), self.block_size
        seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens)]
        for seq_len, table in zip(seq_lens, block_tables):
            if len(table) * block_size < seq_len:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold "
                    f"{seq_len} tokens at block_size={block_size}"
                )
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        tables = _pad_block_tables(block_tables)
        decode_mask = self._decode_mask(seq_lens[:num_decodes])
        num_decode_blocks = 0 if decode_mask is None else decode_mask.shape[-1] // block_size
        # Only prefill chunks after cached context gather; fresh prompts use their own K/V.
        prefill_blocks = [
            cdiv(s, block_size)
            for q, s in zip(query_lens[num_decodes:], seq_lens[num_decodes:])
            if q != s
        ]
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        starts = torch.zeros(num_reqs + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=starts[1:])
        # Token t belongs to row r(t); its position is num_computed[r] + (t - start[r]).
        rows = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
        computed = torch.tensor(num_computed_tokens, dtype=torch.long)
        positions = computed[rows] + torch.arange(len(rows)) - starts[rows]
        slots = tables[rows, positions // block_size] * block_size + positions % block_size
        return PagedAttentionMetadata(
            slot_mapping=slots.to(self.device),
            block_tables=tables.to(self.device),
            query_start_loc=starts.tolist(),
            seq_lens=seq_lens,
            positions=positions.to(self.device),
            num_decodes=num_decodes,
            decode_mask=decode_mask,
            decode_block_ids=tables[:num_decodes, :num_decode_blocks].flatten().to(self.device),
            prefill_masks=[
                self._prefill_mask(q, s)
                for q, s in zip(query_lens[num_decodes:], seq_lens[num_decodes:])
            ],
            workspace=self._workspace(max([num_decodes * num_decode_blocks, *prefill_blocks])),
        )

    def _decode_mask(self, seq_lens: list[int]) -> torch.Tensor | None:
        """Key-validity mask [D, 1, 1, max_ctx] of the batched decode rows (None when none)."""
        if not seq_lens:
            return None
        max_ctx = cdiv(max(seq_lens), self.block_size) * self.block_size
        lens = torch.tensor(seq_lens, dtype=torch.long)
        valid = torch.arange(max_ctx)[None, :] < lens[:, None]
        # Additive (0 / -inf) rather than boolean: SDPA would convert a boolean mask per layer.
        mask = torch.zeros(valid.shape, dtype=self.workspace.dtype)
        mask.masked_fill_(~valid, -torch.inf)
        return mask.view(len(seq_lens), 1, 1, max_ctx).to(self.device)

    def _prefill_mask(self, query_len: int, seq_len: int) -> torch.Tensor | None:
        """Query i sits at position seq_len - query_len + i and sees keys j <= that position."""
        if query_len == seq_len:
            return None
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=self.device)
        return mask.tril(seq_len - query_len)

    def _workspace(self, num_blocks: int) -> torch.Tensor:
        """A [2, n] buffer for gathers of num_blocks blocks; grows, never shrinks."""
        if num_blocks * self.block_numel > self.workspace.shape[1]:
            self.workspace = torch.empty(
                2, num_blocks * self.block_numel, dtype=self.workspace.dtype, device=self.device
            )
        return self.workspace


def _pad_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """[B, max_blocks] block ids, short tables padded with the null block 0."""
    tables = torch.zeros(len(block_tables), max(map(len, block_tables)), dtype=torch.long)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    return tables
