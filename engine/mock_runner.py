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
        for sched_req in sched_out.scheduled:
            bad = next((t for t in sched_req.token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                out.failed[sched_req.req_id] = f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            elif sched_req.sample:
                out.sampled_token_ids[sched_req.req_id] = (sched_req.token_ids[-1] + 1) % self.vocab_size
        return out
