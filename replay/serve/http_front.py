"""kvdrain's OpenAI-compatible HTTP front (`serve --http`): completions, models, health, metrics. Runs in: frontend process.

One asyncio thread owns everything: aiohttp's handlers call the router directly (it is
not thread-safe, and needs no lock here), and a pump task polls the router for outputs
(every millisecond while requests are open, every 10 ms otherwise) and hands each to
its request's queue, and keeps the latest stats snapshot of every engine for /metrics.
When the zmq serve shares the router (replay/serve/fronts.py), the outputs of requests
the front does not own and every stats snapshot go to that SharedRouter for it, and
`on_tick` runs once per pump round to let it work.

A client that disconnects aborts its request (aiohttp cancels the handler, as vLLM
aborts on disconnect); like vLLM's abort path, that counts in no finished-request metric
(vllm:request_success_total, the e2e latency histogram). Nothing a client sends reaches
an engine unchecked (protocol.py); errors are vLLM's JSON error bodies with their status
codes; a missing or wrong API key gets vLLM's auth middleware's 401 {"error": "Unauthorized"}.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from engine.core.outputs import RequestOutput
from engine.proc.messages import StatsSnapshot
from replay.openai import protocol
from replay.openai.bearer import bearer_middleware
from replay.openai.protocol import ApiError, CompletionParams, ServedModel
from replay.openai.tokenizer import WordTokenizer
from replay.serve import chat
from replay.serve.connections import (
    ConnectionGuard,
    GuardedSite,
    QuietLoopErrors,
    connection_cap,
    quiet_logger,
)
from replay.serve.tokenize_endpoint import tokenize_answer
from replay.serve.vllm_metrics import EngineCollector, FrontStats
from replay.verify.stamp import kvdrain_version
from replay.verify.text import printable

POLL_BUSY_S = 0.001
POLL_IDLE_S = 0.010
FIRST_STATS_TIMEOUT_S = 10.0
SERVER_HEADER = "kvdrain (aiohttp)"


@dataclass(frozen=True, slots=True)
class HttpFrontOptions:
    """`serve --http`: where its front listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (HttpFront.port says which)
    api_key: str | None = None
    max_body_bytes: int = 8 << 20  # larger bodies: 413
    # A connection's request head must be whole this long after it opened or its last
    # answer (aiohttp's keep-alive timeout: idle connections close then too).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # a body still not whole after this: 408
    max_connections: int | None = None  # None: connections.connection_cap()


@dataclass(slots=True)
class _Open:
    """A request between its POST and its final output."""

    client_id: str
    params: CompletionParams
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_t: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False  # its final output arrived


