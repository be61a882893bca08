"""kvdrain's P/D proxy: vLLM's protocol against in-process fakes of a vLLM P and D, its
command line (ready line, signals, listening rules), and one replay through it in front of
two `kvdrain serve --http`."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig, KVTransferConfig
from replay.deploy.topology import TopologyLaunch
from replay.openai import pool
from replay.openai.route_header import ROUTE_HEADER, parse_route
from replay.pipeline import ReplayConfig, run_replay
from replay.target.client import HttpTargetOptions
from replay.trace.shaping import ShapingOptions
from replay.verify.rules import VerifyOptions
from replay.verify.windows import idle_windows
from replay.vllm.pd_request import PREFILL_KV_TRANSFER_PARAMS
from replay.vllm.proxy import Proxy, ProxyOptions
from tests.e2e.test_cli import EXAMPLE, Lines, Serve, invoke
from tests.http_utils import running_front, running_proxy, served_model
from tests.replay.sim.test_xpyd import two_prefix_groups, write

pytestmark = pytest.mark.timeout(120)
P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p",
    "remote_block_ids": [3, 4],
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
}
STREAM_CHUNKS = [
    b'data: {"choices":[{"text":" w1"',
    b"}]}\n\n",
    b'data: {"choices":[{"text":" w2"}]}\n\n',
    b"data: [DONE]\n\n",
]
CLIENT_REQUEST = {
    "model": "tiny",
    "prompt": [1, 2, 3],
    "max_tokens": 5,
    "stream": False,
    "min_tokens": 2,
}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class FakeVllm:
    """A vLLM server as the proxy sees it: P answers with kv_transfer_params; D checks it got
    them and answers, streamed in STREAM_CHUNKS (each sent once `release` lets it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict] = []
        self.headers: list = []
        self.peers: list[int] = []  # the client port of each completion's connection
        self.fail: tuple[int, bytes] | None = None  # answer every completion with this
        self.healthy = True
        self.break_off = False  # a D that dies after its first chunk
        self.hold = True  # a stream waits after its first chunk until `release` is set again
        self.release = asyncio.Event()
        self.release.set()
        self.first_chunk_sent = asyncio.Event()
        self.hang = False  # a completion is answered only once `unhang` is set (by stop)
        self.unhang = asyncio.Event()
        self.received = asyncio.Event()  # a completion arrived
        self.trickle_s: float | None = None  # a stream that sends a chunk this often, forever
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)  # the proxy's cap is the one tested
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.unhang.set()
        self.release.set()
        await self._runner.cleanup()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        self.peers.append(request.transport.get_extra_info("peername")[1])
        self.received.set()
        if self.hang:
            await self.unhang.wait()
        if self.fail is not None:
            return web.Response(
                status=self.fail[0], body=self.fail[1], content_type="application/json"
            )
        if body["kv_transfer_params"].get("do_remote_decode"):  # a P's work
            return web.json_response(
                {"id": "cmpl-p", "choices": [{"text": " w9"}], "kv_transfer_params": P_PARAMS}
            )
        assert body["kv_transfer_params"] == P_PARAMS  # a D's work: with what P answered
        if not body.get("stream"):
            return web.json_response(
                {"id": "cmpl-d", "served_by": self.name, "choices": [{"text": " w1 w2"}]}
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while self.trickle_s is not None and not self.unhang.is_set():
            await response.write(STREAM_CHUNKS[2])
            await asyncio.sleep(self.trickle_s)
        for i, chunk in enumerate(STREAM_CHUNKS):
            await self.release.wait()
            await response.write(chunk)
            if i == 0 and self.break_off:
                request.transport.close()
                return response
            if i == 0 and self.hold:
                self.first_chunk_sent.set()
                self.release.clear()
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"0.32.0 ({self.name})"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        return web.json_response(
            {"count": 1, "max_model_len": 512, "tokens": [int(body["prompt"][1:])]}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)


@asynccontextmanager
async def deployment(num_prefill: int = 1, num_decode: int = 1, **options):
    """Fakes of num_prefill P and num_decode D, and a proxy in front: (proxy, Ps, Ds)."""
    prefill = [FakeVllm(f"P{i}") for i in range(num_prefill)]
    decode = [FakeVllm(f"D{i}") for i in range(num_decode)]
    for fake in prefill + decode:
        await fake.start()
    proxy = Proxy(
        ProxyOptions(
            prefill=tuple(f.url for f in prefill), decode=tuple(f.url for f in decode), **options
        )
    )
    await proxy.start()
    try:
        yield proxy, prefill, decode
    finally:
        await proxy.stop()
        for fake in prefill + decode:
            await fake.stop()


async def _post(url: str, body, **kwargs) -> tuple[int, bytes, str]:
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", data=data, **kwargs) as response:
            return response.status, await response.read(), response.headers.get("Content-Type", "")


def test_a_completion_is_prefilled_on_p_with_one_token_then_decoded_on_d_with_ps_params():
    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            status, body, content_type = await _post(proxy.url, CLIENT_REQUEST)
            assert status == 200 and content_type.startswith("application/json")
            assert json.loads(body) == {
                "id": "cmpl-d",
                "served_by": "D0",
                "choices": [{"text": " w1 w2"}],
            }
            (to_p,), (to_d,) = p.bodies, d.bodies
            assert to_p == {
                "model": "tiny",
                "prompt": [1, 2, 3],
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
            }
            assert to_d == {**CLIENT_REQUEST, "kv_transfer_params": P_PARAMS}
            assert p.headers[0]["X-Request-Id"] == d.headers[0]["X-Request-Id"]

    run(go())


def test_the_prefill_request_is_exactly_vllms_toy_proxys():
    assert PREFILL_KV_TRANSFER_PARAMS == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    from replay.vllm.pd_request import prefill_request

    body = {
        "prompt": "w1",
        "max_tokens": 9,
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_completion_tokens": 3,
    }
    assert prefill_request(body) == {
        "prompt": "w1",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
    }
    assert body["max_tokens"] == 9 and "stream_options" in body  # the client's request is untouched


def test_ds_stream_passes_through_byte_for_byte_as_it_arrives():
    async def go():
        async with deployment() as (proxy, _, (d,)):
            d.release.set()
            async with aiohttp.ClientSession() as session:
                request = {
                    **CLIENT_REQUEST,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with session.post(proxy.url + "/v1/completions", json=request) as response:
                    assert response.status == 200
                    assert response.headers["Content-Type"].startswith("text/event-stream")
                    await d.first_chunk_sent.wait()
                    first = await response.content.readany()  # D holds the rest until we have it
                    assert first == STREAM_CHUNKS[0]
                    d.release.set()
                    rest = await response.content.read()
            assert first + rest == b"".join(STREAM_CHUNKS)
            assert d.bodies[0]["stream_options"] == {"include_usage": True}

    run(go())


def test_no_upstream_connection_is_reused_once_idle_as_long_as_a_servers_keep_alive_may_be(
    monkeypatch,
):
    """vLLM's uvicorn closes an idle keep-alive connection after 5 s; a request sent on one
    it is closing fails ("Server disconnected"), so the proxy reuses none idle for
    pool.IDLE_S (shortened here), and still reuses a connection between two requests."""
    monkeypatch.setattr(pool, "IDLE_S", 0.5)

    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            for _ in range(2):
                assert (await _post(proxy.url, CLIENT_REQUEST))[0] == 200
            await asyncio.sleep(1.0)
            assert (await _post(proxy.url, CLIENT_REQUEST))[0] == 200
            for fake in (p, d):
                assert fake.peers[0] == fake.peers[1] != fake.peers[2], fake.peers

    run(go())


def test_upstream_errors_are_forwarded_with_their_status_and_body():
    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            p.fail = (400, b'{"error": {"message": "too long", "code": 400}}')
            assert await _post(proxy.url, CLIENT_REQUEST) == (400, p.fail[1], "application/json")
            assert d.bodies == []  # P refused it: D never sees it
            p.fail, d.fail = None, (404, b'{"error": {"message": "no such model"}}')
            status, body, _ = await _post(proxy.url, CLIENT_REQUEST)
            assert (status, body) == (404, d.fail[1])
            status, body, _ = await _post(proxy.url, b"{not json")
            assert status == 400 and json.loads(body)["error"]["code"] == 400

    run(go())


def test_an_upstream_that_is_down_is_a_502_with_an_openai_error_body():
    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            await d.stop()
            status, body, _ = await _post(proxy.url, CLIENT_REQUEST)
            error = json.loads(body)["error"]
            assert status == 502 and error["code"] == 502 and error["type"] == "BadGatewayError"
            assert "decode server D" in error["message"] and d.url in error["message"]
            await p.stop()
            status, body, _ = await _post(proxy.url, CLIENT_REQUEST)
            assert status == 502 and "prefill server P" in json.loads(body)["error"]["message"]
            await p.start(), await d.start()  # deployment() stops them again

    run(go())


def test_a_decode_server_that_breaks_off_its_stream_breaks_the_clients_off_too(capfd):
    async def go():
        async with deployment() as (proxy, _, (d,)):
            d.break_off = True
            async with aiohttp.ClientSession() as session:
                request = {**CLIENT_REQUEST, "stream": True}
                async with session.post(proxy.url + "/v1/completions", json=request) as response:
                    assert response.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await response.content.read()
            async with aiohttp.ClientSession() as session:
                async with session.get(proxy.url + "/metrics") as response:
                    return _samples(await response.text())

    samples = run(go())
    assert (
        samples[
            (
                "kvdrain_proxy_requests_total",
                (("stage", "decode"), ("status", "broken"), ("upstream", "D")),
            )
        ]
        == 1
    )
    err = capfd.readouterr().err
    assert "decode server D broke off its answer" in err and "Traceback" not in err


def test_a_client_that_leaves_before_the_streams_end_is_not_a_decode_server_breaking_off(
    capfd, monkeypatch
):
    """The client read [DONE] and closed its connection before the proxy's last write: the
    write fails as aiohttp fails it on a closing transport."""
    write_eof = web.StreamResponse.write_eof

    async def closing(self, data=b""):  # the proxy's answers only: the fakes' have no route
        if ROUTE_HEADER in self.headers:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await write_eof(self, data)

    async def go():
        async with deployment() as (proxy, _, (d,)):
            d.hold = False
            monkeypatch.setattr(web.StreamResponse, "write_eof", closing)
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    proxy.url + "/v1/completions", json={**CLIENT_REQUEST, "stream": True}
                ) as response:
                    with pytest.raises(aiohttp.ClientError):  # the stream's end never came
                        await response.read()
            monkeypatch.undo()
            async with aiohttp.ClientSession() as session:
                async with session.get(proxy.url + "/metrics") as response:
                    return _samples(await response.text())

    samples = run(go())
    assert (
        samples[
            (
                "kvdrain_proxy_requests_total",
                (("stage", "decode"), ("status", "200"), ("upstream", "D")),
            )
        ]
        == 1
    )
    err = capfd.readouterr().err
    assert "broke off" not in err and "Traceback" not in err, err


def test_several_prefill_and_decode_servers_are_used_in_turn():
    async def go():
        async with deployment(num_prefill=2, num_decode=3) as (proxy, prefill, decode):
            answers = [
                json.loads((await _post(proxy.url, CLIENT_REQUEST))[1])["served_by"]
                for _ in range(6)
            ]
            assert answers == ["D0", "D1", "D2", "D0", "D1", "D2"]
            assert [len(p.bodies) for p in prefill] == [3, 3]

    run(go())


def test_every_completion_answer_names_its_way_streamed_or_not_errors_included():
    async def go():
        async with deployment(num_prefill=2, num_decode=2) as (proxy, (p0, p1), (d0, d1)):
            d0.hold = d1.hold = False
            async with aiohttp.ClientSession() as session:

                async def route(request) -> tuple[int, str | None]:
                    async with session.post(
                        proxy.url + "/v1/completions", json=request
                    ) as response:
                        await response.read()
                        return response.status, response.headers.get(ROUTE_HEADER)

                streamed = {**CLIENT_REQUEST, "stream": True}
                assert await route(CLIENT_REQUEST) == (200, "P0,D0")
                assert await route(streamed) == (200, "P1,D1")
                p0.fail = (400, b'{"error": {"message": "too long", "code": 400}}')
                assert await route(CLIENT_REQUEST) == (400, "P0")  # P refused it: no D
                d0.fail = (404, b'{"error": {"message": "no such model"}}')
                assert await route(streamed) == (404, "P1,D0")
                p0.fail = None
                await d1.stop()
                assert await route(CLIENT_REQUEST) == (502, "P0,D1")  # D1 is down
                await p1.stop()
                assert await route(CLIENT_REQUEST) == (502, "P1")
                await p1.start(), await d1.start()  # deployment() stops them again
                async with session.get(proxy.url + "/v1/models") as response:
                    assert ROUTE_HEADER not in response.headers  # not a completion

    run(go())


def test_a_route_header_is_read_back_as_the_names_it_lists_and_nothing_else():
    assert parse_route("P0,D1") == ("P0", "D1") and parse_route(" P ") == ("P",)
    assert (
        parse_route(None) == parse_route("") == parse_route("P0,,D") == parse_route("P0,\x00") == ()
    )


def test_models_come_from_d_and_health_names_every_upstream():
    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            async with aiohttp.ClientSession() as session:
                async with session.get(proxy.url + "/v1/models") as response:
                    assert (await response.json())["data"] == [{"id": "model-of-D0"}]
                async with session.get(proxy.url + "/health") as response:
                    health = await response.json()
                    assert response.status == 200 and health["status"] == "ok"
                    assert health["upstreams"] == {
                        "P": {"url": p.url, "status": "ok"},
                        "D": {"url": d.url, "status": "ok"},
                    }
                p.healthy = False
                await d.stop()
                async with session.get(proxy.url + "/health") as response:
                    health = await response.json()
                    assert response.status == 503 and health["status"] == "unhealthy"
                    assert health["upstreams"]["P"]["status"] == "status 503"
                    assert health["upstreams"]["D"]["status"].startswith("unreachable")
                await d.start()

    run(go())


def test_version_and_tokenize_are_ds_so_a_replay_learns_the_server_through_the_proxy():
    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            async with aiohttp.ClientSession() as session:
                async with session.get(proxy.url + "/version") as response:
                    version = await response.json()
                async with session.post(
                    proxy.url + "/tokenize", json={"prompt": "w41"}
                ) as response:
                    tokens = await response.json()
            assert version == {"version": "0.32.0 (D0)"}
            assert tokens["tokens"] == [41] and d.bodies == [{"prompt": "w41"}] and p.bodies == []

    run(go())


def _samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_upstream_requests_by_stage_and_status_with_their_latency():
    async def go():
        async with deployment() as (proxy, (p,), (d,)):
            await _post(proxy.url, CLIENT_REQUEST)
            d.fail = (500, b"{}")
            await _post(proxy.url, CLIENT_REQUEST)
            async with aiohttp.ClientSession() as session:
                async with session.get(proxy.url + "/metrics") as response:
                    samples = _samples(await response.text())
        count = "kvdrain_proxy_requests_total"
        assert samples[(count, (("stage", "prefill"), ("status", "200"), ("upstream", "P")))] == 2
        assert samples[(count, (("stage", "decode"), ("status", "200"), ("upstream", "D")))] == 1
        assert samples[(count, (("stage", "decode"), ("status", "500"), ("upstream", "D")))] == 1
        latency = "kvdrain_proxy_upstream_latency_seconds_count"
        assert samples[(latency, (("stage", "decode"), ("upstream", "D")))] == 2

    run(go())


def test_the_api_key_guards_v1_and_the_upstream_key_goes_to_every_server():
    async def go():
        async with deployment(api_key="front", upstream_api_key="back") as (proxy, (p,), (d,)):
            status, body, _ = await _post(proxy.url, CLIENT_REQUEST)
            assert status == 401 and p.bodies == []
            status, _, _ = await _post(
                proxy.url, CLIENT_REQUEST, headers={"Authorization": "Bearer front"}
            )
            assert status == 200
            assert p.headers[0]["Authorization"] == d.headers[0]["Authorization"] == "Bearer back"
            async with aiohttp.ClientSession() as session:
                async with session.get(proxy.url + "/health") as response:
                    assert response.status == 200  # open, like vLLM's

    run(go())


def test_a_key_that_is_not_utf8_is_a_401_not_a_crash():
    async def go():
        async with deployment(api_key="front") as (proxy, (p,), _):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            body = json.dumps(CLIENT_REQUEST).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Authorization: Bearer \xff\xfe\xc3\r\nContent-Length: %d\r\n\r\n"
                % len(body)
                + body
            )
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 401") and p.bodies == []

    run(go())


