"""Batched model execution over the paged KV cache. Runs in: engine-core process."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runner.attention import PagedAttentionBuilder
from engine.runner.kv_cache import KVCache, kv_cache_shape, resolve_device, resolve_dtype
from engine.runner.kv_cache_sizing import MemoryProfile, available_kv_cache_memory, num_gpu_blocks
from engine.runner.model import LlamaForCausalLM
from engine.utils import cdiv


class ModelRunner:
    """Runs each step's scheduled chunks (prefills and decodes together) in one forward."""

    def __init__(self, config: EngineConfig, kv_cache: KVCache | None = None) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model, self.device)
        sizing = (
            kv_cache is None
            and config.gpu_memory_utilization is not None
            and self.device.startswith("cuda")
        )
        init = (
            (*torch.cuda.mem_get_info(self.device), torch.cuda.memory_allocated(self.device))
            if sizing
            else None
        )  # vLLM's init snapshot: free, total, and what is ours already
        self.model = LlamaForCausalLM(config.model, self.device, self.dtype)
        if sizing:  # vLLM: load the model, profile it, then size the KV cache
            config = replace(config, num_blocks=self.determine_num_blocks(config, *init))
        self.config = config  # num_blocks as allocated
        expected = kv_cache_shape(config.model, config.num_blocks, config.block_size)
        if kv_cache is not None and (
            kv_cache.handle.shape != expected or kv_cache.tensor.dtype != self.dtype
        ):
            raise ValueError(
                f"KV cache {kv_cache.handle.shape} {kv_cache.handle.dtype} does "
                f"not fit the config: {expected} {self.dtype}"
            )
        self._owns_kv_cache = kv_cache is None
        self.kv_cache = kv_cache or KVCache.allocate(
            config.model, config.num_blocks, config.block_size, self.device, self.dtype
        )
        self.attn_builder = PagedAttentionBuilder(self.kv_cache.tensor)
        # req_id -> block table, mirrored from the scheduler's new_block_ids each step.
        self.block_tables: dict[str, list[int]] = {}

    def determine_num_blocks(
        self, config: EngineConfig, init_free: int, total: int, allocated_before: int = 0
    ) -> int:
        """vLLM's determine_available_memory: this engine's torch memory after a profile
        run at max_num_batched_tokens; then as many blocks as the rest of its budget holds."""
        torch.cuda.synchronize(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_kv_bytes = self.profile_run(config)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_kv_bytes
        torch.cuda.empty_cache()
        profile = MemoryProfile(
            init_free=init_free,
            total=total,
            weights=allocated - allocated_before,
            peak_activation=max(0, peak - allocated),
        )
        available = available_kv_cache_memory(profile, config.gpu_memory_utilization)
        bytes_per_block = (
            math.prod(kv_cache_shape(config.model, 1, config.block_size)) * self.dtype.itemsize
        )
        return num_gpu_blocks(available, bytes_per_block, config.block_size, config.max_model_len)

    @torch.inference_mode()
    def profile_run(self, config: EngineConfig) -> int:
        """One forward of a step's most tokens (max_num_batched_tokens, as prompts of at
        most max_model_len: one when it fits, this runner's largest attention; at most
        max_num_seqs of them) and max_num_seqs logits, over a scratch KV cache just big
        enough; returns the scratch cache's bytes."""
        seq_len = min(config.max_num_batched_tokens, config.max_model_len)
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * seq_len)
        query_lens = [seq_len] * (num_tokens // seq_len) + [num_tokens % seq_len] * (
            num_tokens % seq_len > 0
        )
        blocks_per_seq = cdiv(seq_len, config.block_size)
        tables = [
            list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
            for i in range(len(query_lens))
        ]
        num_blocks = len(query_lens) * blocks_per_seq + 1  # the null block 0 too
        kv = torch.zeros(
            kv_cache_shape(config.model, num_blocks, config.block_size),
            dtype=self.dtype,
            device=self.device,
        )
        attn_metadata = PagedAttentionBuilder(kv).build([0] * len(query_lens), query_lens, tables)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, attn_metadata.positions, attn_metadata, kv)
        self.model.compute_logits(hidden[-min(config.max_num_seqs, num_tokens) :])
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        return kv.nbytes

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """One step: update block tables, run every valid scheduled chunk, sample greedily."""
        self._update_block_tables(sched_out)
        runnable, failed = [], {}
        for sched_req in sched_out.scheduled:
            error = self._check(sched_req, runnable)
            if error is None:
                runnable.append(sched_req)
            else:
                failed[sched_req.req_id] = f"request {sched_req.req_id!r}: {error}"
        if not runnable:  # a zero-token step: the model does not run
            return ModelRunnerOutput(failed=failed)
        with torch.inference_mode():
            sampled = self._run(runnable)
        return ModelRunnerOutput(sampled_token_ids=sampled, failed=failed)

    def close(self) -> None:
        """Release the KV cache if this runner allocated it."""
        if self._owns_kv_cache:
            self.kv_cache.close()

    def _update_block_tables(self, sched_out: SchedulerOutput) -> None:
        # Drop first: a request preempted earlier may come back this step with is_new.
        for req_id in sched_out.finished_req_ids | sched_out.preempted_req_ids:
            self.block_tables.pop(req_id, None)
        for sched_req in sched_out.scheduled:
            if sched_req.is_new:
                self.block_tables[sched_req.req_id] = list(sched_req.new_block_ids)
            elif sched_req.req_id in self.block_tables:
                self.block_tables[sched_req.req_id].extend(sched_req.new_block_ids)

    def _check(self, sched_req: ScheduledRequest, runnable: list[ScheduledRequest]) -> str | None:
        """Why this chunk cannot run (None when it can)."""
        vocab_size = self.config.model.vocab_size
        if not sched_req.token_ids:
            return "no tokens scheduled"
        if sched_req.num_computed_tokens < 0:
            return f"num_computed_tokens={sched_req.num_computed_tokens} is negative"
        for i, token_id in enumerate(sched_req.token_ids):
            if not 0 <= token_id < vocab_size:
                return f"token id {token_id} at index {i} outside [0, {vocab_size})"
        if any(r.req_id == sched_req.req_id for r in runnable):
            return "scheduled twice in one step"
        table = self.block_tables.get(sched_req.req_id)
        if table is None:
            return "no block table: first scheduled without is_new"
        seq_len = sched_req.num_computed_tokens + len(sched_req.token_ids)
        return self._check_block_table(table, seq_len)

    def _check_block_table(self, table: list[int], seq_len: int) -> str | None:
        block_size, num_blocks = self.config.block_size, self.kv_cache.num_blocks
        num_needed = cdiv(seq_len, block_size)
        if len(table) < num_needed:
            return (
                f"block table of {len(table)} blocks holds {len(table) * block_size} "
                f"tokens, {seq_len} needed"
            )
        for i, block_id in enumerate(table[:num_needed]):
            if not 0 <= block_id < num_blocks:
                return (
                    f"block id {block_id} at block index {i} is past the cache "
                    f"({num_blocks} blocks)"
                )
            if block_id == 0:
                return f"the null block 0 at block index {i} would hold tokens"
        return None

    def _run(self, runnable: list[ScheduledRequest]) -> dict[str, int]:
        """Packed forward of all chunks, decodes first (attention batches them); argmax."""
        reqs = sorted(runnable, key=lambda r: len(r.token_ids) != 1)  # stable
        attn_metadata = self.attn_builder.build(
            [r.num_computed_tokens for r in reqs],
            [len(r.token_ids) for r in reqs],
            [self.block_tables[r.req_id] for r in reqs],
        )
        input_ids = torch.tensor(
            [t for r in reqs for t in r.token_ids], dtype=torch.long, device=self.device
        )
        hidden = self.model(input_ids, attn_metadata.positions, attn_metadata, self.kv_cache.tensor)
        rows = [i for i, r in enumerate(reqs) if r.sample]
        if not rows:
            return {}
        last = torch.tensor(
            [attn_metadata.query_start_loc[i + 1] - 1 for i in rows], device=self.device
        )
        token_ids = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        return {reqs[i].req_id: token_id for i, token_id in zip(rows, token_ids)}
