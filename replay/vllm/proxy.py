"""kvdrain's P/D proxy in front of vLLM servers (`kvdrain proxy`). Runs in: proxy process.

vLLM's disaggregated-serving protocol, as its NixlConnector expects it (vLLM ships only a
toy proxy, in its tests): a completion goes to a prefill server (P) with `max_tokens: 1`,
`stream: false` and `kv_transfer_params` asking it to hold the prompt's KV for a remote
decode; P answers with the `kv_transfer_params` that say where the blocks are; then the
original request goes to a decode server (D) with those params, and D's answer is the
client's. D's body, streamed or not, is passed through unchanged, chunk by chunk as it
arrives, so latencies measured through the proxy are D's and not the proxy's.

An upstream's error (any status other than 200) is forwarded with its status and body;
an upstream that cannot be reached is a 502 with an OpenAI-style error body naming it.
Which P and which D serve a request: balance.py's Balancer under `--router` (round-robin,
as vLLM's toy proxy; least-loaded, by the requests the proxy has in flight at each; prefix,
by the proxy's own table of the prompt blocks it sent to each P: it cannot see a server's
real cache, so a prefix a P has evicted still counts there). /v1/models, /version and
/tokenize are the first D's (a replay learns the server's version and vocabulary through them),
/health is 200 only when every upstream's /health is, and /metrics is the proxy's own.
Its Server header is "kvdrain proxy", and on an upstream's answer "kvdrain proxy, in front
of <the upstream's Server>", so a replay's first line names both.

Every completion's answer, streamed or not, errors included, names its way in ROUTE_HEADER (replay/openai/route_header.py):
the upstreams it went to, P then D, by the names /health gives them (the names a replay's
scrape gives their engines), so an HTTP replay judges each engine in its own idle windows
(replay/verify/windows.py); a proxy that does not say is judged by role, as any server.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from engine.core.block_hash import hash_request_blocks
from replay.deploy.placement import ROUTER_POLICIES, Balancer
from replay.openai import pool
from replay.openai.bearer import bearer_middleware, check_http_listen
from replay.openai.route_header import route_headers

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
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("Content-Type", "Cache-Control", "X-Request-Id")
SERVER = (
    "kvdrain proxy"  # its Server header; an upstream's answer adds ", in front of <its Server>"
)
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


class ProxyError(ValueError):
    """Options the proxy cannot run with (the CLI's usage error)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    """One vLLM server behind the proxy: its name (P, D, or P0, P1, ... when several) and base URL."""

    name: str
    url: str  # scheme://host:port, no trailing slash


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyOptions:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, printed in the ready line
    api_key: str | None = None  # clients must send 'Authorization: Bearer KEY' on /v1
    upstream_api_key: str | None = None  # sent to every upstream as 'Authorization: Bearer KEY'
    insecure: bool = False  # listen beyond loopback without --api-key
    connect_timeout_s: float = 10.0
    health_timeout_s: float = 5.0
    router: str = "round-robin"  # balance.py's policy
    block_size: int = 16  # the prefix table's block, in prompt tokens (ids) or words (text)

    def __post_init__(self) -> None:
        if self.router not in ROUTER_POLICIES:
            raise ProxyError(f"--router: must be one of {ROUTER_POLICIES}, got {self.router!r}")
        if not self.prefill or not self.decode:
            raise ProxyError("--prefill and --decode: give at least one URL of each")
        for url in self.prefill + self.decode:
            base_url(url)
        if not 0 <= self.port <= 65535:
            raise ProxyError(f"--port: {self.port} is not a port")
        if self.api_key == "":
            raise ProxyError("--api-key: must not be empty")


def base_url(url: str) -> str:
    """http(s)://HOST:PORT from a server URL (a trailing / or /v1 is dropped); ProxyError if not one."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or path not in ("", "/v1")
        or parts.query
        or parts.fragment
    ):
        raise ProxyError(f"{url!r}: expected http://HOST:PORT (a vLLM server's address)")
    try:
        _ = parts.port
    except ValueError:
        raise ProxyError(f"{url!r}: the port is not a number") from None
    return f"{parts.scheme}://{parts.netloc}"


def name_upstreams(role: str, urls: tuple[str, ...]) -> list[Upstream]:
    """role 'P' or 'D': one URL is named after the role, several are role0, role1, ..."""
    if len(urls) == 1:
        return [Upstream(name=role, url=base_url(urls[0]))]
    return [Upstream(name=f"{role}{i}", url=base_url(u)) for i, u in enumerate(urls)]


def check_listen(options: ProxyOptions) -> list[str]:
    """Refuse (CredentialError) to listen beyond loopback without --api-key or --insecure; warnings."""
    return check_http_listen(options.host, options.api_key, options.insecure, flag="--host")


def prefill_request(body: dict) -> dict:
    """What P gets: the request cut to one token, not streamed, holding its KV for a remote decode."""
    request = {k: v for k, v in copy.deepcopy(body).items() if k not in NOT_FOR_PREFILL}
    request["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_request(body: dict, prefill_answer: dict) -> dict:
    """What D gets: the client's request with the kv_transfer_params P answered (if any)."""
    request = dict(body)
    params = prefill_answer.get("kv_transfer_params")
    if params:
        request["kv_transfer_params"] = params
    return request


def error_body(status: int, message: str) -> dict:
    """An OpenAI-style error body, as vLLM answers."""
    kinds = {
        400: "BadRequestError",
        401: "Unauthorized",
        502: "BadGatewayError",
        503: "ServiceUnavailableError",
    }
    return {
        "error": {
            "message": message,
            "type": kinds.get(status, "Error"),
            "param": None,
            "code": status,
        }
    }


class Unreachable(Exception):
    """An upstream that could not be reached or broke its answer off."""

    def __init__(
        self, upstream: Upstream, stage: str, cause: BaseException, route: tuple[str, ...] = ()
    ) -> None:
        said = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        super().__init__(f"{stage} server {upstream.name} ({upstream.url}) is unreachable: {said}")
        self.route = route  # the completion's way so far (empty: not a completion)


class ProxyMetrics:
    """The proxy's own /metrics: upstream requests by stage and status, and their latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvdrain_proxy_requests",
            "Requests sent upstream, by stage "
            "(prefill, decode, models, version, tokenize) and answer status ('unreachable': none).",
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

    def observe(self, stage: str, upstream: Upstream, status: str, start: float) -> None:
        self.requests.labels(stage, upstream.name, status).inc()
        self.latency.labels(stage, upstream.name).observe(time.monotonic() - start)


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
        self.session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[bearer_middleware(self.options.api_key), self._unreachable],
            client_max_size=64 << 20,
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=pool.connector())
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port)
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
    async def _unreachable(self, request: web.Request, handler):
        try:
            return await handler(request)
        except Unreachable as e:
            return web.json_response(
                error_body(502, str(e)), status=502, headers=route_headers(e.route)
            )

    # ---- handlers --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            return web.json_response(error_body(400, f"malformed JSON body: {e}"), status=400)
        if not isinstance(body, dict):
            return web.json_response(error_body(400, "the body must be a JSON object"), status=400)
        request_id = request.headers.get("X-Request-Id") or f"proxy-{uuid.uuid4().hex}"
        prefill = self.upstreams[self.balancer.pick_prefill(self._prompt_blocks(body))]
        self.balancer.started(prefill.name)
        try:
            answer = await self._prefill(prefill, request.path, prefill_request(body), request_id)
        finally:
            self.balancer.ended(prefill.name)
        if isinstance(answer, web.Response):
            return answer
        decode = self.upstreams[self.balancer.pick_decode()]
        self.balancer.started(decode.name)
        try:
            return await self._decode(
                request, (prefill, decode), decode_request(body, answer), request_id
            )
        finally:
            self.balancer.ended(decode.name)

    async def _prefill(
        self, upstream: Upstream, path: str, body: dict, request_id: str
    ) -> dict | web.Response:
        """P's JSON answer, or the response that ends the request (P's error, forwarded)."""
        start, route = time.monotonic(), (upstream.name,)
        try:
            async with self.session.post(
                upstream.url + path, json=body, headers=self._headers(request_id)
            ) as answer:
                data = await answer.read()
        except aiohttp.ClientError as e:
            self.metrics.observe("prefill", upstream, "unreachable", start)
            raise Unreachable(upstream, "prefill", e, route) from None
        self.metrics.observe("prefill", upstream, str(answer.status), start)
        if answer.status != 200:
            return _forwarded(answer, data, route)
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            parsed = None
        if not isinstance(parsed, dict):
            return web.json_response(
                error_body(
                    502,
                    f"prefill server {upstream.name} "
                    f"({upstream.url}) answered 200 without a "
                    f"JSON object",
                ),
                status=502,
                headers=route_headers(route),
            )
        return parsed

    async def _decode(
        self, request: web.Request, way: tuple[Upstream, Upstream], body: dict, request_id: str
    ) -> web.StreamResponse:
        """D's answer passed through as it arrives: status, content type and bytes unchanged
        (way: the P that prefilled it and this D)."""
        upstream, route = way[1], tuple(u.name for u in way)
        start = time.monotonic()
        status = "unreachable"
        try:
            async with self.session.post(
                upstream.url + request.path, json=body, headers=self._headers(request_id)
            ) as answer:
                status = str(answer.status)
                return await _pass_through(request, answer, route)
        except aiohttp.ClientError as e:
            if status != "unreachable":  # D broke off an answer already begun: cut the client off
                status = "broken"
                print(
                    f"kvdrain proxy: decode server {upstream.name} broke off its answer: {e!r}",
                    file=sys.stderr,
                    flush=True,
                )
                raise
            raise Unreachable(upstream, "decode", e, route) from None
        finally:
            self.metrics.observe("decode", upstream, status, start)

    async def forward(self, request: web.Request) -> web.Response:
        """A D's answer to the same request (/v1/models, /version, /tokenize)."""
        upstream, stage = self.decode[0], request.path.strip("/").removeprefix("v1/")
        start = time.monotonic()
        headers = self._headers()
        if request.content_type == "application/json":
            headers["Content-Type"] = "application/json"
        try:
            async with self.session.request(
                request.method,
                upstream.url + request.path,
                data=await request.read(),
                headers=headers,
            ) as answer:
                data = await answer.read()
        except aiohttp.ClientError as e:
            self.metrics.observe(stage, upstream, "unreachable", start)
            raise Unreachable(upstream, "decode", e) from None
        self.metrics.observe(stage, upstream, str(answer.status), start)
        return _forwarded(answer, data)

    async def health(self, request: web.Request) -> web.Response:
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
                return "ok" if answer.status == 200 else f"status {answer.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"unreachable: {e!r}"

    async def serve_metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encoder(self.metrics.registry))
        response.headers["Content-Type"] = content_type
        return response


