"""Wire types frontend <-> engine core and the codec every socket uses. Runs in: every process.

Each message is a frozen dataclass under a fixed numeric tag (MESSAGES), sent as msgpack([tag,
field, ...]); no pickle, so a peer can only make us build a registered type. The codec builds a
message from its fields in order, so wire types are not kw_only (callers pass keywords all the
same). Imports only stdlib, msgpack and the pure engine/core/outputs.py, so it is cheap to import.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from operator import attrgetter
from typing import Any, Union

import msgpack

from engine.core.outputs import RequestOutput


class DecodeError(ValueError):
    """A frame that is not a well-formed registered message."""


_SCALARS = {int: (int,), float: (float, int), str: (str,), bool: (bool,), bytes: (bytes,)}
# The exact types msgpack decodes each scalar to (it makes no subclasses; bool is its
# own type), so the fast checks below compare types and refuse the same values.
_EXACT = {
    int: frozenset((int,)),
    float: frozenset((float, int)),
    str: frozenset((str,)),
    bool: frozenset((bool,)),
    bytes: frozenset((bytes,)),
}


def _make_check(tp: Any, codec: Codec) -> Callable[[Any], Any]:
    """A function that validates (and for nested messages, rebuilds) one decoded field.

    The reference check: one Python call per list item or dict entry, and the error
    that names what is wrong. _make_fast_check accepts exactly what this accepts.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _SCALARS:
        ok = _SCALARS[tp]

        def check(v):  # bool is an int in Python; refuse it where an int is wanted
            if not isinstance(v, ok) or (tp is not bool and isinstance(v, bool)):
                raise DecodeError(f"expected {tp.__name__}, got {type(v).__name__}")
            return v

        return check
    if origin in (Union, types.UnionType):
        checks = [_make_check(a, codec) for a in args if a is not type(None)]
        return lambda v: None if v is None and type(None) in args else checks[0](v)
    if origin is list:
        item = _make_check(args[0], codec)
        return lambda v: [item(x) for x in _expect(v, list)]
    if origin is dict or tp is dict:
        key, val = (_make_check(a, codec) for a in args) if args else (None, None)
        if key is None:
            return lambda v: _expect(v, dict)
        return lambda v: {key(k): val(x) for k, x in _expect(v, dict).items()}
    if is_dataclass(tp):
        return lambda v: codec.from_fields(tp, _expect(v, list))
    raise TypeError(f"unsupported wire field type {tp!r}")


