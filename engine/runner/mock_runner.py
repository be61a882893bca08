"""A torch-free deterministic model runner for tests and big replays. Runs in: engine-core process.

The next token is (last token + 1) % vocab_size: outputs are a pure function of the prompt,
whatever the batching, chunking, preemption or KV transfer. With a KV cache it stamps and checks
it (engine/runner/kv_stamps.py); a request whose KV arrived corrupt samples last token + 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.runner.kv_cache import KVCache


class MockModelRunner:
    def __init__(
        self, config: EngineConfig, kv_cache: KVCache | None = None, check_vocab: bool = True
    ) -> None:
        """check_vocab False: the caller vouches that every token is in the vocabulary
        (each prompt checked before it reached the scheduler), so a step skips the pass
        over its tokens that fails a request holding one outside it."""
        self.vocab_size = config.model.vocab_size
        self.check_vocab = check_vocab
        self.stamps = None
        if kv_cache is not None and kv_cache.pages is not None:
            from engine.runner.kv_stamps import KVStamps  # numpy: only where there is KV memory

            self.stamps = KVStamps(kv_cache, config.block_size)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        tokens, vocab_size = sched_out.token_ids, self.vocab_size
        all_valid = not (tokens and self.check_vocab) or (
            min(tokens) >= 0 and max(tokens) < vocab_size
        )
        sampled, partial = out.sampled_token_ids, sched_out.partial_req_ids
        end = 0
        for req_id, num_new in zip(sched_out.req_ids, sched_out.num_scheduled_tokens):
            start, end = end, end + num_new
            bad = (
                None
                if all_valid
                else next((t for t in tokens[start:end] if not 0 <= t < vocab_size), None)
            )
            if bad is not None:
                out.failed[req_id] = f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            elif req_id not in partial:
                sampled[req_id] = (tokens[end - 1] + 1) % vocab_size
        if self.stamps is not None and all_valid:
            self.stamps.update(sched_out)
            for req_id in self.stamps.corrupt & sampled.keys():
                sampled[req_id] = (sampled[req_id] + 1) % vocab_size
        return out

    def decode_token_ids(self, request: Request, num_steps: int) -> list[int]:
        """The tokens execute() samples for `request` in its next num_steps decode steps
        (engine/core/decode_run.py); a runner with KV stamps may sample others."""
        if self.stamps is not None:
            raise RuntimeError("decode_token_ids: a runner with KV stamps samples from its KV")
        last, vocab_size = request.all_token_ids[-1], self.vocab_size
        return [(last + i) % vocab_size for i in range(1, num_steps + 1)]
