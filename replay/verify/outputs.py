"""The output check: what a single engine generates for a prompt, to hold each replayed request's output against. Runs in: frontend process.

A P/D run must produce what one engine would (DESIGN: the transfer is bit-exact), so a
request whose output differs got corrupt KV on the way, whatever the block counts say:
replay/verify/rules.py calls it a violation. With the mock runner the single engine's
output is a formula (engine/runner/mock_runner.py; it checks stamped KV, so corrupt KV changes
its tokens): cheap enough to check every request, on by default. Stop conditions are
engine/core/stop.py's: EOS first, then max_tokens and max_model_len.
"""

from __future__ import annotations

from engine.config import EngineConfig


def mock_output_tokens(prompt: list[int], max_tokens: int, engine: EngineConfig) -> list[int]:
    """The tokens one engine running the mock runner generates for `prompt`."""
    vocab, eos = engine.model.vocab_size, engine.eos_token_id
    room = engine.max_model_len - len(prompt)
    tokens: list[int] = []
    last = prompt[-1]
    while len(tokens) < max_tokens and len(tokens) < room:
        last = (last + 1) % vocab
        tokens.append(last)
        if last == eos:
            break
    return tokens


def can_check_outputs(engine: EngineConfig) -> str | None:
    """Why the output check cannot run for these engines; None: it can."""
    if engine.runner != "mock":
        return "--check-outputs needs the mock runner (no single-engine oracle for torch yet)"
    return None
