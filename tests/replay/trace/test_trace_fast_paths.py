"""Trace shaping's and prompt synthesis's fast paths against the straightforward ones."""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine.utils import cdiv
from replay.trace import synth
from replay.trace.reader import TraceRequest
from replay.trace.records import scaled_lengths
from replay.trace.shaping import ShapingOptions, scale_request, shape
from replay.trace.synth import synth_prompt
from tests.replay.sim.test_sim_fast_paths import reference_prompt


def reference_scale(req: TraceRequest, factor: float) -> TraceRequest:
    """scale_request as first written: dataclasses.replace of the fields that change."""
    length, max_tokens, block = scaled_lengths(req, factor)
    if req.hash_ids is not None:
        return dataclasses.replace(req, max_tokens=max_tokens, prompt_len=length,
                                   hash_block_size=block)
    token_ids = req.prompt_token_ids
    if token_ids is not None:
        token_ids = (token_ids * cdiv(length, len(token_ids)))[:length]
    return dataclasses.replace(req, max_tokens=max_tokens, prompt_len=length,
                               prompt_token_ids=token_ids)


def random_request(rng: random.Random, i: int) -> TraceRequest:
    kind, t, pd = rng.randrange(3), rng.uniform(0, 100), rng.choice([None, True, False])
    max_tokens, line = rng.randint(1, 3000), rng.randint(1, 10**6)
    if kind == 0:  # hash ids, a partial last block
        block, n = rng.choice([1, 16, 512, 600]), rng.randint(1, 8)
        length = (n - 1) * block + rng.randint(1, block)
        hash_ids = tuple(rng.randrange(10**6) for _ in range(n))
        return TraceRequest(t, f"h{i}", max_tokens, length, None, hash_ids, block, pd, line)
    if kind == 1:  # token ids
        ids = tuple(rng.randrange(32000) for _ in range(rng.randint(1, 300)))
        return TraceRequest(t, f"t{i}", max_tokens, len(ids), ids, None, 16, pd, line)
    return TraceRequest(t, f"p{i}", max_tokens, rng.randint(1, 20000), pd=pd, line=line)


@pytest.mark.parametrize("seed", range(4))
def test_scale_request_equals_the_replace_based_reference(seed):
    rng = random.Random(seed)
    for i in range(300):
        req, factor = random_request(rng, i), rng.choice([1.0, 0.03125, 0.05, 0.5, 1.7, 3.0])
        expected = reference_scale(req, factor)
        assert scale_request(req, factor) == expected
        t = rng.uniform(0, 50)
        assert scale_request(req, factor, t) == dataclasses.replace(expected, t=t)


def test_shape_yields_what_scaling_then_moving_would():
    rng = random.Random(7)
    records, t = [], 0.0
    for i in range(200):
        t += rng.choice([0.0, 0.1, 5.0, 80.0])
        records.append(dataclasses.replace(random_request(rng, i), t=t))
    opts = ShapingOptions(speedup=2.0, max_gap=10.0, scale_tokens=0.05, insert_idle=3.0,
                          insert_idle_every=17)
    unscaled = list(shape(iter(records), dataclasses.replace(opts, scale_tokens=1.0)))
    shaped = list(shape(iter(records), opts))
    assert shaped == [dataclasses.replace(reference_scale(r, 0.05), t=u.t)
                      for r, u in zip(records, unscaled)]
    assert all(type(r.t) is type(u.t) for r, u in zip(shaped, unscaled))


@pytest.mark.parametrize("seed", range(3))
def test_a_replays_own_memo_gives_the_reference_tokens_whatever_its_budget(seed, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(synth, "MEMO_BYTES", rng.choice([0, 200, 5000, 1 << 20]))
    memo = synth.BlockMemo()
    for i in range(150):
        req = random_request(rng, i)
        if req.hash_ids is not None and rng.random() < 0.5:  # share ids between requests
            n = len(req.hash_ids)
            req = dataclasses.replace(req, hash_ids=tuple(rng.randrange(20) for _ in range(n)))
        if req.prompt_token_ids is not None:
            continue  # used as given, no memo
        vocab = rng.choice([1, 7, 32000, 2**32 - 1])
        assert synth_prompt(req, vocab, memo) == reference_prompt(req, vocab)
        assert memo.nbytes <= synth.MEMO_BYTES

