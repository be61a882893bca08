"""The HTTP replay client against hostile servers: answers delivered late, endless streams,
fields of the wrong type, markup and escape codes, negative gauges, duplicate keys,
redirects to another host. None of them may give a false verdict, unbounded memory or a
traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from replay.metrics.scrape import MetricsSource
from replay.target.client import HttpReplay, HttpTargetOptions
from replay.trace.records import TraceRequest
from replay.verify.outcome import http_verdict
from replay.verify.rules import VerifyOptions, verify
from replay.verify.timeline import Timeline
from tests.http_utils import serving, serving_in_thread

pytestmark = pytest.mark.timeout(90)


def _chunk(choices: object = None, **extra) -> bytes:
    body = {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [] if choices is None else choices,
        **extra,
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class LeakyPD:
    """A P/D server that renders honest metrics: P holds 8 blocks from its first request on
    (it leaks through every idle window), D holds 4 while a request runs and none otherwise.
    Each /metrics answer is rendered when the scrape arrives and delivered `delay_s` later;
    each completion takes `busy_s`."""

    def __init__(self, delay_s: float, busy_s: float) -> None:
        self.delay_s = delay_s
        self.busy_s = busy_s
        self.num_running = 0
        self.has_run = False

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.num_running += 1
        self.has_run = True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self.busy_s)
        self.num_running -= 1
        await response.write(
            _chunk([{"index": 0, "text": "w5", "token_ids": [5], "finish_reason": "length"}])
        )
        await response.write(
            _chunk(usage={"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3})
        )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        p_used = 8 if self.has_run else 0
        d_used = 4 if self.num_running else 0
        text = "".join(
            f'vllm:kv_cache_usage_perc{{engine="{e}"}} {used / 100}\n'
            f'vllm:cache_config_info{{engine="{e}",num_gpu_blocks="101"}} 1\n'
            for e, used in (("P", p_used), ("D", d_used))
        )
        await asyncio.sleep(self.delay_s)
        return web.Response(text=text)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app


def invoke_replay(url: str, tmp_path: Path, *args: str):
    from click.testing import CliRunner

    from cli import cli

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 2}\n')
    return CliRunner().invoke(
        cli,
        [
            "replay",
            str(trace),
            "--target",
            url,
            "--no-live",
            "--tail",
            "0.1",
            "--vocab-size",
            "512",
            *args,
        ],
        catch_exceptions=False,
    )


def models_app(card: dict) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


@pytest.mark.parametrize(
    "card,error",
    [
        (
            {"id": "m", "kvdrain": {"vocab_size": [1]}},
            "data[0].kvdrain.vocab_size: expected a positive integer, got list",
        ),
        (
            {"id": "m", "kvdrain": {"vocab_size": 0}},
            "data[0].kvdrain.vocab_size: expected a positive integer, got 0",
        ),
        (
            {"id": "m", "max_model_len": "4096"},
            "data[0].max_model_len: expected a positive integer, got str",
        ),
        (
            {"id": "m", "max_model_len": True},
            "data[0].max_model_len: expected a positive integer, got bool",
        ),
        ({"id": "m", "owned_by": {"x": 1}}, "data[0].owned_by: expected a str, got dict"),
        ({"id": "m", "kvdrain": [1]}, "data[0].kvdrain: expected a dict, got list"),
        ({"id": 7}, "data[0].id: expected a str, got int"),
    ],
)
def test_a_models_field_of_the_wrong_type_is_a_usage_error_naming_it(
    tmp_path: Path, card: dict, error: str
):
    with serving_in_thread(models_app(card)) as url:
        result = invoke_replay(url, tmp_path)
    assert result.exit_code == 2, result.output
    assert error in result.output and "Traceback" not in result.output


def replay_against(app: web.Application, trace, **options) -> Timeline:
    async def go() -> Timeline:
        async with serving(app) as url:
            metrics = (MetricsSource.parse(url + "/metrics"),)
            options.setdefault("vocab_size", 512)  # a vLLM card does not say it
            return await HttpReplay(HttpTargetOptions(url, metrics=metrics, **options)).run_async(
                trace
            )

    return asyncio.run(asyncio.wait_for(go(), 60))


LEAK_TRACE = [TraceRequest(0.0, "a", 2, 1), TraceRequest(2.5, "b", 2, 1)]
LEAK_OPTIONS = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.2)


def _verdicts(verdict, engine: str) -> list[str]:
    return [w.verdict for w in verdict.windows if w.engine == engine]


def test_late_scrapes_of_an_engine_that_leaks_are_never_judged_drained():
    """Each answer arrives 1.6 s after it was rendered: a reading of P taken before its first
    request (0 blocks) lands inside the first idle window, a reading of D taken while it
    decoded (4 blocks) lands inside the tail. A scrape is evidence only for the time between
    its sending and its answer: P is never drained, D never leaks, and the run is not
    verified."""
    timeline = replay_against(LeakyPD(delay_s=1.6, busy_s=0.8).app(), LEAK_TRACE, tail_s=2.0)
    verdict = verify(timeline, [], LEAK_OPTIONS)
    assert "drained" not in _verdicts(verdict, "P"), verdict.windows
    assert "leak" not in _verdicts(verdict, "D"), verdict.windows
    assert http_verdict(timeline, verdict)[0] != "verified"
    for w in verdict.windows:  # a time to drain is an upper bound, so never under the deadline
        if w.verdict == "drained":
            assert w.time_to_drain <= LEAK_OPTIONS.drain_deadline_s


def test_prompt_scrapes_of_the_same_server_see_the_leak_and_the_drain():
    timeline = replay_against(
        LeakyPD(delay_s=0.0, busy_s=0.8).app(), LEAK_TRACE, tail_s=1.0, scrape_interval_s=0.05
    )
    verdict = verify(timeline, [], VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5))
    assert _verdicts(verdict, "P") == ["leak", "leak"]
    assert "drained" in _verdicts(verdict, "D") and "leak" not in _verdicts(verdict, "D")
    assert verdict.status == "violation"


class EndlessStream:
    """A completion that streams 60 KB chunks until the client goes away."""

    def __init__(self) -> None:
        self.num_chunks = 0
        text = " ".join(["w1"] * 20_000)  # 60 KB
        self.chunk = _chunk([{"index": 0, "text": text, "token_ids": [1], "finish_reason": None}])

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(self.chunk)
            self.num_chunks += 1

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app


def test_an_endless_stream_holds_no_more_than_its_max_tokens_allow():
    """The client keeps counts and digests, never the streamed text, and a stream with more
    outputs than max_tokens is that request's error: the bytes held stay bounded."""
    import tracemalloc

    server = EndlessStream()
    tracemalloc.start()
    try:
        started = time.monotonic()
        timeline = replay_against(
            server.app(), [TraceRequest(0.0, "a", 8, 2)], tail_s=0.05, request_timeout_s=4.0
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    record = timeline.request("a")
    assert record.error == "ValueError: stream: more outputs than max_tokens (8)"
    assert time.monotonic() - started < 4.0  # not given up on after request_timeout_s
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB held"


class HugeMetrics(LeakyPD):
    """LeakyPD whose /metrics also carries 3 MB of other series, 300 KB of them vllm:'s."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.0, busy_s=0.05)
        ours = "".join(f'vllm:junk_total{{a="{i}"}} {i}\n' for i in range(12_000))
        others = "".join(f'other_junk_total{{a="{i}"}} {i}\n' for i in range(100_000))
        self.junk = ours + others

    async def metrics(self, request: web.Request) -> web.Response:
        response = await super().metrics(request)
        return web.Response(text=response.text + self.junk)


def test_a_huge_metrics_answer_delays_no_send_and_its_cost_is_the_clients():
    """Parsing a big /metrics on the event loop once held every send back for seconds (and
    the verdict blamed the engines): only vllm:, sglang: and kvdrain: lines are parsed, off
    the loop, and the scrape's costs are in its status."""
    trace = [TraceRequest(0.5 * i, f"r{i}", 1, 2) for i in range(4)]
    timeline = replay_against(HugeMetrics().app(), trace, tail_s=0.5, scrape_interval_s=0.1)
    late = [r.send_lateness_s for r in timeline.requests]
    assert max(late) < 0.5, late
    status = timeline.meta["http"]["metrics"][0]
    assert status["num_failures"] == 0 and status["max_parse_s"] > 0
    assert status["max_answer_s"] > 0


EVIL = "\x1b[2J\x1b]0;owned\x07[bold red]X[/]\u202e"


class Hostile(LeakyPD):
    """LeakyPD that writes markup and escape codes wherever it can, and `metrics_text` on
    /metrics when given."""

    def __init__(self, metrics_text: str | None = None) -> None:
        super().__init__(delay_s=0.0, busy_s=0.05)
        self.metrics_text = metrics_text

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "m" + EVIL, "owned_by": EVIL, "max_model_len": 4096}],
            },
            headers={"Server": "[blink]srv[/blink]"},
        )

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is not None:
            return web.Response(text=self.metrics_text)
        used = 8 if self.has_run else 0
        return web.Response(
            text=f'kvdrain:kv_blocks_used{{engine="P{EVIL}"}} {used}\n'
            f'kvdrain:kv_blocks_free{{engine="P{EVIL}"}} {100 - used}\n'
        )

    async def completions(self, request: web.Request) -> web.Response:
        await request.read()
        self.has_run = True
        return web.json_response(
            {"error": {"message": "no" + EVIL, "type": "x", "code": 400}}, status=400
        )