def _make_fast_check(tp: Any, codec: Codec, slow: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """_make_check's check at C speed for flat fields: the types of a list's items or a
    dict's keys and values are compared as one set (map(type, ...)), with no Python call
    per item. Anything it does not accept goes to `slow`, which accepts it or raises
    the reference error; nested messages are rebuilt by the codec as before."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _make_fast_check(rest[0], codec, slow)
            return lambda v: None if v is None else inner(v)
        return slow
    if tp in _EXACT:
        ok = _EXACT[tp]
        return lambda v: v if type(v) in ok else slow(v)
    if origin is list and args[0] in _EXACT:
        ok = _EXACT[args[0]]
        return lambda v: v if type(v) is list and set(map(type, v)) <= ok else slow(v)
    if tp is dict:
        return lambda v: v if type(v) is dict else slow(v)
    if origin is dict and args[0] in _EXACT and args[1] in _EXACT:
        key_ok, val_ok = _EXACT[args[0]], _EXACT[args[1]]
        return lambda v: (
            v
            if type(v) is dict
            and set(map(type, v)) <= key_ok
            and set(map(type, v.values())) <= val_ok
            else slow(v)
        )
    return slow  # nested messages, lists of them, nested containers


def _expect(v: Any, tp: type) -> Any:
    if not isinstance(v, tp):
        raise DecodeError(f"expected {tp.__name__}, got {type(v).__name__}")
    return v


def _carries_message(tp: Any) -> bool:
    """Whether a field of this type can hold a registered message (encoded as fields)."""
    return is_dataclass(tp) or any(_carries_message(a) for a in typing.get_args(tp))


class Codec:
    """Encodes and strictly decodes the messages of one protocol, each under its fixed tag.

    Decoding checks the tag, the arity and every field's type against the dataclass
    annotations, and raises DecodeError saying what is wrong.
    fast=False runs the reference field checks only (tests compare the two paths).
    """

    def __init__(
        self, messages: dict[int, type], nested: tuple[type, ...] = (), fast: bool = True
    ) -> None:
        if len(set(messages.values())) != len(messages):
            raise ValueError("a message type is registered under two tags")
        if any(not isinstance(tag, int) or isinstance(tag, bool) or tag < 0 for tag in messages):
            raise ValueError("message tags must be non-negative ints")
        self.messages = dict(messages)
        self._tags = {cls: tag for tag, cls in messages.items()}
        self._checks: dict[type, list[tuple[str, Callable]]] = {}
        self._fast_checks: dict[type, tuple[Callable, ...]] = {}
        self._getters: dict[type, Callable[[Any], tuple] | None] = {}  # None: it nests messages
        for cls in (*messages.values(), *nested):
            hints = typing.get_type_hints(cls)
            names = [f.name for f in fields(cls)]
            self._checks[cls] = [(name, _make_check(hints[name], self)) for name in names]
            self._fast_checks[cls] = tuple(
                _make_fast_check(hints[name], self, check) if fast else check
                for name, check in self._checks[cls]
            )
            nests = not fast or any(_carries_message(hints[name]) for name in names)
            self._getters[cls] = None if nests else _tuple_getter(names)

    def to_fields(self, msg: Any) -> list:
        getter = self._getters.get(type(msg))
        if getter is not None:  # flat: every field as it is
            return list(getter(msg))
        return [
            self.to_fields(v)
            if is_dataclass(v)
            else [self.to_fields(x) for x in v]
            if isinstance(v, list) and v and is_dataclass(v[0])
            else v
            for v in (getattr(msg, f.name) for f in fields(msg))
        ]

    def from_fields(self, cls: type, values: list) -> Any:
        checks = self._fast_checks[cls]
        if len(values) != len(checks):
            raise DecodeError(f"{cls.__name__}: expected {len(checks)} fields, got {len(values)}")
        try:
            return cls(*[check(value) for check, value in zip(checks, values)])
        except DecodeError:
            pass
        kwargs = {}  # again, field by field, to say which field is wrong
        for (name, check), value in zip(self._checks[cls], values):
            try:
                kwargs[name] = check(value)
            except DecodeError as e:
                raise DecodeError(f"{cls.__name__}.{name}: {e}") from None
        raise AssertionError(f"{cls.__name__}: the fast check refused what the reference accepts")

    def encode(self, msg: Any) -> bytes:
        cls = type(msg)
        getter = self._getters.get(cls)
        if getter is not None:
            return msgpack.packb([self._tags[cls], *getter(msg)], use_bin_type=True)
        return msgpack.packb([self._tags[cls], *self.to_fields(msg)], use_bin_type=True)

    def decode(self, data: bytes) -> Any:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several types for garbage
            raise DecodeError(f"not msgpack: {e}") from None
        if type(obj) is not list or not obj or type(obj[0]) is not int:
            raise DecodeError("expected [tag, field, ...]")
        cls = self.messages.get(obj[0])
        if cls is None:
            raise DecodeError(f"unknown message tag {obj[0]}")
        return self.from_fields(cls, obj[1:])


def _tuple_getter(names: list[str]) -> Callable[[Any], tuple]:
    """msg -> the tuple of its fields (attrgetter returns a bare value for one name)."""
    if not names:
        return lambda msg: ()
    if len(names) == 1:
        name = names[0]
        return lambda msg: (getattr(msg, name),)
    return attrgetter(*names)


# ---- frontend <-> engine core ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict | None = None
    stop_token_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class Shutdown:
    timeout_s: float = 5.0  # how long to wait for outstanding connector reports


@dataclass(frozen=True, slots=True)
class GetStats:
    pass


@dataclass(frozen=True, slots=True)
class Ready:
    engine_id: str
    pid: int
    num_blocks: int  # the pool as allocated, the null block included
    block_size: int
    max_model_len: int
    vocab_size: int
    device: str


@dataclass(frozen=True, slots=True)
class RequestOutputMsg:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict | None
    num_cached_tokens: int
    error: str | None


def output_to_msg(output: RequestOutput, req_id: str | None = None) -> RequestOutputMsg:
    """The wire form of one output; req_id replaces the output's (serve's client ids)."""
    return RequestOutputMsg(
        output.req_id if req_id is None else req_id,
        output.new_token_ids,
        output.finish_reason,
        output.kv_transfer_params,
        output.num_cached_tokens,
        output.error,
    )


def output_from_msg(msg: RequestOutputMsg) -> RequestOutput:
    return RequestOutput(
        msg.req_id,
        msg.new_token_ids,
        msg.finish_reason,
        msg.kv_transfer_params,
        msg.num_cached_tokens,
        msg.error,
    )


@dataclass(frozen=True, slots=True)
class RequestOutputs:
    engine_id: str
    outputs: list[RequestOutputMsg]


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    engine_id: str
    seq: int
    monotonic: float  # the engine's time.monotonic(); same clock as the frontend's on one host
    loop_state: str  # stepping | polling | blocked
    num_steps: int
    num_wakeups: int
    counts: dict[str, int]  # SchedulerStats fields and connector counters


@dataclass(frozen=True, slots=True)
class EngineError:
    engine_id: str
    message: str


# Wire tags: fixed forever (peers decode by them); a new type takes a new number.
MESSAGES: dict[int, type] = {
    0: AddRequest,
    1: Abort,
    2: Shutdown,
    3: GetStats,
    4: Ready,
    5: RequestOutputs,
    6: StatsSnapshot,
    7: EngineError,
    # 8 and 9 are taken: the serve protocol (a frontend's, over these messages) adds its own there.
}
CODEC = Codec(MESSAGES, nested=(RequestOutputMsg,))
encode = CODEC.encode
decode = CODEC.decode
