"""Tests of the torch model, paged attention, shareable KV cache and model runner."""

from __future__ import annotations

import functools
import glob
import itertools
import multiprocessing as mp
import os
import random
from collections.abc import Callable, Iterator

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import MODEL_PRESETS, EngineConfig, ModelConfig, get_model_config
from engine.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runner.attention import PagedAttentionBuilder
from engine.runner.kv_cache import KVCache, KVCacheHandle, resolve_device
from engine.runner.model import LlamaForCausalLM
from engine.runner.model_runner import ModelRunner
from engine.utils import cdiv

# KVDRAIN_TEST_DEVICE=cuda runs the same tests on a GPU (bench/gpu_check.sh).
DEVICE = os.environ.get("KVDRAIN_TEST_DEVICE", "cpu")
BLOCK_SIZE = 4


def make_config(dtype: str = "float64", num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        runner="torch",
        device=DEVICE,
        model=ModelConfig(dtype=dtype),
    )


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    """Every KV cache this process allocated is unlinked by the end of the test."""
    yield
    assert glob.glob(f"/dev/shm/kvdrain-kv-{os.getpid()}-*") == []


@pytest.fixture
def make_runner() -> Iterator[Callable[..., ModelRunner]]:
    """ModelRunner factory; closes every runner (and so its KV cache) after the test."""
    runners: list[ModelRunner] = []

    def make(dtype: str = "float32", num_blocks: int = 64) -> ModelRunner:
        runners.append(ModelRunner(make_config(dtype, num_blocks)))
        return runners[-1]

    yield make
    for runner in runners:
        runner.close()


def random_tokens(seed: int, n: int, vocab_size: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


class ToyScheduler:
    """Plays the scheduler: chunked prefill then decode, blocks from a trivial free list."""

    def __init__(self, free_block_ids: list[int]) -> None:
        self.free_block_ids = list(free_block_ids)  # never reused: cached prefixes stay put
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.scheduled_once: set[str] = set()

    def add(
        self,
        req_id: str,
        tokens: list[int],
        block_ids: list[int] | None = None,
        num_computed: int | None = None,
    ) -> None:
        """`block_ids` already hold the KV of the first `num_computed` tokens (a prefix hit)."""
        self.tokens[req_id] = list(tokens)
        self.block_ids[req_id] = list(block_ids or [])
        self.num_computed[req_id] = (
            len(self.block_ids[req_id]) * BLOCK_SIZE if num_computed is None else num_computed
        )
        self.outputs[req_id] = []

    def finish(self, req_id: str) -> None:
        del self.tokens[req_id]
        self.finished.add(req_id)

    def schedule(self, chunk_size: int) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished)
        self.finished = set()
        for req_id, tokens in self.tokens.items():
            start = self.num_computed[req_id]
            end = min(start + chunk_size, len(tokens))
            table = self.block_ids[req_id]
            is_new = req_id not in self.scheduled_once
            self.scheduled_once.add(req_id)
            new = [self.free_block_ids.pop(0) for _ in range(cdiv(end, BLOCK_SIZE) - len(table))]
            table.extend(new)
            out.add(
                ScheduledRequest(
                    req_id=req_id,
                    token_ids=tokens[start:end],
                    num_computed_tokens=start,
                    new_block_ids=list(table) if is_new else new,
                    is_new=is_new,
                    sample=end == len(tokens),
                )
            )
        out.total_num_scheduled_tokens = sum(len(s.token_ids) for s in out.scheduled)
        return out

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        assert not runner_out.failed, runner_out.failed
        for s in sched_out.scheduled:
            self.num_computed[s.req_id] += len(s.token_ids)
            if s.req_id in runner_out.sampled_token_ids:
                self.tokens[s.req_id].append(runner_out.sampled_token_ids[s.req_id])
                self.outputs[s.req_id].append(runner_out.sampled_token_ids[s.req_id])

    def run(
        self, runner: ModelRunner, req_ids: list[str], num_outputs: int, chunk_size: int = 1 << 20
    ) -> None:
        """Step until each of req_ids has num_outputs tokens."""
        while min(len(self.outputs[r]) for r in req_ids) < num_outputs:
            sched_out = self.schedule(chunk_size)
            self.update(sched_out, runner.execute(sched_out))


