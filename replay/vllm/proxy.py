"""kvdrain's P/D proxy in front of vLLM servers (`kvdrain proxy`). Runs in: proxy process.

A completion is prefilled on a P, then decoded on a D (pd_request.py: vLLM's protocol, as
its NixlConnector expects it; vLLM ships only a toy proxy, in its tests). D's body,
streamed or not, is passed through unchanged, chunk by chunk as it arrives, so latencies
measured through the proxy are D's and not the proxy's.

An upstream's error (any status other than 200) is forwarded with its status and body;
one that cannot be reached is a 502, one too slow a 504 (upstream.py's timeouts), each
with an OpenAI-style error body naming it; an answer already begun is cut off instead,
said in one line on stderr. Bounded: a client's body (413), the requests at each upstream
(503), P's answer (502); nothing a client or an upstream does prints a traceback.

Which P and which D serve a request: balance.py's Balancer under `--router` (round-robin,
as vLLM's toy proxy; least-loaded, by the requests the proxy has in flight at each; prefix,
by the proxy's own table of the prompt blocks it sent to each P: it cannot see a server's
real cache, so a prefix a P has evicted still counts there). /v1/models, /version and
/tokenize are the first D's (a replay learns the server's version and vocabulary through them),
/health is 200 only while every upstream's /health is and none timed out in the last
minute, and /metrics is the proxy's own.
Its Server header is "kvdrain proxy", and on an upstream's answer "kvdrain proxy, in front
of <the upstream's Server>", so a replay's first line names both.

Every completion's answer, streamed or not, errors included, names its way in
ROUTE_HEADER (replay/openai/route_header.py): the upstreams it went to, P then D, by the
names /health gives them (the names a replay's scrape gives their engines), so an HTTP
replay judges each engine in its own idle windows (replay/verify/windows.py); a proxy
that does not say is judged by role, as any server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import signal
import sys
import time
import uuid

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from engine.core.block_hash import hash_request_blocks
from replay.deploy.placement import Balancer
from replay.openai import pool
from replay.openai.bearer import bearer_middleware, check_http_listen
from replay.openai.protocol import ApiError
from replay.openai.route_header import route_headers
from replay.serve.connections import (
    ConnectionGuard,
    GuardedSite,
    QuietLoopErrors,
    connection_cap,
    quiet_logger,
)
from replay.verify.text import printable
from replay.vllm.pd_request import (
    decode_request,
    encode,
    kv_transfer_params,
    off_loop,
    prepare,
)
from replay.vllm.proxy_options import ProxyOptions, base_url
from replay.vllm.upstream import (
    Exchange,
    TimeoutLog,
    Upstream,
    UpstreamError,
    UpstreamTimedOut,
)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("Content-Type", "Cache-Control", "X-Request-Id")
SERVER = (
    "kvdrain proxy"  # its Server header; an upstream's answer adds ", in front of <its Server>"
)
WHO = "kvdrain proxy"  # how its lines on stderr begin
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
EXIT_SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 143}


def name_upstreams(role: str, urls: tuple[str, ...]) -> list[Upstream]:
    """role 'P' or 'D': one URL is named after the role, several are role0, role1, ..."""
    if len(urls) == 1:
        return [Upstream(name=role, url=base_url(urls[0]))]
    return [Upstream(name=f"{role}{i}", url=base_url(u)) for i, u in enumerate(urls)]


def check_listen(options: ProxyOptions) -> list[str]:
    """Refuse (CredentialError) beyond loopback without --api-key or --insecure; warnings."""
    return check_http_listen(options.host, options.api_key, options.insecure, flag="--host")


def error_response(status: int, message: str, route: tuple[str, ...] = ()) -> web.Response:
    """An OpenAI-style error answer, as vLLM gives them."""
    body = ApiError(status, message).body()
    return web.json_response(body, status=status, headers=route_headers(route))


class ProxyMetrics:
    """The proxy's own /metrics: upstream requests by stage and status, and their latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvdrain_proxy_requests",
            "Requests sent upstream, by stage (prefill, decode, models, version, tokenize) and "
            "answer status ('unreachable': none; 'timeout': too slow; 'broken': cut off).",
            ["stage", "upstream", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvdrain_proxy_upstream_latency_seconds",
            "From sending a request upstream to the end of its answer.",
            ["stage", "upstream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, exchange: Exchange) -> None:
        stage, name = exchange.stage, exchange.upstream.name
        self.requests.labels(stage, name, exchange.outcome).inc()
        self.latency.labels(stage, name).observe(time.monotonic() - exchange.started)


class Proxy:
    """The aiohttp app and its upstream session; start() binds, stop() closes both."""

    def __init__(self, options: ProxyOptions) -> None:
        self.options = options
        self.prefill = name_upstreams("P", options.prefill)
        self.decode = name_upstreams("D", options.decode)
        self.metrics = ProxyMetrics()
        self.balancer = Balancer(
            [u.name for u in self.prefill], [u.name for u in self.decode], options.router
        )
        self.upstreams = {u.name: u for u in self.prefill + self.decode}
        self.timeouts = TimeoutLog()
        self.guard = ConnectionGuard(options.max_connections or connection_cap())
        self.session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[bearer_middleware(self.options.api_key), self._errors],
            client_max_size=self.options.max_body_bytes,
        )
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.completions)
        app.router.add_get("/v1/models", self.forward)
        app.router.add_get("/version", self.forward)
        app.router.add_post("/tokenize", self.forward)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.serve_metrics)
        app.on_response_prepare.append(_name_server)
        return app

    async def start(self) -> None:
        asyncio.get_running_loop().set_exception_handler(QuietLoopErrors(WHO))
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.timeouts.connect_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=pool.connector())
        self._runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.options.header_timeout_s,
            logger=quiet_logger(WHO),
        )
        await self._runner.setup()
        site = GuardedSite(self._runner, self.options.host, self.options.port, self.guard)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.session is not None:
            await self.session.close()

    def _prompt_blocks(self, body: dict) -> list:
        """The prompt's full blocks as hashes, for the prefix policy (empty for the others)."""
        if self.options.router != "prefix":
            return []
        prompt = body.get("prompt", body.get("messages", ""))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return hash_request_blocks(prompt, self.options.block_size, [])
        words = (prompt if isinstance(prompt, str) else json.dumps(prompt)).split()
        size, hashes, parent = self.options.block_size, [], b""
        for end in range(size, len(words) + 1, size):  # chained, as a block hash is
            parent = hashlib.sha256(parent + " ".join(words[end - size : end]).encode()).digest()[
                :16
            ]
            hashes.append(parent)
        return hashes

    def _headers(self, request_id: str | None = None) -> dict[str, str]:
        headers = {}
        if self.options.upstream_api_key is not None:
            headers["Authorization"] = f"Bearer {self.options.upstream_api_key}"
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        return headers

    # ---- middleware ------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        self.guard.set_busy(request.transport, True)  # never evicted while it is answered
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e.status, e.message)
        except UpstreamError as e:
            return error_response(e.status, str(e), e.route)
        except web.HTTPException as e:  # unknown path (404), wrong method (405)
            if e.status < 400:
                raise
            return error_response(e.status, e.text or e.reason)
        finally:
            self.guard.set_busy(request.transport, False)

    # ---- handlers --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await self._read(request)
        body, to_prefill = await off_loop(len(raw), prepare, raw)
        blocks = await off_loop(len(raw), self._prompt_blocks, body)
        prefill = self.upstreams[self.balancer.pick_prefill(blocks)]
        self._admit("prefill", [prefill])
        self._admit("decode", self.decode)
        request_id = request.headers.get("X-Request-Id") or f"proxy-{uuid.uuid4().hex}"
        self.balancer.started(prefill.name)
        try:
            answer = await self._prefill(prefill, request.path, to_prefill, request_id)
        finally:
            self.balancer.ended(prefill.name)
        if isinstance(answer, web.Response):
            return answer
        to_decode = await off_loop(len(raw), _decode_bytes, body, answer)
        decode = self.upstreams[self.balancer.pick_decode()]
        self.balancer.started(decode.name)
        try:
            return await self._decode(request, (prefill, decode), to_decode, request_id)
        finally:
            self.balancer.ended(decode.name)

    async def _read(self, request: web.Request) -> bytes:
        """The client's body: at most max_body_bytes (413), whole within body_timeout_s (408)."""
        limit, said = self.options.max_body_bytes, request.content_length
        too_large = ApiError(413, f"the request body is larger than {limit} bytes")
        if said is not None and said > limit:
            raise too_large
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {self.options.body_timeout_s:g} s"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except web.RequestPayloadError as e:  # a bogus Content-Encoding, a cut body
            raise ApiError(400, f"the request body cannot be read: {printable(e)}") from None

    def _admit(self, role: str, upstreams: list[Upstream]) -> None:
        """503 if every one of the upstreams holds max_in_flight requests already. D's are
        asked before P is: a request admitted is decoded even if its D filled up while P
        prefilled (refused then, it would leave P holding its KV for a decode that never
        comes)."""
        cap = self.options.max_in_flight
        if any(self.balancer.num_in_flight[u.name] < cap for u in upstreams):
            return
        names = ", ".join(f"{u.name} ({u.url})" for u in upstreams)
        held = f"{cap} request{'s' * (cap != 1)} in flight"
        raise ApiError(
            503,
            f"{role} server {names} has {held}, its cap (--max-in-flight {cap}): try again later"
            if len(upstreams) == 1
            else f"{role} servers {names} have {held} each, their cap (--max-in-flight {cap}): "
            f"try again later",
        )

    @contextlib.asynccontextmanager
    async def _exchange(self, exchange: Exchange, method: str, path: str, data: bytes, headers):
        """The upstream's answer, its head read within first_byte_s; on leaving, the
        exchange is counted in /metrics, a timeout noted for /health, and a failed
        answer's connection closed (vLLM aborts a request whose client is gone)."""
        try:
            answer = await exchange.step(
                self.session.request(
                    method, exchange.upstream.url + path, data=data, headers=headers
                ),
                self.options.timeouts.first_byte_s,
                "sent no answer",
            )
            exchange.status = answer.status
            try:
                yield answer
            except BaseException:
                answer.close()
                raise
            finally:
                answer.release()
        except UpstreamTimedOut as e:
            self.timeouts.note(e)
            raise
        finally:
            self.metrics.observe(exchange)

    async def _read_answer(self, exchange: Exchange, answer, limit: int) -> bytes:
        """An answer's whole body, each read within idle_s; UpstreamError past `limit` bytes."""
        data = bytearray()
        while chunk := await exchange.step(
            answer.content.readany(), self.options.timeouts.idle_s, "sent nothing more"
        ):
            data += chunk
            if len(data) > limit:
                raise UpstreamError(
                    exchange.upstream,
                    exchange.role,
                    f"answered more than {limit} bytes",
                    exchange.route,
                )
        return bytes(data)

    async def _prefill(
        self, upstream: Upstream, path: str, data: bytes, request_id: str
    ) -> dict | None | web.Response:
        """P's kv_transfer_params, or the response that ends the request (P's error, forwarded)."""
        exchange = Exchange(upstream, "prefill", self.options.timeouts, (upstream.name,))
        headers = {**self._headers(request_id), "Content-Type": "application/json"}
        async with self._exchange(exchange, "POST", path, data, headers) as answer:
            raw = await self._read_answer(exchange, answer, self.options.max_prefill_answer_bytes)
            if answer.status != 200:
                return _forwarded(answer, raw, exchange.route)
        return _params(exchange, raw)

    async def _decode(
        self, request: web.Request, way: tuple[Upstream, Upstream], data: bytes, request_id: str
    ) -> web.StreamResponse:
        """D's answer passed through as it arrives: status, content type and bytes unchanged
        (way: the P that prefilled it and this D)."""
        route = tuple(u.name for u in way)
        exchange = Exchange(way[1], "decode", self.options.timeouts, route)
        headers = {**self._headers(request_id), "Content-Type": "application/json"}
        async with self._exchange(exchange, "POST", request.path, data, headers) as answer:
            return await self._pass_through(request, exchange, answer)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """A D's answer to the same request (/v1/models, /version, /tokenize)."""
        stage = request.path.strip("/").removeprefix("v1/")
        exchange = Exchange(self.decode[0], stage, self.options.timeouts, role="decode")
        headers = self._headers()
        if request.content_type == "application/json":
            headers["Content-Type"] = "application/json"
        data = await self._read(request)
        async with self._exchange(exchange, request.method, request.path, data, headers) as answer:
            return await self._pass_through(request, exchange, answer)

    async def _pass_through(
        self, request: web.Request, exchange: Exchange, answer: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """An answer to the client as it arrives, each read within idle_s. A client that
        left (its connection closing under a write) ends it there, and is not the
        upstream's failure; an upstream that breaks it off or stalls cuts it off."""
        response = web.StreamResponse(status=answer.status, headers=_passed(answer, exchange.route))
        await response.prepare(request)
        try:
            while chunk := await exchange.step(
                answer.content.readany(), self.options.timeouts.idle_s, "sent nothing more"
            ):
                if not await _to_client(response.write(chunk)):
                    return response
        except UpstreamError as e:
            self._cut_off(request, answer, e)
            return response
        await _to_client(response.write_eof())
        return response

    def _cut_off(self, request: web.Request, answer, error: UpstreamError) -> None:
        """An answer begun that its upstream broke off or let stall: no error can be sent
        any more, so the client's connection is closed (it sees the answer cut, never a
        clean end), the upstream's too, and one line says why."""
        if isinstance(error, UpstreamTimedOut):
            self.timeouts.note(error)
            said = f"{error}; its answer to the client is cut off"
        else:
            said = f"{error.role} server {error.upstream.name} broke off its answer: {error.cause}"
        print(f"{WHO}: {printable(said, 400)}", file=sys.stderr, flush=True)
        answer.close()
        if request.transport is not None:
            request.transport.close()

    async def health(self, request: web.Request) -> web.Response:
        """200 and status ok while every upstream's /health is and none timed out in the
        last minute; 503 otherwise, each upstream's status beside."""
        upstreams = self.prefill + self.decode
        states = await asyncio.gather(*(self._health_of(u) for u in upstreams))
        healthy = all(state == "ok" for state in states)
        body = {
            "status": "ok" if healthy else "unhealthy",
            "upstreams": {u.name: {"url": u.url, "status": s} for u, s in zip(upstreams, states)},
        }
        return web.json_response(body, status=200 if healthy else 503)

    async def _health_of(self, upstream: Upstream) -> str:
        timeout = aiohttp.ClientTimeout(total=self.options.health_timeout_s)
        try:
            async with self.session.get(
                upstream.url + "/health", headers=self._headers(), timeout=timeout
            ) as answer:
                await answer.read()
                state = "ok" if answer.status == 200 else f"status {answer.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            state = f"unreachable: {printable(repr(e))}"
        return self.timeouts.recent(upstream.name) or state

    async def serve_metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encoder(self.metrics.registry))
        response.headers["Content-Type"] = content_type
        return response


