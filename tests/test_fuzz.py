"""Fuzz tests (hypothesis): the trace reader and every wire decoder on hostile input.

Properties, each with bounded examples, sizes and time:
- The trace reader, on arbitrary bytes and on JSON / CSV lines of hostile shapes, in every
  format (sniffed or named), raises nothing but TraceError and allocates little; a trace
  that validates against the engines' limits synthesises only prompts that fit them.
- CODEC.decode (engine/proc/messages.py), SERVE_CODEC.decode (replay/serve/messages.py)
  and CONNECTOR_CODEC.decode (connector/messages.py),
  on arbitrary bytes and on well-formed msgpack of random shapes (registered tags and
  arities included), raise nothing but DecodeError and return only registered types.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
import types
import typing
from datetime import timedelta
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.messages import CONNECTOR_CODEC
from engine.proc.messages import CODEC, DecodeError
from replay.serve.messages import SERVE_CODEC
from replay.trace.inspect import inspect_trace
from replay.trace.reader import (
    FORMATS,
    TraceError,
    TraceLimits,
    TraceRequest,
    read_trace,
    validate_trace,
)
from replay.trace.shaping import ShapingOptions, shape
from replay.trace.synth import synth_prompt

FUZZ = settings(
    max_examples=60,
    deadline=timedelta(seconds=2),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_TRACE_ALLOC = 8 << 20  # bytes: a small file (< 4 KiB) must never cost more

# ---- trace lines -------------------------------------------------------------------

FIELDS = [
    "t",
    "id",
    "max_tokens",
    "prompt_len",
    "prompt_token_ids",
    "hash_ids",
    "hash_block_size",
    "pd",
    "abort",
    "kv",
    "queues",
    "used",
    "free",
    "cached",
    "kvdrain_trace",
    "timestamp",
    "input_length",
    "output_length",
]
BIG = [10**12, 300_000_000, 2**20, 2**20 + 1, 2**31, 2**63, 2**64, 10**400, -1, 0, 1, 511, 512]
ints = st.integers(-5, 5000) | st.integers(-(2**70), 2**70) | st.sampled_from(BIG)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e300, 1e7, 1e10])
strings = st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfff", "", "P", "x" * 300])
scalars = st.none() | st.booleans() | ints | floats | strings
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.sampled_from(FIELDS) | strings, inner, max_size=4)
    ),
    max_leaves=24,
)
json_lines = st.dictionaries(st.sampled_from(FIELDS), values, max_size=7).map(json.dumps)
stamps = st.sampled_from(
    [
        "2023-11-16 18:17:03",
        "2023-11-16 18:17:03.123456789Z",
        "9999-12-31 23:59:59",
        "2023-13-16 18:17:03",
        "0001-01-01 00:00:00+23:59",
    ]
)
cells = (
    stamps
    | st.integers(0, 10**30).map(str)
    | st.text(max_size=6)
    | st.sampled_from(["0" * 5000 + "7", "9" * 5001, '"', '"a,b"'])
)
csv_lines = st.lists(cells, max_size=5).map(",".join)
deep = st.integers(0, 3000).flatmap(
    lambda n: st.sampled_from(["[" * n, "{" * n, '{"t": ' + "[" * n])
)
text_lines = json_lines | csv_lines | deep
lines = text_lines.map(str.encode) | st.binary(max_size=64)
FIRST = [
    b"",
    b'{"kvdrain_trace": 1}',
    b'{"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 2}',
    b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
    b"TIMESTAMP,ContextTokens,GeneratedTokens",
    b"\xef\xbb\xbf" + b"[" * 70,
]
files = st.tuples(st.sampled_from(FIRST), st.lists(lines, max_size=8)).map(
    lambda fl: b"\n".join([fl[0], *fl[1]])
)
limits = st.none() | st.builds(
    TraceLimits, st.integers(2, 5000), st.integers(1, 1000), st.sampled_from([1.0, 0.5, 3.0])
)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "trace"


def read_everything(path: Path, fmt: str | None, skip: bool, lim: TraceLimits | None) -> None:
    """What a replay does with a trace: validate, read, shape, synthesise; inspect too."""
    try:
        validate_trace(path, fmt, skip, lim)
        inspect_trace(path, fmt)
    except TraceError:
        pass
    try:
        records = list(read_trace(path, fmt, skip, lim))
    except TraceError:
        return
    if lim is None or lim.max_model_len is None:
        return
    for rec in shape(iter(records), ShapingOptions(scale_tokens=lim.scale_tokens)):
        if isinstance(rec, TraceRequest):  # validated: it fits, or the engine rejects its prompt
            prompt = synth_prompt(rec, lim.vocab_size)
            if len(prompt) >= lim.max_model_len:
                continue  # a deployment limit: sent, and rejected as vLLM's front would
            assert rec.max_tokens < lim.max_model_len


@FUZZ
@given(data=files, fmt=st.sampled_from([None, *FORMATS]), skip=st.booleans(), lim=limits)
def test_trace_reader_raises_only_trace_errors_and_allocates_little(
    trace_path, data, fmt, skip, lim
):
    trace_path.write_bytes(data)
    tracemalloc.start()
    try:
        read_everything(trace_path, fmt, skip, lim)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_TRACE_ALLOC


@FUZZ
@given(data=st.lists(text_lines, min_size=1, max_size=6), fmt=st.sampled_from([None, *FORMATS]))
def test_trace_reader_on_text_lines(trace_path, data, fmt):
    trace_path.write_text("\n".join(data), encoding="utf-8", errors="surrogatepass")
    read_everything(trace_path, fmt, True, TraceLimits(4096, 512))


# ---- wire decoders -----------------------------------------------------------------

CODECS = {"engine": CODEC, "serve": SERVE_CODEC, "connector": CONNECTOR_CODEC}
wire_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
wire_values = st.recursive(
    wire_scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3), inner, max_size=4)
    ),
    max_leaves=20,
)


def shaped_frames(codec) -> st.SearchStrategy[bytes]:
    """msgpack [tag, field, ...]: a registered tag and its arity, or anything near them."""
    tags = st.sampled_from(sorted(codec.messages)) | st.integers(-2, 20) | wire_scalars
    arity = st.sampled_from([len(codec._checks[c]) for c in codec.messages.values()])
    fields = arity.flatmap(lambda n: st.lists(wire_values, min_size=n, max_size=n)) | st.lists(
        wire_values, max_size=8
    )
    frames = st.tuples(tags, fields).map(lambda tf: [tf[0], *tf[1]]) | wire_values
    return frames.map(lambda obj: msgpack.packb(obj, use_bin_type=True))


def decode_only_raises_decode_error(codec, data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except DecodeError:
        return
    assert type(msg) in codec.messages.values()


@FUZZ
@given(name=st.sampled_from(sorted(CODECS)), data=st.binary(max_size=256))
def test_decoders_on_arbitrary_bytes(name, data):
    decode_only_raises_decode_error(CODECS[name], data)


@pytest.mark.parametrize("name", sorted(CODECS))
@FUZZ
@given(data=st.data())
def test_decoders_on_well_formed_msgpack_of_random_shapes(name, data):
    codec = CODECS[name]
    decode_only_raises_decode_error(codec, data.draw(shaped_frames(codec)))


def typed(tp) -> st.SearchStrategy:
    """Values of wire field type `tp` that its check accepts (nested messages as lists)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float, str, bool, bytes):
        return {
            int: st.integers(-(2**63), 2**64 - 1),
            float: st.floats(allow_nan=False),
            str: st.text(max_size=6),
            bool: st.booleans(),
            bytes: st.binary(max_size=6),
        }[tp]
    if origin in (typing.Union, types.UnionType):
        return st.one_of([st.none() if a is type(None) else typed(a) for a in args])
    if origin is list:
        return st.lists(typed(args[0]), max_size=3)
    if tp is dict or origin is dict:
        key, val = args or (str, int)
        return st.dictionaries(typed(key), typed(val), max_size=3)
    hints = typing.get_type_hints(tp)
    return st.tuples(*[typed(hints[f.name]) for f in dataclasses.fields(tp)]).map(list)


def broken(value: object, data: st.DataObject) -> object:
    """`value` with one part, at any depth, replaced by a random wire value."""
    if isinstance(value, list) and value and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(value) - 1))
        return [*value[:i], broken(value[i], data), *value[i + 1 :]]
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(list(value)))
        return {**value, key: broken(value[key], data)}
    return data.draw(wire_values)


@pytest.mark.parametrize("name", sorted(CODECS))
@FUZZ
@given(data=st.data())
def test_decoders_on_valid_messages_and_one_part_replaced(name, data):
    """Every registered message round-trips; with any one part replaced, at most DecodeError."""
    codec = CODECS[name]
    tag = data.draw(st.sampled_from(sorted(codec.messages)))
    frame = [tag, *data.draw(typed(codec.messages[tag]))]
    msg = codec.decode(msgpack.packb(frame, use_bin_type=True))
    assert type(msg) is codec.messages[tag] and codec.decode(codec.encode(msg)) == msg
    data_bytes = msgpack.packb(broken(frame, data), use_bin_type=True)
    decode_only_raises_decode_error(codec, data_bytes)
