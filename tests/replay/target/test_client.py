"""The HTTP replay client against small in-process servers: every record is closed
whatever happens (an abort at its request's instant, a malformed stream, a server that
never answers), ignored requests are counted, the trace's token ids are checked against
the server's vocabulary before t = 0, latency is replay/verify/latency.py's, and a
scrape that reads +Inf or NaN is a counted failure."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.metrics.scrape import MetricsSource, Scraper
from replay.openai.route_header import ROUTE_HEADER
from replay.target.client import IGNORED_BY_SERVER, HttpReplay, HttpTargetOptions
from replay.trace.reader import TraceError
from replay.trace.records import TraceAbort, TraceRequest
from replay.verify import outcome
from replay.verify.coverage import ignored_by_cause
from replay.verify.latency import latency_summary
from replay.verify.outcome import http_verdict
from replay.verify.rules import verify
from replay.verify.timeline import Timeline
from tests.http_utils import serving

pytestmark = pytest.mark.timeout(60)


def _chunk(choices: object = None, **extra) -> bytes:
    body = {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [] if choices is None else choices,
        **extra,
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _choice(token: int | None, finish_reason: str | None = None, **extra) -> dict:
    return {
        "index": 0,
        "text": "" if token is None else f"w{token}",
        "token_ids": [] if token is None else [token],
        "finish_reason": finish_reason,
        **extra,
    }


class FakeServer:
    """/v1/models, a streaming /v1/completions whose chunks `answer(body)` chooses (an
    answer of None never ends until the test is over), and vLLM's /tokenize over a word
    vocabulary of `vocab_size` words w0... (None: no /tokenize)."""

    def __init__(self, answer, vocab_size: int | None = 1000) -> None:
        self.answer = answer
        self.vocab_size = vocab_size
        self.num_posts = 0
        self.num_tokenizes = 0
        self.peers: set[tuple] = set()  # the client ends of the connections POSTs came on
        self.release = asyncio.Event()
        self.route = lambda body: None  # the ROUTE_HEADER a body is answered with (None: none)
        self.end = None  # awaited between [DONE] and the body's end (None: ends at once)

    async def tokenize(self, request: web.Request) -> web.Response:
        """Like vLLM over a WordLevel tokenizer: an unknown word is <unk>, after the words."""
        self.num_tokenizes += 1
        words = (await request.json())["prompt"].split()
        known = {f"w{i}" for i in range(self.vocab_size)} if len(words) == 1 else set()
        tokens = [int(w[1:]) if w in known else self.vocab_size for w in words]
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": 4096,
                "tokens": tokens,
                "token_strs": [w if w in known else "<unk>" for w in words],
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.num_posts += 1
        self.peers.add(request.transport.get_extra_info("peername"))
        body = await request.json()
        chunks, route = self.answer(body), self.route(body)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                **({ROUTE_HEADER: route} if route is not None else {}),
            }
        )
        await response.prepare(request)
        if chunks is None:
            await self.release.wait()
            return response
        for chunk in chunks:
            await response.write(chunk)
        await response.write(b"data: [DONE]\n\n")
        if self.end is not None:
            await self.end(self)
        await response.write_eof()
        return response

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        if self.vocab_size is not None:
            app.router.add_post("/tokenize", self.tokenize)
        async with serving(app) as url:
            try:
                yield url
            finally:
                self.release.set()


def replay(
    answer, trace, server_vocab_size: int | None = 1000, route=None, **options
) -> tuple[Timeline, FakeServer]:
    server = FakeServer(answer, server_vocab_size)
    server.route = route or server.route

    async def go() -> Timeline:
        async with server.running() as url:
            return await HttpReplay(HttpTargetOptions(url, tail_s=0.05, **options)).run_async(trace)

    return asyncio.run(asyncio.wait_for(go(), 30)), server


def good(body: dict) -> list[bytes]:
    return [
        _chunk([_choice(5)]),
        _chunk([_choice(6, "length")]),
        _chunk(usage={"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}),
    ]


def test_an_abort_at_the_instant_of_its_request_closes_the_record():
    """The task is cancelled before its first step: the record is still closed, as aborted."""
    trace = [TraceRequest(0.0, "a", 2, 3), TraceAbort(0.0, "a"), TraceRequest(0.0, "b", 2, 2)]
    timeline, _ = replay(good, trace)
    a, b = timeline.request("a"), timeline.request("b")
    assert a.end_t is not None and a.finish_reason == "abort" and a.error is None
    assert a.send_t >= 0 and b.finish_reason == "length" and b.num_output_tokens == 2
    assert verify(timeline, []).violations == ()


def test_the_way_a_proxy_names_goes_into_the_request_records_stages():
    """kvdrain's proxy names each answer's way (P, then D); another server names none."""
    ways = {0: "P1,D0", 1: "P0", 2: None, 3: "P0,,D"}
    trace = [TraceRequest(0.0, f"r{i}", 2, 2, prompt_token_ids=(i, 1)) for i in ways]
    timeline, _ = replay(good, trace, route=lambda body: ways[body["prompt"][0]])
    stages = {
        r.req_id: [(engine, t == r.send_t) for engine, t in r.stages] for r in timeline.requests
    }
    assert stages == {"r0": [("P1", True), ("D0", True)], "r1": [("P0", True)], "r2": [], "r3": []}


MALFORMED = {
    "list": [b"data: []\n\n"],
    "choices not a list": [_chunk({"0": 1})],
    "a choice not an object": [_chunk([3])],
    "usage not an object": [_chunk([_choice(5)], usage=[2])],
    "token ids not ints": [
        _chunk([{"index": 0, "text": "x", "token_ids": ["5"], "finish_reason": None}])
    ],
    "finish_reason not a string": [_chunk([_choice(5, 7)])],
}


def test_a_malformed_stream_is_that_requests_error_and_the_run_inconclusive():
    names = list(MALFORMED)
    trace = [TraceRequest(0.0, name, 2, 2, prompt_token_ids=(i, 1)) for i, name in enumerate(names)]
    trace.append(TraceRequest(0.0, "fine", 2, 2, prompt_token_ids=(99, 1)))
    timeline, _ = replay(
        lambda body: good(body) if body["prompt"][0] == 99 else MALFORMED[names[body["prompt"][0]]],
        trace,
    )
    for name in names:
        record = timeline.request(name)
        assert record.end_t is not None and record.finish_reason == "error", name
        assert record.error.startswith("ValueError: stream chunk"), (name, record.error)
    assert timeline.request("fine").error is None
    verdict = verify(timeline, [])
    assert not verdict.violations  # not "never ended"
    status, reasons = http_verdict(timeline, verdict)
    assert status == "inconclusive" and any(
        f"{len(names)} of {len(trace)} requests failed" in r for r in reasons
    )


def test_a_request_given_up_on_is_closed_as_failed_not_unfinished():
    trace = [
        TraceRequest(0.0, "hangs", 2, 2, prompt_token_ids=(0, 0)),
        TraceRequest(0.0, "fine", 2, 2, prompt_token_ids=(1, 1)),
    ]
    timeline, _ = replay(
        lambda body: None if body["prompt"][0] == 0 else good(body), trace, request_timeout_s=0.3
    )
    hung = timeline.request("hangs")
    assert hung.end_t is not None and hung.finish_reason == "error"
    assert hung.error == "gave up after 0.3 s without an end"
    assert timeline.request("fine").error is None
    verdict = verify(timeline, [])
    assert not [v for v in verdict.violations if v.kind == "unfinished"]
    assert http_verdict(timeline, verdict)[0] == "inconclusive"  # exit 3, not 1


def test_token_ids_beyond_the_servers_vocabulary_fail_before_anything_is_sent():
    trace = [TraceRequest(0.0, "a", 2, 2, prompt_token_ids=(1, 40000))]
    with pytest.raises(
        TraceError,
        match=r"prompt token id 40,000 is outside the server's "
        r"vocabulary \[0, 1,000\) \(from /tokenize\)",
    ):
        replay(good, trace, max_token_id=40000)
    timeline, server = replay(good, trace, max_token_id=40000, vocab_size=50000)
    assert server.num_posts == 1 and timeline.request("a").error is None
    assert server.num_tokenizes == 0  # --vocab-size said it


@pytest.mark.parametrize("vocab_size", [1, 2, 3, 511, 512, 513, 1000, 70001])
def test_the_vocabulary_is_learnt_from_tokenize_when_the_server_does_not_say_it(vocab_size: int):
    timeline, server = replay(good, [TraceRequest(0.0, "a", 2, 2)], server_vocab_size=vocab_size)
    said = timeline.meta["http"]["server"]
    assert (said["vocab_size"], said["vocab_source"]) == (vocab_size, "/tokenize")
    assert server.num_tokenizes <= 2 * vocab_size.bit_length() + 2


def test_a_server_that_says_no_vocabulary_is_a_usage_error_never_an_assumed_one():
    from replay.target.client import VocabularyUnknown

    with pytest.raises(VocabularyUnknown, match="--vocab-size"):
        replay(good, [TraceRequest(0.0, "a", 2, 2)], server_vocab_size=None)
    timeline, _ = replay(
        good, [TraceRequest(0.0, "a", 2, 2)], server_vocab_size=None, vocab_size=77
    )
    said = timeline.meta["http"]["server"]
    assert (said["vocab_size"], said["vocab_source"]) == (77, "--vocab-size")


def test_length_without_tokens_is_ignored_by_the_server_with_its_cause_if_given():
    def answer(body: dict) -> list[bytes]:
        extra = (
            {"kvdrain_ignored_reason": "up to 600 tokens need 38 KV blocks; the pool has 31"}
            if body["prompt"][0] == 1
            else {}
        )
        return [
            _chunk([_choice(None, "length", **extra)]),
            _chunk(usage={"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}),
        ]

    trace = [TraceRequest(0.0, f"r{i}", 2, 4, prompt_token_ids=(i % 2, 7)) for i in range(4)]
    timeline, _ = replay(answer, trace)
    assert timeline.request("r0").error == IGNORED_BY_SERVER
    assert ignored_by_cause(timeline.requests) == {
        "can never fit the KV pool": 2,
        "ignored by the server": 2,
    }
    verdict = verify(timeline, [])
    assert verdict.ignored == ignored_by_cause(timeline.requests)
    status, reasons = http_verdict(timeline, verdict)
    assert status == "inconclusive" and not any("failed" in r for r in reasons)
    assert any("4 of 4 requests ignored" in r for r in reasons)


def test_latency_is_the_vllm_bench_summary_of_replay_verify_latency():
    trace = [TraceRequest(0.0, f"r{i}", 2, 2) for i in range(3)]
    timeline, _ = replay(good, trace)
    assert not hasattr(outcome, "latency_summary")
    assert timeline.meta["http"]["latency"] == latency_summary(timeline.requests)
    assert timeline.meta["http"]["latency"]["completed"] == 3


async def _scrape_texts(texts: list[str]) -> Scraper:
    answers = iter(texts)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=next(answers))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as url:
        scraper = Scraper(MetricsSource.parse(f"{url}/metrics"), 0.0)
        async with aiohttp.ClientSession() as session:
            for _ in texts:
                await scraper.scrape(session)
    return scraper


def test_a_non_finite_metric_value_is_a_counted_scrape_failure():
    cache = 'vllm:cache_config_info{engine="0",num_gpu_blocks="101"} 1\n'
    texts = [
        f'vllm:kv_cache_usage_perc{{engine="0"}} {v}\n' + cache
        for v in ("0.5", "+Inf", "NaN", "-Inf", "0.25")
    ]
    scraper = asyncio.run(asyncio.wait_for(_scrape_texts(texts), 30))
    assert [s.num_used_blocks for s in scraper.samples] == [50, 25]
    assert (scraper.num_scrapes, scraper.num_failures) == (5, 3)
    assert scraper.errors[0] == "ValueError: vllm:kv_cache_usage_perc: not a finite value: inf"
    sglang = asyncio.run(
        asyncio.wait_for(
            _scrape_texts(["sglang:token_usage 0.5\nsglang:max_total_num_tokens NaN\n"]), 30
        )
    )
    assert sglang.num_failures == 1 and not sglang.samples
    assert sglang.errors == ["ValueError: sglang:max_total_num_tokens: not a finite value: nan"]


def test_any_exception_in_a_scrape_is_counted_and_the_scraper_goes_on(monkeypatch):
    import replay.metrics.scrape as scrape

    real = scrape.parse_metrics
    calls = iter([RuntimeError("boom"), None])

    def flaky(text: str):
        error = next(calls)
        if error is not None:
            raise error
        return real(text)

    monkeypatch.setattr(scrape, "parse_metrics", flaky)
    text = 'kvdrain:kv_blocks_used{engine="P"} 3\nkvdrain:kv_blocks_free{engine="P"} 7\n'
    scraper = asyncio.run(asyncio.wait_for(_scrape_texts([text, text]), 30))
    assert scraper.num_failures == 1 and scraper.errors == ["RuntimeError: boom"]
    assert [s.num_used_blocks for s in scraper.samples] == [3]


def _kvdrain_metrics(step: int) -> str:
    """kvdrain's /metrics for a P/D serve, every family (histograms included) moving with step."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from engine.proc.messages import StatsSnapshot
    from replay.serve.vllm_metrics import EngineCollector

    counts = {
        "num_waiting": step % 3,
        "num_running": step,
        "num_waiting_for_remote_kvs": step % 2,
        "num_finished_awaiting_free": step % 4,
        "num_usable_blocks": 100,
        "num_used_blocks": 10 + step,
        "num_cached_blocks": step,
        "num_free_blocks": 90 - step,
    }
    latest = {
        e: StatsSnapshot(
            e, step, 0.0, ("stepping", "blocked")[step % 2], 7 * step, 3 * step, dict(counts)
        )
        for e in ("P", "D")
    }
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector("m", ["P", "D"], 16, latest, {}))
    return generate_latest(registry).decode()


