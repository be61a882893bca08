"""The virtual replay's fast paths against the straightforward ones: same tokens, same timelines."""

from __future__ import annotations

import hashlib
import json
import random
import struct
from dataclasses import replace

import pytest

from engine.core.block_hash import hash_request_blocks
from engine.core.request import Request
from replay.sim import simulation
from replay.sim.options import SimOptions
from replay.sim.simulation import Simulation
from replay.trace import synth
from replay.trace.reader import TraceAbort, TraceRequest, read_trace
from replay.trace.synth import synth_prompt


def reference_stream(key: bytes, num_tokens: int, vocab_size: int) -> list[int]:
    """The synthesis as first written: one struct-unpacked word per token, mod vocab."""
    words = struct.unpack(f"<{num_tokens}I", hashlib.shake_128(key).digest(4 * num_tokens))
    return [w % vocab_size for w in words]


def reference_prompt(req: TraceRequest, vocab_size: int) -> list[int]:
    if req.hash_ids is None:
        return reference_stream(
            b"kvdrain/request/" + req.req_id.encode(), req.prompt_len, vocab_size
        )
    block, tokens = req.hash_block_size, []
    for hash_id in req.hash_ids:
        tokens += reference_stream(b"kvdrain/hash/%d" % hash_id, block, vocab_size)
    return tokens[: req.prompt_len]


@pytest.mark.parametrize("seed", range(5))
def test_synth_equals_the_token_by_token_stream(seed):
    rng = random.Random(seed)
    synth._SHARED_MEMO.__init__()  # start empty: the first call of each id draws it
    for i in range(60):
        vocab = rng.choice([1, 7, 512, 4096, 32000, 2**32 - 1])
        block = rng.choice([1, 3, 16, 512, 600])  # 600: past the memo's block limit
        n = rng.randint(1, 6)
        hash_ids = tuple(rng.choice([rng.randrange(50), rng.randrange(10**12)]) for _ in range(n))
        prompt_len = (n - 1) * block + rng.randint(1, block)
        req = TraceRequest(0.0, f"h{i}", 4, prompt_len, hash_ids=hash_ids, hash_block_size=block)
        assert synth_prompt(req, vocab) == reference_prompt(req, vocab)
        plain = TraceRequest(0.0, f"p{i}", 4, rng.randint(1, 2000))
        assert synth_prompt(plain, vocab) == reference_prompt(plain, vocab)
    tokens = synth_prompt(
        TraceRequest(0.0, "t", 4, 40, hash_ids=(1, 2, 3), hash_block_size=16), 100
    )
    assert all(type(t) is int for t in tokens)  # plain ints, as the engine and msgpack want


def timeline_json(records, options: SimOptions, share_hashes: bool) -> str:
    sim = Simulation(records, options)
    sim.frontend.share_hashes = share_hashes
    return json.dumps(sim.run().to_dict(), sort_keys=True)


def test_a_request_with_given_block_hashes_is_the_request_that_hashes_itself():
    prompt = list(range(7, 7 + 61))  # 15 full blocks of 4 and a partial one
    hashes = hash_request_blocks(prompt, 4, [])
    given = Request("r", list(prompt), 9, 4, block_hashes=list(hashes))
    own = Request("r", list(prompt), 9, 4)
    assert given.block_hashes == own.block_hashes == hashes and len(hashes) == 15
    for token in range(9):  # a block filled by sampled tokens gets the same hash
        given.append_output_token_ids(token)
        own.append_output_token_ids(token)
    assert given.block_hashes == own.block_hashes and len(own.block_hashes) == 17


@pytest.mark.parametrize(
    "liveness,topology,overrides",
    [
        ("event", "pd", {}),
        ("legacy", "pd", {"num_blocks": 14, "pull_delay_s": 0.0173}),  # pool pressure on P
        ("poll", "single", {"num_blocks": 14}),
        ("event", "pd", {"num_blocks": 14, "block_size": 8, "max_model_len": 512}),
    ],
)
def test_block_hashes_computed_once_give_the_same_timeline(tmp_path, liveness, topology, overrides):
    """The frontend hashes each prompt once for every engine; each engine hashing it
    itself (the straightforward path) gives the same timeline, byte for byte."""
    lines = [{"kvdrain_trace": 1, "name": "prefixes"}]
    for i in range(24):  # shared prefixes, so prefix hits depend on the hashes
        hash_ids = [1, 2, 3][: i % 4] + [100 + i, 200 + i]
        lines.append(
            {
                "t": round(0.05 * i + (3.0 if i >= 12 else 0.0), 6),
                "id": f"r{i}",
                "hash_ids": hash_ids,
                "prompt_len": 16 * len(hash_ids) - 5,
                "max_tokens": 3 + i % 5,
            }
        )
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = list(read_trace(path))
    engine = replace(
        SimOptions().engine,
        liveness=liveness,
        **{k: v for k, v in {"num_blocks": 64, **overrides}.items() if k != "pull_delay_s"},
    )
    options = SimOptions(
        engine=engine,
        topology=topology,
        tail_s=2.0,
        sample_interval_s=0.0371,
        pull_delay_s=overrides.get("pull_delay_s", 0.002),
    )
    shared = timeline_json(records, options, share_hashes=True)
    assert shared == timeline_json(records, options, share_hashes=False)
    assert '"num_prefix_hit_tokens"' in shared