def test_markup_and_escape_codes_from_a_server_never_reach_the_terminal(tmp_path: Path):
    with serving_in_thread(Hostile().app()) as url:
        result = invoke_replay(url, tmp_path, "--metrics", url + "/metrics")
    assert result.exit_code in (1, 3), result.output
    for bad in ("\x1b", "\x07", "\u202e"):
        assert bad not in result.output, result.output
    assert "[bold red]X[/]" in result.output  # printed as text, not taken as markup
    assert "[blink]srv[/blink]" in result.output


class HostileProxy(Hostile):
    """Hostile, and a kvdrain proxy's /health naming an upstream (itself) and a /version,
    both with markup and escape codes."""

    def __init__(self) -> None:
        super().__init__()
        self.url = ""

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "upstreams": {"P" + EVIL: {"url": self.url}}})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32" + EVIL})

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        return app


def test_a_servers_version_and_upstream_names_reach_the_terminal_escaped(tmp_path: Path):
    hostile = HostileProxy()
    with serving_in_thread(hostile.app()) as url:
        hostile.url = url
        result = invoke_replay(url, tmp_path)  # no --metrics: /health names the upstream
    assert result.exit_code in (1, 3), result.output
    for bad in ("\x1b", "\x07", "\u202e"):
        assert bad not in result.output, result.output
    escaped = "\\x1b[2J\\x1b]0;owned\\x07[bold red]X[/]\\u202e"
    assert f"version 0.32{escaped}" in result.output, result.output
    # an engine's name keeps a label's characters only: it is printed as markup too
    assert "  P_x1b_2J_x1b_0_owned_x07_bold_red_X_/__u202e: version" in result.output