VLLM_METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.%d
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %d
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length"} 4.0
vllm:request_success_created{engine="0",finished_reason="length"} 1.7e9
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0
"""


@pytest.mark.parametrize(
    "texts",
    [
        [_kvdrain_metrics(k) for k in range(4)],
        [VLLM_METRICS % (k, k) for k in range(1, 4)],
        [f"sglang:token_usage 0.{k}\nsglang:max_total_num_tokens 4096\n" for k in range(1, 4)],
    ],
    ids=["kvdrain", "vllm", "sglang"],
)
def test_scrapes_after_the_first_parse_only_what_they_read_and_read_the_same(texts, monkeypatch):
    from urllib.parse import urlsplit

    import replay.metrics.scrape as scrape

    def records(scraper: Scraper) -> list:
        netloc = urlsplit(scraper.source.url).netloc  # each run has its own server
        return [
            (
                s.engine.replace(netloc, "URL"),
                s.num_used_blocks,
                s.num_free_blocks,
                s.num_cached_blocks,
                s.num_waiting,
                s.num_running,
                s.num_waiting_for_remote_kvs,
                s.num_finished_awaiting_free,
                s.loop_state,
                s.num_steps,
                s.num_wakeups,
            )
            for s in scraper.samples
        ]

    parsed: list[str] = []
    real_parse = scrape.parse_metrics

    def parse(text: str):
        parsed.append(text)
        return real_parse(text)

    monkeypatch.setattr(scrape, "parse_metrics", parse)
    fast = asyncio.run(asyncio.wait_for(_scrape_texts(texts), 30))
    assert parsed[0] == texts[0] and all(
        len(p) < len(t) or "#" not in t for p, t in zip(parsed[1:], texts[1:])
    )
    monkeypatch.setattr(scrape, "sample_lines", lambda text, names: text)
    whole = asyncio.run(asyncio.wait_for(_scrape_texts(texts), 30))
    assert fast.num_failures == whole.num_failures == 0
    assert len(fast.samples) == len(whole.samples) >= len(texts)
    assert records(fast) == records(whole)
    assert fast.names_found == whole.names_found


@pytest.mark.parametrize("cut", ["one write", "7-byte writes"])
def test_a_stream_reads_the_same_however_its_bytes_are_cut(cut: str):
    whole = b"".join(good({}))
    pieces = [whole] if cut == "one write" else [whole[i : i + 7] for i in range(0, len(whole), 7)]
    trace = [TraceRequest(0.0, "r0", 2, 2)]
    (record,), (expected,) = (
        replay(lambda body: pieces, trace)[0].requests,
        replay(good, trace)[0].requests,
    )
    assert (record.error, record.finish_reason, record.num_output_tokens, record.output_digest) == (
        None,
        "length",
        2,
        expected.output_digest,
    )
    assert len(record.itls) == 1


def test_the_events_of_one_read_share_its_time_and_blank_lines_between_them_are_skipped():
    """A read's events arrived together: each is stamped with the read's time, not with
    when the client got round to parsing it."""
    from replay.target.stream import Stream, read_stream

    class Content:
        def __init__(self, reads: list[bytes]) -> None:
            self.reads = reads

        async def iter_any(self):
            for data in self.reads:
                yield data

    class Response:
        content = Content(
            [
                good({})[0] + good({})[1][:9],
                good({})[1][9:] + b"\n" + good({})[2],
                b"data: [DONE]\n\n",
            ]
        )

    class Clock:
        def __init__(self) -> None:
            self.reads = 0

        def now(self) -> float:
            self.reads += 1
            return float(self.reads)

    stream = Stream(max_outputs=2)
    asyncio.run(read_stream(Response(), stream, Clock().now))
    assert stream.chunk_times == [1.0, 2.0] and stream.usage_completion_tokens == 2
    assert (stream.finish_reason, stream.done_t, stream.num_tokens) == ("length", 3.0, 2)


@pytest.mark.parametrize("where", ["reading the trace", "starting a request"])
def test_what_fails_in_the_sending_midway_ends_the_replay_with_that_error(where: str, monkeypatch):
    """An error while sending reaches the replay's caller, after the requests already started."""

    def trace():
        yield TraceRequest(0.0, "r0", 2, 2)
        if where == "reading the trace":
            raise TraceError("trace: line 2: bad")
        yield TraceRequest(0.05, "r1", 2, 2)

    start = HttpReplay._start

    def failing_start(self: HttpReplay, session, req: TraceRequest) -> None:
        if req.req_id == "r1":
            raise TraceError("trace: r1: bad")
        start(self, session, req)

    monkeypatch.setattr(HttpReplay, "_start", failing_start)
    server = FakeServer(good)

    async def go() -> HttpReplay:
        async with server.running() as url:
            replay = HttpReplay(HttpTargetOptions(url, tail_s=0.05))
            with pytest.raises(TraceError, match="bad"):
                await replay.run_async(trace())
            return replay

    assert list(asyncio.run(asyncio.wait_for(go(), 30)).requests) == ["r0"]