def generate(
    runner: ModelRunner, prompts: dict[str, list[int]], max_tokens: int, chunk_size: int = 1 << 20
) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, all requests batched in every step."""
    sched = ToyScheduler(list(range(1, runner.config.num_blocks)))
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt)
    sched.run(runner, list(prompts), max_tokens, chunk_size)
    return {r: sched.outputs[r][:max_tokens] for r in prompts}


def dense_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the no-cache reference path, recomputing the whole sequence."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids = torch.tensor(tokens, device=model.embed_tokens.weight.device)
            hidden = model.dense_forward(ids)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt) :]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- model --------------------------------------------------------------------------


def test_presets_and_unknown_preset() -> None:
    assert get_model_config("tiny") == ModelConfig()
    assert set(MODEL_PRESETS) >= {"tiny", "small", "medium"}
    with pytest.raises(ValueError, match="huge"):
        get_model_config("huge")


def test_weights_come_from_the_seed_and_greedy_tokens_vary() -> None:
    a, b = LlamaForCausalLM(ModelConfig()), LlamaForCausalLM(ModelConfig())
    c = LlamaForCausalLM(ModelConfig(seed=1))
    assert torch.equal(a.layers[0].mlp.down_proj.weight, b.layers[0].mlp.down_proj.weight)
    assert not torch.equal(a.layers[0].mlp.down_proj.weight, c.layers[0].mlp.down_proj.weight)
    untied = LlamaForCausalLM(ModelConfig(tie_word_embeddings=False))
    assert untied.compute_logits(untied.dense_forward(torch.tensor([1, 2]))).shape == (2, 512)
    assert len(set(dense_greedy(a, random_tokens(0, 8), 16))) >= 4


@functools.cache
def fp64_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64"), DEVICE, torch.float64)


def paged_hidden(
    model: LlamaForCausalLM, prompts: list[list[int]], chunks: list[int], seed: int
) -> list[torch.Tensor]:
    """Each prompt's hidden states computed through the paged cache, many requests a step.

    At step s prompt i computes its next chunks[(s + i) % len(chunks)] tokens, so prefill
    chunks and single tokens mix; rows come in shuffled order, blocks are scattered.
    """
    rng = random.Random(seed)
    cache = KVCache.allocate(model.config, 64, BLOCK_SIZE, DEVICE, torch.float64)
    builder = PagedAttentionBuilder(cache.tensor)
    free = rng.sample(range(1, 64), 63)
    tables = [[free.pop() for _ in range(cdiv(len(p), BLOCK_SIZE))] for p in prompts]
    num_done, hidden = [0] * len(prompts), [[] for _ in prompts]
    try:
        for step in itertools.count():
            rows = [i for i, p in enumerate(prompts) if num_done[i] < len(p)]
            if not rows:
                return [torch.cat(parts) for parts in hidden]
            rng.shuffle(rows)
            new = [
                prompts[i][num_done[i] : num_done[i] + chunks[(step + i) % len(chunks)]]
                for i in rows
            ]
            md = builder.build(
                [num_done[i] for i in rows], [len(n) for n in new], [tables[i] for i in rows]
            )
            ids = torch.tensor([t for n in new for t in n], device=DEVICE)
            with torch.inference_mode():
                out = model(ids, md.positions, md, cache.tensor)
            for row, i in enumerate(rows):
                hidden[i].append(out[md.query_start_loc[row] : md.query_start_loc[row + 1]])
                num_done[i] += len(new[row])
    finally:
        cache.close()


def check_paged_matches_dense(prompts: list[list[int]], chunks: list[int], seed: int) -> None:
    model = fp64_model()
    for prompt, paged in zip(prompts, paged_hidden(model, prompts, chunks, seed)):
        with torch.inference_mode():
            dense = model.dense_forward(torch.tensor(prompt, device=DEVICE))
        assert rel_err(paged, dense) < 1e-5


@pytest.mark.parametrize("chunks", [[1], [3], [8], [64], [5, 1, 2]])
def test_paged_forward_matches_dense(chunks: list[int]) -> None:
    check_paged_matches_dense(
        [random_tokens(i, n) for i, n in enumerate([1, 9, 17, 30])], chunks, seed=0
    )


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    seed=st.integers(0, 99),
)
def test_paged_forward_matches_dense_for_any_chunking(
    lens: list[int], chunks: list[int], seed: int
) -> None:
    check_paged_matches_dense(
        [random_tokens(seed + i, n) for i, n in enumerate(lens)], chunks, seed
    )


def test_runner_greedy_tokens_match_dense_over_many_decode_steps(make_runner) -> None:
    runner = make_runner("float64")
    prompts = {f"r{i}": random_tokens(i, n) for i, n in enumerate([5, 13, 22])}
    got = generate(runner, prompts, max_tokens=24, chunk_size=7)
    for req_id, prompt in prompts.items():
        assert got[req_id] == dense_greedy(runner.model, prompt, 24)


def test_batch_invariance_fp32(make_runner) -> None:
    prompts = {f"r{i}": random_tokens(10 + i, n) for i, n in enumerate([3, 11, 26, 40])}
    batched = generate(make_runner(), prompts, max_tokens=12, chunk_size=9)
    for req_id, prompt in prompts.items():
        assert generate(make_runner(), {req_id: prompt}, max_tokens=12) == {req_id: batched[req_id]}


def test_prefix_blocks_already_in_cache_give_the_same_tokens(make_runner) -> None:
    runner, scratch = make_runner(), make_runner()
    shared = random_tokens(20, 3 * BLOCK_SIZE)
    sched = ToyScheduler(list(range(1, 64)))
    sched.add("a", shared + random_tokens(21, 5))
    sched.run(runner, ["a"], 3)
    sched.finish("a")
    prompt_b = shared + random_tokens(22, 6)
    sched.add("b", prompt_b, block_ids=sched.block_ids["a"][:3])  # 12 tokens already cached
    sched.run(runner, ["b"], 8)
    assert sched.outputs["b"] == generate(scratch, {"b": prompt_b}, max_tokens=8)["b"]
    assert "a" not in runner.block_tables  # its finish reached the runner


@pytest.mark.parametrize("how", ["copy_blocks_from", "bytes"])
def test_moved_blocks_continue_decoding_identically(how: str, make_runner) -> None:
    src, dst = make_runner(), make_runner(num_blocks=40)
    src_sched = ToyScheduler(list(range(1, 64)))
    src_sched.add("a", random_tokens(30, 13))
    src_sched.run(src, ["a"], 2)
    src_ids = src_sched.block_ids["a"]
    dst_ids = list(range(39, 39 - len(src_ids), -1))  # different ids, descending
    if how == "bytes":
        dst.kv_cache.write_blocks(dst_ids, src.kv_cache.read_blocks(src_ids))
    else:
        dst.kv_cache.copy_blocks_from(src.kv_cache, src_ids, dst_ids)
    dst_sched = ToyScheduler([b for b in range(1, 40) if b not in dst_ids])
    # The last sampled token is not computed yet: both runners go on from there.
    dst_sched.add("a", src_sched.tokens["a"], dst_ids, src_sched.num_computed["a"])
    src_sched.run(src, ["a"], 12)
    dst_sched.run(dst, ["a"], 10)
    assert dst_sched.outputs["a"] == src_sched.outputs["a"][2:]


# --- runner: bad input, state ---------------------------------------------------------


@pytest.mark.parametrize(
    "bad, reason",
    [
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[1, 512],
                num_computed_tokens=0,
                new_block_ids=[5],
                is_new=True,
                sample=True,
            ),
            "token id 512",
        ),
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[-1],
                num_computed_tokens=0,
                new_block_ids=[5],
                is_new=True,
                sample=True,
            ),
            "token id -1",
        ),
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[1, 2],
                num_computed_tokens=0,
                new_block_ids=[64],
                is_new=True,
                sample=True,
            ),
            "past the cache",
        ),
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[1, 2],
                num_computed_tokens=0,
                new_block_ids=[0],
                is_new=True,
                sample=True,
            ),
            "null block",
        ),
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[1] * 9,
                num_computed_tokens=0,
                new_block_ids=[5, 6],
                is_new=True,
                sample=True,
            ),
            "9 needed",
        ),
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[1],
                num_computed_tokens=3,
                new_block_ids=[5],
                is_new=False,
                sample=True,
            ),
            "no block table",
        ),
        (
            ScheduledRequest(
                req_id="bad",
                token_ids=[],
                num_computed_tokens=0,
                new_block_ids=[5],
                is_new=True,
                sample=True,
            ),
            "no tokens",
        ),
    ],
)
def test_bad_request_fails_alone(bad: ScheduledRequest, reason: str, make_runner) -> None:
    runner = make_runner()
    good = ScheduledRequest(
        req_id="good",
        token_ids=random_tokens(40, 6),
        num_computed_tokens=0,
        new_block_ids=[1, 2],
        is_new=True,
        sample=True,
    )
    out = runner.execute(SchedulerOutput([good, bad], 6 + len(bad.token_ids)))
    assert set(out.failed) == {"bad"} and reason in out.failed["bad"]
    assert set(out.sampled_token_ids) == {"good"}
    assert out.sampled_token_ids["good"] == generate(runner, {"x": good.token_ids}, 1)["x"][0]


def test_zero_token_step_dropped_state_and_resume_after_preemption(make_runner) -> None:
    runner = make_runner()
    step = SchedulerOutput(
        [
            ScheduledRequest(
                req_id="a",
                token_ids=[1, 2, 3],
                num_computed_tokens=0,
                new_block_ids=[1],
                is_new=True,
                sample=False,
            ),
            ScheduledRequest(
                req_id="b",
                token_ids=[4, 5],
                num_computed_tokens=0,
                new_block_ids=[2],
                is_new=True,
                sample=True,
            ),
        ],
        5,
    )
    out = runner.execute(step)
    assert set(out.sampled_token_ids) == {"b"} and not out.failed  # "a" is mid-prefill
    assert runner.execute(SchedulerOutput()) == ModelRunnerOutput()
    runner.execute(SchedulerOutput(finished_req_ids={"a"}, preempted_req_ids={"b"}))
    assert runner.block_tables == {}
    # Recompute after preemption: the table starts over on other blocks, same token.
    resume = ScheduledRequest(
        req_id="b",
        token_ids=[4, 5],
        num_computed_tokens=0,
        new_block_ids=[7],
        is_new=True,
        sample=True,
    )
    resumed = runner.execute(SchedulerOutput([resume], 2))
    assert resumed.sampled_token_ids == out.sampled_token_ids


# --- KV cache: handles, bytes, other processes --------------------------------------


def test_handle_round_trips_through_msgpack_and_rejects_garbage() -> None:
    cache = KVCache.allocate(ModelConfig(), 8, BLOCK_SIZE, "cpu")
    try:
        wire = msgpack.unpackb(msgpack.packb(cache.handle.to_dict()), raw=False)
        assert KVCacheHandle.from_dict(wire) == cache.handle
        for broken in (
            {**wire, "shape": [1, 2]},
            {**wire, "dtype": "int8"},
            {**wire, "owner_pid": "7"},
            {k: v for k, v in wire.items() if k != "name"},
        ):
            with pytest.raises(ValueError):
                KVCacheHandle.from_dict(broken)
        with pytest.raises(ValueError, match="not a kvdrain"):  # never map arbitrary files
            KVCache.open(KVCacheHandle.from_dict({**wire, "name": "/etc/passwd"}))
    finally:
        cache.close()


def test_block_bytes_round_trip_and_validation() -> None:
    cache = KVCache.allocate(ModelConfig(), 8, BLOCK_SIZE, DEVICE, torch.float32)
    try:
        cache.tensor[:, :, 3] = 1.5
        data = cache.read_blocks([3, 4])
        assert len(data) == 2 * cache.num_bytes_per_block
        cache.write_blocks([6, 5], data)
        assert torch.equal(cache.tensor[:, :, 6], cache.tensor[:, :, 3])
        assert torch.equal(cache.tensor[:, :, 5], cache.tensor[:, :, 4])
        with pytest.raises(ValueError, match="null block"):
            cache.read_blocks([0])
        with pytest.raises(ValueError, match="outside"):
            cache.write_blocks([8], data[: cache.num_bytes_per_block])
        with pytest.raises(ValueError, match="bytes"):
            cache.write_blocks([1], data)
        with pytest.raises(ValueError, match="duplicate"):
            cache.write_blocks([1, 1], data)
    finally:
        cache.close()


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="tpu"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")


def run_peer(handle: dict, block_ids: list[int], results: mp.Queue) -> None:
    """Child: map the parent's KV cache by handle, send back blocks, write 7.0 into the last."""
    cache = KVCache.open(KVCacheHandle.from_dict(handle))
    results.put(cache.read_blocks(block_ids[:-1]))
    sevens = torch.full([cache.num_bytes_per_block // 4], 7.0)  # float32 cache
    cache.write_blocks(block_ids[-1:], sevens.numpy().tobytes())
    cache.close()
    results.put("done")


def run_crashing_owner(results: mp.Queue) -> None:
    """Child: allocate a KV cache, report its path, then die of an exception."""
    cache = KVCache.allocate(ModelConfig(), 4, BLOCK_SIZE, "cpu")
    results.put(cache.handle.name)
    raise RuntimeError("owner crashed on purpose")


def run_child(target: Callable[..., None], num_results: int, *args: object) -> list[object]:
    """Run a spawned child to its end: the num_results it puts on its queue, then its exitcode."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, results))
    child.start()
    try:
        got = [
            results.get(timeout=180) for _ in range(num_results)
        ]  # a torch import at load 25 takes a while
        child.join(timeout=30)
        return [*got, child.exitcode]
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=5)


def check_peer_reads_and_writes(device: str) -> None:
    cache = KVCache.allocate(ModelConfig(), 8, BLOCK_SIZE, device, torch.float32)
    try:
        cache.tensor[:, :, 2] = torch.arange(
            cache.tensor[:, :, 2].numel(), dtype=torch.float32, device=device
        ).view_as(cache.tensor[:, :, 2])
        if device == "cuda":
            torch.cuda.synchronize()  # the write above must land before the peer reads
        handle = msgpack.unpackb(msgpack.packb(cache.handle.to_dict()), raw=False)
        got = run_child(run_peer, 2, handle, [2, 5])
        assert got[0] == cache.read_blocks([2]) and got[1:] == ["done", 0]
        assert bool((cache.tensor[:, :, 5] == 7.0).all())
        if cache.handle.kind == "shm":
            assert os.path.exists(cache.handle.name)  # the peer never unlinks
    finally:
        cache.close()
        cache.close()  # idempotent
    assert cache.handle.kind == "cuda" or not os.path.exists(cache.handle.name)


def test_spawned_peer_maps_shm_kv_cache() -> None:
    check_peer_reads_and_writes("cpu")


@pytest.mark.gpu
def test_spawned_peer_maps_cuda_kv_cache() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_peer_reads_and_writes("cuda")


def test_crashing_owner_still_unlinks() -> None:
    path, exitcode = run_child(run_crashing_owner, 1)
    assert exitcode == 1 and not os.path.exists(path)
