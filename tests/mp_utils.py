"""Helpers for multiprocess tests: every wait is a bounded receive, never a sleep.

Everything goes through the router, so P's outputs are always forwarded to D while a
test waits for stats; user-facing outputs are kept in a backlog for `collect`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time

import zmq

from connector.messages import CONNECTOR_CODEC, KVCacheRegistered, RegisterKVCache, WorkerReady
from connector.worker_proc import ConnectorWorkerConfig, run_connector_worker
from engine.config import EngineConfig, KVTransferConfig, ModelConfig
from engine.core.outputs import RequestOutput
from engine.proc.messages import StatsSnapshot
from engine.runner.kv_cache import KVCache
from replay.deploy.pd_router import PDRouter
from replay.deploy.topology import start_topology


def mock_tokens(prompt: list[int], max_tokens: int, vocab: int = 512) -> list[int]:
    """What MockModelRunner generates: last + 1, modulo the vocabulary."""
    return [(prompt[-1] + 1 + i) % vocab for i in range(max_tokens)]


class Harness:
    def __init__(self, router: PDRouter) -> None:
        self.router = router
        self.clients = router.clients
        self.backlog: list[RequestOutput] = []

    def add_request(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.router.add_request(req_id, prompt, max_tokens)

    def poll(self, timeout_s: float) -> None:
        self.backlog.extend(self.router.poll(timeout_s))

    def collect(self, req_ids: set[str], timeout_s: float = 20.0) -> dict[str, dict]:
        """Poll until every request in req_ids finished; returns tokens and finish reasons."""
        tokens: dict[str, list] = {r: [] for r in req_ids}
        finished: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            for output in self.backlog:
                tokens[output.req_id].extend(output.new_token_ids)
                if output.finished:
                    finished[output.req_id] = output.finish_reason
            self.backlog.clear()
            if set(finished) == req_ids:
                return {"tokens": tokens, "reasons": finished}
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"unfinished after {timeout_s} s: {sorted(req_ids - set(finished))}"
                )
            self.poll(0.05)

    def stats(self, engine: str, timeout_s: float = 5.0) -> StatsSnapshot:
        """Ask an engine for a snapshot and wait (bounded) until a newer one arrives."""
        client = self.clients[engine]
        asked = time.monotonic()  # one host, one clock: the answer is stamped after this
        client.request_stats()
        deadline = asked + timeout_s
        while client.latest_stats is None or client.latest_stats.monotonic < asked:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stats from engine {engine} in {timeout_s} s")
            self.poll(0.02)
        return client.latest_stats

    def wait_for_stats(self, engine: str, predicate, timeout_s: float) -> StatsSnapshot | None:
        """The first snapshot that satisfies predicate, or None at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = self.stats(engine)
            if predicate(snap):
                return snap
            self.poll(0.02)
        return None

    def idle_for(self, seconds: float) -> None:
        """Let `seconds` pass with no traffic, still receiving whatever arrives."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.poll(min(left, 0.1))


@contextlib.contextmanager
def topology(
    liveness: str = "event",
    topology_name: str = "pd",
    policy: str = "recompute",
    runner: str = "mock",
    device: str = "cpu",
    **kv_options,
):
    base = EngineConfig(
        num_blocks=128,
        block_size=4,
        liveness=liveness,
        kv_load_failure_policy=policy,
        runner=runner,
        device=device,
    )
    router = start_topology(base, KVTransferConfig(**kv_options), topology_name)
    try:
        yield Harness(router)
    finally:
        router.shutdown()


def _recv_one(sock: zmq.Socket, timeout_s: float) -> bytes:
    assert sock.poll(int(timeout_s * 1000)), "no message in time"
    return sock.recv()


@contextlib.contextmanager
def spawned_p_worker(tmp_path, **config_kw):
    """A real prefill connector worker process with its KV cache registered:
    yields (config, cache, agent, peer); killed and closed on the way out."""
    ctx = zmq.Context.instance()
    config = ConnectorWorkerConfig(
        engine_id="P",
        agent_addr=f"ipc://{tmp_path}/agent",
        kv_addr=f"ipc://{tmp_path}/kv",
        **config_kw,
    )
    cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=4)
    agent, peer = ctx.socket(zmq.PAIR), ctx.socket(zmq.DEALER)
    proc = multiprocessing.get_context("spawn").Process(target=run_connector_worker, args=(config,))
    proc.start()
    try:
        for sock, addr in ((agent, config.agent_addr), (peer, config.kv_addr)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
        assert isinstance(CONNECTOR_CODEC.decode(_recv_one(agent, 60)), WorkerReady)
        agent.send(CONNECTOR_CODEC.encode(RegisterKVCache("P", cache.handle.to_dict())))
        assert CONNECTOR_CODEC.decode(_recv_one(agent, 60)) == KVCacheRegistered(
            "P", cache.num_blocks
        )
        yield config, cache, agent, peer
    finally:
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        agent.close()
        peer.close()
        cache.close()
