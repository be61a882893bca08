"""The HTTP replay's parts: one replay over HTTP (used by the server and CLI tests), and the
scraper's reading of vLLM, older vLLM, SGLang and kvdrain expositions."""

from __future__ import annotations

import pytest

from replay.metrics.scrape import MetricsSource, choose_metric, parse_metrics, read_engines
from replay.target.client import HttpReplay, HttpTargetOptions
from replay.trace.reader import read_trace
from replay.trace.shaping import ShapingOptions, shape
from replay.verify.outcome import http_verdict
from replay.verify.rules import VerifyOptions, verify
from tests.paths import EXAMPLE

pytestmark = pytest.mark.timeout(120)
VERIFY = VerifyOptions(idle_threshold_s=0.5, drain_deadline_s=0.3)


def replay_over_http(
    port: int, metrics_path: str | None = "/metrics", max_requests: int | None = None
):
    metrics = (
        ()
        if metrics_path is None
        else (MetricsSource.parse(f"http://127.0.0.1:{port}{metrics_path}"),)
    )
    options = HttpTargetOptions(
        f"http://127.0.0.1:{port}", metrics, scrape_interval_s=0.05, tail_s=1.0
    )
    shaping = ShapingOptions(speedup=4.0, max_requests=max_requests)
    timeline = HttpReplay(options).run(shape(read_trace(EXAMPLE), shaping))
    verdict = verify(timeline, [], VERIFY)
    return timeline, verdict, http_verdict(timeline, verdict)


VLLM = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.00001
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="200001"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
"""


def test_scraper_reads_vllm_older_vllm_sglang_and_kvdrain():
    samples = parse_metrics(VLLM)
    assert choose_metric(samples) == "vllm:kv_cache_usage_perc"
    (reading,) = read_engines(samples, "vllm:kv_cache_usage_perc")
    assert (reading.used, reading.free, reading.unit) == (2, 199998, "blocks")
    assert reading.labels["vllm:num_requests_waiting"] == 3
    old = parse_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    assert choose_metric(old) == "vllm:gpu_cache_usage_perc"
    (reading,) = read_engines(old, "vllm:gpu_cache_usage_perc")
    assert (reading.used, reading.unit) == (500000, "ppm")
    tiny = parse_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 1e-9\n')
    assert read_engines(tiny, "vllm:gpu_cache_usage_perc")[0].used == 1  # never rounds to 0
    sglang = parse_metrics(
        'sglang:token_usage{tp_rank="0"} 0.25\nsglang:max_total_num_tokens 4000\n'
    )
    assert choose_metric(sglang) == "sglang:token_usage"
    assert read_engines(sglang, "sglang:token_usage")[0].used == 1000
    assert choose_metric(parse_metrics("process_cpu_seconds_total 3\n")) is None


def test_metrics_source_names():
    assert MetricsSource.parse("P=http://h:8100/metrics") == MetricsSource(
        "http://h:8100/metrics", "P"
    )
    assert MetricsSource.parse("http://h:8100/metrics").name is None
    with pytest.raises(ValueError):
        MetricsSource.parse("h:8100/metrics")


def test_probe_accepts_a_proxy_without_models_when_the_model_is_named():
    import asyncio

    import aiohttp
    from aiohttp import web

    from replay.target.client import probe

    async def go():
        app = web.Application()  # no routes: /v1/models is a 404, like vLLM's toy P/D proxy
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as session:
                named = await probe(session, HttpTargetOptions(url, model="m"))
                try:
                    await probe(session, HttpTargetOptions(url))
                except ConnectionError as e:
                    return named, str(e)
        finally:
            await runner.cleanup()

    named, error = asyncio.run(go())
    assert named.model == "m" and named.models == [] and named.vocab_size is None  # not assumed
    assert "--model" in error