def test_a_refusal_whose_message_is_markup_is_printed_as_text(tmp_path: Path):
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"down{EVIL} [/]"}}, status=503)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    with serving_in_thread(app) as url:
        result = invoke_replay(url, tmp_path)
    assert result.exit_code == 2, result.output
    assert "HTTP 503: down\\x1b[2J\\x1b]0;owned\\x07[bold red]X[/]\\u202e [/]" in result.output


def test_a_negative_usage_gauge_is_a_failed_scrape_never_a_count(tmp_path: Path):
    negative = 'kvdrain:kv_blocks_used{engine="P"} -256\nkvdrain:kv_blocks_free{engine="P"} 356\n'
    timeline = replay_against(Hostile(negative).app(), [TraceRequest(0.0, "a", 1, 2)], tail_s=0.2)
    assert not timeline.samples
    status = timeline.meta["http"]["metrics"][0]
    assert status["num_failures"] == status["num_scrapes"]
    assert status["errors"][0] == "ValueError: kvdrain:kv_blocks_used: negative: -256"
    over = 'vllm:kv_cache_usage_perc{engine="0"} 1.5\n'
    status = replay_against(Hostile(over).app(), [TraceRequest(0.0, "a", 1, 2)], tail_s=0.2).meta[
        "http"
    ]["metrics"][0]
    assert status["errors"][0] == "ValueError: vllm:kv_cache_usage_perc: a fraction above 1: 1.5"


