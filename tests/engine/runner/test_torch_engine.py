"""The real torch runner end to end: in one engine core, and across P and D processes."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.proc.client import InprocClient
from tests.mp_utils import topology

SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
PROMPTS = {f"r{i}": SHARED + [(37 * i + j) % 500 for j in range(5 + 2 * i)] for i in range(8)}


def run_inproc(config: EngineConfig, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    client = InprocClient(config)
    try:
        for req_id, prompt in prompts.items():
            client.add_request(req_id, prompt, max_tokens)
        tokens = {r: [] for r in prompts}
        for _ in range(10_000):
            if not client.core.has_work():
                break
            for output in client.get_outputs():
                tokens[output.req_id] += output.new_token_ids
        stats = client.core.make_stats()
        client.core.scheduler.block_pool.check_invariants()
        return {"tokens": tokens, "stats": stats}
    finally:
        client.shutdown()


def test_torch_engine_core_end_to_end_frees_every_block():
    config = EngineConfig(
        runner="torch",
        device="cpu",
        num_blocks=14,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    together = run_inproc(config, PROMPTS, 6)
    stats = together["stats"]
    assert stats.num_used_blocks == 0 and stats.num_running == 0
    assert stats.num_prefix_hit_tokens > 0  # the shared prefix was reused
    assert stats.num_preemptions > 0  # 13 blocks are too few for everyone at once
    alone = {r: run_inproc(config, {r: p}, 6)["tokens"][r] for r, p in list(PROMPTS.items())[:3]}
    for req_id, tokens in alone.items():
        assert together["tokens"][req_id] == tokens
    assert len({tuple(t) for t in together["tokens"].values()}) > 1  # not a constant model


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_pd_transfer_is_bit_exact_with_the_torch_runner(transport):
    single = run_inproc(
        EngineConfig(runner="torch", device="cpu", num_blocks=128, block_size=4), PROMPTS, 8
    )["tokens"]
    with topology(runner="torch", device="cpu", transport=transport) as h:
        for req_id, prompt in PROMPTS.items():
            h.add_request(req_id, prompt, 8)
        result = h.collect(set(PROMPTS), timeout_s=60)
        assert h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 5)
        assert h.stats("D").counts["num_recved"] == 8
    assert result["tokens"] == single
