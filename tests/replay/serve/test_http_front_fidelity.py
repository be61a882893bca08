"""kvdrain's HTTP front where vLLM 0.32 decides the details, over a fake in-process router
(no engine processes): a client disconnect counts in no finished-request metric, an explicit
null is the default where vLLM's field is Optional, the response id is "cmpl-<hex>", the
401 body is vLLM's auth middleware's, an ignored request says its cause, and the loop
states on /metrics are engine/core/liveness.py's."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.liveness import LOOP_STATE_NAMES
from engine.core.outputs import RequestOutput
from engine.proc.messages import StatsSnapshot
from engine.proc.stats_check import KNOWN_LOOP_STATES
from replay.openai.protocol import ServedModel
from replay.serve.http_front import HttpFrontOptions
from tests.http_utils import running_front

pytestmark = pytest.mark.timeout(60)
MODEL = ServedModel("m", 512, 1000, 16, ("P", "D"), "pd", "event")
IGNORED_CAUSE = "up to 600 tokens need 38 KV blocks; the pool has 31"


class FakeRouter:
    """A router whose outputs `behaviour(req_id, prompt, max_tokens)` chooses at once."""

    engines = ["P", "D"]
    vocab_size = 1000

    def __init__(self, behaviour) -> None:
        self.behaviour = behaviour
        self.pending: list[RequestOutput] = []
        self.aborted: list[str] = []
        self.seq = 0

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def add_request(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.pending += self.behaviour(req_id, prompt, max_tokens)

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    def poll(self, timeout: float) -> list[RequestOutput]:
        out, self.pending = self.pending, []
        return out

    def request_stats(self) -> None:
        pass

    def take_stats(self) -> list[StatsSnapshot]:
        self.seq += 1
        counts = {
            "num_usable_blocks": 100,
            "num_used_blocks": 0,
            "num_free_blocks": 100,
            "num_cached_blocks": 0,
        }
        return [
            StatsSnapshot(e, self.seq, time.monotonic(), "blocked", self.seq, 0, counts)
            for e in self.engines
        ]


def answers(req_id: str, prompt: list[int], max_tokens: int) -> list[RequestOutput]:
    if prompt[0] == 0:  # never answered
        return []
    if prompt[0] == 1:  # ignored, as the scheduler reports FINISHED_IGNORED
        return [RequestOutput(req_id, [], "length", error=IGNORED_CAUSE)]
    return [RequestOutput(req_id, [7]), RequestOutput(req_id, [8], "length")]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict, **kwargs
) -> tuple[int, object]:
    async with session.post(url + "/v1/completions", json=body, **kwargs) as response:
        raw = await response.read()
        if response.content_type == "text/event-stream":
            return response.status, [
                json.loads(line[6:])
                for line in raw.decode().splitlines()
                if line.startswith("data: {")
            ]
        return response.status, json.loads(raw)


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_a_client_disconnect_counts_in_no_finished_request_metric():
    router = FakeRouter(answers)
    with running_front(router, MODEL) as front:
        url = f"http://127.0.0.1:{front.port}"

        async def go() -> str:
            async with aiohttp.ClientSession() as session:
                try:  # the request never gets an answer: the client gives up
                    await _post(
                        session,
                        url,
                        {"prompt": [0, 1], "stream": True},
                        timeout=aiohttp.ClientTimeout(total=0.3),
                    )
                except asyncio.TimeoutError:
                    pass
                deadline = time.monotonic() + 10
                while not router.aborted and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                await _post(session, url, {"prompt": [5, 1]})  # one that finishes
                async with session.get(url + "/metrics") as response:
                    return await response.text()

        samples = _samples(run(go()))
    assert len(router.aborted) == 1
    success = {
        s.labels["finished_reason"]: s.value
        for s in samples["vllm:request_success_total"]
        if s.labels["engine"] == "D"
    }
    assert success["abort"] == 0 and success["length"] == 1
    e2e = {s.labels["engine"]: s.value for s in samples["vllm:e2e_request_latency_seconds_count"]}
    assert e2e == {"P": 0, "D": 1}


def test_explicit_nulls_are_defaults_where_vllm_fields_are_optional():
    with running_front(FakeRouter(answers), MODEL) as front:
        url = f"http://127.0.0.1:{front.port}"

        async def go():
            async with aiohttp.ClientSession() as session:
                nulls = {
                    "prompt": [5, 1],
                    "max_tokens": None,
                    "stream": None,
                    "return_token_ids": None,
                    "model": None,
                    "kv_transfer_params": None,
                    "stream_options": None,
                    "echo": None,
                    "logprobs": None,
                    "stop": None,
                    "stop_token_ids": None,
                }
                plain = await _post(session, url, nulls)
                usage = await _post(
                    session,
                    url,
                    {"prompt": [5, 1], "stream": True, "stream_options": {"include_usage": None}},
                )
                empty = await _post(session, url, {"prompt": [5, 1], "stream_options": {}})
                eos = await _post(session, url, {"prompt": [5, 1], "ignore_eos": None})
                return plain, usage, empty, eos

        plain, usage, empty, eos = run(go())
    assert plain[0] == 200 and plain[1]["choices"][0]["token_ids"] is None  # return_token_ids: off
    assert plain[1]["usage"]["completion_tokens"] == 2
    assert usage[0] == 200 and all("usage" not in chunk for chunk in usage[1])
    assert empty[0] == 200  # vLLM refuses stream_options only when it is truthy
    assert eos[0] == 400 and eos[1]["error"]["param"] == "ignore_eos"  # a bool, not Optional


def test_response_ids_are_cmpl_and_one_hex_or_the_given_id():
    with running_front(FakeRouter(answers), MODEL) as front:
        url = f"http://127.0.0.1:{front.port}"

        async def go():
            async with aiohttp.ClientSession() as session:
                return [
                    await _post(session, url, {"prompt": [5, 1]}),
                    await _post(session, url, {"prompt": [5, 1], "stream": True}),
                    await _post(session, url, {"prompt": [5, 1], "request_id": "abc"}),
                    await _post(session, url, {"prompt": [5, 1]}, headers={"X-Request-Id": "xyz"}),
                ]

        plain, stream, given, header = run(go())
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", plain[1]["id"])
    assert {chunk["id"] for chunk in stream[1]} == {stream[1][0]["id"]}
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", stream[1][0]["id"])
    assert (given[1]["id"], header[1]["id"]) == ("cmpl-abc", "cmpl-xyz")


def test_unauthorized_is_vllms_body():
    with running_front(FakeRouter(answers), MODEL, HttpFrontOptions(api_key="k")) as front:
        url = f"http://127.0.0.1:{front.port}"

        async def go():
            async with aiohttp.ClientSession() as session:
                return (
                    await _post(session, url, {"prompt": [5, 1]}),
                    await _post(
                        session, url, {"prompt": [5, 1]}, headers={"Authorization": "Bearer no"}
                    ),
                    await _post(
                        session, url, {"prompt": [5, 1]}, headers={"Authorization": "Bearer k"}
                    ),
                )

        missing, wrong, right = run(go())
    assert missing == (401, {"error": "Unauthorized"}) and wrong == missing
    assert right[0] == 200


def test_an_ignored_request_carries_the_engines_cause():
    with running_front(FakeRouter(answers), MODEL) as front:
        url = f"http://127.0.0.1:{front.port}"

        async def go():
            async with aiohttp.ClientSession() as session:
                return (
                    await _post(session, url, {"prompt": [1, 1]}),
                    await _post(session, url, {"prompt": [1, 1], "stream": True}),
                    await _post(session, url, {"prompt": [5, 1]}),
                )

        plain, stream, normal = run(go())
    choice = plain[1]["choices"][0]
    assert (choice["finish_reason"], choice["kvdrain_ignored_reason"]) == ("length", IGNORED_CAUSE)
    assert plain[1]["usage"]["completion_tokens"] == 0
    assert stream[1][-1]["choices"][0]["kvdrain_ignored_reason"] == IGNORED_CAUSE
    assert "kvdrain_ignored_reason" not in normal[1]["choices"][0]  # only when ignored


def test_loop_states_have_one_source():
    with running_front(FakeRouter(answers), MODEL) as front:

        async def go() -> str:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{front.port}/metrics") as response:
                    return await response.text()

        samples = _samples(run(go()))
    states = [s.labels["state"] for s in samples["kvdrain:loop_state"] if s.labels["engine"] == "P"]
    assert tuple(states) == LOOP_STATE_NAMES and KNOWN_LOOP_STATES == frozenset(LOOP_STATE_NAMES)