class HttpFront:
    server_header = SERVER_HEADER  # for handlers elsewhere (chat.py) that stream

    def __init__(
        self,
        router,
        model: ServedModel,
        options: HttpFrontOptions = HttpFrontOptions(),
        on_tick: Callable[[HttpFront], None] | None = None,
        shared=None,
    ) -> None:
        self.router = router
        self.shared = shared  # a SharedRouter: the co-tenant's outputs and stats go there
        self.model = model
        self.options = options
        self.on_tick = on_tick
        self.listening: socket.socket | None = None  # bound before the engines: see listen()
        self.open: dict[str, _Open] = {}  # internal id -> request
        self.client_ids: dict[str, str] = {}  # client's request id -> internal id
        self.latest: dict[str, StatsSnapshot] = {}
        self.front = {engine: FrontStats() for engine in model.engines}
        self.answering_engine = model.engines[-1]  # D in a P/D topology
        self.num_requests = 0
        self.registry = CollectorRegistry(auto_describe=False)
        prefill = getattr(router, "prefill_finished", None)  # P's prefill-only completions
        self.registry.register(
            EngineCollector(
                model.name,
                list(model.engines),
                model.block_size,
                self.latest,
                self.front,
                (model.engines[0], prefill)
                if prefill is not None and len(model.engines) > 1
                else None,
            )
        )
        self._ids = itertools.count(1)
        self._takes_params = (
            "kv_transfer_params" in inspect.signature(router.add_request).parameters
        )
        self._wake = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.pump_error: BaseException | None = None
        self.port = 0
        self.guard = ConnectionGuard(options.max_connections or connection_cap())

    # ---- life cycle ----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.options.max_body_bytes,
            middlewares=[self._errors, bearer_middleware(self.options.api_key)],
        )
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_routes(chat.routes(self))  # /v1/completions (batches, else self's), chat
        app.router.add_post(
            "/tokenize", self.tokenize
        )  # vLLM's (replay/serve/tokenize_endpoint.py)
        app.router.add_get("/version", self.version)
        return app

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(QuietLoopErrors())
        self._runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.options.header_timeout_s,
            logger=quiet_logger(),
        )
        await self._runner.setup()
        site = GuardedSite(
            self._runner, self.options.host, self.options.port, self.guard, self.listening
        )
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.router.request_stats()
        await self._first_stats()
        self._pump_task = asyncio.create_task(self._pump())

    async def _first_stats(self) -> None:
        """Until every engine has published once (bounded): /metrics is whole from the start."""
        deadline = time.monotonic() + FIRST_STATS_TIMEOUT_S
        while set(self.model.engines) - set(self.latest) and time.monotonic() < deadline:
            self.poll_once()
            await asyncio.sleep(POLL_BUSY_S)

    async def stop(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
            await asyncio.gather(self._pump_task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- the pump ------------------------------------------------------------------

    async def _pump(self) -> None:
        try:
            while True:
                self.poll_once()
                if self.open or getattr(self.router, "has_pending", False):
                    await asyncio.sleep(POLL_BUSY_S)
                    continue
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), POLL_IDLE_S)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # an engine died: /health says so, requests fail
            self.pump_error = e
            for request in self.open.values():
                request.queue.put_nowait(RequestOutput("", [], "error", error=f"engine: {e}"))
            print(f"kvdrain serve --http: {e}", file=sys.stderr, flush=True)

    def poll_once(self) -> None:
        for output in self.router.poll(0):
            request = self.open.get(output.req_id)
            if request is not None:
                request.queue.put_nowait(output)
            elif self.shared is not None:
                self.shared.outputs.append(output)
        for snap in self.router.take_stats():
            self.latest[snap.engine_id] = snap
            if self.shared is not None:
                self.shared.stats.append(snap)
        if self.on_tick is not None:
            self.on_tick(self)

    # ---- middlewares -----------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        self.guard.set_busy(request.transport, True)
        try:
            response = await handler(request)
        except ApiError as e:
            response = _error_response(e)
        except web.HTTPException as e:  # unknown path (404), wrong method (405), 413
            if e.status < 400:
                raise
            response = _error_response(ApiError(e.status, e.text or e.reason, None))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away; its request was aborted
        except Exception as e:  # a bug: say so here (not to the client), keep serving
            said = printable(f"{request.path}: {e!r}", 400)
            print(f"kvdrain serve --http: {said}", file=sys.stderr, flush=True)
            response = _error_response(ApiError(500, f"internal error ({type(e).__name__})"))
        finally:
            self.guard.set_busy(request.transport, False)
        response.headers["Server"] = SERVER_HEADER
        return response

    # ---- handlers ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.pump_error is not None:
            raise ApiError(503, f"engine failure: {self.pump_error}")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model.card()]})

    async def metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encoder(self.registry))
        response.headers["Content-Type"] = content_type
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        return web.json_response(tokenize_answer(body, self.model))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": kvdrain_version()})

    async def read_body(self, request: web.Request) -> object:
        """The request's JSON body, read within body_timeout_s (aiohttp keeps it read)."""
        try:
            raw = await asyncio.wait_for(request.read(), self.options.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {self.options.body_timeout_s:g} s"
            ) from None
        except web.HTTPException:
            raise  # 413: too large
        except web.RequestPayloadError as e:  # a bogus Content-Encoding, a cut body
            raise ApiError(400, f"the request body cannot be read: {e}") from None
        return protocol.decode_body(raw)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        params = protocol.parse_completion(await self.read_body(request), self.model)
        client_id = protocol.check_request_id(
            request.headers.get("X-Request-Id") or params.request_id
        )
        internal_id = self._submit(client_id, params)
        try:
            if params.stream:
                return await self._stream(request, internal_id)
            return await self._complete(internal_id)
        finally:
            self._release(internal_id)

    # ---- request life ----------------------------------------------------------------

    def _submit(self, client_id: str, params: CompletionParams) -> str:
        if self.pump_error is not None:
            raise ApiError(503, f"engine failure: {self.pump_error}")
        if client_id in self.client_ids:
            raise ApiError(400, f"request id {client_id!r} is already in flight", "request_id")
        internal_id = f"{client_id}@http{next(self._ids)}"
        extra = (
            {"kv_transfer_params": params.kv_transfer_params}
            if self._takes_params and params.kv_transfer_params is not None
            else {}
        )
        self.router.add_request(internal_id, params.prompt_token_ids, params.max_tokens, **extra)
        self.num_requests += 1
        self.open[internal_id] = _Open(client_id, params, time.monotonic())
        self.client_ids[client_id] = internal_id
        self._wake.set()
        return internal_id

    def _release(self, internal_id: str) -> None:
        """The handler is done (finished, failed or cancelled): abort what still runs
        (counted in no finished-request metric, as vLLM's abort path counts none)."""
        request = self.open.pop(internal_id, None)
        if request is None:
            return
        del self.client_ids[request.client_id]
        if not request.finished:
            self.router.abort(internal_id)

    async def _next(self, internal_id: str) -> RequestOutput:
        request = self.open[internal_id]
        output = await request.queue.get()
        now = time.monotonic()
        stats = self.front[self.answering_engine]
        if output.new_token_ids and request.first_token_t is None:
            request.first_token_t = now
            stats.ttft.observe(now - request.arrival)
        request.num_output_tokens += len(output.new_token_ids)
        request.num_cached_tokens = max(request.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            request.finished = True
            stats.on_finished(output.finish_reason, now - request.arrival)
        return output

    def _usage(self, internal_id: str) -> dict:
        r = self.open[internal_id]
        return protocol.usage(
            len(r.params.prompt_token_ids), r.num_output_tokens, r.num_cached_tokens
        )

    async def _generate(self, internal_id: str) -> tuple[list[int], RequestOutput]:
        """Every token of a request not streamed, and its last output (a 500 if the engine
        failed it)."""
        tokens: list[int] = []
        while True:
            output = await self._next(internal_id)
            tokens.extend(output.new_token_ids)
            if output.finished:
                break
        if output.finish_reason == "error":
            raise ApiError(500, f"request failed in the engine: {output.error}")
        return tokens, output

    def _choice(self, internal_id: str, tokens: list[int], output: RequestOutput) -> dict:
        """A completion's choice: its text, token ids if asked for, finish and stop reasons."""
        return protocol.choice(
            WordTokenizer.decode(tokens),
            tokens if self.open[internal_id].params.return_token_ids else None,
            protocol.openai_finish_reason(output.finish_reason),
            protocol.ignored_reason(output.finish_reason, len(tokens), output.error),
        )

    async def _complete(self, internal_id: str) -> web.Response:
        tokens, output = await self._generate(internal_id)
        first = protocol.head(
            "cmpl-" + self.open[internal_id].client_id, self.model.name, int(time.time())
        )
        return web.json_response(
            protocol.completion(
                first,
                self._choice(internal_id, tokens, output),
                self._usage(internal_id),
                output.kv_transfer_params,
            )
        )

    async def _stream(self, http_request: web.Request, internal_id: str) -> web.StreamResponse:
        request = self.open[internal_id]
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Server": SERVER_HEADER,
            }
        )
        await response.prepare(http_request)
        first_chunk = protocol.head("cmpl-" + request.client_id, self.model.name, int(time.time()))
        first = True
        while True:
            output = await self._next(internal_id)
            if output.finish_reason == "error":
                error = ApiError(500, f"request failed in the engine: {output.error}")
                await protocol.send_event(response, error.body())
                break
            if output.new_token_ids or output.finished:
                text = WordTokenizer.decode(output.new_token_ids, first)
                first = first and not output.new_token_ids
                await protocol.send_event(
                    response,
                    protocol.stream_chunk(
                        first_chunk,
                        protocol.choice(
                            text,
                            output.new_token_ids if request.params.return_token_ids else None,
                            protocol.openai_finish_reason(output.finish_reason),
                            protocol.ignored_reason(
                                output.finish_reason, request.num_output_tokens, output.error
                            ),
                        ),
                    ),
                )
            if output.finished:
                if request.params.include_usage:
                    await protocol.send_event(
                        response, protocol.usage_chunk(first_chunk, self._usage(internal_id))
                    )
                break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)
