"""`kvdrain serve --http`: the HTTP front and the zmq serve on one router, in one asyncio loop. Runs in: frontend process.

The HTTP front owns the router's outputs (it polls it); the zmq serve (replay --target
tcp://, top, --record) keeps working beside it through a SharedRouter, which hands it
the outputs of its own requests and every stats snapshot. With --record the front gives
its requests through a RecordingRouter, so HTTP clients are recorded too (t = 0 at the
first request of either front). Both run in the one thread
of the asyncio loop: the router is never touched from two threads.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable

from replay.openai.bearer import check_http_listen
from replay.openai.protocol import ServedModel
from replay.serve.http_front import HttpFront, HttpFrontOptions
from replay.serve.recorder import RecordingRouter

STOP_CHECK_S = 0.05


class SharedRouter:
    """The router as the zmq serve sees it while the HTTP front polls the real one."""

    def __init__(self, router) -> None:
        self.router = router
        self.outputs: list = []  # the serve's requests' outputs, filled by the front
        self.stats: list = []  # every engine's snapshots, filled by the front

    @property
    def engines(self) -> list[str]:
        return self.router.engines

    @property
    def vocab_size(self) -> int:
        return self.router.vocab_size

    @property
    def has_pending(self) -> bool:
        return self.router.has_pending

    @property
    def errors(self) -> list:
        return self.router.errors

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], max_tokens: int, pd: bool | None = None
    ) -> None:
        self.router.add_request(req_id, prompt_token_ids, max_tokens, pd)

    def abort(self, req_id: str) -> None:
        self.router.abort(req_id)

    def request_stats(self) -> None:
        self.router.request_stats()

    def poll(self, timeout_s: float) -> list:
        outputs, self.outputs = self.outputs, []
        return outputs

    def take_stats(self) -> list:
        stats, self.stats = self.stats, []
        return stats

    def shutdown(self) -> None:
        """The real router is shut down by whoever started it."""


def parse_http_address(text: str) -> tuple[str, int]:
    """PORT, :PORT or HOST:PORT (HOST defaults to 127.0.0.1; port 0 picks a free one)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http: expected [HOST:]PORT, got {text!r}")
    return host, int(port)


def served_model(router, engine, topology: str, name: str) -> ServedModel:
    """What `serve --http` serves: the engines' limits (engine: their EngineConfig)."""
    return ServedModel(
        name,
        engine.max_model_len,
        router.vocab_size,
        engine.block_size,
        tuple(router.engines),
        topology,
        engine.liveness,
    )


class HttpServe:
    """`serve --http`'s part in serve_main: wrap the router for the zmq serve, then run both."""

    def __init__(self, options: HttpFrontOptions, model_name: str, insecure: bool = False) -> None:
        """CredentialError (before anything starts) for a host beyond loopback without an API key,
        unless insecure (then warned about at start)."""
        self.warnings = check_http_listen(options.host, options.api_key, insecure)
        self.options = options
        self.model_name = model_name
        self.shared: SharedRouter | None = None
        self.front: HttpFront | None = None
        self.listening: socket.socket | None = None
        self.url: str | None = None  # http://HOST:PORT once the front listens

    @property
    def num_requests(self) -> int:
        """Requests the HTTP front took (0 before it ran)."""
        return self.front.num_requests if self.front is not None else 0

    def bind(self) -> None:
        """Take the HTTP address now, before any engine starts: OSError (an address in use,
        a host not here) is the caller's one-line error."""
        host, port = self.options.host, self.options.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listening = socket.create_server((host, port), family=family)

    def close(self) -> None:
        """Release the address if the front never took it over."""
        if self.listening is not None:
            self.listening.close()
            self.listening = None

    def share(self, router) -> SharedRouter:
        """The router the zmq serve gets (call first)."""
        self.shared = SharedRouter(router)
        return self.shared

    def run(
        self,
        server,
        engine,
        topology: str,
        on_round: Callable[[object], None],
        should_stop: Callable[[], bool],
    ) -> None:
        """Serve both fronts until should_stop() (or Ctrl-C); `server` is the zmq serve."""
        router = self.shared.router
        taking = router if server.recorder is None else RecordingRouter(router, server.recorder)
        self.front = HttpFront(
            taking,
            served_model(router, engine, topology, self.model_name),
            self.options,
            shared=self.shared,
        )
        self.front.listening, self.listening = self.listening, None
        asyncio.run(self._serve(self.front, server, on_round, should_stop))

    async def _serve(self, front: HttpFront, server, on_round, should_stop) -> None:
        def tick(_: HttpFront) -> None:
            server.run_once(0)
            on_round(server)

        front.on_tick = tick
        await front.start()
        host = front.options.host
        url = f"http://{'[' + host + ']' if ':' in host else host}:{front.port}"
        self.url = url
        print(
            f"kvdrain serve: OpenAI-compatible HTTP on {url} (model {self.model_name!r}; /metrics)",
            flush=True,
        )
        for warning in self.warnings:
            print(warning, file=sys.stderr, flush=True)
        try:
            while not should_stop() and front.pump_error is None:
                await asyncio.sleep(STOP_CHECK_S)
        finally:
            await front.stop()
        if front.pump_error is not None:  # an engine died: the serve ends, as vLLM's does
            raise front.pump_error