def test_bad_urls_and_listening_beyond_loopback_without_a_key_are_usage_errors():
    assert invoke("proxy", "--prefill", "http://127.0.0.1:1").exit_code == 2  # --decode missing
    result = invoke("proxy", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2")
    assert result.exit_code == 2 and "expected http://HOST:PORT" in result.output
    result = invoke(
        "proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--host",
        "0.0.0.0",
    )
    assert result.exit_code == 2 and "--api-key" in result.output and "--insecure" in result.output
    assert invoke("proxy", "--help").output.count("Example") == 1


def _proxy_process(*args: str) -> Lines:
    return Lines(
        [
            sys.executable,
            "-m",
            "cli",
            "proxy",
            "--prefill",
            "http://127.0.0.1:9",
            "--decode",
            "http://127.0.0.1:9",
            *args,
        ]
    )


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_proxy_prints_its_ready_line_and_stops_cleanly_on_a_signal(sig, code):
    proxy = _proxy_process("--port", "0")
    try:
        port = int(proxy.wait_for(r"^proxy ready http://127\.0\.0\.1:(\d+)$", 30).group(1))
        assert port > 0
        proxy.proc.send_signal(sig)
        assert proxy.proc.wait(10) == code
    finally:
        if proxy.proc.poll() is None:
            proxy.proc.kill()
            proxy.proc.wait(5)
    assert not any("Traceback" in line for line in proxy.seen), proxy.seen


def test_a_replay_through_a_proxy_whose_decode_server_is_down_says_so_not_to_name_the_model():
    """The pre-flight's GET /v1/models through the proxy is a 502: the advice was --model."""
    proxy = _proxy_process("--port", "0")
    try:
        url = proxy.wait_for(r"^proxy ready (http://\S+)$", 30).group(1)
        for model in ((), ("--model", "m")):
            result = invoke("replay", str(EXAMPLE), "--target", url, "--no-live", *model)
            assert result.exit_code == 2, result.output
            assert (
                f"{url}/v1/models: HTTP 502: decode server D (http://127.0.0.1:9) is unreachable: "
                f"ClientConnectorError: Cannot connect to host 127.0.0.1:9"
            ) in result.output
            assert "check that it and its upstreams are up" in result.output
            assert "--model" not in result.output and "ConnectionKey(" not in result.output
    finally:
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(10) == 143


def test_an_insecure_proxy_beyond_loopback_warns():
    proxy = _proxy_process("--host", "0.0.0.0", "--insecure")
    try:
        proxy.wait_for(r"WARNING: --insecure", 30)
        proxy.wait_for(r"^proxy ready http://0\.0\.0\.0:\d+$", 30)
    finally:
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(10) == 143


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replay_through_the_proxy_in_front_of_two_kvdrain_serves_gives_a_verdict(tmp_path: Path):
    """Two single-engine serves as a P and a D stand-in. P has no connector: it answers
    without params and frees its blocks at once (too soon for a scrape to see), so D
    prefills itself and D's /metrics is the one judged. The judged replay asks 50 times the
    example's output tokens: D then holds blocks for tens of milliseconds per request, which a
    10 ms scrape sees on a loaded machine too (the example's 4-23 tokens last a few
    milliseconds there: a whole run's scrapes may miss every one)."""
    serves, proxy = [], None
    longer = write(tmp_path, _times_tokens(EXAMPLE, 50))
    try:
        for _ in range(2):
            serves.append(Serve("--topology", "single", "--http", "0"))
        p_url, d_url = [s.wait_for(r"HTTP on (http://\S+)", 30).group(1) for s in serves]
        proxy = Lines([sys.executable, "-m", "cli", "proxy", "--prefill", p_url, "--decode", d_url])
        proxy_url = proxy.wait_for(r"^proxy ready (http://\S+)$", 30).group(1)
        report = tmp_path / "report.json"
        fast = [
            "--speedup",
            "4",
            "--no-live",
            "--idle-threshold",
            "0.5",
            "--drain-deadline",
            "0.3",
            "--tail",
            "1",
            "--scrape-interval",
            "0.05",
            "--max-requests",
            "8",
        ]
        found = invoke(
            "replay", str(EXAMPLE), "--target", proxy_url, "--report", str(report), *fast
        )
        data = json.loads(report.read_text())  # no --metrics: the proxy's /health names P and D
        assert data["http"]["metrics_from"] == "the proxy's /health", found.output
        assert [(m["url"], list(m["engines"].values())) for m in data["http"]["metrics"]] == [
            (f"{p_url}/metrics", ["P"]),
            (f"{d_url}/metrics", ["D"]),
        ]
        # Speedup 2 for slack: P prefills, then D prefills again (a single engine has no
        # connector), behind a proxy, on a small shared machine.
        result = invoke(
            "replay",
            str(longer),
            "--target",
            proxy_url,
            "--metrics",
            f"D={d_url}/metrics",
            "--report",
            str(report),
            *fast[2:-2],
            "--speedup",
            "2",
            "--scrape-interval",
            "0.01",
        )
        assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
        data = json.loads(report.read_text())
        assert data["http"]["verdict"] == "verified" and {w["engine"] for w in data["windows"]} == {
            "D"
        }
        assert _scraped(f"{proxy_url}/metrics", "kvdrain_proxy_requests_total") == {
            (("stage", "prefill"), ("status", "200"), ("upstream", "P")): 8 + 32,
            (("stage", "decode"), ("status", "200"), ("upstream", "D")): 8 + 32,
            (("stage", "models"), ("status", "200"), ("upstream", "D")): 2,  # the replays' probes
            (("stage", "version"), ("status", "200"), ("upstream", "D")): 2,
        }
    finally:
        if proxy is not None and proxy.proc.poll() is None:
            proxy.proc.send_signal(signal.SIGTERM)
            proxy.proc.wait(10)
        for serve in serves:
            serve.stop()


def _times_tokens(trace: Path, factor: int) -> list[dict]:
    """The records of a kvdrain trace with every request's max_tokens times `factor`."""
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return [
        dict(r, max_tokens=r["max_tokens"] * factor) if "max_tokens" in r else r for r in records
    ]


def _scraped(url: str, name: str) -> dict[tuple, float]:
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as response:
                return _samples(await response.text())

    return {labels: v for (n, labels), v in run(go()).items() if n == name}


def test_the_proxys_prefix_router_sends_a_shared_prompt_to_the_p_it_sent_it_to():
    from replay.vllm.proxy import Proxy, ProxyOptions

    proxy = Proxy(
        ProxyOptions(
            prefill=("http://127.0.0.1:1", "http://127.0.0.1:2"),
            decode=("http://127.0.0.1:3",),
            router="prefix",
            block_size=2,
        )
    )
    shared = {"prompt": "w1 w2 w3 w4 w9"}
    first = proxy.balancer.pick_prefill(proxy._prompt_blocks(shared))
    proxy.balancer.started(first)
    other = proxy.balancer.pick_prefill(proxy._prompt_blocks({"prompt": "w7 w7 w7 w7"}))
    assert other != first
    assert proxy.balancer.pick_prefill(proxy._prompt_blocks({"prompt": "w1 w2 w3 w4 w5"})) == first
    assert (
        proxy._prompt_blocks({"prompt": [1, 2, 3, 4, 5]})
        and len(proxy._prompt_blocks({"prompt": [1, 2, 3]})) == 1
    )


@contextmanager
def two_serves_and_a_decode_serve_behind_the_proxy(liveness: str):
    """Two pd `serve --http` fronts as P0 and P1 (each prefills on its own P and hands the
    KV to its own D: a P that holds blocks for a reader) and a single one as D, behind the
    prefix-routing proxy; yields the proxy's URL."""
    config = EngineConfig(runner="mock", num_blocks=256, liveness=liveness)
    with ExitStack() as stack:
        topologies = ("pd", "pd", "single")
        launches = [
            stack.enter_context(TopologyLaunch(config, KVTransferConfig(), t)) for t in topologies
        ]
        urls = []
        for launch, topology in zip(launches, topologies):  # they start at once; each waited for
            router = launch.wait_ready()
            stack.callback(router.shutdown)
            front = stack.enter_context(
                running_front(router, served_model(router, config, topology))
            )
            urls.append(f"http://127.0.0.1:{front.port}")
        options = ProxyOptions(prefill=tuple(urls[:2]), decode=(urls[2],), router="prefix")
        yield stack.enter_context(running_proxy(options))


def replay_through(url: str, trace: Path):
    http = HttpTargetOptions(url, scrape_interval_s=0.05, tail_s=1.0)
    return run_replay(
        ReplayConfig(
            trace=trace,
            http=http,
            shaping=ShapingOptions(speedup=2.0),
            verify=VerifyOptions(idle_threshold_s=0.5, drain_deadline_s=0.3),
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("liveness", ["legacy", "event"])
def test_through_the_proxy_a_starved_prefill_server_is_judged_in_its_own_window(
    tmp_path: Path, liveness
):
    """Group A's prefix lives on one P, which idles from t=1 to t=4 while group B keeps the
    other P and D busy: no idle gap of the whole trace. The proxy names each request's way,
    so over HTTP that P's own window is judged from its metrics: legacy holds A's last
    blocks through it (exit 1), event frees them (exit 0)."""
    trace = write(tmp_path, two_prefix_groups(pause=(1.0, 4.0), end=5.0, spacing=0.25))
    with two_serves_and_a_decode_serve_behind_the_proxy(liveness) as url:
        result = replay_through(url, trace)
    ways = {r.req_id: [upstream for upstream, _ in r.stages] for r in result.timeline.requests}
    (starved,) = {way[0] for req_id, way in ways.items() if req_id.startswith("a")}
    assert {way[0] for req_id, way in ways.items() if req_id.startswith("b")} == {
        "P1" if starved == "P0" else "P0"
    }
    assert all(way[1:] == ["D"] for way in ways.values()), ways
    assert all(
        is_tail for _, _, is_tail in idle_windows(result.timeline, 0.5)
    )  # the trace never idles
    a = sorted(
        (r for r in result.timeline.requests if r.req_id.startswith("a")), key=lambda r: r.arrival_t
    )
    before, after = [r for r in a if r.arrival_t < 0.5][-1], [r for r in a if r.arrival_t >= 2.0][0]
    own = [w for w in result.verdict.windows if w.engine == f"{starved}:P" and not w.is_tail]
    assert len(own) == 1 and before.first_token_t <= own[0].start and own[0].end <= after.send_t, (
        result.verdict.windows
    )  # inside A's pause (t 1..4 at speedup 2)
    if liveness == "legacy":
        leaks = [w for w in result.verdict.windows if w.verdict == "leak" and not w.is_tail]
        assert {w.engine for w in leaks} == {f"{starved}:P"}, result.verdict.windows
        assert result.verdict.exit_code == 1
    else:
        assert all(w.verdict == "drained" for w in own)
        assert result.verdict.exit_code == 0, (result.verdict.reasons, result.verdict.violations)


def test_the_proxy_names_itself_and_what_is_behind_it_in_its_server_header():
    async def go():
        async with deployment() as (proxy, _, (d,)):
            async with aiohttp.ClientSession() as session:
                async with session.get(d.url + "/v1/models") as response:
                    behind = response.headers["Server"]
                async with session.get(proxy.url + "/v1/models") as response:
                    assert response.headers["Server"] == f"kvdrain proxy, in front of {behind}"
                async with session.post(
                    proxy.url + "/v1/completions", json=CLIENT_REQUEST
                ) as response:
                    await response.read()
                    assert response.headers["Server"] == f"kvdrain proxy, in front of {behind}"
                async with session.get(proxy.url + "/health") as response:
                    assert response.headers["Server"] == "kvdrain proxy"

    run(go())