def test_requests_one_after_another_reuse_one_connection():
    trace = [TraceRequest(0.2 * i, f"r{i}", 2, 2) for i in range(8)]
    timeline, server = replay(good, trace)
    assert [r.error for r in timeline.requests] == [None] * 8
    assert server.num_posts == 8 and len(server.peers) == 1


def replay_ending(end, trace) -> tuple[Timeline, FakeServer]:
    """replay() against a server that awaits end(server) between [DONE] and the body's end."""
    server = FakeServer(good)
    server.end = end

    async def go() -> Timeline:
        async with server.running() as url:
            return await HttpReplay(HttpTargetOptions(url, tail_s=0.05)).run_async(trace)

    return asyncio.run(asyncio.wait_for(go(), 30)), server


def test_a_body_that_ends_in_a_later_write_after_done_is_read_to_its_end_and_its_connection_reused():
    async def later(server: FakeServer) -> None:
        await asyncio.sleep(0.05)  # the body's end in a read of its own

    trace = [TraceRequest(0.3 * i, f"r{i}", 2, 2) for i in range(4)]
    timeline, server = replay_ending(later, trace)
    assert [r.error for r in timeline.requests] == [None] * 4
    assert server.num_posts == 4 and len(server.peers) == 1


def test_a_request_ends_at_done_and_a_body_kept_open_after_it_only_loses_its_connection(
    monkeypatch,
):
    """The drain after [DONE] neither delays the request's end nor turns it into an error."""
    monkeypatch.setattr("replay.target.stream.DRAIN_S", 0.1)
    closed_at: dict[str, float] = {}
    close = HttpReplay._close

    def timed_close(self: HttpReplay, record, stream, max_tokens: int = 0) -> None:
        closed_at[record.req_id] = self.now()
        close(self, record, stream, max_tokens)

    monkeypatch.setattr(HttpReplay, "_close", timed_close)

    async def never(server: FakeServer) -> None:
        await server.release.wait()

    trace = [TraceRequest(0.0, "r0", 2, 2), TraceRequest(0.5, "r1", 2, 2)]
    timeline, server = replay_ending(never, trace)
    assert [(r.error, r.finish_reason, r.num_output_tokens) for r in timeline.requests] == [
        (None, "length", 2)
    ] * 2
    assert len(server.peers) == 2  # each body left open: its connection closed, not reused
    assert all(r.last_token_t <= r.end_t < closed_at[r.req_id] for r in timeline.requests)


