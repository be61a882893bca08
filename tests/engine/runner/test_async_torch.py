"""The real torch runner under async scheduling: placeholders reach it as the tokens it sampled."""

from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.runner.model_runner import ModelRunner


def run(async_scheduling: bool) -> tuple[dict[str, list[int]], int]:
    config = EngineConfig(
        num_blocks=20,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=128,
        runner="torch",
        device="cpu",
        async_scheduling=async_scheduling,
    )
    runner = ModelRunner(config)
    core = EngineCore(runner.config, runner)
    rng = random.Random(0)
    for i in range(6):
        core.add_request(
            f"r{i}", [rng.randrange(500) for _ in range(rng.randint(3, 30))], rng.randint(2, 12)
        )
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not core.has_work():
            break
        for output in core.step().outputs:
            tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
    return tokens, core.scheduler.num_preemptions


def test_the_torch_runner_samples_the_same_tokens_with_async_scheduling_through_preemptions():
    sync, asynchronous = run(False), run(True)
    assert asynchronous == sync
    assert sync[1] > 0  # the small pool preempts
