"""Sizing the KV pool from device memory as vLLM 0.32 does: its arithmetic and errors, the
CLI defaults that choose it, and (on a GPU) a real engine that sizes, allocates and
reports the pool."""

from __future__ import annotations

import math
import os
import time

import pytest

from engine.config import EngineConfig, get_model_config
from engine.profiles import DEPLOYMENT_PRESETS
from engine.runner.kv_cache_sizing import (
    MAX_NUM_GPU_BLOCKS,
    GiB,
    MemoryProfile,
    available_kv_cache_memory,
    num_gpu_blocks,
    request_memory,
)
from tests.paths import EXAMPLE


def test_requested_memory_is_a_share_of_the_whole_device_that_must_be_free() -> None:
    assert request_memory(80 * GiB, 80 * GiB, 0.9) == math.ceil(80 * GiB * 0.9)
    with pytest.raises(
        ValueError,
        match=r"Free memory on device \(30.00/80.00 GiB\) on startup "
        r"is less than desired GPU memory utilization \(0.9, 72.00 GiB\)",
    ):
        request_memory(30 * GiB, 80 * GiB, 0.9)


def test_available_memory_pays_weights_and_the_activation_peak() -> None:
    profile = MemoryProfile(
        init_free=80 * GiB, total=80 * GiB, weights=16 * GiB, peak_activation=2 * GiB
    )
    assert available_kv_cache_memory(profile, 0.5) == 40 * GiB - 18 * GiB


def test_blocks_from_memory_with_vllms_checks_and_kvdrains_cap() -> None:
    per_block = 2 * 1 << 20  # an 8B model: 128 KiB a token, 16 tokens a block
    assert num_gpu_blocks(56 * GiB, per_block, 16, 32768) == 28672
    assert num_gpu_blocks(56 * GiB + per_block - 1, per_block, 16, 32768) == 28672  # floor
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        num_gpu_blocks(0, per_block, 16, 32768)
    with pytest.raises(ValueError, match=r"max seq len \(32768\)"):  # needs 2048 blocks
        num_gpu_blocks(2047 * per_block, per_block, 16, 32768)
    assert num_gpu_blocks(2049 * per_block, per_block, 16, 32768) == 2049  # 2048 and the null block
    assert num_gpu_blocks(1 << 50, 4096, 16, 4096) == MAX_NUM_GPU_BLOCKS


def test_deployment_presets_use_the_same_arithmetic() -> None:
    profile = DEPLOYMENT_PRESETS["llama3-8b-h100"]
    usable = int(profile.gpu_memory_bytes * profile.gpu_memory_utilization) - profile.weights_bytes
    assert profile.num_gpu_blocks == usable // (profile.block_size * profile.kv_bytes_per_token)


def test_cpu_runner_keeps_num_blocks_and_profile_run_needs_a_scratch_cache_only() -> None:
    from engine.runner.kv_cache import kv_cache_shape
    from engine.runner.model_runner import ModelRunner

    config = EngineConfig(
        runner="torch",
        device="cpu",
        num_blocks=64,
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=100,
        max_model_len=256,
    )
    runner = ModelRunner(config)
    try:
        assert runner.config.num_blocks == 64 and runner.kv_cache.num_blocks == 64
        scratch = runner.profile_run(config)  # ceil(100 / 16) + the null block
        assert scratch == math.prod(kv_cache_shape(config.model, 8, 16)) * 4
    finally:
        runner.close()


def _options(**given) -> dict:
    options = {"num_blocks": None, "gpu_memory_utilization": None, "topology": "pd"}
    return options | given


@pytest.mark.parametrize(
    "given, blocks, util",
    [
        ({}, 512, 0.45),
        ({"topology": "single"}, 512, 0.9),
        ({"gpu_memory_utilization": 0.3}, 512, 0.3),
        ({"num_blocks": 100}, 100, None),  # vLLM's num_gpu_blocks_override: no sizing
        ({"num_blocks": 100, "gpu_memory_utilization": 0.3}, 100, None),
    ],
)
def test_cli_sizes_from_memory_unless_num_blocks_is_given(
    given: dict, blocks: int, util: float | None
) -> None:
    from replay.commands.groups import CPU_NUM_BLOCKS, gpu_share

    options = _options(**given)
    assert (options["num_blocks"] or CPU_NUM_BLOCKS, gpu_share(**options)) == (blocks, util)


def test_a_deployment_preset_sets_num_blocks_and_turns_sizing_off() -> None:
    sized = DEPLOYMENT_PRESETS["llama3-8b-h100"].apply(EngineConfig(gpu_memory_utilization=0.45))
    assert (sized.num_blocks, sized.gpu_memory_utilization) == (28672, None)
    kept = DEPLOYMENT_PRESETS["llama3-8b-h100"].apply(
        EngineConfig(num_blocks=99, gpu_memory_utilization=0.45), keep=frozenset({"num_blocks"})
    )
    assert (kept.num_blocks, kept.gpu_memory_utilization) == (99, 0.45)


