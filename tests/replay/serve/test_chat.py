"""The OpenAI surface a load tool drives: chat completions (streaming and not, the
messages' text through the front's tokenizer), batch prompts, and one policy for
sampling knobs (honoured at greedy values, refused with a 422 naming them otherwise)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from replay.openai.tokenizer import WordTokenizer
from replay.serve.chat import messages_text
from tests.http_utils import MODEL_NAME, engines, running_front
from tests.mp_utils import mock_tokens

pytestmark = pytest.mark.timeout(120)
MESSAGES = [
    {"role": "system", "content": "w7 w300"},
    {"role": "user", "content": [{"type": "text", "text": "w511"}, {"type": "text", "text": "hi"}]},
]


@pytest.fixture(scope="module")
def front():
    with engines("event", "pd") as (router, model), running_front(router, model) as running:
        yield f"http://127.0.0.1:{running.port}", model


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            if headers is not None:
                headers.update(response.headers)
            return response.status, await response.read()


def _prompt_ids(vocab_size: int) -> list[int]:
    return WordTokenizer(vocab_size).encode(messages_text(MESSAGES))


def test_the_messages_become_one_line_per_message_through_the_same_tokenizer():
    assert messages_text(MESSAGES) == "system: w7 w300\nuser: w511 hi"


def test_a_chat_completion_answers_as_vllm_does(front):
    url, model = front
    status, raw = run(
        _post(
            url,
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": MESSAGES,
                "max_completion_tokens": 3,
                "temperature": 0,
                "seed": 7,
            },
        )
    )
    assert status == 200, raw
    body = json.loads(raw)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and body["choices"][0]["finish_reason"] == "length"
    prompt = _prompt_ids(model.vocab_size)
    assert WordTokenizer(model.vocab_size).encode(message["content"]) == mock_tokens(prompt, 3)
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 3


def test_a_streamed_chat_sends_the_role_then_deltas_then_usage(front):
    url, model = front
    headers: dict = {}
    status, raw = run(
        _post(
            url,
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers,
        )
    )
    assert status == 200 and headers["Server"] == "kvdrain (aiohttp)"
    events = [e[len("data: ") :] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert WordTokenizer(model.vocab_size).encode(text) == mock_tokens(
        _prompt_ids(model.vocab_size), 4
    )
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_a_batch_of_prompts_gets_one_choice_per_prompt_in_order(front):
    url, model = front
    status, raw = run(
        _post(
            url,
            "/v1/completions",
            {"prompt": ["w5 w6", "w9 w10 w11"], "max_tokens": 2, "return_token_ids": True},
        )
    )
    assert status == 200, raw
    body = json.loads(raw)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [
        mock_tokens([5, 6], 2),
        mock_tokens([9, 10, 11], 2),
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    ids = run(_post(url, "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 1}))
    assert ids[0] == 200 and len(json.loads(ids[1])["choices"]) == 2
    streamed = run(_post(url, "/v1/completions", {"prompt": ["a", "b"], "stream": True}))
    assert streamed[0] == 422 and json.loads(streamed[1])["error"]["param"] == "stream"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "knob,value,status",
    [
        ("temperature", 0.7, 422),
        ("temperature", 0.0, 200),
        ("top_p", 0.9, 422),
        ("top_p", 1, 200),
        ("top_k", 40, 422),
        ("seed", 1234, 200),
        ("logit_bias", {"5": 10}, 422),
        ("presence_penalty", 0.5, 422),
    ],
)
def test_a_sampling_knob_is_honoured_at_greedy_values_or_refused_naming_it(
    front, path, knob, value, status
):
    url, _ = front
    body = {"max_tokens": 1, knob: value}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": [1, 2]})
    got, raw = run(_post(url, path, body))
    assert got == status, raw
    if status == 422:
        error = json.loads(raw)["error"]
        assert error["param"] == knob and knob in error["message"]


def test_chat_only_fields_the_engines_cannot_honour_are_refused(front):
    url, _ = front
    for field, value in (
        ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_object"}),
        ("logprobs", True),
    ):
        status, raw = run(_post(url, "/v1/chat/completions", {"messages": MESSAGES, field: value}))
        assert status == 422 and json.loads(raw)["error"]["param"] == field
    status, raw = run(_post(url, "/v1/chat/completions", {"messages": []}))
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"


def test_a_batch_refused_at_a_later_prompt_leaves_none_of_its_prompts_in_flight(front):
    """The batch's second id is in flight already: a 400, and its first prompt, submitted
    before, is released (it stayed in flight for good, refusing its id ever after)."""
    url, _ = front

    async def go():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "w5 w6", "max_tokens": 3000, "stream": True, "request_id": "abc-1"}
            async with session.post(url + "/v1/completions", json=body) as streaming:
                await streaming.content.readline()  # abc-1 is in flight
                refused = await _post(
                    url, "/v1/completions", {"prompt": ["w1", "w2"], "request_id": "abc"}
                )
            return refused, await _post(
                url, "/v1/completions", {"prompt": "w1", "request_id": "abc-0"}
            )

    (status, raw), (after, again) = run(go())
    assert status == 400 and b"abc-1" in raw
    assert after == 200, again


class ParamsRouter:
    """A P as vLLM's P/D protocol sees it: it takes the client's kv_transfer_params and
    answers one token with the params its D needs; a request for 2 tokens it ignores."""

    engines = ["P"]
    vocab_size = 1000
    answered = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [3]}

    def __init__(self) -> None:
        from tests.replay.serve.test_http_front_fidelity import FakeRouter

        self.fake, self.given = FakeRouter(self._answer), []

    def _answer(self, req_id: str, prompt: list[int], max_tokens: int):
        from engine.core.outputs import RequestOutput

        if max_tokens == 2:
            return [RequestOutput(req_id, [], "length", error="the pool is too small")]
        return [RequestOutput(req_id, [7], "length", kv_transfer_params=self.answered)]

    def add_request(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict | None = None,
    ) -> None:
        self.given.append(kv_transfer_params)
        self.fake.add_request(req_id, prompt, max_tokens)

    def __getattr__(self, name: str):
        return getattr(self.fake, name)


def test_a_chat_answer_carries_kv_transfer_params_and_ignored_reasons_as_a_completion_does():
    """A P/D proxy may send a chat to P: P's answer must name the KV its D is to pull."""
    from replay.openai.protocol import ServedModel

    router, asked = ParamsRouter(), {"do_remote_decode": True}
    model = ServedModel("m", 512, 1000, 16, ("P",), "single", "event")
    with running_front(router, model) as running:
        url = f"http://127.0.0.1:{running.port}"
        chat = run(
            _post(
                url,
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "w5"}],
                    "max_tokens": 1,
                    "kv_transfer_params": asked,
                },
            )
        )
        completion = run(
            _post(
                url,
                "/v1/completions",
                {"prompt": [5], "max_tokens": 1, "kv_transfer_params": asked},
            )
        )
        ignored = run(_post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}))
        streamed = run(
            _post(
                url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True}
            )
        )
    assert chat[0] == completion[0] == 200 and router.given[:2] == [asked, asked]
    assert (
        json.loads(chat[1])["kv_transfer_params"]
        == json.loads(completion[1])["kv_transfer_params"]
        == ParamsRouter.answered
    )
    assert json.loads(ignored[1])["choices"][0]["kvdrain_ignored_reason"] == "the pool is too small"
    last = json.loads(streamed[1].decode().split("\n\n")[-3][len("data: ") :])
    assert last["choices"][0]["kvdrain_ignored_reason"] == "the pool is too small"
