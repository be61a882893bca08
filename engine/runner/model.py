"""Tiny Llama-style decoder over packed tokens. Runs in: engine-core process."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.runner.attention import AttentionMetadata, CausalAttentionMetadata

EMBED_STD = 0.1  # small next to the layers' outputs, so a token does not just predict itself


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in at least fp32, return in x's dtype."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim/2] of each position's rotation angles (computed in fp64)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** (-exponents / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (Llama/NeoX style): x [T, heads, head_dim], cos/sin [T, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_layer: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), *rotary)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), *rotary)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attn_metadata.attend(q, k, v, kv_layer)
        return self.o_proj(out.reshape(num_tokens, q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate) * up)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_layer: torch.Tensor | None,
    ) -> torch.Tensor:
        """Pre-norm residual block."""
        x = x + self.self_attn(self.input_layernorm(x), rotary, attn_metadata, kv_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def _materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give every meta parameter uninitialised memory on `device` (to_empty's job, but
    without its Python decomposition of empty_like, whose first call imports sympy and
    torch.fx: a second of start-up on a small CPU)."""
    for submodule in module.modules():
        for name, param in list(submodule.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(submodule, name, nn.Parameter(empty, requires_grad=False))


class LlamaForCausalLM(nn.Module):
    """The decoder: packed tokens in, final hidden states out; logits on demand."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            # _weight: no reset_parameters. normal_ on a meta tensor would import
            # torch._dynamo (a slow import); _init_weights draws every weight anyway.
            self.embed_tokens = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        _materialize(self, device, dtype)  # not to_empty(): see _materialize
        self._init_weights(config.seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Draw every weight from one CPU generator in a fixed order (same for every dtype)."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = EMBED_STD if name.startswith("embed") else 1.0 / math.sqrt(param.shape[1])
            param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, H]; kv_cache [L, 2, ...] or None."""
        x = self.embed_tokens(input_ids)
        rotary = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary, attn_metadata, None if kv_cache is None else kv_cache[i])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def dense_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference path: one whole sequence [T], full causal attention, no cache -> [T, H]."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.forward(input_ids, positions, CausalAttentionMetadata(), None)