def test_duplicate_keys_from_a_server_are_an_error_not_the_last_value():
    class Duplicates(LeakyPD):
        async def completions(self, request: web.Request) -> web.StreamResponse:
            await request.read()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(
                b'data: {"choices": [{"index": 0, "text": "w5", "token_ids": [5], '
                b'"finish_reason": "length"}], "usage": {"completion_tokens": 1, '
                b'"completion_tokens": 900}}\n\ndata: [DONE]\n\n'
            )
            await response.write_eof()
            return response

    timeline = replay_against(
        Duplicates(0.0, 0.0).app(), [TraceRequest(0.0, "a", 1, 2)], tail_s=0.2
    )
    assert timeline.request("a").error == "DuplicateKeyError: duplicate key 'completion_tokens'"


def test_a_redirect_to_another_host_is_refused_and_one_on_the_same_host_followed(tmp_path: Path):
    hits = []

    async def elsewhere(request: web.Request) -> web.Response:
        hits.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    other = web.Application()
    other.router.add_get("/{tail:.*}", elsewhere)
    with serving_in_thread(other) as other_url:

        async def moved(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(other_url + "/v1/models")

        app = web.Application()
        app.router.add_get("/v1/models", moved)
        with serving_in_thread(app) as url:
            result = invoke_replay(url, tmp_path, "--api-key", "sekrit")
    assert result.exit_code == 2, result.output
    assert f"a redirect to another host ({other_url}) was not followed" in result.output
    assert hits == []

    server = LeakyPD(0.0, 0.05)
    app = server.app()

    async def slash(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/metrics/")

    app.router.add_get("/metrics/", server.metrics)
    app.router._resources = [r for r in app.router._resources if r.canonical != "/metrics"]
    app.router.add_get("/metrics", slash)  # as vLLM's mounted /metrics answers
    timeline = replay_against(app, [TraceRequest(0.0, "a", 1, 2)], tail_s=0.2)
    assert timeline.meta["http"]["metrics"][0]["num_failures"] == 0 and timeline.samples


def test_more_tokens_than_max_tokens_in_one_chunk_is_that_requests_error():
    class Overflowing(LeakyPD):
        async def completions(self, request: web.Request) -> web.StreamResponse:
            await request.read()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(
                _chunk(
                    [
                        {
                            "index": 0,
                            "text": "",
                            "token_ids": list(range(5000)),
                            "finish_reason": "length",
                        }
                    ]
                )
                + b"data: [DONE]\n\n"
            )
            await response.write_eof()
            return response

    timeline = replay_against(
        Overflowing(0.0, 0.0).app(), [TraceRequest(0.0, "a", 2, 2)], tail_s=0.2
    )
    assert timeline.request("a").error == "ValueError: stream: more tokens than max_tokens (2)"


def test_a_streams_running_digest_is_output_digest_of_its_tokens():
    import hashlib

    from replay.target.stream import Stream
    from replay.verify.timeline import output_digest

    stream = Stream(max_outputs=10)
    for i, ids in enumerate(([5], [17, 3], [], [900])):
        stream.add(float(i), ids, "x")
    assert stream.digest() == output_digest([5, 17, 3, 900]) and stream.num_tokens == 4
    assert Stream().digest() == output_digest([])
    text = Stream()
    for piece in ("w1", " w2", " héllo"):
        text.add(0.0, [], piece)
    assert text.digest() == hashlib.sha256("w1 w2 héllo".encode()).hexdigest()[:16]


def test_a_scrape_cancelled_unanswered_at_the_end_is_not_counted():
    """The run's last scrape, cancelled while the server still thinks, is no scrape: with
    it counted, '3 of 4 scrapes failed' was printed for a server that failed all 3 it answered."""
    from replay.metrics.scrape import Scraper

    answered, release = asyncio.Event(), asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        answered.set()
        await release.wait()
        return web.Response(text="")

    async def go():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with serving(app) as url:
            scraper = Scraper(MetricsSource.parse(url + "/metrics"), time.monotonic())
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(scraper.scrape(session))
                await asyncio.wait_for(answered.wait(), 30)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            release.set()
        return scraper

    scraper = asyncio.run(asyncio.wait_for(go(), 60))
    assert (scraper.num_scrapes, scraper.num_failures) == (0, 0)
