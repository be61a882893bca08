"""kvdrain's P/D proxy bounded: upstreams that hang or trickle, bodies and answers too
large, requests beyond an engine's cap, hostile clients; never a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from replay.openai.route_header import ROUTE_HEADER
from replay.vllm.proxy_options import ProxyError, ProxyOptions, UpstreamTimeouts
from tests.e2e.test_cli import Lines, invoke
from tests.http_utils import running_proxy
from tests.replay.vllm.test_proxy import CLIENT_REQUEST, FakeVllm, _post, _samples, deployment, run

pytestmark = pytest.mark.timeout(120)
FAST = UpstreamTimeouts(connect_s=2.0, first_byte_s=0.5, idle_s=0.5, total_s=5.0)
STREAMED = {**CLIENT_REQUEST, "stream": True}
MB = 1 << 20


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            return response.status, json.loads(await response.read())


async def _metrics(url: str) -> dict[tuple, float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            return _samples(await response.text())


def _requests(samples: dict, stage: str, upstream: str, status: str) -> float:
    labels = (("stage", stage), ("status", status), ("upstream", upstream))
    return samples.get(("kvdrain_proxy_requests_total", labels), 0)


async def _cut_off(url: str, request: dict) -> bytes:
    """A streamed completion whose answer the proxy cuts off; the bytes before the cut."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=request) as response:
            assert response.status == 200
            got = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                while chunk := await response.content.readany():
                    got += chunk
            return got


