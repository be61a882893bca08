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

from replay.openai.protocol import ServedModel
from replay.serve.http_front import HttpFrontOptions
from tests.http_utils import running_front
from tests.replay.serve.test_http_front_fidelity import FakeRouter, answers

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
    "a lone surrogate in the request id": b'{"prompt": [1, 2], "request_id": "a\\udc80"}',
    "a request id of 100,000 characters": b'{"prompt": [1, 2], "request_id": "%s"}'
    % (b"a" * 100_000),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_a_bad_body_is_a_400_with_vllms_error_body(name: str):
    with running_front(FakeRouter(answers), MODEL) as front:
        status, body = post(front.port, BAD_BODIES[name])
        assert_vllm_error(status, body, 400)
        status, _ = post(front.port, b'{"prompt": [5, 1], "max_tokens": 2}')
        assert status == 200  # and the front keeps serving


def test_a_non_utf8_request_id_header_is_a_400():
    with running_front(FakeRouter(answers), MODEL) as front:
        status, body = post(front.port, b'{"prompt": [5, 1]}', b"X-Request-Id: \xff\xfe")
        assert_vllm_error(status, body, 400)


def test_a_bogus_content_encoding_is_a_400():
    with running_front(FakeRouter(answers), MODEL) as front:
        status, body = post(front.port, b'{"prompt": [5, 1]}', b"Content-Encoding: gzip")
        assert_vllm_error(status, body, 400)


def test_a_non_utf8_authorization_header_is_a_401():
    with running_front(FakeRouter(answers), MODEL, HttpFrontOptions(api_key="sekrit")) as front:
        status, body = post(
            front.port, b'{"prompt": [5, 1]}', b"Authorization: Bearer \xff\xfe\xc3"
        )
        assert status == 401 and body == {"error": "Unauthorized"}
        status, _ = post(front.port, b'{"prompt": [5, 1]}', b"Authorization: Bearer sekrit")
        assert status == 200


def test_a_huge_text_prompt_is_refused_before_it_is_tokenised(monkeypatch):
    """7.5 MB of words against max_model_len 512: the length check comes first, so the
    front tokenises no more than max_model_len tokens of it."""
    import replay.openai.tokenizer as tokenizer

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
            assert time.monotonic() - started < 10.0  # loose: a loaded machine; `seen` is the check
    assert max(seen, default=0) <= MODEL.max_model_len  # never tokenised past the limit


FRONT_AT_AN_FD_LIMIT = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
from replay.serve.http_front import HttpFrontOptions
from tests.http_utils import running_front
from tests.replay.serve.test_http_front_hostile_clients import MODEL
from tests.replay.serve.test_http_front_fidelity import FakeRouter, answers
with running_front(FakeRouter(answers), MODEL, HttpFrontOptions(header_timeout_s={header_timeout})) as front:
    print(front.port, flush=True)
    sys.stdin.read()
"""


def _half_open(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    return sock


def _health(port: int, timeout_s: float) -> int | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return int(sock.recv(64).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_half_open_connections_at_the_fd_limit_keep_health_reachable_and_stderr_quiet():
    """600 connections that never finish their headers, against a front limited to 512 file
    descriptors: the oldest half-open ones make room, /health still answers at once, and
    stderr stays quiet (no traceback per refused accept)."""
    import subprocess
    import sys

    code = FRONT_AT_AN_FD_LIMIT.format(limit=512, header_timeout=30)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    sockets = []
    try:
        port = int(child.stdout.readline())
        for _ in range(600):
            try:
                sockets.append(_half_open(port))
            except OSError:
                pass
        statuses = [_health(port, 2.0) for _ in range(3)]
        assert statuses == [200, 200, 200]
    finally:
        for sock in sockets:
            sock.close()
        try:
            _, stderr = child.communicate(timeout=20)
        finally:
            child.kill()
    assert len(stderr) < 2000, stderr[-2000:].decode(errors="replace")


def test_a_connection_that_never_finishes_its_headers_is_closed_after_the_header_timeout():
    with running_front(FakeRouter(answers), MODEL, HttpFrontOptions(header_timeout_s=0.5)) as front:
        sock = _half_open(front.port)
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1024) == b""  # closed by the front
        assert 0.3 < time.monotonic() - started < 5
        sock.close()


def test_a_body_that_never_arrives_is_a_408_after_the_body_timeout():
    with running_front(FakeRouter(answers), MODEL, HttpFrontOptions(body_timeout_s=0.5)) as front:
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                b"Content-Type: application/json\r\n\r\n" + b'{"prompt": [1'
            )
            raw = sock.recv(65536)
        status_line, _, rest = raw.partition(b"\r\n")
        assert int(status_line.split()[1]) == 408
        assert_vllm_error(408, json.loads(rest.partition(b"\r\n\r\n")[2]), 408)


def test_beyond_the_connection_cap_busy_connections_are_kept_and_a_newcomer_gets_a_503():
    """Two streams in flight fill a cap of 2: a third connection is refused with vLLM's error
    body, and the two streams go on."""
    router = FakeRouter(answers)
    with running_front(router, MODEL, HttpFrontOptions(max_connections=2)) as front:
        url = f"http://127.0.0.1:{front.port}"

        async def go() -> list[int]:
            async with aiohttp.ClientSession() as session:
                hung = [
                    asyncio.create_task(
                        session.post(
                            url + "/v1/completions", json={"prompt": [0, 1], "stream": True}
                        )
                    )
                    for _ in range(2)
                ]
                deadline = time.monotonic() + 10
                while len(front.open) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                status, body = await asyncio.to_thread(post, front.port, b'{"prompt": [5, 1]}')
                assert_vllm_error(status, body, 503)
                assert len(front.open) == 2
                for task in hung:
                    task.cancel()
                await asyncio.gather(*hung, return_exceptions=True)
                return [status]

        assert run(go()) == [503]


def test_a_gzip_bomb_is_a_413_at_once():
    """200 MB of zeros in a 200 KB gzip body: refused when the decompressed body passes
    max_body_bytes, not after inflating all of it."""
    import zlib

    packer = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    bomb = b"".join(packer.compress(zeros) for _ in range(200)) + packer.flush()
    assert len(bomb) < 1 << 20
    with running_front(FakeRouter(answers), MODEL) as front:
        started = time.monotonic()
        status, body = post(front.port, bomb, b"Content-Encoding: gzip")
        assert_vllm_error(status, body, 413)
        assert time.monotonic() - started < 5


def test_malformed_requests_print_one_line_each_kind_not_a_traceback_each():
    """In a process of its own, as a serve runs (no logging set up: aiohttp's records
    reach stderr through logging's last resort, tracebacks and all)."""
    import subprocess
    import sys

    junk = [
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ]
    code = FRONT_AT_AN_FD_LIMIT.format(limit=4096, header_timeout=30)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        port = int(child.stdout.readline())
        for request in junk * 20:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request)
                assert b" 400 " in sock.recv(64)
        assert _health(port, 5.0) == 200
        _, err = child.communicate(timeout=20)
    finally:
        child.kill()
    assert b"Traceback" not in err and len(err.splitlines()) <= 2, err[-3000:]
