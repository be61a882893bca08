"""`POST /v1/chat/completions` and batch prompts on kvdrain's HTTP front. Runs in: frontend process.

Chat: the messages become one text, each message a line `<role>: <content>` (content a
string, or a list of `{"type": "text", "text": ...}` parts, joined by spaces), and that
text goes through the same tokenizer as a completions text prompt (tokenizer.py: `w<N>`
words are token N, any other word its UTF-8 bytes). The request is then checked as a
completions request (protocol.py: types, limits, the sampling policy) with
`max_completion_tokens` taken as `max_tokens`; what only chat has and the greedy engines
cannot honour (tools, a response format, top_logprobs, logprobs true) is refused (422).
Answers have vLLM's chat shapes: `chat.completion` with choices[0].message and, as a
completion, `kv_transfer_params` (vLLM's P/D protocol: what a P answers for its D), or
`chat.completion.chunk` deltas (the first carrying the role), usage last, `[DONE]`; an
ignored request's choice says why in `kvdrain_ignored_reason`, as a completion's does.

Batch prompts (`prompt` a list of strings, or a list of token-id lists): each prompt is
its own request, answered in one body whose choices carry their prompt's index (vLLM's
batch completions); not streamed (422), as kvdrain's front streams one sequence.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from replay.openai import protocol
from replay.openai.protocol import ApiError
from replay.openai.tokenizer import WordTokenizer

CHAT_ONLY_REFUSED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None,),
    "function_call": (None,),
    "response_format": (None,),
    "top_logprobs": (None, 0),
    "logprobs": (None, False),
    "parallel_tool_calls": (None,),
    "audio": (None,),
    "modalities": (None,),
    "prediction": (None,),
}
CHAT_ONLY_IGNORED = frozenset(("store", "metadata", "service_tier", "chat_template_kwargs"))


def messages_text(messages: object) -> str:
    """The one text of a chat: a line `role: content` per message (ApiError if malformed)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of messages", "messages")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a string role", "messages")
        lines.append(f"{message['role']}: {_content_text(message.get('content'), i)}")
    return "\n".join(lines)


def _content_text(content: object, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    422,
                    f"messages[{i}].content: only text parts are supported, "
                    f"got type {part.get('type')!r}",
                    "messages",
                )
            parts.append(part["text"])
        return " ".join(parts)
    raise ApiError(
        400, f"messages[{i}].content: expected a string or a list of text parts", "messages"
    )


def completion_body(body: object) -> dict:
    """A chat body as the completions body it asks for (then checked by protocol.py)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected a JSON object, got {type(body).__name__}")
    for key, ok in CHAT_ONLY_REFUSED.items():
        if body.get(key, ok[0]) not in ok:
            raise ApiError(
                422,
                f"{key}={body[key]!r} is not supported by kvdrain's engines "
                f"(greedy, text only, one sequence)",
                key,
            )
    out = {
        k: v
        for k, v in body.items()
        if k not in CHAT_ONLY_REFUSED
        and k not in CHAT_ONLY_IGNORED
        and k not in ("messages", "max_completion_tokens")
    }
    out["prompt"] = messages_text(body.get("messages"))
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    return out


def routes(front) -> list[web.RouteDef]:
    """/v1/completions (a batch here, one prompt by front.completions) and /v1/chat/completions."""

    async def completions_route(request: web.Request) -> web.StreamResponse:
        return await completions(front, request)

    async def chat_route(request: web.Request) -> web.StreamResponse:
        return await chat_completions(front, request)

    return [
        web.post("/v1/completions", completions_route),
        web.post("/v1/chat/completions", chat_route),
    ]


# ---- answers ---------------------------------------------------------------------


def _chat_head(client_id: str, model: str, chunk: bool) -> dict:
    return {
        "id": "chatcmpl-" + client_id,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
    }


def chat_choice(text: str, finish_reason: str | None, ignored_reason: str | None = None) -> dict:
    """choices[0] of a chat answer; ignored_reason as a completion's choice carries it."""
    out = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    if ignored_reason is not None:
        out["kvdrain_ignored_reason"] = ignored_reason
    return out


def chat_delta(delta: dict, finish_reason: str | None, ignored_reason: str | None = None) -> dict:
    out = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if ignored_reason is not None:
        out["kvdrain_ignored_reason"] = ignored_reason
    return out


