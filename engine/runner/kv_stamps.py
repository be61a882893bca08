"""The mock runner's marks in real KV memory: each computed token's id in its slot, checked where a prefix was computed elsewhere. Runs in: engine-core process.

The mock runner needs no KV to pick its tokens, so a transfer that delivered the wrong
bytes would go unseen. With a KV cache (a P/D engine) it writes every token it computes
into that token's slot (the first 4 bytes of layer 0's K, as an int32), keeps each
request's block table as a model runner does, and when a request is first scheduled with
a prefix it did not compute in this life (loaded from P, or a prefix-cache hit), it reads
the prefix's slots back and compares them with the prompt. A mismatch (blocks freed and
reused before the copy, say) marks the request corrupt: the runner then samples other
tokens for it, so its output differs from a single engine's and the replay's output
check (replay/verify/outputs.py) sees it, as it would with a real model.
"""

from __future__ import annotations

import numpy as np

from engine.core.outputs import SchedulerOutput
from engine.runner.kv_cache import KVCache


class KVStamps:
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
