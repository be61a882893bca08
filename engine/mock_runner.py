"""A torch-free deterministic model runner for fast tests and big replays. Runs in: engine-core process.

The next token is (last token + 1) % vocab_size, so outputs are a pure function of
the prompt, whatever the batching, chunking, preemption or KV transfer.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput


class MockModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.vocab_size = config.model.vocab_size

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        tokens, vocab_size = sched_out.token_ids, self.vocab_size
        all_valid = not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size)
        sampled, partial = out.sampled_token_ids, sched_out.partial_req_ids
        end = 0
        for req_id, num_new in zip(sched_out.req_ids, sched_out.num_scheduled_tokens):
            start, end = end, end + num_new
            bad = None if all_valid else next(
                (t for t in tokens[start:end] if not 0 <= t < vocab_size), None)
            if bad is not None:
                out.failed[req_id] = f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            elif req_id not in partial:
                sampled[req_id] = (tokens[end - 1] + 1) % vocab_size
        return out
