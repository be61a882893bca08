"""Trace parsing's, shaping's and prompt synthesis's fast paths against the straightforward ones."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from engine.utils import cdiv
from replay.trace import formats, synth
from replay.trace.formats import FieldError, checked_mooncake, parse_json, parse_mooncake
from replay.trace.reader import TraceRequest
from replay.trace.records import MAX_JSON_DEPTH, scaled_lengths
from replay.trace.shaping import ShapingOptions, scale_request, shape
from replay.trace.synth import synth_prompt
from tests.replay.sim.test_sim_fast_paths import reference_prompt


def reference_scale(req: TraceRequest, factor: float) -> TraceRequest:
    """scale_request as first written: dataclasses.replace of the fields that change."""
    length, max_tokens, block = scaled_lengths(req, factor)
    if req.hash_ids is not None:
        return dataclasses.replace(
            req, max_tokens=max_tokens, prompt_len=length, hash_block_size=block
        )
    token_ids = req.prompt_token_ids
    if token_ids is not None:
        token_ids = (token_ids * cdiv(length, len(token_ids)))[:length]
    return dataclasses.replace(
        req, max_tokens=max_tokens, prompt_len=length, prompt_token_ids=token_ids
    )


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
    opts = ShapingOptions(
        speedup=2.0, max_gap=10.0, scale_tokens=0.05, insert_idle=3.0, insert_idle_every=17
    )
    unscaled = list(shape(iter(records), dataclasses.replace(opts, scale_tokens=1.0)))
    shaped = list(shape(iter(records), opts))
    assert shaped == [
        dataclasses.replace(reference_scale(r, 0.05), t=u.t) for r, u in zip(records, unscaled)
    ]
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


def _outcome(parse, *args) -> object:
    """What parse(*args) returns, or the message of the FieldError it raises."""
    try:
        return parse(*args)
    except FieldError as e:
        return f"FieldError: {e}"


def random_mooncake_value(rng: random.Random, good: object) -> object:
    """`good` most of the time, else a value near or past a bound, or of another type."""
    if rng.random() < 0.8:
        return good
    return rng.choice(
        [
            0,
            -1,
            1,
            512,
            513,
            2**20,
            2**20 + 1,
            1e10,
            1e10 + 1,
            10**10 + 1,
            0.5,
            -0.0,
            float("nan"),
            float("inf"),
            True,
            None,
            "7",
            [],
            [1.0],
            [1, True],
            [1, "2"],
        ]
    )


@pytest.mark.parametrize("seed", range(4))
def test_a_mooncake_lines_fast_parse_equals_the_field_by_field_one(seed):
    rng = random.Random(seed)
    for line in range(1, 2000):
        num_in = rng.choice([1, 511, 512, 513, rng.randint(1, 20000)])
        obj = {
            "timestamp": rng.choice([0, rng.randint(0, 10**7), rng.uniform(0, 1e9)]),
            "input_length": num_in,
            "output_length": rng.randint(1, 4000),
            "hash_ids": [rng.randrange(10**6) for _ in range(-(-num_in // 512))],
        }
        for key in rng.sample(sorted(obj), rng.choice([0, 0, 1, 2])):
            if rng.random() < 0.2:
                del obj[key]
            else:
                obj[key] = random_mooncake_value(rng, obj[key])
        assert repr(_outcome(parse_mooncake, obj, line)) == repr(
            _outcome(checked_mooncake, obj, line)
        )


@pytest.mark.parametrize(
    "text",
    [
        '{"timestamp": 1, "hash_ids": [1, 2]}',
        '{"a": {"b": [1, 2.5, "x", null, true]}}',
        "[1, 2]",
        "7",
        '"s"',
        "{} ",
        " {}",
        '{"a": 1} x',
        "{",
        '{"a": }',
        '{"a": 1,}',
        "\ufeff{}",
        '{"a": NaN}',
        '{"a": 1e999}',
        '{"\\ud800": 1}',
        "[" * 70 + "]" * 70,
        "[" * 5000 + "]" * 5000,
        '{"a": ' + "9" * 5000 + "}",
        '{"a": 1}{"b": 2}',
    ],
)
def test_a_json_lines_scan_equals_json_loads(text):
    assert repr(_outcome(parse_json, text)) == repr(_outcome(reference_parse_json, text))


def reference_parse_json(text: str) -> dict[str, object]:
    """parse_json as first written: json.loads, then the depth and type checks."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError("json", f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise FieldError("json", f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise FieldError("json", f"invalid JSON: {str(e)[:80]}") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and formats._depth(obj) > MAX_JSON_DEPTH:
        raise FieldError("json", f"nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(obj, dict):
        raise FieldError("json", f"must be a JSON object, got {formats.show(obj)}")
    return obj
