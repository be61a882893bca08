"""What kvdrain's HTTP front says about itself as vLLM's server does: /tokenize, /version,
and a P that counts its prefill-only requests in vllm:request_success_total."""

from __future__ import annotations

import asyncio
import importlib.metadata

import aiohttp
import pytest
import tomllib
from prometheus_client.parser import text_string_to_metric_families

from tests.http_utils import MODEL_NAME, engines, running_front
from tests.paths import ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pd():
    with engines("event", "pd") as (router, model):
        yield router, model


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _post(session, url: str, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + path, json=body) as response:
        return response.status, await response.json()


def _not_installed(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


def test_tokenize_answers_as_vllms_count_max_model_len_tokens_and_token_strs(pd, monkeypatch):
    """/version is the report's kvdrain version: a checkout run without installing it said unknown."""
    router, model = pd
    monkeypatch.setattr(importlib.metadata, "version", _not_installed)

    async def go(url):
        async with aiohttp.ClientSession() as session:
            plain = await _post(
                session, url, "/tokenize", {"model": MODEL_NAME, "prompt": "w7 w511 w512"}
            )
            strs = await _post(
                session,
                url,
                "/tokenize",
                {"prompt": "w3 hi", "return_token_strs": True, "add_special_tokens": False},
            )
            other = await _post(session, url, "/tokenize", {"model": "gpt-4", "prompt": "w1"})
            ids = await _post(session, url, "/tokenize", {"prompt": [1, 2]})
            async with session.get(url + "/version") as response:
                version = await response.json()
        return plain, strs, other, ids, version

    with running_front(router, model) as front:
        plain, strs, other, ids, version = run(go(f"http://127.0.0.1:{front.port}"))
    assert plain == (
        200,
        {
            "count": 6,
            "max_model_len": model.max_model_len,  # w512: beyond 512 words
            "tokens": [7, 511, *b"w512"],
            "token_strs": None,
        },
    )
    assert strs == (
        200,
        {
            "count": 3,
            "max_model_len": model.max_model_len,
            "tokens": [3, 104, 105],
            "token_strs": ["w3", "w104", "w105"],
        },
    )
    assert other[0] == 404 and ids[0] == 400  # vLLM's /tokenize takes text, not ids
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert version == {"version": pyproject["project"]["version"]}


def test_p_counts_each_prefill_only_request_as_finished_by_length_as_a_vllm_p_does(pd):
    router, model = pd
    key = {
        e: (
            "vllm:request_success_total",
            (("engine", e), ("finished_reason", "length"), ("model_name", MODEL_NAME)),
        )
        for e in ("P", "D")
    }

    async def go(url):
        async with aiohttp.ClientSession() as session:
            before = await _metrics(session, url)
            answers = await asyncio.gather(
                *(
                    _post(
                        session, url, "/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 3}
                    )
                    for _ in range(4)
                )
            )
            return before, answers, await _metrics(session, url)

    with running_front(router, model) as front:
        before, answers, after = run(go(f"http://127.0.0.1:{front.port}"))
    assert [status for status, _ in answers] == [200] * 4
    assert after[key["P"]] - before[key["P"]] == 4
    assert after[key["D"]] - before[key["D"]] == 4


async def _metrics(session, url: str) -> dict[tuple, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_vllm_release_a_version_names():
    from replay.target.server_facts import release_of

    assert str(release_of("0.32.0")) == "0.32.0"
    assert str(release_of("0.32.0+cpu")) == "0.32.0"
    assert str(release_of("0.11.2.dev5+g1234")) == "0.11.2"
    assert str(release_of("v0.22")) == "0.22.0"
    assert release_of("unknown") is None and release_of(None) is None


def test_reads_after_expiry_are_counted_from_vllm_s_and_kvdrain_s_metrics():
    from replay.metrics.scrape import parse_metrics
    from replay.target.server_facts import engine_facts

    vllm = parse_metrics(
        "# TYPE vllm:nixl_num_notifications_after_expiry counter\n"
        'vllm:nixl_num_notifications_after_expiry_total{engine="0"} 2.0\n'
    )
    kvdrain = parse_metrics(
        "# TYPE kvdrain:connector_events counter\n"
        'kvdrain:connector_events_total{engine="P",event="reads_after_expiry"} 3.0\n'
    )
    assert engine_facts(vllm, "0").counters["num_notifications_after_expiry"] == 2.0
    assert engine_facts(kvdrain, "P").counters["num_notifications_after_expiry"] == 3.0
    assert engine_facts({}, "0").counters["num_notifications_after_expiry"] is None
