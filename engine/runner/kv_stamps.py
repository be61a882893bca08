"""The mock runner's marks in KV memory, so a wrong transfer shows. Runs in: engine-core process.

With a KV cache (a P/D engine), every token computed is stamped into its slot (layer 0's K, first
4 bytes, int32); a request first scheduled with a prefix it did not compute (loaded from P, or a
prefix-cache hit) has that prefix read back against its prompt. A mismatch marks it corrupt: the
runner samples other tokens, so the replay's output check sees it, as it would a real model's.
"""

from __future__ import annotations

import numpy as np

from engine.core.outputs import SchedulerOutput
from engine.runner.kv_cache import KVCache


class KVStamps:
    """Each request's block table, kept as a model runner keeps it, and its stamped slots."""

    def __init__(self, kv_cache: KVCache, block_size: int) -> None:
        if kv_cache.pages is None:
            raise ValueError("KV stamps need host memory (a CPU KV cache)")
        slots = kv_cache.pages[0].view(np.int32)  # layer 0's K: [num_blocks, page words]
        self.flat = slots.reshape(-1)
        self.row, self.block_size = slots.shape[1], block_size
        self.stride = self.row // block_size  # words per token slot
        if self.stride < 1:
            raise ValueError("KV stamps need at least 4 bytes per token slot")
        self.tables: dict[str, list[int]] = {}
        self.corrupt: set[str] = set()
        self.num_mismatches = 0

    def update(self, sched_out: SchedulerOutput) -> None:
        """Follow the block tables, check new prefixes, stamp this step's tokens."""
        for req_id in sched_out.finished_req_ids:
            self.tables.pop(req_id, None)
            self.corrupt.discard(req_id)
        index: list[int] = []
        checks: list[tuple[str, list[int], list[int]]] = []
        offset, bs, row, stride = 0, self.block_size, self.row, self.stride
        for req_id, start, num_new in zip(
            sched_out.req_ids, sched_out.num_computed_tokens, sched_out.num_scheduled_tokens
        ):
            table = self._table(req_id, sched_out)
            prompt = sched_out.prompt_token_ids.get(req_id)
            if start and prompt is not None and req_id in sched_out.new_req_ids:
                checks.append((req_id, table, prompt[:start]))
            index.extend(
                table[p // bs] * row + (p % bs) * stride for p in range(start, start + num_new)
            )
            offset += num_new
        if index:
            self.flat[index] = sched_out.token_ids[:offset]
        # After this step's stamps: a prefix hit may be on blocks another request of the
        # same step computes (the forward fills them before attention reads them).
        for req_id, table, expected in checks:
            self._check_prefix(req_id, table, expected)

    def _table(self, req_id: str, sched_out: SchedulerOutput) -> list[int]:
        new_blocks = sched_out.new_block_ids.get(req_id)
        if req_id in sched_out.new_req_ids:  # first schedule (or resumed): a fresh table
            table = self.tables[req_id] = list(new_blocks or [])
            return table
        table = self.tables.setdefault(req_id, [])
        if new_blocks:
            table.extend(new_blocks)
        return table

    def _check_prefix(self, req_id: str, table: list[int], expected: list[int]) -> None:
        positions = np.arange(len(expected))
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size]
        got = self.flat[blocks * self.row + (positions % self.block_size) * self.stride]
        if not np.array_equal(got, np.asarray(expected, dtype=np.int32)):
            self.corrupt.add(req_id)
            self.num_mismatches += 1