def _passed(answer: aiohttp.ClientResponse, route: tuple[str, ...] = ()) -> dict[str, str]:
    passed = {h: answer.headers[h] for h in PASSED_HEADERS if h in answer.headers}
    if answer.headers.get("Server"):
        passed["Server"] = f"{SERVER}, in front of {answer.headers['Server']}"
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


async def _pass_through(
    request: web.Request, answer: aiohttp.ClientResponse, route: tuple[str, ...]
) -> web.StreamResponse:
    """D's answer to the client as it arrives; a client that left (its connection closing
    under a write) ends it there, and is not D breaking off."""
    response = web.StreamResponse(status=answer.status, headers=_passed(answer, route))
    await response.prepare(request)
    async for chunk in answer.content.iter_any():
        if not await _to_client(response.write(chunk)):
            return response
    await _to_client(response.write_eof())
    return response


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


def proxy_main(options: ProxyOptions) -> int:
    """`kvdrain proxy`: the exit status (130 on SIGINT, 143 on SIGTERM, 2 if it cannot listen)."""

    def say(line: str) -> None:
        print(line, flush=True)

    for warning in check_listen(options):
        print(warning, file=sys.stderr, flush=True)
    try:
        return asyncio.run(run_proxy(options, say))
    except OSError as e:
        print(
            f"kvdrain proxy: cannot listen on {options.host}:{options.port}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    except KeyboardInterrupt:
        return 130
