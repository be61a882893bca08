"""Model step benchmark: paged runner vs dense contiguous cache. Runs in: a bench process.

Usage: python bench/model_step.py [--device auto|cpu|cuda] [--preset tiny|small|medium]
Decode-step time at a fixed context for several batch sizes, and prefill tokens/s, of the paged
ModelRunner (its own input preparation and sampling included) and of the same model over a
contiguous KV cache with torch's SDPA; ratio = paged / dense throughput, medians of interleaved
calls. On a shared CPU, --threads 1 keeps torch's pool from stalling when a core is taken.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig, get_model_config  # noqa: E402
from engine.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from engine.runner.kv_cache import resolve_device  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.utils import cdiv  # noqa: E402

BLOCK_SIZE = 16
WARMUP = 3  # untimed steps before each measurement


@dataclass(slots=True)
class ContiguousAttentionMetadata:
    """Dense reference: B requests of one length; kv_layer [2, B, Hkv, ctx, D] contiguous."""

    batch_size: int
    seq_len: int  # context length after this step

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor | None
    ) -> torch.Tensor:
        """Append this step's K/V at their positions, attend over the first seq_len."""
        num_tokens, num_heads, head_dim = q.shape
        batch, query_len, num_kv_heads = self.batch_size, num_tokens // self.batch_size, k.shape[1]
        start = self.seq_len - query_len
        new_kv = (batch, query_len, num_kv_heads, head_dim)
        kv_layer[0, :, :, start : self.seq_len] = k.view(new_kv).transpose(1, 2)
        kv_layer[1, :, :, start : self.seq_len] = v.view(new_kv).transpose(1, 2)
        keys, values = kv_layer[0, :, :, : self.seq_len], kv_layer[1, :, :, : self.seq_len]
        if query_len == 1:  # decode: a KV head's query group plays the query rows
            q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values)
            return out.reshape(num_tokens, num_heads, head_dim)
        q = q.view(batch, query_len, num_heads, head_dim).transpose(1, 2)
        group = num_heads // num_kv_heads  # repeat K/V heads: enable_gqa is slow on the CPU
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=start == 0)
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)


def timed_pair(
    paged: Callable[[int], None],
    dense: Callable[[int], None],
    num_warmup: int,
    num_iters: int,
    device: str,
) -> tuple[float, float]:
    """Median seconds per call of each, calls interleaved so both see the same machine load."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(num_warmup + num_iters):
        for fn, samples in zip((paged, dense), times):
            start = time.perf_counter()
            fn(i)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
    return statistics.median(times[0][num_warmup:]), statistics.median(times[1][num_warmup:])


def paged_decode(
    runner: ModelRunner, batch: int, context: int, steps: int
) -> Callable[[int], None]:
    """Requests at `context` tokens, blocks scattered over the cache; one token per call."""
    blocks_per_req = cdiv(context + steps, BLOCK_SIZE)
    free = random.Random(0).sample(range(1, runner.config.num_blocks), batch * blocks_per_req)
    tables = [free[i * blocks_per_req : (i + 1) * blocks_per_req] for i in range(batch)]
    runner.kv_cache.tensor.normal_()
    step_id = f"b{batch}-"
    tokens = [random.Random(i).randrange(runner.config.model.vocab_size) for i in range(batch)]

    def step(i: int) -> None:
        reqs = [
            ScheduledRequest(
                req_id=f"{step_id}{r}",
                token_ids=[tokens[r]],
                num_computed_tokens=context + i,
                new_block_ids=tables[r] if i == 0 else [],
                is_new=i == 0,
                sample=True,
            )
            for r in range(batch)
        ]
        sampled = runner.execute(SchedulerOutput(reqs, batch)).sampled_token_ids
        tokens[:] = [sampled[f"{step_id}{r}"] for r in range(batch)]

    return step


def dense_decode(
    runner: ModelRunner, batch: int, context: int, steps: int
) -> Callable[[int], None]:
    """The same model and batch over a contiguous cache [L, 2, B, Hkv, ctx, D]."""
    cfg = runner.config.model
    cache = torch.randn(
        cfg.num_layers,
        2,
        batch,
        cfg.num_kv_heads,
        context + steps,
        cfg.head_dim,
        device=runner.device,
    ).to(runner.dtype)
    input_ids = torch.zeros(batch, dtype=torch.long, device=runner.device)

    @torch.inference_mode()
    def step(i: int) -> None:
        positions = torch.full((batch,), context + i, device=runner.device)
        md = ContiguousAttentionMetadata(batch, context + i + 1)
        hidden = runner.model(input_ids, positions, md, cache)
        input_ids.copy_(runner.model.compute_logits(hidden).argmax(-1))

    return step


def paged_prefill(runner: ModelRunner, batch: int, prompt_len: int) -> Callable[[int], None]:
    """`batch` fresh prompts in one step; each call finishes the previous call's requests."""
    blocks_per_req = cdiv(prompt_len, BLOCK_SIZE)
    vocab = runner.config.model.vocab_size
    prompts = [[random.Random(r).randrange(vocab) for _ in range(prompt_len)] for r in range(batch)]

    def step(i: int) -> None:
        reqs = [
            ScheduledRequest(
                req_id=f"p{i}-{r}",
                token_ids=prompts[r],
                num_computed_tokens=0,
                new_block_ids=list(range(1 + r * blocks_per_req, 1 + (r + 1) * blocks_per_req)),
                is_new=True,
                sample=True,
            )
            for r in range(batch)
        ]
        done = {f"p{i - 1}-{r}" for r in range(batch)}
        runner.execute(SchedulerOutput(reqs, batch * prompt_len, finished_req_ids=done))

    return step