async def _raw(url: str, request: bytes) -> bytes:
    """The first line of the proxy's answer to bytes sent as they are."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


def test_a_prefill_server_that_never_answers_is_a_504_naming_it_and_health_says_so():
    async def go():
        async with deployment(timeouts=FAST) as (proxy, (p,), (d,)):
            p.hang = True
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    proxy.url + "/v1/completions", json=CLIENT_REQUEST
                ) as response:
                    status, error = response.status, (await response.json())["error"]
                    assert response.headers[ROUTE_HEADER] == "P"
            assert status == 504 and error["code"] == 504 and error["type"] == "GatewayTimeoutError"
            assert error["message"] == (
                f"prefill server P ({p.url}) timed out: sent no answer within 0.5 s"
            )
            assert d.bodies == []
            status, health = await _get(proxy.url + "/health")
            assert status == 503 and health["status"] == "unhealthy", health
            assert health["upstreams"]["D"]["status"] == "ok"
            assert health["upstreams"]["P"]["status"].startswith(
                f"prefill server P ({p.url}) timed out: sent no answer within 0.5 s ("
            )
            assert _requests(await _metrics(proxy.url), "prefill", "P", "timeout") == 1

    run(go())


def test_a_decode_server_that_stalls_mid_stream_is_cut_off_and_health_says_so(capfd):
    async def go():
        async with deployment(timeouts=FAST) as (proxy, _, (d,)):
            got = await _cut_off(proxy.url, STREAMED)  # D sends one chunk, then nothing
            assert got == b'data: {"choices":[{"text":" w1"'
            status, health = await _get(proxy.url + "/health")
            assert (
                status == 503
                and "sent nothing more within 0.5 s" in (health["upstreams"]["D"]["status"])
            )
            return await _metrics(proxy.url)

    samples = run(go())
    assert _requests(samples, "decode", "D", "timeout") == 1
    err = capfd.readouterr().err
    assert "decode server D" in err and "sent nothing more within 0.5 s" in err
    assert "Traceback" not in err


def test_a_decode_server_that_trickles_forever_is_cut_off_at_the_total_timeout():
    timeouts = UpstreamTimeouts(first_byte_s=1.0, idle_s=1.0, total_s=1.5)

    async def go():
        async with deployment(timeouts=timeouts) as (proxy, _, (d,)):
            d.trickle_s = 0.05
            started = time.monotonic()
            await _cut_off(proxy.url, STREAMED)
            assert time.monotonic() - started < 30  # 1.5 s; generous for a loaded machine
            status, health = await _get(proxy.url + "/health")
            assert (
                status == 503
                and "its answer took more than 1.5 s" in (health["upstreams"]["D"]["status"])
            )

    run(go())


def test_requests_beyond_an_engines_cap_are_503_at_once_and_pass_again_below_it():
    async def go():
        async with deployment(max_in_flight=1) as (proxy, (p,), (d,)):
            p.hang = True
            first = asyncio.create_task(_post(proxy.url, CLIENT_REQUEST))
            await p.received.wait()
            status, body, _ = await _post(proxy.url, CLIENT_REQUEST)
            error = json.loads(body)["error"]
            assert status == 503 and error["type"] == "ServiceUnavailableError"
            assert error["message"] == (
                f"prefill server P ({p.url}) has 1 request in flight, its cap "
                f"(--max-in-flight 1): try again later"
            )
            assert len(p.bodies) == 1
            p.unhang.set()
            assert (await first)[0] == 200
            assert (await _post(proxy.url, CLIENT_REQUEST))[0] == 200

    run(go())


def test_a_body_over_the_cap_is_a_413_whether_its_length_is_said_or_not():
    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    async def go():
        async with deployment(max_body_bytes=4000) as (proxy, (p,), _):
            for data in (b" " * 5000, chunks()):
                status, body, _ = await _post(proxy.url, data)
                error = json.loads(body)["error"]
                assert status == 413 and error["type"] == "RequestEntityTooLarge", error
                assert "4000 bytes" in error["message"]
            assert p.bodies == []

    run(go())


def test_a_body_that_never_arrives_whole_is_a_408():
    async def go():
        async with deployment(body_timeout_s=0.5) as (proxy, (p,), _):
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            assert (await _raw(proxy.url, head + b"{")).startswith(b"HTTP/1.1 408 ")
            assert p.bodies == []

    run(go())


@pytest.mark.parametrize(
    "answer,said",
    [
        ({"kv_transfer_params": {"remote_block_ids": list(range(4000))}}, "more than 10000 bytes"),
        ({"kv_transfer_params": [1, 2]}, "kv_transfer_params is a JSON list, not an object"),
        ([1, 2], "answered 200 without a JSON object"),
    ],
)
def test_a_prefill_answer_too_large_or_without_params_object_never_reaches_d(answer, said):
    async def go():
        async with deployment(max_prefill_answer_bytes=10_000) as (proxy, (p,), (d,)):
            p.fail = (200, json.dumps(answer).encode())
            status, body, _ = await _post(proxy.url, CLIENT_REQUEST)
            error = json.loads(body)["error"]
            assert status == 502 and error["message"].startswith(f"prefill server P ({p.url})")
            assert said in error["message"] and d.bodies == []

    run(go())


DEEP = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000]


@pytest.mark.parametrize("data", DEEP, ids=["array", "object"])
def test_deep_json_is_a_400_as_serve_answers_it(data):
    async def go():
        async with deployment() as (proxy, (p,), _):
            status, body, _ = await _post(proxy.url, data)
            error = json.loads(body)["error"]
            assert status == 400 and error["message"] == "malformed JSON body: nested too deeply"
            assert p.bodies == []

    run(go())


def test_the_timeouts_and_caps_are_flags_with_their_defaults_shown():
    text = invoke("proxy", "--help").output
    for flag, default in (
        ("--connect-timeout", "10"),
        ("--first-byte-timeout", "120"),
        ("--idle-timeout", "60"),
        ("--total-timeout", "300"),
        ("--max-in-flight", "1024"),
        ("--max-body-mib", "8"),
    ):
        assert re.search(rf"{flag} [A-Z]+ .*?default: {default}", " ".join(text.split())), flag
    bad = invoke(
        "proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--idle-timeout", "0"
    )
    assert bad.exit_code == 2 and "'--idle-timeout': 0.0 is not in the range x>0" in bad.output


def _proxy_process(p: FakeVllm, d: FakeVllm, *args: str) -> tuple[Lines, str]:
    proxy = Lines(
        [sys.executable, "-m", "cli", "proxy", "--prefill", p.url, "--decode", d.url, *args]
    )
    return proxy, proxy.wait_for(r"^proxy ready (http://\S+)$", 30).group(1)


def _stop(proxy: Lines) -> None:
    proxy.proc.send_signal(signal.SIGTERM)
    try:
        assert proxy.proc.wait(10) == 143
    finally:
        if proxy.proc.poll() is None:
            proxy.proc.kill()
            proxy.proc.wait(5)


HOSTILE = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Content-Encoding: gzip\r\n\r\nabcde",
]


def test_hostile_clients_and_a_decode_server_that_cuts_off_print_no_traceback():
    """In a process of its own: aiohttp logs what it cannot handle with a traceback, which
    pytest's log capture would hide in-process."""

    async def go():
        p, d = FakeVllm("P"), FakeVllm("D")
        await p.start(), await d.start()
        proxy, url = _proxy_process(p, d)
        try:
            for data in [*DEEP, b"{not json", gzip.compress(b"[1]")]:
                assert (await _post(url, data))[0] == 400
            for request in HOSTILE:
                assert re.match(rb"HTTP/1\.[01] 400 ", await _raw(url, request)), request
            d.break_off = True
            await _cut_off(url, STREAMED)
        finally:
            _stop(proxy)
            await p.stop(), await d.stop()
        return proxy.seen

    seen = run(go())
    assert not any("Traceback" in line for line in seen), "".join(seen)
    assert any("decode server D broke off its answer" in line for line in seen), seen