@pytest.mark.gpu
def test_engine_on_cuda_sizes_its_pool_from_free_memory_and_reports_it() -> None:
    """A real engine-core process: the pool fills its share of the GPU (minus the model),
    Ready and the stats say so, and a request runs on it."""
    import torch

    from engine.proc.client import MPClient
    from engine.runner.kv_cache import kv_cache_shape

    free, total = torch.cuda.mem_get_info()
    util = 0.05 if free > 0.1 * total else pytest.skip(f"only {free / GiB:.1f} GiB free")
    model = get_model_config("medium")
    config = EngineConfig(
        engine_id="G",
        runner="torch",
        device="cuda",
        model=model,
        gpu_memory_utilization=util,
        max_model_len=4096,
    )
    per_block = math.prod(kv_cache_shape(model, 1, config.block_size)) * 2  # bf16
    upper = math.ceil(total * util) // per_block  # no model, no activations
    start = time.monotonic()
    client = MPClient(config)
    try:
        ready = client.wait_ready()
        took = time.monotonic() - start
        assert 0.5 * upper < ready.num_blocks <= upper, (ready.num_blocks, upper)
        client.add_request("r", list(range(1, 200)), 8)
        deadline = time.monotonic() + 60
        outputs = []
        while not any(o.finished for o in outputs):
            assert time.monotonic() < deadline, "no output within 60 s"
            outputs += client.get_outputs(0.5)
        assert sum(len(o.new_token_ids) for o in outputs) == 8
        print(
            f"sized {ready.num_blocks} blocks of {per_block} B ({util} of {total / GiB:.0f} GiB; "
            f"at most {upper} without the model) in {took:.1f} s, pid {os.getpid()}"
        )
    finally:
        client.shutdown()


def test_a_wall_replay_reports_and_forecasts_on_the_pool_the_engines_allocated(monkeypatch) -> None:
    """Engines that sized their pools from GPU memory report them in Ready; the replay's
    settings then say that size, and its idle-window forecast runs once, on it (not on the
    CPU default the frontend started with). The GPU's sizing is stood in for by the router's
    answer, on the mock runner."""
    from replay import pipeline
    from replay.deploy.pd_router import PDRouter
    from replay.trace.shaping import ShapingOptions

    forecast_pools: list[int] = []
    forecast_timeline = pipeline.forecast_timeline
    monkeypatch.setattr(PDRouter, "num_blocks", property(lambda self: 300))
    monkeypatch.setattr(pipeline, "is_pool_sized_by_engines", lambda config: True)
    monkeypatch.setattr(
        pipeline,
        "forecast_timeline",
        lambda records, config, on_progress=None: (
            forecast_pools.append(config.engine.num_blocks)
            or forecast_timeline(records, config, on_progress)
        ),
    )
    config = pipeline.ReplayConfig(
        trace=EXAMPLE,
        engine=EngineConfig(num_blocks=256, runner="mock", gpu_memory_utilization=0.45),
        shaping=ShapingOptions(speedup=100),
        tail_s=1.0,
    )
    result = pipeline.run_replay(config)
    assert forecast_pools == [300]  # once, on what they allocated
    assert result.config.engine.num_blocks == 300 and result.verdict.exit_code == 0


@pytest.mark.gpu
def test_a_second_runner_in_one_process_does_not_count_the_first_ones_memory() -> None:
    """vLLM's init snapshot: what the process held before the model loads is not this
    engine's. (Counting it, a second runner found no memory left: seen on an H200.)"""
    from engine.runner.model_runner import ModelRunner

    config = EngineConfig(
        runner="torch",
        device="cuda",
        model=get_model_config("medium"),
        gpu_memory_utilization=0.05,
        max_model_len=512,
    )
    first = ModelRunner(config)
    try:
        second = ModelRunner(config)
        assert (
            abs(second.config.num_blocks - first.config.num_blocks) < 0.02 * first.config.num_blocks
        )
        second.close()
    finally:
        first.close()


def test_pool_sizing_reserves_the_null_block_as_vllm_does() -> None:
    """vLLM 0.32 (kv_cache_utils.get_kv_cache_configs) checks max_model_len against the
    available memory less one block (the null block BlockPool holds back), then
    allocates available // bytes per block: a pool that holds exactly one max_model_len
    request counting the null block is refused, one block more is taken."""
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

    config = EngineConfig(
        runner="torch",
        device="cpu",
        num_blocks=16,
        max_num_batched_tokens=100,
        max_model_len=32,
        max_num_seqs=64,
    )
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
        runner.profile_run(
            config := EngineConfig(
                runner="torch",
                device="cpu",
                num_blocks=16,
                max_num_batched_tokens=100,
                max_model_len=32,
                max_num_seqs=2,
            )
        )
        assert seen[1] == (64, [32, 32])  # at most max_num_seqs prompts in a step
    finally:
        runner.close()