def _decode_bytes(body: dict, kv_transfer_params: dict | None) -> bytes:
    return encode(decode_request(body, kv_transfer_params))


def _params(exchange: Exchange, raw: bytes) -> dict | None:
    """The kv_transfer_params of P's answer; UpstreamError if it is no JSON object or they
    are not one."""
    try:
        answer = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        said = "answered 200 without a JSON object"
        raise UpstreamError(exchange.upstream, exchange.role, said, exchange.route)
    try:
        return kv_transfer_params(answer)
    except ValueError as e:
        said = f"answered {e}"
        raise UpstreamError(exchange.upstream, exchange.role, said, exchange.route) from None


def _passed(answer: aiohttp.ClientResponse, route: tuple[str, ...] = ()) -> dict[str, str]:
    passed = {h: printable(answer.headers[h]) for h in PASSED_HEADERS if h in answer.headers}
    if answer.headers.get("Server"):
        passed["Server"] = f"{SERVER}, in front of {printable(answer.headers['Server'])}"
    return {**passed, **route_headers(route)}


async def _name_server(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer names the proxy (aiohttp would name itself), and an upstream's answer
    what is behind it."""
    if not response.headers.get("Server", "").startswith(SERVER):
        response.headers["Server"] = SERVER


def _forwarded(
    answer: aiohttp.ClientResponse, data: bytes, route: tuple[str, ...] = ()
) -> web.Response:
    """An upstream's whole answer, status and body as it gave them."""
    return web.Response(status=answer.status, body=data, headers=_passed(answer, route))


async def _to_client(write) -> bool:
    """Await a write to the client; False if its connection is gone (aiohttp's
    ClientConnectionResetError is a ConnectionResetError, and a ClientError as D's are)."""
    try:
        await write
    except ConnectionResetError:
        return False
    return True


async def run_proxy(options: ProxyOptions, say=print) -> int:
    """Serve until SIGINT or SIGTERM; 128 + the signal's number (130, 143)."""
    proxy = Proxy(options)
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[int] = loop.create_future()
    for sig, code in EXIT_SIGNALS.items():
        loop.add_signal_handler(sig, lambda code=code: stopped.done() or stopped.set_result(code))
    try:
        await proxy.start()
        say(f"proxy ready {proxy.url}")
        names = ", ".join(f"{u.name}={u.url}" for u in proxy.prefill + proxy.decode)
        say(f"kvdrain proxy: {names}")
        return await stopped
    finally:
        await proxy.stop()
        for sig in EXIT_SIGNALS:
            loop.remove_signal_handler(sig)
