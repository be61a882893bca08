"""A replay over HTTP against a stand-in for a vLLM 0.32 server that says only what vLLM
says: the report and summary describe that server (version, block size, pool, connector,
vocabulary from /tokenize), never kvdrain's engine options; what it does not count
(steps, wake-ups) is unknown, and prefix-cache hits come from its counters."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from tests.e2e.test_cli import invoke
from tests.paths import EXAMPLE

pytestmark = pytest.mark.timeout(120)
HITS_PER_REQUEST = 128


class FakeVllm:
    """vLLM 0.32's answers: /v1/models, /version, /tokenize over a word vocabulary, a
    streamed /v1/completions whose usage has no prompt_tokens_details (vLLM's default),
    and /metrics with KV usage while requests run, cache_config_info, prefix-cache and
    NIXL counters."""

    def __init__(self, cached_tokens: bool = False) -> None:
        self.cached_tokens = cached_tokens
        self.running = 0
        self.num_requests = 0
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.port = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": "tiny", "object": "model", "owned_by": "vllm", "max_model_len": 512}
                ],
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def tokenize(self, request: web.Request) -> web.Response:
        words = (await request.json())["prompt"].split()
        known = [w if w[1:].isdigit() and int(w[1:]) < 512 else "<unk>" for w in words]
        return web.json_response(
            {
                "count": len(words),
                "max_model_len": 512,
                "token_strs": known,
                "tokens": [int(w[1:]) if w != "<unk>" else 512 for w in known],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.running += 1
        self.num_requests += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            last = i == body["max_tokens"] - 1
            choice = {
                "index": 0,
                "text": " w1",
                "token_ids": [1],
                "finish_reason": "length" if last else None,
            }
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            await asyncio.sleep(0.005)
        details = {"cached_tokens": HITS_PER_REQUEST} if self.cached_tokens else None
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": body["max_tokens"],
            "total_tokens": 0,
            "prompt_tokens_details": details,
        }
        await response.write(
            b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
        )
        await response.write(b"data: [DONE]\n\n")
        self.running -= 1
        await response.write_eof()
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        labels = 'engine="0",model_name="tiny"'
        return web.Response(
            text=f"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{labels}}} {self.running * 0.01}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {self.running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{labels}}} 0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="4096"}} 1.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{{labels}}} {1000 + HITS_PER_REQUEST * self.num_requests}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{{labels}}} {5000 + 200 * self.num_requests}
# TYPE vllm:nixl_num_kv_expired_reqs counter
vllm:nixl_num_kv_expired_reqs_total{{{labels}}} 2
"""
        )

    def serve(self) -> None:
        async def main() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_get("/version", self.version)
            app.router.add_post("/tokenize", self.tokenize)
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_get("/metrics", self.metrics)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self.ready.set()
            while not self.stop.is_set():
                await asyncio.sleep(0.02)
            await runner.cleanup()

        asyncio.run(main())


def _replay(tmp_path: Path, fake: FakeVllm, *extra: str):
    thread = threading.Thread(target=fake.serve, daemon=True)
    thread.start()
    try:
        assert fake.ready.wait(20)
        url = f"http://127.0.0.1:{fake.port}"
        report = tmp_path / "report.json"
        result = invoke(
            "replay",
            str(EXAMPLE),
            "--target",
            url,
            "--metrics",
            f"P={url}/metrics",
            "--max-requests",
            "6",
            "--speedup",
            "8",
            "--no-live",
            "--tail",
            "0.3",
            "--idle-threshold",
            "0.3",
            "--drain-deadline",
            "0.2",
            "--scrape-interval",
            "0.05",
            "--report",
            str(report),
            *extra,
        )
    finally:
        fake.stop.set()
        thread.join(20)
    return result, json.loads(report.read_text())


def test_the_report_describes_the_vllm_server_and_not_kvdrains_engine_options(tmp_path: Path):
    result, report = _replay(tmp_path, FakeVllm())
    engine = report["settings"]["engine"]
    assert engine["server"] == "vLLM" and engine["version"] == "0.32.0"
    assert (engine["vocab_size"], engine["vocab_source"], engine["max_model_len"]) == (
        512,
        "/tokenize",
        512,
    )
    assert engine["engines"]["P"] | {"cache_config": None} == {
        "version": "0.32.0",
        "block_size": 128,
        "num_gpu_blocks": 4096,
        "connector": "NixlConnector",
        "cache_config": None,
    }
    assert report["settings"]["kv_transfer"] is None and report["settings"]["topology"] is None
    assert not {"liveness", "num_blocks", "max_num_seqs", "runner", "block_size"} & engine.keys()
    assert (
        "server: vLLM 0.32.0, model 'tiny', max_model_len 512, vocabulary 512 (from /tokenize)"
        in result.output
    )
    assert (
        "  P: version 0.32.0, block size 128, num_gpu_blocks 4,096, connector NixlConnector"
        in result.output
    )


def test_steps_and_wakes_a_server_does_not_count_are_unknown_and_hits_come_from_its_counters(
    tmp_path,
):
    result, report = _replay(tmp_path, FakeVllm())
    (p,) = report["engines"]
    assert (p["num_steps"], p["num_wakeups"], p["num_expired"]) == (None, None, 0)
    row = next(line for line in result.output.splitlines() if line.startswith("P "))
    assert row.split()[-3:] == ["-", "-", "0"]
    requests = report["requests"]
    assert (requests["num_prefix_hit_tokens"], requests["prefix_hits_source"]) == (
        6 * HITS_PER_REQUEST,
        "vllm:prefix_cache_hits_total",
    )
    assert (
        f"prefix-cache hits {6 * HITS_PER_REQUEST:,} (vllm:prefix_cache_hits_total)"
        in result.output
    )


def test_hits_the_server_states_per_request_are_the_requests_own(tmp_path: Path):
    _, report = _replay(tmp_path, FakeVllm(cached_tokens=True))
    assert (
        report["requests"]["num_prefix_hit_tokens"],
        report["requests"]["prefix_hits_source"],
    ) == (6 * HITS_PER_REQUEST, "requests")
