"""vLLM's /tokenize as kvdrain's HTTP front answers it. Runs in: frontend process.

vLLM's TokenizeCompletionRequest -> TokenizeResponse (vllm/entrypoints/openai/protocol.py):
{"model", "prompt", "add_special_tokens", "return_token_strs"} -> {"count",
"max_model_len", "tokens", "token_strs"} (token_strs null unless asked). The prompt is
text, tokenized by kvdrain's word tokenizer (replay/openai/tokenizer.py); kvdrain's
models have no special tokens, so add_special_tokens changes nothing. Chat messages are
not served (kvdrain has no chat template).
"""

from __future__ import annotations

from replay.openai.protocol import ApiError, ServedModel
from replay.openai.tokenizer import WordTokenizer

_KNOWN = frozenset(("model", "prompt", "add_special_tokens", "return_token_strs"))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: expected bool, got {type(value).__name__}", name)
    return value


def tokenize_answer(body: object, model: ServedModel) -> dict:
    """The TokenizeResponse for a decoded JSON body; ApiError saying what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(body.keys() - _KNOWN)
    if unknown:
        raise ApiError(422, f"unknown field {unknown[0]!r}", unknown[0])
    name = body.get("model")
    if name is not None and name != model.name:
        raise ApiError(
            404, f"The model `{name}` does not exist. Valid aliases: {model.name}.", "model"
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt: expected a string", "prompt")
    _flag(body, "add_special_tokens", True)
    if model.vocab_size < 256:
        raise ApiError(422, "text prompts need a vocabulary of 256 tokens or more", "prompt")
    tokens = WordTokenizer(model.vocab_size).encode(prompt)
    strs = (
        [WordTokenizer.decode([t]) for t in tokens]
        if _flag(body, "return_token_strs", False)
        else None
    )
    return {
        "count": len(tokens),
        "max_model_len": model.max_model_len,
        "tokens": tokens,
        "token_strs": strs,
    }