def test_a_prompt_the_frontend_refuses_to_hash_takes_add_request_itself(monkeypatch):
    """No shared hashes for a prompt the frontend's check refuses: that engine core
    checks (and hashes) it itself, and the timeline is the one without sharing."""
    refused = []

    def refuse_b(prompt, max_tokens, vocab_size):
        refused.append(prompt[0])
        return "refused" if prompt[0] == 99 else None

    monkeypatch.setattr(simulation, "why_malformed", refuse_b)
    records = [
        TraceRequest(0.0, "a", 3, 20, hash_ids=(1, 2), hash_block_size=16),
        TraceRequest(0.01, "b", 3, 3, prompt_token_ids=(99, 5, 2)),
        TraceRequest(0.02, "c", 3, 20, hash_ids=(1, 3), hash_block_size=16),
    ]
    options = SimOptions(tail_s=1.0)
    shared = timeline_json(records, options, share_hashes=True)
    assert 99 in refused
    assert shared == timeline_json(records, options, share_hashes=False)
    assert {r["req_id"]: r["finish_reason"] for r in json.loads(shared)["requests"]} == {
        "a": "length",
        "b": "length",
        "c": "length",
    }


@pytest.mark.parametrize("seed", range(3))
def test_the_frontends_check_of_a_synthesised_prompt_equals_the_full_check(seed):
    """_Frontend._is_well_formed checks a synthesised prompt's first token only: the
    same answer as why_malformed over every token, for any max_tokens and vocabulary."""
    rng = random.Random(seed)
    sim = Simulation([], SimOptions(tail_s=1.0))
    frontend = sim.frontend
    for i in range(100):
        vocab = rng.choice([1, 2, 7, 512, 32000])
        frontend.vocab_size = vocab
        max_tokens = rng.choice([1, 5, 0, -1, True, 2.0])
        n = rng.randint(1, 4)
        if rng.random() < 0.5:
            req = TraceRequest(
                0.0,
                f"h{i}",
                max_tokens,
                (n - 1) * 16 + rng.randint(1, 16),
                hash_ids=tuple(rng.randrange(10**6) for _ in range(n)),
                hash_block_size=16,
            )
        else:
            req = TraceRequest(0.0, f"p{i}", max_tokens, rng.randint(1, 300))
        prompt = synth_prompt(req, vocab)
        full = simulation.why_malformed(prompt, max_tokens, vocab) is None
        assert frontend._is_well_formed(req, prompt) == full


def seeded_workload(seed: int, num_requests: int = 40) -> list:
    """Arrivals in bursts with shared prefixes, some forced single (pd False), aborts."""
    rng, records, t = random.Random(seed), [], 0.0
    for i in range(num_requests):
        t += rng.choice([0.0, 0.001, 0.01, 0.2])
        hash_ids = tuple(rng.sample([1, 2, 3], rng.randint(0, 2))) + (1000 * seed + i,)
        records.append(
            TraceRequest(
                round(t, 6),
                f"r{i}",
                rng.randint(1, 40),
                16 * len(hash_ids) - rng.randint(0, 15),
                hash_ids=hash_ids,
                hash_block_size=16,
                pd=rng.choice([None, None, False]),
            )
        )
        if i > 4 and rng.random() < 0.15:
            t += 0.003
            records.append(TraceAbort(round(t, 6), f"r{rng.randrange(i - 4, i)}"))
    return sorted(
        records, key=lambda r: r.t
    )  # sorted() is stable: an abort stays after its request


def timeline_with_fast_paths(records, options: SimOptions, fast_path: bool) -> str:
    sim = Simulation(records, options)
    for engine in sim.engines.values():
        engine.core.scheduler.fast_path = fast_path
    return json.dumps(sim.run().to_dict(), sort_keys=True)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "liveness,topology,overrides",
    [
        ("event", "pd", {}),
        ("event", "pd", {"num_blocks": 12}),  # pressure: preemption on both engines
        ("legacy", "pd", {"num_blocks": 16, "eos_token_id": 7}),  # stops
        ("poll", "single", {"num_blocks": 12, "eos_token_id": 30}),
        ("event", "1p2d", {"num_blocks": 20, "max_model_len": 64}),  # length caps
    ],
    ids=["pd", "pd_pressure", "legacy_stops", "single", "1p2d_caps"],
)
def test_column_outputs_give_the_timeline_of_per_request_records(
    seed, liveness, topology, overrides
):
    """The scheduler's sampled-token loop returns plain outputs as columns (StepOutputs)
    and the frontend reads them so; with the fast paths off every output is a record
    read one by one. Same timeline, byte for byte: tokens, latencies, verdict inputs,
    block counts, preemptions, aborts and stops."""
    engine = replace(SimOptions().engine, liveness=liveness, **{"num_blocks": 64, **overrides})
    if "eos_token_id" in overrides:  # a small vocabulary: the mock's tokens reach EOS often
        engine = replace(engine, model=replace(engine.model, vocab_size=64))
    options = SimOptions(engine=engine, topology=topology, tail_s=2.0, sample_interval_s=0.0171)
    records = seeded_workload(seed)
    fast = timeline_with_fast_paths(records, options, fast_path=True)
    assert fast == timeline_with_fast_paths(records, options, fast_path=False)
    timeline = json.loads(fast)
    reasons = {r["finish_reason"] for r in timeline["requests"]}
    assert "abort" in reasons and "length" in reasons
    if "eos_token_id" in overrides:
        assert "stop" in reasons
    if overrides == {"num_blocks": 12}:
        assert sum(c["num_preemptions"] for c in timeline["counters"].values()) > 0