def test_an_abort_while_a_finished_stream_drains_leaves_its_outcome(monkeypatch):
    monkeypatch.setattr("replay.target.stream.DRAIN_S", 30.0)

    async def never(server: FakeServer) -> None:
        await server.release.wait()

    timeline, _ = replay_ending(never, [TraceRequest(0.0, "r0", 2, 2), TraceAbort(1.0, "r0")])
    record = timeline.request("r0")
    assert (record.error, record.finish_reason, record.num_output_tokens) == (None, "length", 2)


def test_a_tick_slower_than_the_scrape_interval_starves_no_send():
    """No /metrics to scrape and an on_tick (the live view) slower than the interval: the
    scrape loop is behind at every slot, and still yields to the loop each time (else the
    sending never runs and no asyncio timeout can fire)."""
    import time as clock

    ticks: list[float] = []

    def slow_tick(replay: HttpReplay) -> None:
        clock.sleep(0.03)  # > scrape_interval_s
        ticks.append(replay.now())
        assert len(ticks) < 200, "the scrape loop ran 200 ticks and the one request never finished"

    server = FakeServer(good)

    async def go() -> Timeline:
        async with server.running() as url:
            options = HttpTargetOptions(url, tail_s=0.05, scrape_interval_s=0.02)
            return await HttpReplay(options, on_tick=slow_tick).run_async(
                [TraceRequest(0.0, "r0", 2, 2)]
            )

    timeline = asyncio.run(asyncio.wait_for(go(), 30))
    assert timeline.request("r0").error is None and server.num_posts == 1