def dense_prefill(runner: ModelRunner, batch: int, prompt_len: int) -> Callable[[int], None]:
    cfg = runner.config.model
    cache = torch.zeros(
        cfg.num_layers,
        2,
        batch,
        cfg.num_kv_heads,
        prompt_len,
        cfg.head_dim,
        device=runner.device,
        dtype=runner.dtype,
    )
    input_ids = torch.randint(0, cfg.vocab_size, (batch * prompt_len,), device=runner.device)
    positions = torch.arange(prompt_len, device=runner.device).repeat(batch)
    last = torch.arange(1, batch + 1, device=runner.device) * prompt_len - 1

    @torch.inference_mode()
    def step(i: int) -> None:
        md = ContiguousAttentionMetadata(batch, prompt_len)
        hidden = runner.model(input_ids, positions, md, cache)
        runner.model.compute_logits(hidden[last]).argmax(-1).tolist()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--preset", default=None, help="default: small on CPU, medium on CUDA")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = build_runner(args)
    print(
        f"model_step: preset={args.preset} device={runner.device} dtype={runner.dtype} "
        f"threads={torch.get_num_threads()} block_size={BLOCK_SIZE} context={args.context}"
    )
    print(
        f"{'phase':<18}{'paged ms':>10}{'dense ms':>10}{'paged tok/s':>13}{'dense tok/s':>13}"
        f"{'paged/dense':>13}"
    )
    try:
        run_all(runner, args)
    finally:
        runner.close()


def build_runner(args: argparse.Namespace) -> ModelRunner:
    """A runner with blocks for the largest decode batch (fills in args.preset if unset)."""
    device = resolve_device(args.device)
    args.preset = args.preset or ("medium" if device.startswith("cuda") else "small")
    max_len = args.context + WARMUP + args.steps
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    num_blocks = 1 + max(
        max(batch_sizes) * cdiv(max_len, BLOCK_SIZE),
        args.prefill_batch * cdiv(args.context, BLOCK_SIZE),
    )
    return ModelRunner(
        EngineConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            runner="torch",
            device=device,
            model=get_model_config(args.preset),
            max_model_len=max_len + 1,
        )
    )


def run_all(runner: ModelRunner, args: argparse.Namespace) -> None:
    num_steps = WARMUP + args.steps
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        paged, dense = timed_pair(
            paged_decode(runner, batch, args.context, num_steps),
            dense_decode(runner, batch, args.context, num_steps),
            WARMUP,
            args.steps,
            runner.device,
        )
        report(f"decode B={batch}", paged, dense, batch)
    paged, dense = timed_pair(
        paged_prefill(runner, args.prefill_batch, args.context),
        dense_prefill(runner, args.prefill_batch, args.context),
        1,
        5,
        runner.device,
    )
    report(
        f"prefill {args.prefill_batch}x{args.context}",
        paged,
        dense,
        args.prefill_batch * args.context,
    )


def report(phase: str, paged_s: float, dense_s: float, num_tokens: int) -> None:
    print(
        f"{phase:<18}{paged_s * 1e3:>10.2f}{dense_s * 1e3:>10.2f}{num_tokens / paged_s:>13.0f}"
        f"{num_tokens / dense_s:>13.0f}{dense_s / paged_s:>13.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
