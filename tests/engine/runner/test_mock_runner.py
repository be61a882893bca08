"""The mock runner: deterministic tokens, a request with a token outside the vocabulary fails alone."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.outputs import ScheduledRequest, SchedulerOutput
from engine.core.request import Request
from engine.runner.mock_runner import MockModelRunner

CONFIG = EngineConfig(runner="mock")
VOCAB = CONFIG.model.vocab_size


def step(tokens: dict[str, list[int]]) -> SchedulerOutput:
    scheduled = [
        ScheduledRequest(
            req_id=req_id,
            token_ids=ids,
            num_computed_tokens=0,
            new_block_ids=[],
            is_new=True,
            sample=True,
        )
        for req_id, ids in tokens.items()
    ]
    return SchedulerOutput(scheduled, sum(map(len, tokens.values())))


def test_a_token_outside_the_vocabulary_fails_its_request_alone():
    out = MockModelRunner(CONFIG).execute(step({"good": [1, 2, 3], "bad": [4, VOCAB]}))
    assert out.sampled_token_ids == {"good": 4}
    assert f"token id {VOCAB} is outside the vocabulary" in out.failed["bad"]


def test_a_runner_told_its_tokens_are_checked_samples_the_same_tokens():
    tokens = {"a": [5, 6, VOCAB - 1], "b": [0], "c": list(range(40))}
    checked = MockModelRunner(CONFIG).execute(step(tokens))
    trusted = MockModelRunner(CONFIG, check_vocab=False).execute(step(tokens))
    assert trusted.sampled_token_ids == checked.sampled_token_ids == {"a": 0, "b": 1, "c": 40}
    assert not trusted.failed and not checked.failed


def test_decode_token_ids_are_the_tokens_execute_samples_next():
    runner, tokens = MockModelRunner(CONFIG), [VOCAB - 3]
    request = Request("r", list(tokens), 8, CONFIG.block_size)
    expected = []
    for _ in range(5):
        expected.append(runner.execute(step({"r": [tokens[-1]]})).sampled_token_ids["r"])
        tokens.append(expected[-1])
    assert runner.decode_token_ids(request, 5) == expected == [VOCAB - 2, VOCAB - 1, 0, 1, 2]
