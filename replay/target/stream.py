"""One streamed completion as the HTTP replay client reads it. Runs in: frontend process.

The answer to a streaming POST /v1/completions: server-sent event lines, whatever
arrived in one read split here and stamped with that read's time; each `data:` chunk
checked field by field (a wrong type is a ValueError, that request's error) and kept as
counts and running digests, never its text (nothing grows with what the server sends:
more outputs or tokens than max_tokens is an error); an `error` chunk is the request's
error; `data: [DONE]` ends it. Then the body is read to its end (DRAIN_S at most), so
that aiohttp returns its connection to the pool. replay/target/client.py turns a Stream
into the request's record.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from replay.openai.protocol import loads_strict
from replay.verify.text import printable

MAX_LINE_BYTES = 128 << 10  # a longer stream line is that request's error (aiohttp's readline cap)
DRAIN_S = 1.0  # after [DONE], how long the body's end is waited for before its connection is closed


@dataclass(slots=True)
class Stream:
    """What one streamed response said, kept as counts and running digests (nothing grows
    with what the server sends: a stream of more outputs than max_tokens is an error)."""

    max_outputs: int = 0  # content chunks allowed (each carries at least one token); 0: any
    num_tokens: int = 0
    tokens_digest: hashlib._Hash = field(default_factory=hashlib.sha256)  # output_digest's
    text_digest: hashlib._Hash | None = None  # of the text, when a chunk had text and no ids
    chunk_times: list[float] = field(default_factory=list)  # replay seconds of each content chunk
    finish_reason: str | None = None
    usage_completion_tokens: int | None = None
    num_cached_tokens: int | None = None  # None: the usage did not say
    error: str | None = None
    ignored_reason: str | None = None  # kvdrain's front says why it ignored the request
    done_t: float | None = None  # replay seconds when [DONE] was read: the request's end

    def add(self, now: float, token_ids: list[int], text: str) -> None:
        """One content chunk; a ValueError beyond max_outputs of them."""
        if self.max_outputs and len(self.chunk_times) >= self.max_outputs:
            raise ValueError(f"stream: more outputs than max_tokens ({self.max_outputs})")
        self.chunk_times.append(now)
        if token_ids:  # output_digest's comma-joined ids, one update per chunk
            ids = ",".join(map(str, token_ids))
            self.tokens_digest.update((f",{ids}" if self.num_tokens else ids).encode())
            self.num_tokens += len(token_ids)
        if self.max_outputs and self.num_tokens > self.max_outputs:
            raise ValueError(f"stream: more tokens than max_tokens ({self.max_outputs})")
        if text:
            if self.text_digest is None:
                self.text_digest = hashlib.sha256()
            self.text_digest.update(text.encode("utf-8", "surrogatepass"))

    def digest(self) -> str:
        """output_digest of the token ids; of the text when the server sent none."""
        if self.num_tokens or self.text_digest is None:
            return self.tokens_digest.hexdigest()[:16]
        return self.text_digest.hexdigest()[:16]


async def read_stream(
    response: aiohttp.ClientResponse, stream: Stream, now: Callable[[], float]
) -> None:
    """The SSE lines as they come, whatever arrived at once split here (one await per
    read, not per line: the replay's sends share this loop); the lines of one read
    arrived together and share its time (now()). A blank line only ends an event: skipped."""
    pending = b""
    async for data in response.content.iter_any():
        t = now()
        *lines, pending = (pending + data).split(b"\n")
        if len(pending) > MAX_LINE_BYTES:
            raise ValueError(f"stream: a line longer than {MAX_LINE_BYTES >> 10} KiB")
        for line in lines:
            if line and _read_line(line, stream, t):
                return
    _read_line(pending, stream, now())


def _read_line(line: bytes, stream: Stream, now: float) -> bool:
    """One SSE line, read at `now`, into the stream; True at [DONE]."""
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"stream: a line longer than {MAX_LINE_BYTES >> 10} KiB")
    line = line.strip()
    if not line.startswith(b"data:"):
        return False
    data = line[5:].lstrip()
    if data == b"[DONE]":
        stream.done_t = now
        return True
    chunk = loads_strict(data)
    if type(chunk) is not dict:
        raise ValueError(f"stream chunk: expected a JSON object, got {type(chunk).__name__}")
    if "error" in chunk:
        stream.error = error_message(chunk)
    else:
        _apply_chunk(stream, chunk, now)
    return False


def error_message(body: object) -> str:
    """The server's error message, printable (it reaches the terminal)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return printable(body["error"].get("message"))
    return printable(body)


async def drain(content: aiohttp.StreamReader) -> None:
    """Read a finished stream's body to its end, discarding it: aiohttp returns a
    connection to the pool only when its response was read to the end, and closes it
    otherwise. The body's last chunk is a separate write after [DONE] (kvdrain's front and
    vLLM's both end the body after it), so it is often in a later read: a stream left at
    [DONE] costs a new connection, for the client and for the server. A server that sends
    more, or keeps the body open, for DRAIN_S gets its connection closed; nothing read
    here changes the request's record, which [DONE] already closed."""
    if content.is_eof():
        return
    try:
        await asyncio.wait_for(_read_to_end(content), DRAIN_S)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        pass  # the connection is closed instead of reused


async def _read_to_end(content: aiohttp.StreamReader) -> None:
    while await content.readany():
        pass


def _expect(value: object, types: tuple[type, ...], what: str) -> object:
    """value if it is None or one of types (a bool is no int); a ValueError otherwise."""
    if value is None or (
        isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    ):
        return value
    raise ValueError(
        f"stream chunk: {what}: expected {' or '.join(t.__name__ for t in types)}, "
        f"got {type(value).__name__}"
    )


def _apply_chunk(stream: Stream, chunk: dict, now: float) -> None:
    """One chunk into the stream; a ValueError if its fields have the wrong types."""
    usage = chunk.get("usage")
    if usage is not None:
        _apply_usage(stream, _expect(usage, (dict,), "usage"))
    choices = chunk.get("choices")
    if choices is not None:
        for choice in _expect(choices, (list,), "choices"):
            if type(choice) is not dict:
                raise ValueError(
                    f"stream chunk: choices: expected objects, got {type(choice).__name__}"
                )
            _apply_choice(stream, choice, now)


def _apply_usage(stream: Stream, usage: dict) -> None:
    stream.usage_completion_tokens = _expect(
        usage.get("completion_tokens"), (int,), "usage.completion_tokens"
    )
    details = _expect(usage.get("prompt_tokens_details"), (dict,), "usage.prompt_tokens_details")
    stream.num_cached_tokens = _expect(
        (details or {}).get("cached_tokens"), (int,), "cached_tokens"
    )


def _apply_choice(stream: Stream, choice: dict, now: float) -> None:
    token_ids = _expect(choice.get("token_ids"), (list,), "token_ids") or ()
    for token in token_ids:
        if type(token) is not int:
            raise ValueError("stream chunk: token_ids: expected a list of integers")
    text = _expect(choice.get("text"), (str,), "text") or ""
    if token_ids or text:
        stream.add(now, token_ids, text)
    reason = choice.get("finish_reason")
    if reason is not None:
        stream.finish_reason = _expect(reason, (str,), "finish_reason")
        stream.ignored_reason = _expect(
            choice.get("kvdrain_ignored_reason"), (str,), "kvdrain_ignored_reason"
        )
