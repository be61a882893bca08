"""Helpers for the HTTP tests: kvdrain's HTTP front, its proxy, or any aiohttp app, on a free loopback port in a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from aiohttp import web

from engine.config import EngineConfig, KVTransferConfig
from replay.deploy.topology import start_topology
from replay.openai.protocol import ServedModel
from replay.serve.http_front import HttpFront, HttpFrontOptions

MODEL_NAME = "kvdrain-mock"


def served_model(router, config: EngineConfig, topology: str) -> ServedModel:
    return ServedModel(
        MODEL_NAME,
        config.max_model_len,
        router.vocab_size,
        config.block_size,
        tuple(router.engines),
        topology,
        config.liveness,
    )


@contextlib.contextmanager
def engines(
    liveness: str = "event",
    topology: str = "pd",
    kv: KVTransferConfig = KVTransferConfig(),
    **overrides,
):
    config = EngineConfig(runner="mock", num_blocks=256, liveness=liveness, **overrides)
    router = start_topology(config, kv, topology)
    try:
        yield router, served_model(router, config, topology)
    finally:
        router.shutdown()


@contextlib.contextmanager
def _in_thread(what: str, serve):
    """serve() (an async context manager) entered in a thread with its own event loop;
    yields what it yields, and leaves it (bounded) at the end."""
    ready, box = threading.Event(), {}

    async def main() -> None:
        async with serve() as value:
            box["value"], box["stop"], box["loop"] = (
                value,
                asyncio.Event(),
                asyncio.get_running_loop(),
            )
            ready.set()
            await box["stop"].wait()

    def run() -> None:
        try:
            asyncio.run(main())
        finally:
            ready.set()

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    assert ready.wait(30) and "value" in box, f"the {what} did not start"
    try:
        yield box["value"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        assert not thread.is_alive(), f"the {what} did not stop"


@contextlib.contextmanager
def running_front(router, model: ServedModel, options: HttpFrontOptions = HttpFrontOptions()):
    """The front serving `router` from a thread with its own event loop; yields it (port set)."""

    @contextlib.asynccontextmanager
    async def serve():
        front = HttpFront(router, model, options)
        await front.start()
        try:
            yield front
        finally:
            await front.stop()

    with _in_thread("HTTP front", serve) as front:
        yield front


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def serving_in_thread(app: web.Application):
    """app on a free loopback port, from a thread with its own event loop; yields its URL."""
    with _in_thread("server", lambda: serving(app)) as url:
        yield url


@contextlib.contextmanager
def running_proxy(options):
    """kvdrain's proxy (replay/vllm/proxy.py ProxyOptions) from a thread with its own event
    loop; yields its URL."""
    from replay.vllm.proxy import Proxy

    @contextlib.asynccontextmanager
    async def serve():
        proxy = Proxy(options)
        await proxy.start()
        try:
            yield proxy.url
        finally:
            await proxy.stop()

    with _in_thread("proxy", serve) as url:
        yield url
