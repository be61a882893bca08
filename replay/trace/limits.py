"""The engines' limits a trace's requests are checked against. Runs in: frontend process.

The validating pass (replay/trace/reader.py) calls check_request on every request, after
token scaling and before any token is synthesised, so a request no engine could take is
a `file:line: field: what` error before anything starts, never a surprise mid-replay.
A prompt as long as max_model_len or longer is the deployment's limit, not a bad line:
it is sent, the engine rejects it as vLLM's front does (the scheduler's "ignored", counted
by cause: replay/verify/coverage.py), and coverage decides as for any ignored request.
The format's own caps (MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS) stay errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.trace.faults import FaultSupport
from replay.trace.formats import FieldError
from replay.trace.records import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, TraceRequest, scaled_lengths

# The field that holds a request's prompt length, and its output length, in each format.
_PROMPT_FIELD = {"kvdrain": "prompt_len", "mooncake": "input_length", "azure": "ContextTokens"}
_OUTPUT_FIELD = {"kvdrain": "max_tokens", "mooncake": "output_length", "azure": "GeneratedTokens"}


@dataclass(frozen=True, slots=True)
class TraceLimits:
    """What the engines accept; None where unknown (--target: not before connecting)."""

    max_model_len: int | None = None  # a prompt must be shorter; prompt + output is capped
    vocab_size: int | None = None  # every prompt token id must be below
    scale_tokens: float = 1.0  # the shaping's token scale, applied before the checks
    faults: FaultSupport | None = None  # what the target carries out; None: not checked


def check_request(req: TraceRequest, fmt: str, limits: TraceLimits) -> bool:
    """A FieldError if the engines cannot take `req`; True if they will cap its output.

    Its prompt must be shorter than max_model_len and its max_tokens below it, every
    prompt token id in the vocabulary; prompt + max_tokens over max_model_len is capped
    by the engine (it stops there), which the caller counts.
    """
    prompt, output, _ = scaled_lengths(req, limits.scale_tokens)
    max_len = limits.max_model_len if limits.max_model_len is not None else MAX_PROMPT_TOKENS + 1
    vocab = limits.vocab_size
    if (
        prompt > MAX_PROMPT_TOKENS
        or output > MAX_OUTPUT_TOKENS
        or (output >= max_len and prompt < max_len)
        or (
            vocab is not None
            and req.prompt_token_ids is not None
            and max(req.prompt_token_ids) >= vocab
        )
    ):
        _explain(req, fmt, limits, prompt, output)
    return limits.max_model_len is not None and prompt < max_len and prompt + output > max_len


def _explain(req: TraceRequest, fmt: str, limits: TraceLimits, prompt: int, output: int) -> None:
    """Raise the FieldError of the first limit that (scaled) `req` breaks."""
    names = ("prompt_token_ids" if req.prompt_token_ids else _PROMPT_FIELD[fmt], _OUTPUT_FIELD[fmt])
    scaled = "" if limits.scale_tokens == 1.0 else f" (scaled by {limits.scale_tokens:g})"
    for name, n, cap in (
        (names[0], prompt, MAX_PROMPT_TOKENS),
        (names[1], output, MAX_OUTPUT_TOKENS),
    ):
        if n > cap:  # scaling up can pass the caps that the line itself was within
            raise FieldError(name, f"{n:,} tokens{scaled}, more than the reader's cap of {cap:,}")
    max_len = limits.max_model_len
    if max_len is not None and output >= max_len:
        raise FieldError(
            names[1],
            f"{output:,} tokens{scaled} can never be generated: "
            f"max_model_len {max_len:,} holds prompt and output",
        )
    raise FieldError(
        "prompt_token_ids",
        f"token {max(req.prompt_token_ids)} is outside the vocabulary [0, {limits.vocab_size})",
    )
