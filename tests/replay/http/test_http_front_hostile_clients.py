"""kvdrain's HTTP front against hostile clients, over a fake in-process router: every bad
input is a 4xx with vLLM's error body (a lone surrogate, JSON nested 100,000 deep, a bogus
Content-Encoding, a non-UTF-8 Authorization header, duplicate keys), a huge text prompt is
refused before it is tokenised, and half-open connections (slowloris) neither keep others
out nor flood stderr."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

from replay.http.protocol import ServedModel
from replay.http.server import HttpOptions
from tests.http_utils import running_front
from tests.replay.http.test_http_front_fidelity import FakeRouter, answers

pytestmark = pytest.mark.timeout(60)
MODEL = ServedModel("m", 512, 1000, 16, ("P", "D"), "pd", "event")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """One HTTP/1.1 request written byte for byte; (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status_line, _, rest = raw.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload) if payload else {}


def post(port: int, body: bytes, *headers: bytes) -> tuple[int, dict]:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return raw_request(port, head + b"".join(h + b"\r\n" for h in headers), body)


def assert_vllm_error(status: int, body: dict, expected: int) -> None:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == expected
    assert "internal error" not in error["message"] and "Error(" not in error["message"]


BAD_BODIES = {
    "a lone surrogate": b'{"prompt": "hi \\ud800 there", "max_tokens": 2}',
    "JSON nested 100,000 deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "duplicate keys": b'{"prompt": [1, 2], "max_tokens": 2, "max_tokens": 400}',
    "not UTF-8": b'{"prompt": "\xff\xfe"}',
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_a_bad_body_is_a_400_with_vllms_error_body(name: str):
    with running_front(FakeRouter(answers), MODEL) as front:
        status, body = post(front.port, BAD_BODIES[name])
        assert_vllm_error(status, body, 400)
        status, _ = post(front.port, b'{"prompt": [5, 1], "max_tokens": 2}')
        assert status == 200  # and the front keeps serving


def test_a_bogus_content_encoding_is_a_400():
    with running_front(FakeRouter(answers), MODEL) as front:
        status, body = post(front.port, b'{"prompt": [5, 1]}', b"Content-Encoding: gzip")
        assert_vllm_error(status, body, 400)


def test_a_non_utf8_authorization_header_is_a_401():
    with running_front(FakeRouter(answers), MODEL, HttpOptions(api_key="sekrit")) as front:
        status, body = post(front.port, b'{"prompt": [5, 1]}', b"Authorization: Bearer \xff\xfe\xc3")
        assert status == 401 and body == {"error": "Unauthorized"}
        status, _ = post(front.port, b'{"prompt": [5, 1]}', b"Authorization: Bearer sekrit")
        assert status == 200


def test_a_huge_text_prompt_is_refused_before_it_is_tokenised(monkeypatch):
    """7.5 MB of words against max_model_len 512: the length check comes first, so the
    front tokenises no more than max_model_len tokens of it."""
    import replay.http.tokenizer as tokenizer

    seen = []
    real = tokenizer.WordTokenizer.encode

    def counting(self, text, *args, **kwargs):
        ids = real(self, text, *args, **kwargs)
        seen.append(len(ids))
        return ids
    monkeypatch.setattr(tokenizer.WordTokenizer, "encode", counting)
    words = json.dumps({"prompt": "ab " * 2_500_000, "max_tokens": 2}).encode()
    ids = json.dumps({"prompt": list(range(1, 999)) * 1000, "max_tokens": 2}).encode()
    with running_front(FakeRouter(answers), MODEL) as front:
        for body in (words, ids):
            started = time.monotonic()
            status, answer = post(front.port, body)
            assert_vllm_error(status, answer, 400)
            assert "maximum context length is 512 tokens" in answer["error"]["message"]
            assert time.monotonic() - started < 1.5
    assert max(seen, default=0) <= MODEL.max_model_len