def test_the_heap_alive_at_t0_is_frozen_without_a_collection_until_the_sending_is_over(monkeypatch):
    """A full collection walks the whole heap and holds every send back meanwhile; frozen
    after the probes, the collector walks only what the replay makes. The freeze runs no
    collection: one would run every pending finalizer of the process on the replay's loop,
    synchronously, where a blocking one stops the replay and no asyncio timeout can fire."""
    import gc

    if gc.get_freeze_count() or not gc.isenabled():
        pytest.skip("the heap is already frozen, or the collector off, in this process")

    def collect(*args):
        raise AssertionError("gc.collect() called on the replay's loop")

    monkeypatch.setattr(gc, "collect", collect)
    frozen: list[int] = []
    server = FakeServer(good)

    async def go() -> Timeline:
        async with server.running() as url:
            options = HttpTargetOptions(url, tail_s=0.05, scrape_interval_s=0.02)
            replay = HttpReplay(options, on_tick=lambda r: frozen.append(gc.get_freeze_count()))
            return await replay.run_async([TraceRequest(0.0, "r0", 2, 2)])

    try:
        timeline = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        after = gc.get_freeze_count()
        gc.unfreeze()
    assert timeline.request("r0").error is None
    assert len(frozen) >= 2 and frozen[0] == 0 and all(n > 0 for n in frozen[1:])
    assert after == 0


