"""The HTTP front's pure parts: the word tokenizer, the completion request checks and strict JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.openai.protocol import ApiError, ServedModel, _encoding, loads_strict, parse_completion
from replay.openai.tokenizer import WordTokenizer

MODEL = ServedModel(
    "kvdrain-mock",
    max_model_len=64,
    vocab_size=512,
    block_size=16,
    engines=("P", "D"),
    topology="pd",
    liveness="event",
)


def test_token_ids_round_trip_through_text():
    tok = WordTokenizer(512)
    ids = [0, 7, 255, 256, 511, 42, 42]
    assert tok.encode(tok.decode(ids)) == ids
    # Streaming pieces join into the whole text.
    assert tok.decode(ids[:2]) + tok.decode(ids[2:], first=False) == tok.decode(ids)


def test_other_words_are_their_utf8_bytes():
    tok = WordTokenizer(512)
    assert tok.encode("hi  w3") == [104, 105, 3]
    assert tok.encode("w512 w07 é") == list(b"w512") + list(b"w07") + list("é".encode())
    assert tok.encode("") == []
    with pytest.raises(ValueError, match="256"):
        WordTokenizer(100)


def test_a_good_request_is_parsed():
    params = parse_completion(
        {
            "model": "kvdrain-mock",
            "prompt": [1, 2, 3],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
            "request_id": "r1",
            "kv_transfer_params": {"x": 1},
        },
        MODEL,
    )
    assert (params.prompt_token_ids, params.max_tokens, params.stream, params.include_usage) == (
        [1, 2, 3],
        5,
        True,
        True,
    )
    assert params.request_id == "r1" and params.kv_transfer_params == {"x": 1}
    assert parse_completion({"prompt": "w1 w2"}, MODEL).prompt_token_ids == [1, 2]
    assert parse_completion({"prompt": [1]}, MODEL).max_tokens == 16  # vLLM's default
    # max_tokens is cut to what max_model_len leaves, as vLLM does.
    assert parse_completion({"prompt": [1] * 60, "max_tokens": 10}, MODEL).max_tokens == 4


@pytest.mark.parametrize(
    "body,status,param",
    [
        ([1, 2], 400, None),
        ({}, 400, "prompt"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": [1, "2"]}, 400, "prompt"),
        ({"prompt": [1, True]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": [512]}, 400, "prompt"),
        ({"prompt": [-1]}, 400, "prompt"),
        ({"prompt": [1] * 64}, 400, "input_tokens"),
        ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [1], "max_tokens": "3"}, 400, "max_tokens"),
        ({"prompt": [1], "max_tokens": 2.0}, 400, "max_tokens"),
        ({"prompt": [1], "stream": "yes"}, 400, "stream"),
        ({"prompt": [1], "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": [1], "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
        ({"prompt": [1], "model": "llama"}, 404, "model"),
        ({"prompt": [1], "max_token": 3}, 422, "max_token"),
        ({"prompt": [1], "n": 2}, 422, "n"),
        ({"prompt": [1], "echo": True}, 422, "echo"),
        ({"prompt": [1], "stop": ["\n"]}, 422, "stop"),
    ],
)
def test_bad_requests_get_vllm_errors(body, status, param):
    with pytest.raises(ApiError) as info:
        parse_completion(body, MODEL)
    error = info.value
    assert error.status == status and error.param == param
    shape = error.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"} and shape["code"] == status
    assert shape["message"]


def test_prompt_too_long_says_so_like_vllm():
    with pytest.raises(ApiError, match="maximum context length is 64 tokens"):
        parse_completion({"prompt": [1] * 100}, MODEL)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=8), st.binary(max_size=7).map(lambda b: b"{" + b)))
def test_strict_json_reads_bytes_in_the_encoding_json_itself_would_guess(raw: bytes):
    assert _encoding(raw) == json.detect_encoding(raw)


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16", "utf-32-be"])
def test_strict_json_reads_an_object_in_any_encoding_json_reads(encoding: str):
    text = '{"choices": [{"text": "w1 héllo"}]}'
    assert loads_strict(text.encode(encoding)) == json.loads(text.encode(encoding))
