"""What an engine takes: the request limits every front checks before anything is sent. Runs in: frontend process and engine-core process (pure).

vLLM's input processor rejects a request before it reaches an engine core (an empty
prompt, a token outside the vocabulary, a prompt that does not fit max_model_len,
max_tokens < 1). kvdrain checks the same limits once at each front (the P/D router,
so serve and the HTTP server too; the trace reader for a replay), so a request that
could only fail never reaches P, where it would hold KV blocks for a D that rejects
it. The engine core checks them again for anyone who talks to it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

_INT_ONLY = {int}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """An engine's limits (from its Ready message or its config)."""

    max_model_len: int
    vocab_size: int


def why_invalid(prompt_token_ids: object, max_tokens: object, limits: RequestLimits) -> str | None:
    """Why no engine with `limits` can take this request; None: it can."""
    why = why_malformed(prompt_token_ids, max_tokens, limits.vocab_size)
    if why is not None:
        return why
    num_tokens = len(prompt_token_ids)  # a sequence of ints now
    if num_tokens >= limits.max_model_len:
        return (
            f"prompt_token_ids: a prompt of {num_tokens} tokens does not fit "
            f"max_model_len {limits.max_model_len} (it must be shorter)"
        )
    return None


def why_malformed(prompt_token_ids: object, max_tokens: object, vocab_size: int) -> str | None:
    """Why this is no request at all (the engine core's own check: a prompt over
    max_model_len is a request, which its scheduler finishes as ignored)."""
    if type(max_tokens) is not int or max_tokens < 1:
        return f"max_tokens: must be an integer >= 1, got {max_tokens!r}"
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        return "prompt_token_ids: must be a non-empty list of token ids"
    if set(map(type, prompt_token_ids)) != _INT_ONLY:  # every type(t) is int; in C
        return "prompt_token_ids: every token id must be an integer"
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None
