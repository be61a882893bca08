"""kvdrain's HTTP front against real engine processes (mock runner), through a real aiohttp client.

SSE as vLLM streams it, token ids and text round-trips, usage, /v1/models, /health,
/metrics parsed by prometheus_client, every bad input's status code, the API key, and
a client that goes away; after all of it the engines still serve.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import KVTransferConfig
from replay.openai.tokenizer import WordTokenizer
from replay.serve.http_front import HttpFrontOptions
from replay.trace.reader import read_trace
from tests.http_utils import MODEL_NAME, engines, running_front
from tests.mp_utils import mock_tokens
from tests.replay.target.test_replay_over_http import EXAMPLE, replay_over_http

pytestmark = pytest.mark.timeout(120)
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def pd():
    # D holds each request's blocks for the 150 ms pull at least: a 50 ms scrape sees D's
    # usage move even on a loaded machine (a mock decode alone can finish between scrapes).
    with engines("event", "pd", KVTransferConfig(pull_delay_ms=150)) as (router, model):
        yield router, model


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _post(session, url, body, **kwargs):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url + "/v1/completions", data=data, **kwargs) as response:
        return response.status, await response.read(), response.headers


def _sse_events(raw: bytes) -> list[str]:
    lines = raw.decode().split("\n\n")
    assert lines[-1] == ""
    assert all(line.startswith("data: ") for line in lines[:-1])
    return [line[len("data: ") :] for line in lines[:-1]]


def test_streaming_is_vllms_sse_with_token_ids_and_usage(pd):
    router, model = pd
    prompt = list(range(10, 50))

    async def go(url):
        async with aiohttp.ClientSession() as session:
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            }
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                return await response.read()

    with running_front(router, model) as front:
        events = _sse_events(run(go(f"http://127.0.0.1:{front.port}")))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 40
    assert last["usage"]["completion_tokens"] == 5 and last["usage"]["total_tokens"] == 45
    tokens = [t for c in deltas for t in c["choices"][0]["token_ids"]]
    assert tokens == mock_tokens(prompt, 5)
    text = "".join(c["choices"][0]["text"] for c in deltas)
    assert WordTokenizer(model.vocab_size).encode(text) == tokens
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == "length"
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_text_prompt_and_usage_without_streaming(pd):
    router, model = pd
    prompt_ids = [7, 300, 511, 104, 105]

    async def go(url):
        async with aiohttp.ClientSession() as session:
            return await _post(
                session, url, {"prompt": "w7 w300 w511 hi", "max_tokens": 3, "request_id": "text-1"}
            )

    with running_front(router, model) as front:
        status, raw, headers = run(go(f"http://127.0.0.1:{front.port}"))
    assert status == 200 and "kvdrain" in headers["Server"]
    body = json.loads(raw)
    assert body["id"] == "cmpl-text-1"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert WordTokenizer(512).encode(body["choices"][0]["text"]) == mock_tokens(prompt_ids, 3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["token_ids"] is None  # only with return_token_ids, as vLLM


def _metrics(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_models_health_and_metrics(pd):
    router, model = pd

    async def go(url):
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/models") as r:
                models = await r.json()
            async with session.get(url + "/health") as r:
                health = r.status
            async with session.get(url + "/metrics") as r:
                before = _metrics(await r.text())
            await asyncio.gather(
                *(_post(session, url, {"prompt": [1, 2, 3], "max_tokens": 2}) for _ in range(3))
            )
            async with session.get(url + "/metrics") as r:
                return models, health, before, _metrics(await r.text())

    with running_front(router, model) as front:
        models, health, before, after = run(go(f"http://127.0.0.1:{front.port}"))
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["max_model_len"] == model.max_model_len and card["kvdrain"]["engines"] == ["P", "D"]
    assert health == 200
    key = (
        "vllm:request_success_total",
        (("engine", "D"), ("finished_reason", "length"), ("model_name", MODEL_NAME)),
    )
    assert after[key] == before[key] + 3
    ttft = ("vllm:time_to_first_token_seconds_count", (("engine", "D"), ("model_name", MODEL_NAME)))
    assert after[ttft] == before[ttft] + 3
    for engine in ("P", "D"):
        assert (
            "vllm:kv_cache_usage_perc",
            (("engine", engine), ("model_name", MODEL_NAME)),
        ) in after


BAD = [
    ("malformed JSON", b'{"prompt": [1, 2', 400),
    ("not an object", b"[1, 2]", 400),
    ("not UTF-8", b'{"prompt": "\xff"}', 400),
    ("wrong type", {"prompt": [1], "max_tokens": "8"}, 400),
    ("bool as int", {"prompt": [1, True]}, 400),
    ("token outside the vocabulary", {"prompt": [1, 512]}, 400),
    ("max_tokens 0", {"prompt": [1], "max_tokens": 0}, 400),
    ("prompt too long", {"prompt": [1] * 4096}, 400),
    ("empty prompt", {"prompt": []}, 400),
    ("unknown model", {"prompt": [1], "model": "gpt-4"}, 404),
    ("unknown field", {"prompt": [1], "max_token": 8}, 422),
    ("unsupported n", {"prompt": [1], "n": 3}, 422),
    ("huge body", {"prompt": [1] * (MAX_BODY // 2)}, 413),
]


def test_every_bad_input_gets_its_status_and_the_engines_keep_serving(pd):
    router, model = pd

    async def go(url):
        async with aiohttp.ClientSession() as session:
            results = [
                (name, status, await _post(session, url, body)) for name, body, status in BAD
            ]
            async with session.get(url + "/v1/nope") as r:
                results.append(("unknown path", 404, (r.status, await r.read(), r.headers)))
            async with session.get(url + "/v1/completions") as r:
                results.append(("wrong method", 405, (r.status, await r.read(), r.headers)))
            results.append(("duplicate id", 400, await _duplicate(session, url)))
            good = await _post(
                session, url, {"prompt": [5, 6], "max_tokens": 4, "return_token_ids": True}
            )
            return results, good

    with running_front(router, model, HttpFrontOptions(max_body_bytes=MAX_BODY)) as front:
        results, good = run(go(f"http://127.0.0.1:{front.port}"))
    for name, expected, (status, raw, _) in results:
        assert status == expected, (name, raw)
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["code"] == expected and error["message"], name
    assert good[0] == 200
    assert json.loads(good[1])["choices"][0]["token_ids"] == mock_tokens([5, 6], 4)


async def _duplicate(session, url):
    """A second request with the id of one still streaming: 400; the first goes on."""
    body = {"prompt": [1, 2, 3], "max_tokens": 3000, "stream": True, "request_id": "dup"}
    async with session.post(url + "/v1/completions", json=body) as first:
        await first.content.readline()  # streaming: it is in flight
        second = await _post(session, url, dict(body, stream=False))
    return second


def test_api_key_guards_v1_only(pd):
    router, model = pd

    async def go(url):
        async with aiohttp.ClientSession() as session:
            out = []
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Bearer s3cret"},
            ):
                async with session.get(url + "/v1/models", headers=headers) as r:
                    out.append(r.status)
            async with session.get(url + "/health") as r:
                out.append(r.status)
            async with session.get(url + "/metrics") as r:
                out.append(r.status)
            return out

    with running_front(router, model, HttpFrontOptions(api_key="s3cret")) as front:
        assert run(go(f"http://127.0.0.1:{front.port}")) == [401, 401, 200, 200, 200]


def test_a_client_that_goes_away_aborts_its_request_and_frees_its_blocks(pd):
    router, model = pd

    async def go(url):
        async with aiohttp.ClientSession() as session:
            body = {"prompt": list(range(100)), "max_tokens": 3000, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.content.readline()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # bounded: the abort reaches both engines
                async with session.get(url + "/metrics") as r:
                    m = _metrics(await r.text())
                used = [
                    m[("kvdrain:kv_blocks_used", (("engine", e), ("model_name", MODEL_NAME)))]
                    for e in ("P", "D")
                ]
                aborts = m[
                    (
                        "vllm:request_success_total",
                        (("engine", "D"), ("finished_reason", "abort"), ("model_name", MODEL_NAME)),
                    )
                ]
                if used == [0, 0]:  # like vLLM's abort path, a disconnect counts as no finish
                    return aborts == 0
                await asyncio.sleep(0.05)
            return False

    with running_front(router, model) as front:
        assert run(go(f"http://127.0.0.1:{front.port}"))


def test_after_all_that_a_replay_over_http_verifies(pd):
    """Last in this module: the engines that took every bad input above still drain."""
    router, model = pd
    with running_front(router, model) as front:
        timeline, verdict, (status, reasons) = replay_over_http(front.port)
        _, _, (no_metrics, why) = replay_over_http(front.port, "/no-metrics-here", max_requests=4)
        _, _, (no_url, why_not) = replay_over_http(front.port, None, max_requests=4)
    assert (status, reasons) == ("verified", [])
    # at least the example's 4 idle gaps; a loaded machine may leave an engine's own short
    # windows unobserved (coverage says which), never judged otherwise
    assert sum(w.verdict == "drained" for w in verdict.windows) >= 4, verdict.windows
    http = timeline.meta["http"]
    assert http["server"]["owned_by"] == "kvdrain" and "kvdrain" in http["server"]["server"]
    assert "vllm:kv_cache_usage_perc" in http["metrics"][0]["metric_names_found"]
    assert http["latency"]["completed"] == 32 and http["latency"]["median_ttft_ms"] > 0
    # ignore_eos and max_tokens: every request got all its tokens.
    assert sum(r.num_output_tokens for r in timeline.requests) == sum(
        r.max_tokens for r in read_trace(EXAMPLE) if hasattr(r, "max_tokens")
    )
    assert no_metrics == "inconclusive" and "HTTP 404" in " ".join(why)
    assert no_url == "inconclusive" and "no --metrics" in why_not[0]
