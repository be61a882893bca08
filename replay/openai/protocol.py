"""The OpenAI completions protocol as kvdrain's HTTP front speaks it: request checks and response bodies. Runs in: frontend process.

Shapes follow vLLM 0.32 (vllm/entrypoints/openai/completion/protocol.py, serving.py,
serve/engine/protocol.py): errors are {"error": {"message", "type", "param", "code"}};
a stream is `data: <chunk>` events and `data: [DONE]`, the last chunk before it carrying
only usage when `stream_options.include_usage` is true. Every check runs here, once, with
the engines' limits, before anything reaches an engine:
- `prompt`: a list of token ids, each below the vocabulary, or a string (see
  tokenizer.py); not empty; at most max_model_len - 1 tokens (vLLM answers 400 "This
  model's maximum context length is ..."). `max_tokens` >= 1 (default 16, vLLM's), cut
  to what max_model_len leaves, as vLLM does.
- an explicit null is the default where vLLM's CompletionRequest field is Optional with
  one (`max_tokens`, `stream`, `stream_options`, `stream_options.include_usage`,
  `return_token_ids`, `model`, `kv_transfer_params`, `echo`, `logprobs`, ...).
- the response id is "cmpl-" + the request id: X-Request-Id, else the body's
  `request_id`, else a random uuid4 hex (vLLM's _base_request_id and random_uuid).
- an ignored request (the engine's FINISHED_IGNORED: finish_reason "length", no token)
  carries the engine's cause in its choice's `kvdrain_ignored_reason` (kvdrain's own
  field, absent otherwise; vLLM gives no cause).
- `model`, when given, must be the served name (404 like vLLM).
- types are checked strictly (400, `param` names the field); fields vLLM knows but
  kvdrain's greedy engines cannot honour (n > 1, echo, logprobs, best_of, stop strings,
  beam search) are refused (422); fields that are neither OpenAI's nor vLLM's are refused
  (422: vLLM ignores them, but a verifier should not guess what `max_token` meant).
  Sampling knobs (temperature, top_p, top_k, min_p, the penalties, logit_bias) are
  honoured at greedy decoding's values (temperature 0, top_p 1, ...) and refused (422,
  naming the knob) at any other; a seed, which changes nothing greedy, is accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from replay.openai.tokenizer import WordTokenizer

DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    408: "RequestTimeout",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# Accepted: cannot change what a greedy engine answers (a seed only matters when sampling).
_IGNORED = frozenset(
    (
        "seed",
        "user",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "priority",
        "suffix",
        "include_stop_str_in_output",
        "add_special_tokens",
    )
)
# Sampling knobs: honoured at the values greedy decoding has (kvdrain's engines are
# greedy), refused (422, naming the knob) at any other: one policy, nothing ignored.
_GREEDY = {
    "temperature": (0,),
    "top_p": (1,),
    "top_k": (0, -1),
    "min_p": (0,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
}
# vLLM's fields that would change the answer in ways kvdrain does not model -> the values
# that change nothing (vLLM's defaults).
_UNSUPPORTED = {
    "n": (1,),
    "best_of": (None, 1),
    "echo": (False, None),
    "logprobs": (None,),
    "stop": (None, []),
    "use_beam_search": (False,),
    "min_tokens": (0,),
    "prompt_logprobs": (None,),
    "stop_token_ids": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
}
_KNOWN = (
    frozenset(
        (
            "model",
            "prompt",
            "max_tokens",
            "stream",
            "stream_options",
            "ignore_eos",
            "kv_transfer_params",
            "request_id",
            "return_token_ids",
            "logit_bias",
        )
    )
    | _IGNORED
    | set(_UNSUPPORTED)
    | set(_GREEDY)
)


class ApiError(Exception):
    """A request the front refuses: an HTTP status and vLLM's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "Error"),
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the front serves and the limits every request is checked against."""

    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    engines: tuple[str, ...]
    topology: str = "single"
    liveness: str = ""

    def card(self) -> dict:
        """One /v1/models entry (vLLM's ModelCard, plus kvdrain's own facts)."""
        return {
            "id": self.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvdrain",
            "root": self.name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
            "kvdrain": {
                "vocab_size": self.vocab_size,
                "block_size": self.block_size,
                "engines": list(self.engines),
                "topology": self.topology,
                "liveness": self.liveness,
            },
        }


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """A checked completion request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool  # vLLM's extension: token ids beside the text
    kv_transfer_params: dict | None


