"""Regressions found reviewing this session's engine/ and connector/ changes: the KV
registration handshake's error paths (connector/agent.py, connector/worker_proc.py) and
GPU pool sizing against vLLM 0.32 (engine/runner/kv_cache_sizing.py, engine/runner/model_runner.py)."""
from __future__ import annotations

import time

import pytest

import connector.agent as agent_mod
from engine.config import EngineConfig, KVTransferConfig, ModelConfig
from engine.runner.kv_cache import KVCache


def test_a_kv_cache_the_worker_cannot_map_fails_the_start_at_once(tmp_path, monkeypatch) -> None:
    """A RegisterKVCache whose memory the worker cannot map (here: the segment is gone)
    ends the worker, so the agent says so at once; it used to count a bad message and
    stay silent, and the engine start hung READY_TIMEOUT_S (60 s) for KVCacheRegistered."""
    monkeypatch.setattr(agent_mod, "READY_TIMEOUT_S", 20.0)
    config = EngineConfig(engine_id="P", num_blocks=8, kv_transfer=KVTransferConfig(
        kv_role="kv_producer", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"))
    cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=16)
    handle = cache.handle.to_dict()
    cache.close()  # the owner unlinks the segment: the handle names nothing now
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code .* before KVCacheRegistered"):
        agent_mod.PDConnectorAgent(config, handle)
    assert time.monotonic() - start < 15.0


def test_pool_sizing_reserves_the_null_block_as_vllm_does() -> None:
    """vLLM 0.32 (kv_cache_utils.get_kv_cache_configs) checks max_model_len against the
    available memory less one block (the null block BlockPool holds back), then
    allocates available // bytes per block: a pool that holds exactly one max_model_len
    request counting the null block is refused, one block more is taken."""
    from engine.runner.kv_cache_sizing import num_gpu_blocks
    per_block = 2 << 20
    needed = 32768 // 16  # blocks for one request of max_model_len 32768
    with pytest.raises(ValueError, match=r"max seq len \(32768\)"):
        num_gpu_blocks(needed * per_block, per_block, 16, 32768)
    assert num_gpu_blocks((needed + 1) * per_block, per_block, 16, 32768) == needed + 1
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        num_gpu_blocks(per_block, per_block, 16, 16)  # the null block only


def test_the_profile_run_covers_a_steps_tokens_when_max_model_len_is_shorter() -> None:
    """vLLM profiles max_num_batched_tokens in one step; a step of kvdrain's scheduler
    holds that many over several prompts when max_model_len is shorter, so the profile
    run must too (it ran one prompt of max_model_len tokens: a smaller activation peak
    than a real step's, a pool sized too big)."""
    from engine.runner.model_runner import ModelRunner
    config = EngineConfig(runner="torch", device="cpu", num_blocks=16, max_num_batched_tokens=100,
                          max_model_len=32, max_num_seqs=64)
    runner = ModelRunner(config)
    model, seen = runner.model, []

    class Recording:
        def __call__(self, input_ids, positions, attn_metadata, kv):
            seen.append((len(input_ids), list(attn_metadata.seq_lens)))
            return model(input_ids, positions, attn_metadata, kv)

        def compute_logits(self, hidden):
            return model.compute_logits(hidden)
    runner.model = Recording()
    try:
        runner.profile_run(config)
        assert seen == [(100, [32, 32, 32, 4])]
        runner.profile_run(config := EngineConfig(runner="torch", device="cpu", num_blocks=16,
                                                  max_num_batched_tokens=100, max_model_len=32,
                                                  max_num_seqs=2))
        assert seen[1] == (64, [32, 32])  # at most max_num_seqs prompts in a step
    finally:
        runner.close()
