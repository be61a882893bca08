"""The two requests a completion becomes behind the proxy: P's and D's. Runs in: proxy process.

vLLM's disaggregated-serving protocol, as its NixlConnector expects it: P gets the request
cut to one token, not streamed, with `kv_transfer_params` asking it to hold the prompt's
KV for a remote decode; D gets the client's request with the `kv_transfer_params` P
answered. A body of more than OFF_LOOP_BYTES is parsed and written in a worker thread,
so the event loop keeps answering (/health, streams) while it is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TypeVar

from replay.openai.protocol import ApiError

# What P is asked to do: hold the prompt's KV for a decode elsewhere (vLLM's toy proxy's dict).
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
NOT_FOR_PREFILL = (
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
)  # P refuses or ignores them
OFF_LOOP_BYTES = 1 << 20

T = TypeVar("T")


def prefill_request(body: dict) -> dict:
    """What P gets: the request cut to one token, not streamed, holding its KV for a remote
    decode (a new top-level dict: the client's values are shared, never changed)."""
    request = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    request["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_request(body: dict, kv_transfer_params: dict | None) -> dict:
    """What D gets: the client's request with the kv_transfer_params P answered (if any)."""
    request = dict(body)
    if kv_transfer_params:
        request["kv_transfer_params"] = kv_transfer_params
    return request


def parse_body(raw: bytes) -> dict:
    """The client's JSON object; ApiError 400 for anything else (deep JSON included)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def encode(request: dict) -> bytes:
    """A request's JSON; ApiError 400 if it nests too deeply to write."""
    try:
        return json.dumps(request).encode()
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None


async def off_loop(size: int, work: Callable[..., T], *args) -> T:
    """work(*args), in a worker thread when `size` bytes are worth one."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)


def prepare(raw: bytes) -> tuple[dict, bytes]:
    """The client's body and P's request as bytes."""
    body = parse_body(raw)
    return body, encode(prefill_request(body))


def kv_transfer_params(answer: dict) -> dict | None:
    """The kv_transfer_params P answered: an object or none (anything else is no answer)."""
    params = answer.get("kv_transfer_params")
    if params is None or isinstance(params, dict):
        return params
    raise ValueError(f"kv_transfer_params is a JSON {type(params).__name__}, not an object")