def test_a_stream_line_past_the_cap_is_that_requests_error():
    from replay.target.stream import MAX_LINE_BYTES

    endless = [b"data: " + b"x" * (MAX_LINE_BYTES // 2)] * 3
    timeline, _ = replay(lambda body: endless, [TraceRequest(0.0, "r0", 2, 2)])
    assert timeline.requests[0].error == "ValueError: stream: a line longer than 128 KiB"


@pytest.mark.parametrize(
    "texts",
    [
        [_kvdrain_metrics(k) for k in range(4)],
        [VLLM_METRICS % (k, k) for k in range(1, 4)],
        [f"sglang:token_usage 0.{k}\nsglang:max_total_num_tokens 4096\n" for k in range(1, 4)],
    ],
    ids=["kvdrain", "vllm", "sglang"],
)
def test_only_the_first_scrape_of_kvdrain_vllm_or_sglang_reaches_prometheus_clients_parser(
    texts, monkeypatch
):
    """Its ~100 us a line (2-3 ms a kvdrain scrape, in the parse thread) held the GIL
    against the replay's sends; the later scrapes' plain sample lines are read by
    parse_plain_samples."""
    import replay.metrics.scrape as scrape

    calls: list[str] = []
    real = scrape.text_string_to_metric_families

    def counted(text: str):
        calls.append(text)
        return real(text)

    monkeypatch.setattr(scrape, "text_string_to_metric_families", counted)
    threads: list[object] = []
    real_to_thread = asyncio.to_thread

    def to_thread(f, *args):
        threads.append(f)
        return real_to_thread(f, *args)

    monkeypatch.setattr(scrape.asyncio, "to_thread", to_thread)
    scraper = asyncio.run(asyncio.wait_for(_scrape_texts(texts), 30))
    assert scraper.num_failures == 0 and len(scraper.samples) >= len(texts)
    assert len(calls) == 1
    assert len(threads) == 1  # the later reads, well under a millisecond, stay on the loop


_NAMES = st.sampled_from(
    ["vllm:kv_cache_usage_perc", "kvdrain:kv_blocks_used", "sglang:token_usage"]
)
_LABEL_NAMES = st.sampled_from(
    ["engine", "model_name", "state", "__name__", "__x", "_a", "le", "a1"]
)
_LABEL_VALUES = st.sampled_from(
    ["0", "P", "", "a b", 'x\\"y', "back\\\\slash", "n\\nl", "{}", ",", "=", "é", "a}b", "__"]
)
_VALUES = st.sampled_from(
    [
        "0",
        "1",
        "-1",
        "+3",
        "1.0",
        "0.25",
        "1e-9",
        "1E5",
        "+Inf",
        "-Inf",
        "NaN",
        "inf",
        "nan",
        "1_0",
        "0x10",
        "1.5.2",
        "٣",
        "1\xa0",
        "",
        "abc",
        "007",
    ]
)


@st.composite
def _sample_line(draw) -> str:
    name = draw(_NAMES)
    labels = draw(st.lists(st.tuples(_LABEL_NAMES, _LABEL_VALUES), max_size=3))
    body = ",".join(f'{k}="{v}"' for k, v in labels)
    head = name + draw(
        st.sampled_from([f"{{{body}}}", f"{{{body},}}", f"{{ {body} }}"])
        if labels
        else st.sampled_from(["", "{}"])
    )
    tail = draw(st.sampled_from(["", " 1700000000000", "  ", "\t"]))
    return head + draw(st.sampled_from([" ", "  ", "\t"])) + draw(_VALUES) + tail


def _as_tuples(samples: dict[str, list]) -> dict[str, list]:
    """Samples comparable by value (NaN equal to NaN), type included (an int stays an int)."""
    return {
        name: [
            (
                s.name,
                s.labels,
                type(s.value),
                "nan" if s.value != s.value else s.value,
                s.timestamp,
                s.exemplar,
            )
            for s in found
        ]
        for name, found in samples.items()
    }


@given(st.lists(_sample_line(), min_size=1, max_size=6))
@settings(max_examples=400, deadline=None)
def test_plain_sample_lines_read_as_prometheus_clients_parser_reads_them(lines):
    from replay.metrics.scrape import parse_metrics, parse_plain_samples

    text = "".join(f"{line}\n" for line in lines)
    fast = parse_plain_samples(text)
    try:
        slow = parse_metrics(text)
    except ValueError:
        assert fast is None, text  # what prometheus_client refuses is left to it
        return
    assert fast is None or _as_tuples(fast) == _as_tuples(slow), text


def test_a_plain_line_is_read_by_the_fast_parse_and_an_escaped_one_left_to_prometheus_client():
    from replay.metrics.scrape import parse_plain_samples

    plain = 'vllm:num_requests_running{engine="0",model_name="m"} 3\nsglang:token_usage 0.5\n'
    assert _as_tuples(parse_plain_samples(plain)) == {
        "vllm:num_requests_running": [
            ("vllm:num_requests_running", {"engine": "0", "model_name": "m"}, int, 3, None, None)
        ],
        "sglang:token_usage": [("sglang:token_usage", {}, float, 0.5, None, None)],
    }
    assert parse_plain_samples(plain + 'vllm:num_requests_running{engine="a\\"b"} 1\n') is None


def test_n_metrics_urls_are_scraped_spread_over_the_interval_each_on_its_own_grid(monkeypatch):
    """Started at one instant, n scrapes' aiohttp work (1-2 ms each on a 2-core machine)
    held a send due then behind all n; the i-th of n URLs is scraped at (k + i/n) * interval."""
    targets: dict[str, list[float]] = {}
    real = HttpReplay._scrape_at

    async def scrape_at(self, session, scraper, t):
        targets.setdefault(scraper.source.name, []).append(t)
        return await real(self, session, scraper, t)

    monkeypatch.setattr(HttpReplay, "_scrape_at", scrape_at)
    server = FakeServer(good)
    interval, names = 0.02, ("a", "b", "c")

    async def go() -> Timeline:
        async with server.running() as url:
            metrics = tuple(MetricsSource(f"{url}/v1/models", name) for name in names)
            options = HttpTargetOptions(
                url, tail_s=0.2, scrape_interval_s=interval, metrics=metrics
            )
            return await HttpReplay(options).run_async([TraceRequest(0.0, "r0", 2, 2)])

    asyncio.run(asyncio.wait_for(go(), 30))
    assert sorted(targets) == list(names)
    for i, name in enumerate(names):
        slots = [t / interval - i / len(names) for t in targets[name]]
        assert slots and all(abs(s - round(s)) < 1e-6 and round(s) >= 1 for s in slots), (
            name,
            slots,
        )
