"""The checks before an HTTP replay's first request: a bad metrics URL or a target that does
not answer is exit 2 at once with nothing sent; without --metrics the target's own
/metrics is used when it has a KV-usage metric, and a run without any says so."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from aiohttp import web

from replay.metrics.scrape import MetricsSource
from replay.target.client import HttpTargetOptions
from replay.target.preflight import FROM_TARGET, preflight
from replay.verify.outcome import NO_METRICS
from tests.http_utils import engines, running_front, serving_in_thread

pytestmark = pytest.mark.timeout(120)
TRACE = "".join(
    json.dumps({"t": t, "id": f"r{i}", "prompt_len": 4, "max_tokens": 2}) + "\n"
    for i, t in enumerate((0.0, 0.0, 1.2))
)


class Stub:
    """A server with a model list and completions, counting what it was sent; /metrics and
    /v1/models answer `metrics_status` and `models_status` (404: no such route)."""

    def __init__(self, metrics_status: int = 404, models_status: int = 200) -> None:
        self.metrics_status = metrics_status
        self.models_status = models_status
        self.num_completions = 0

    async def models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.Response(status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status)
        return web.Response(
            text='kvdrain:kv_blocks_used{engine="P"} 0\nkvdrain:kv_blocks_free{engine="P"} 100\n'
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.num_completions += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in (
            {"choices": [{"index": 0, "text": "w5", "token_ids": [5], "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}},
        ):
            await response.write(b"data: " + json.dumps({"id": "c", **chunk}).encode() + b"\n\n")
            await asyncio.sleep(0)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        return app


def replay(url: str, tmp_path: Path, *args: str):
    from click.testing import CliRunner

    from cli import cli

    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE)
    return CliRunner().invoke(
        cli,
        [
            "replay",
            str(trace),
            "--target",
            url,
            "--no-live",
            "--tail",
            "0.3",
            "--idle-threshold",
            "0.5",
            "--drain-deadline",
            "0.2",
            "--vocab-size",
            "512",
            *args,
        ],
        catch_exceptions=False,
    )


def test_a_metrics_url_that_answers_404_is_exit_2_naming_it_before_any_request(tmp_path: Path):
    stub = Stub(metrics_status=200)
    with serving_in_thread(stub.app()) as url:
        result = replay(url, tmp_path, "--metrics", f"{url}/nope", "--metrics", f"{url}/metrics")
    assert result.exit_code == 2, result.output
    assert (
        f"{url}/nope: HTTP 404" in result.output and "before any request was sent" in result.output
    )
    assert stub.num_completions == 0


def test_a_target_whose_model_list_fails_is_exit_2_naming_the_url_and_status(tmp_path: Path):
    stub = Stub(models_status=500)
    with serving_in_thread(stub.app()) as url:
        result = replay(url, tmp_path)
    assert result.exit_code == 2, result.output
    assert f"{url}/v1/models: HTTP 500" in result.output
    assert stub.num_completions == 0


def test_a_model_list_refused_for_want_of_a_key_says_to_give_one(tmp_path: Path):
    stub = Stub(models_status=401)
    with serving_in_thread(stub.app()) as url:
        result = replay(url, tmp_path, "--model", "m")
    assert result.exit_code == 2, result.output
    assert (
        f"{url}/v1/models: HTTP 401; the server needs an API key: give --api-key" in result.output
    )
    assert stub.num_completions == 0


def test_a_metrics_url_nothing_listens_on_is_exit_2_naming_the_connection_error(tmp_path: Path):
    stub = Stub()
    with serving_in_thread(Stub().app()) as closed:  # a port that was free a moment ago
        pass
    with serving_in_thread(stub.app()) as url:
        result = replay(url, tmp_path, "--metrics", f"{closed}/metrics")
    assert result.exit_code == 2, result.output
    assert re.search(re.escape(f"{closed}/metrics") + r": Client\w*Error", result.output), (
        result.output
    )
    assert stub.num_completions == 0


def test_without_metrics_the_targets_own_metrics_are_scraped_when_it_serves_them():
    with engines() as (router, model), running_front(router, model) as front:
        url = f"http://127.0.0.1:{front.port}"
        checked = preflight(HttpTargetOptions(url)).options
        given = preflight(
            HttpTargetOptions(url, (MetricsSource.parse(f"P={url}/metrics"),))
        ).options
    assert (
        checked.metrics == (MetricsSource(f"{url}/metrics"),)
        and checked.metrics_from == FROM_TARGET
    )
    assert (
        given.metrics == (MetricsSource(f"{url}/metrics", "P"),)
        and given.metrics_from == "--metrics"
    )


def test_without_metrics_anywhere_the_run_goes_on_and_never_claims_its_windows_observed(
    tmp_path: Path,
):
    stub = Stub(metrics_status=404)
    with serving_in_thread(stub.app()) as url:
        result = replay(url, tmp_path)
    assert result.exit_code == 3, result.output
    assert stub.num_completions == 3
    assert NO_METRICS in result.output
    observed = re.findall(r"(\d+) of (\d+) expected idle windows? observed", result.output)
    assert observed and all(seen != expected or seen == "0" for seen, expected in observed), (
        result.output
    )