def _expect(
    body: dict, name: str, types: tuple[type, ...], default: object, nullable: bool = True
) -> object:
    """body[name] checked against types; absent (or null when nullable): default."""
    value = body.get(name, default)
    if value is None and (nullable or default is None):
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types)
        raise ApiError(400, f"{name}: expected {names}, got {type(value).__name__}", name)
    return value


def parse_completion(body: object, model: ServedModel) -> CompletionParams:
    """Check a decoded JSON body; raises ApiError saying what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected a JSON object, got {type(body).__name__}")
    _check_fields(body)
    name = _expect(body, "model", (str,), None)
    if name is not None and name != model.name:
        raise ApiError(
            404, f"The model `{name}` does not exist. Valid aliases: {model.name}.", "model"
        )
    prompt = _prompt_ids(body, model)
    max_tokens = _expect(body, "max_tokens", (int,), DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    stream = _expect(body, "stream", (bool,), False)
    include_usage = _include_usage(body, stream)
    _expect(body, "ignore_eos", (bool,), False, nullable=False)  # no EOS in kvdrain's engines
    return_token_ids = _expect(body, "return_token_ids", (bool,), False)
    params = _expect(body, "kv_transfer_params", (dict,), None)
    request_id = _expect(body, "request_id", (str,), None) or uuid.uuid4().hex
    return CompletionParams(
        request_id,
        prompt,
        min(max_tokens, model.max_model_len - len(prompt)),
        stream,
        include_usage,
        return_token_ids,
        params,
    )


MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str) -> str:
    """A client's request id (X-Request-Id or the body's): valid Unicode, not too long."""
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "request id: not valid UTF-8", "request_id") from None
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ApiError(
            400, f"request id: longer than {MAX_REQUEST_ID_CHARS} characters", "request_id"
        )
    return request_id


def _include_usage(body: dict, stream: bool) -> bool:
    options = _expect(body, "stream_options", (dict,), None)
    if not options:  # vLLM: `if data.get("stream_options") and not data.get("stream")`
        return False
    if not stream:
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = options.get("include_usage")
    if include_usage is None:  # Optional[bool] = False
        return False
    if not isinstance(include_usage, bool):
        raise ApiError(400, "stream_options.include_usage: expected bool", "stream_options")
    return include_usage


def _check_fields(body: dict) -> None:
    for key in body:
        if key not in _KNOWN:
            raise ApiError(422, f"unknown field {key!r}", key)
    for key, ok in _UNSUPPORTED.items():
        value = body.get(key, ok[0])
        if not any(value == v and type(value) is type(v) for v in ok):
            raise ApiError(
                422,
                f"{key}={value!r} is not supported by kvdrain's engines "
                f"(greedy, one sequence, no stop strings)",
                key,
            )
    for key, ok in _GREEDY.items():
        value = body.get(key)
        if value is not None and not (type(value) in (int, float) and value in ok):
            raise ApiError(
                422,
                f"{key}={value!r} would sample; kvdrain's engines decode "
                f"greedily: send {key}={ok[0]} or leave it out",
                key,
            )
    if body.get("logit_bias") not in (None, {}):
        raise ApiError(
            422, "logit_bias is not supported by kvdrain's engines (greedy)", "logit_bias"
        )


def _prompt_ids(body: dict, model: ServedModel) -> list[int]:
    """The prompt's token ids; its length is checked before anything costs per token."""
    if "prompt" not in body:
        raise ApiError(400, "prompt: field required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        ids = _text_ids(prompt, model)
        _check_length(len(ids), model, at_least=len(ids) >= model.max_model_len)
    elif isinstance(prompt, list):
        _check_length(len(prompt), model)
        if not all(type(t) is int for t in prompt):
            raise ApiError(400, "prompt: expected a string or a list of token ids", "prompt")
        ids = prompt
    else:
        raise ApiError(400, "prompt: expected a string or a list of token ids", "prompt")
    if not ids:
        raise ApiError(400, "The prompt cannot be empty.", "prompt")
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400, f"Token id {bad} is out of vocabulary (vocab_size {model.vocab_size}).", "prompt"
        )
    return ids


