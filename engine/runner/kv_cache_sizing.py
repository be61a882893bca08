"""How many KV blocks fit in device memory, by vLLM 0.32's arithmetic. Runs in: any process (pure).

num_blocks = (ceil(total * gpu_memory_utilization) - weights - activation peak) // bytes per block
(all layers, K and V), with vLLM's errors. The measuring (a profile run of the model) is
engine/runner/model_runner.py's; engine/profiles.py's presets share the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1 << 30
# kvdrain's block pool is Python objects, built one by one; a tiny model on a big GPU would
# get tens of millions. Above this, the pool is capped (a documented difference: vLLM has no
# cap, and its pool is built the same way).
MAX_NUM_GPU_BLOCKS = 1 << 20


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What the profile run measured, in bytes (one engine's own torch memory)."""

    init_free: int  # device memory free before the model was loaded
    total: int  # device memory in all
    weights: int  # the model's torch memory after loading (persistent)
    peak_activation: int  # the profile run's peak above the persistent memory


def format_gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f}"


def request_memory(init_free: int, total: int, gpu_memory_utilization: float) -> int:
    """vLLM's budget for one instance: a fraction of the whole device, which must be free
    (vllm/v1/worker/utils.py request_memory)."""
    requested = math.ceil(total * gpu_memory_utilization)
    if init_free < requested:
        raise ValueError(
            f"Free memory on device ({format_gib(init_free)}/{format_gib(total)} GiB) on "
            f"startup is less than desired GPU memory utilization "
            f"({gpu_memory_utilization}, {format_gib(requested)} GiB). Decrease GPU memory "
            f"utilization or reduce GPU memory used by other processes."
        )
    return requested


def available_kv_cache_memory(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """The budget left for the KV cache once weights and the activation peak are paid
    (vLLM's gpu_worker.py determine_available_memory)."""
    requested = request_memory(profile.init_free, profile.total, gpu_memory_utilization)
    return requested - profile.weights - profile.peak_activation


def num_gpu_blocks(
    available: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    cap: int = MAX_NUM_GPU_BLOCKS,
) -> int:
    """Blocks for `available` bytes (the null block among them), with vLLM's two checks
    (vllm/v1/core/kv_cache_utils.py get_num_blocks, check_enough_kv_cache_memory); like
    vLLM 0.32 (get_kv_cache_configs) they plan against the memory less the null block."""
    usable = available - bytes_per_block  # vLLM's check_memory: BlockPool holds one back
    if usable <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
    needed = math.ceil(max_model_len / block_size) * bytes_per_block
    if needed > usable:
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available "
            f"KV cache memory ({format_gib(usable)} GiB). Try increasing "
            f"`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
        )
    return min(available // bytes_per_block, cap)