async def chat_completions(front, request: web.Request) -> web.StreamResponse:
    """The handler (front: server.py's HttpFront; its request life is reused as is)."""
    body = await front.read_body(request)
    params = protocol.parse_completion(completion_body(body), front.model)
    client_id = protocol.check_request_id(request.headers.get("X-Request-Id") or params.request_id)
    internal_id = front._submit(client_id, params)
    try:
        if params.stream:
            return await _stream(front, request, internal_id)
        return await _complete(front, internal_id)
    finally:
        front._release(internal_id)


async def _complete(front, internal_id: str) -> web.Response:
    open_request = front.open[internal_id]
    tokens, output = await front._generate(internal_id)
    answer = chat_choice(
        WordTokenizer.decode(tokens),
        protocol.openai_finish_reason(output.finish_reason),
        protocol.ignored_reason(output.finish_reason, len(tokens), output.error),
    )
    return web.json_response(
        {
            **_chat_head(open_request.client_id, front.model.name, False),
            "choices": [answer],
            "usage": front._usage(internal_id),
            "kv_transfer_params": output.kv_transfer_params,
        }
    )


async def _stream(front, http_request: web.Request, internal_id: str) -> web.StreamResponse:
    open_request = front.open[internal_id]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Server": front.server_header,
        }
    )  # before the middleware
    await response.prepare(http_request)
    head = _chat_head(open_request.client_id, front.model.name, True)
    role = chat_delta({"role": "assistant", "content": ""}, None)
    await protocol.send_event(response, {**head, "choices": [role]})
    first = True
    while True:
        output = await front._next(internal_id)
        if output.finish_reason == "error":
            failed = ApiError(500, f"request failed in the engine: {output.error}")
            await protocol.send_event(response, failed.body())
            break
        if output.new_token_ids or output.finished:
            text = WordTokenizer.decode(output.new_token_ids, first)
            first = first and not output.new_token_ids
            delta = {"content": text} if text else {}
            ignored = protocol.ignored_reason(
                output.finish_reason, open_request.num_output_tokens, output.error
            )
            await protocol.send_event(
                response,
                {
                    **head,
                    "choices": [
                        chat_delta(
                            delta, protocol.openai_finish_reason(output.finish_reason), ignored
                        )
                    ],
                },
            )
        if output.finished:
            if open_request.params.include_usage:
                usage = front._usage(internal_id)
                await protocol.send_event(response, {**head, "choices": [], "usage": usage})
            break
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# ---- batch prompts ---------------------------------------------------------------


def is_batch(body: object) -> bool:
    """`prompt` is a list of strings or of token-id lists (not one token-id list)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(p, (str, list)) for p in prompt)
    )


async def completions(front, request: web.Request) -> web.StreamResponse:
    """/v1/completions: a batch of prompts here, one prompt as server.py answers it."""
    body = await front.read_body(request)
    if not is_batch(body):
        return await front.completions(request)  # the body stays read: aiohttp keeps it
    if body.get("stream"):
        raise ApiError(
            422,
            "stream=true with a batch of prompts is not supported by kvdrain's "
            "front; send the prompts one per request",
            "stream",
        )
    client_id = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
    if not isinstance(client_id, str):
        raise ApiError(
            400, f"request_id: expected str, got {type(client_id).__name__}", "request_id"
        )
    protocol.check_request_id(client_id)
    params = [
        protocol.parse_completion(
            {**body, "prompt": p, "request_id": f"{client_id}-{i}"}, front.model
        )
        for i, p in enumerate(body["prompt"])
    ]
    ids: list[str] = []
    try:  # a prompt refused at submit (its id in flight) releases those submitted before it
        for p in params:
            ids.append(front._submit(p.request_id, p))
        answers = await _answers(front, ids)
    finally:
        for internal_id in ids:
            front._release(internal_id)
    usage = {
        "prompt_tokens": sum(a[1]["prompt_tokens"] for a in answers),
        "completion_tokens": sum(a[1]["completion_tokens"] for a in answers),
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    first = protocol.head("cmpl-" + client_id, front.model.name, int(time.time()))
    return web.json_response({**first, "choices": [a[0] for a in answers], "usage": usage})


async def _answers(front, ids: list[str]) -> list[tuple[dict, dict]]:
    """Every prompt's answer, in order; one failing cancels the others (then all are released)."""
    tasks = [
        asyncio.ensure_future(_one(front, internal_id, i)) for i, internal_id in enumerate(ids)
    ]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(front, internal_id: str, index: int) -> tuple[dict, dict]:
    """One prompt of a batch: its choice (with its index) and its usage."""
    tokens, output = await front._generate(internal_id)
    answer = front._choice(internal_id, tokens, output)
    answer["index"] = index
    return answer, front._usage(internal_id)