def _text_ids(prompt: str, model: ServedModel) -> list[int]:
    """A text prompt's ids, tokenised no further than max_model_len tokens."""
    if model.vocab_size < 256:
        raise ApiError(
            422, "text prompts need a vocabulary of 256 tokens or more; send token ids", "prompt"
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"prompt: not valid Unicode (a lone surrogate at character {e.start})", "prompt"
        ) from None
    return WordTokenizer(model.vocab_size).encode(prompt, limit=model.max_model_len - 1)


def _check_length(num_tokens: int, model: ServedModel, at_least: bool = False) -> None:
    if num_tokens < model.max_model_len:
        return
    raise ApiError(
        400,
        f"This model's maximum context length is {model.max_model_len} "
        f"tokens. However, your prompt contains {'at least ' if at_least else ''}"
        f"{num_tokens} input tokens, which leaves no room for an output token. "
        f"Please reduce the length of the input prompt.",
        "input_tokens",
    )


def loads_strict(raw: bytes | str) -> object:
    """JSON that repeats no key in an object (which value was meant cannot be known); a
    ValueError otherwise, and for JSON nested deeper than Python's recursion limit."""
    if isinstance(raw, (bytes, bytearray)):  # as json.loads reads bytes
        raw = raw.decode(_encoding(raw), "surrogatepass")
    if raw.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
    try:
        return _STRICT.decode(raw)  # one decoder: json.loads with a hook builds one per call
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _encoding(raw: bytes | bytearray) -> str:
    """json.detect_encoding's answer; an object whose second byte is not NUL is UTF-8 to it
    (no BOM starts with "{"), said here without its Python-level checks (a streamed chunk
    is one object, and the client decodes thousands a second beside its sends)."""
    if raw[:1] == b"{" and raw[1:2] != b"\x00":
        return "utf-8"
    return json.detect_encoding(raw)


def decode_body(raw: bytes) -> object:
    """A request body's JSON (loads_strict); ApiError 400 if it is not UTF-8 JSON."""
    try:
        return loads_strict(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", getattr(e, "key", None)) from None


class DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKeyError(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


_STRICT = json.JSONDecoder(object_pairs_hook=_unique_keys)


# ---- responses --------------------------------------------------------------------


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "completion_tokens": num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def head(response_id: str, model: str, created: int) -> dict:
    """The fields every completion body and chunk starts with."""
    return {"id": response_id, "object": "text_completion", "created": created, "model": model}


def choice(
    text: str,
    token_ids: list[int] | None,
    finish_reason: str | None,
    ignored_reason: str | None = None,
) -> dict:
    """choices[0] (vLLM's exclude_unset dump: logprobs and stop_reason are null here);
    ignored_reason: the engine's cause of an ignored request (kvdrain's own field)."""
    out = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": token_ids,
    }
    if ignored_reason is not None:
        out["kvdrain_ignored_reason"] = ignored_reason
    return out


def stream_chunk(first: dict, delta: dict) -> dict:
    """One streamed delta (vLLM's CompletionStreamResponse); first: head(...)."""
    return {**first, "choices": [delta]}


def usage_chunk(first: dict, usage_info: dict) -> dict:
    """The last chunk before [DONE] with stream_options.include_usage."""
    return {**first, "choices": [], "usage": usage_info}


def completion(
    first: dict, answer: dict, usage_info: dict, kv_transfer_params: dict | None
) -> dict:
    """A whole (non-streamed) answer; kv_transfer_params as vLLM returns them."""
    return {
        **first,
        "choices": [answer],
        "usage": usage_info,
        "kv_transfer_params": kv_transfer_params,
    }


def openai_finish_reason(reason: str | None) -> str | None:
    """kvdrain's "ignored" is vLLM's FINISHED_IGNORED, reported as "length"."""
    return "length" if reason == "ignored" else reason


def ignored_reason(
    finish_reason: str | None, num_output_tokens: int, error: str | None
) -> str | None:
    """The engine's cause when it ignored a request ("length" or "ignored", no token, a cause)."""
    if finish_reason in ("length", "ignored") and num_output_tokens == 0 and error:
        return error
    return None


async def send_event(response, payload: dict) -> None:
    """One server-sent event on an aiohttp StreamResponse, framed as vLLM frames it."""
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
