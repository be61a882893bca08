"""Deployment presets: the engine sizes of a real model on a real GPU. Runs in: frontend process.

A preset gives a model's shape, its GPU and a deployment's scheduler limits; its num_blocks comes
from vLLM's memory arithmetic (engine/runner/kv_cache_sizing.py). The virtual clock runs one by
default, so public traces replay unscaled with nothing ignored for lack of room.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.runner.kv_cache_sizing import (
    GiB,
    MemoryProfile,
    available_kv_cache_memory,
    num_gpu_blocks,
)


@dataclass(frozen=True, slots=True)
class DeploymentPreset:
    """A model on a GPU. Each block holds block_size tokens of K and V for every layer:
    bytes per token = 2 * num_layers * num_kv_heads * head_dim * dtype bytes, and
    num_gpu_blocks = (total * gpu_memory_utilization - weights) // (block_size * bytes per token).
    """

    name: str
    description: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int  # weights plus activation peak: what is not KV cache
    block_size: int = 16
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks vLLM would allocate (its num_gpu_blocks; the null block among them)."""
        gpu = MemoryProfile(
            init_free=self.gpu_memory_bytes,
            total=self.gpu_memory_bytes,
            weights=self.weights_bytes,
            peak_activation=0,
        )  # weights_bytes has it
        usable = available_kv_cache_memory(gpu, self.gpu_memory_utilization)
        return num_gpu_blocks(
            usable, self.block_size * self.kv_bytes_per_token, self.block_size, self.max_model_len
        )

    def sizes(self) -> dict[str, int]:
        """The EngineConfig fields this preset sets."""
        return {
            "num_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }

    def apply(self, config: EngineConfig, keep: frozenset[str] = frozenset()) -> EngineConfig:
        """`config` with this preset's sizes, except the fields in `keep` (set explicitly)."""
        sized = replace(config, **{k: v for k, v in self.sizes().items() if k not in keep})
        # The preset's num_blocks, not the runner's own from device memory.
        return sized if "num_blocks" in keep else replace(sized, gpu_memory_utilization=None)


DEPLOYMENT_PRESETS = {
    p.name: p
    for p in (
        # Llama-3-8B: 32 layers, 8 KV heads (GQA), head dim 128, bf16 -> 128 KiB a token;
        # an 80 GiB H100 at vLLM's default utilization 0.9 minus 16 GiB of weights and
        # activations -> 56 GiB of KV cache: 28,672 blocks of 16 tokens (458,752 tokens).
        # max_model_len 131072 is Llama 3.1's context: the Mooncake trace's longest request
        # (126,527 tokens with its output) fits; 32k would refuse 829 of its prompts.
        DeploymentPreset(
            "llama3-8b-h100",
            "Llama-3.1-8B (bf16) on one 80 GB H100, vLLM defaults",
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype_bytes=2,
            gpu_memory_bytes=80 * GiB,
            gpu_memory_utilization=0.9,
            weights_bytes=16 * GiB,
            max_model_len=131072,
        ),
        # Llama-3-70B with tensor parallel 4 on H100s: per GPU 80 layers / 1, 8 KV heads / 4.
        DeploymentPreset(
            "llama3-70b-4xh100",
            "Llama-3-70B (bf16), TP 4 on 80 GB H100s: one GPU's share",
            num_layers=80,
            num_kv_heads=2,
            head_dim=128,
            dtype_bytes=2,
            gpu_memory_bytes=80 * GiB,
            gpu_memory_utilization=0.9,
            weights_bytes=36 * GiB,
        ),
    )
}
DEFAULT_VIRTUAL_DEPLOYMENT = "llama3-8b-h100"