def _peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024


async def _health_while(url: str, work) -> tuple[object, float]:
    """What `work` returns, and the slowest /health answer while it ran."""
    slowest, done = 0.0, asyncio.Event()

    async def poll():
        nonlocal slowest
        async with aiohttp.ClientSession() as session:
            while not done.is_set():
                started = time.monotonic()
                async with session.get(url + "/health") as response:
                    assert response.status == 200
                slowest = max(slowest, time.monotonic() - started)
                await asyncio.sleep(0.05)

    poller = asyncio.create_task(poll())
    try:
        return await work, slowest
    finally:
        done.set()
        await poller


@pytest.mark.slow
def test_a_60_mb_body_leaves_health_answering_and_the_proxy_small():
    """A 60 MB body is refused (413) as it arrives; one just under the 8 MiB cap (token ids,
    the costliest JSON to parse and write) is served. /health answers throughout, well
    within a second on an idle machine (the bound is for a loaded one); the proxy's peak
    RSS stays far below 400 MB."""

    async def body(num_bytes: int):
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": ['
        piece = b"123456," * (MB // 7)
        for _ in range(num_bytes // len(piece)):
            yield piece
        yield b"1]}"

    async def go():
        p, d = FakeVllm("P"), FakeVllm("D")
        await p.start(), await d.start()
        proxy, url = _proxy_process(p, d)
        try:
            huge, huge_slowest = await _health_while(url, _post(url, body(60 * MB)))
            fits, fits_slowest = await _health_while(url, _post(url, body(8 * MB - 4096)))
            return huge[0], huge_slowest, fits[0], fits_slowest, _peak_rss_mb(proxy.proc.pid)
        finally:
            _stop(proxy)
            await p.stop(), await d.stop()

    huge, huge_slowest, fits, fits_slowest, peak_mb = run(go())
    assert (huge, fits) == (413, 200)
    assert huge_slowest < 5 and fits_slowest < 5, (huge_slowest, fits_slowest)
    assert peak_mb < 400, peak_mb


PROXY_AT_AN_FD_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
from cli import cli
sys.argv = ["kvdrain", "proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
cli()
"""


def _half_open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    return sock


def _health_status(url: str, timeout_s: float) -> int | None:
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return int(sock.recv(64).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_half_open_connections_at_the_fd_limit_leave_health_answering():
    """300 connections that never finish their headers, against a proxy limited to 256 file
    descriptors: the oldest half-open ones make room and /health still answers (503 here:
    its upstreams are not there), where every accept used to fail until they left."""
    proxy = Lines([sys.executable, "-c", PROXY_AT_AN_FD_LIMIT.format(limit=256)])
    sockets = []
    try:
        url = proxy.wait_for(r"^proxy ready (http://\S+)$", 30).group(1)
        for _ in range(300):
            with contextlib.suppress(OSError):
                sockets.append(_half_open(url))
        assert [_health_status(url, 2.0) for _ in range(3)] == [503, 503, 503]
    finally:
        for sock in sockets:
            sock.close()
        _stop(proxy)
    assert not any("Traceback" in line for line in proxy.seen), "".join(proxy.seen)


def test_a_connection_that_never_finishes_its_headers_is_closed_after_the_header_timeout():
    """aiohttp's own keep-alive timeout is an hour: a client that sends half a request head
    held its connection (and a file descriptor) that long."""
    options = ProxyOptions(
        prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",), header_timeout_s=0.5
    )
    with running_proxy(options) as url:
        sock = _half_open(url)
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1024) == b""  # closed by the proxy
        assert 0.3 < time.monotonic() - started < 5
        sock.close()


def test_the_header_timeout_defaults_to_the_serves():
    assert ProxyOptions(prefill=("http://h:1",), decode=("http://h:2",)).header_timeout_s == 10.0


def test_an_upstream_url_with_credentials_is_refused_without_echoing_them():
    """aiohttp sent a URL's user:password as Basic auth, and the proxy showed the URL as
    given: in its ready line, in every 502/504 body to any client, and in /health, which
    needs no key. The upstream's key has its own flag."""
    with pytest.raises(ProxyError) as refused:
        ProxyOptions(prefill=("http://alice:s3cret@127.0.0.1:8100",), decode=("http://h:2",))
    said = str(refused.value)
    assert "s3cret" not in said and "alice" not in said
    assert "--upstream-api-key" in said and "127.0.0.1:8100" in said
