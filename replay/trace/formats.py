"""Trace line parsers: kvdrain JSONL, Mooncake JSONL and Azure CSV. Runs in: frontend process.

The formats themselves are described in replay/trace/reader.py's docstring, which also owns what
spans lines (format detection, headers, time order, unique ids). A bad field raises
FieldError("name", "what is wrong"); the reader adds the file and line.
"""
from __future__ import annotations

import json
import math
import re
from datetime import datetime, timedelta, timezone

from engine.utils import cdiv
from replay.trace.records import (DEFAULT_HASH_BLOCK_SIZE, TraceAbort, TraceRecord, TraceRequest,
                                  TraceSnapshot)

MOONCAKE_BLOCK_SIZE = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:?\d\d)?")
_KEYS = {"abort": {"t", "abort"}, "snapshot": {"t", "kv", "queues"},
         "request": {"t", "id", "max_tokens", "prompt_len", "prompt_token_ids", "hash_ids",
                     "hash_block_size", "pd"}}


class FieldError(Exception):
    """One bad field of one line: `name: what is wrong`."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"{name}: {what}")


def show(value: object) -> str:
    """A value as JSON, cut to 40 characters, for error messages."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(obj: dict[str, object], name: str, minimum: int, label: str = "") -> int:
    if name not in obj:
        raise FieldError(label or name, f"missing, must be an integer >= {minimum}")
    value = obj[name]
    if type(value) is not int or value < minimum:
        raise FieldError(label or name, f"must be an integer >= {minimum}, got {show(value)}")
    return value


def _ints(obj: dict[str, object], name: str, minimum: int | None) -> tuple[int, ...]:
    value = obj.get(name)
    if not isinstance(value, list) or not value or not all(
            type(x) is int and (minimum is None or x >= minimum) for x in value):
        bound = "" if minimum is None else f" >= {minimum}"
        raise FieldError(name, f"must be a non-empty list of integers{bound}, "
                               f"got {show(value)}")
    return tuple(value)


def _seconds(value: object, name: str, per_second: int = 1) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        unit = "milliseconds" if per_second == 1000 else "seconds"
        raise FieldError(name, f"must be a number >= 0 ({unit}), got {show(value)}")
    return value / per_second


def _check_cover(length: int, hash_ids: tuple[int, ...], block: int, name: str) -> None:
    need = cdiv(length, block)
    if need != len(hash_ids):
        raise FieldError("hash_ids", f"has {len(hash_ids)} ids but ceil({name} {length} "
                                     f"/ {block}) = {need}")


def parse_json(text: str) -> dict[str, object]:
    """The JSON object of one JSONL line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError("json", f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise FieldError("json", f"must be a JSON object, got {show(obj)}")
    return obj


def _kvdrain_prompt(obj: dict[str, object]) -> tuple[int, tuple[int, ...] | None,
                                                     tuple[int, ...] | None, int]:
    """(prompt_len, prompt_token_ids, hash_ids, hash_block_size) of a request line."""
    block = DEFAULT_HASH_BLOCK_SIZE
    if "prompt_token_ids" in obj:
        if obj.keys() & {"prompt_len", "hash_ids", "hash_block_size"}:
            raise FieldError("prompt_token_ids", "cannot be combined with prompt_len, "
                                                 "hash_ids or hash_block_size")
        token_ids = _ints(obj, "prompt_token_ids", 0)
        return len(token_ids), token_ids, None, block
    if "hash_ids" in obj:
        hash_ids = _ints(obj, "hash_ids", None)
        block = _int(obj, "hash_block_size", 1) if "hash_block_size" in obj else block
        if "prompt_len" not in obj:
            return len(hash_ids) * block, None, hash_ids, block
        _check_cover(length := _int(obj, "prompt_len", 1), hash_ids, block, "prompt_len")
        return length, None, hash_ids, block
    if "hash_block_size" in obj:
        raise FieldError("hash_block_size", "needs hash_ids")
    if "prompt_len" not in obj:
        raise FieldError("prompt_len", "missing: give prompt_len, prompt_token_ids or hash_ids")
    return _int(obj, "prompt_len", 1), None, None, block


def _engine_counts(value: object, name: str, required: tuple[str, ...],
                   allowed: set[str] | None) -> dict[str, dict[str, int]]:
    """{engine: {count name: integer >= 0}}, as in a snapshot's kv and queues."""
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise FieldError(name, f"must be an object of engine -> counts, got {show(value)}")
    for engine, counts in value.items():
        for key in set(required) | counts.keys():
            if allowed is not None and key not in allowed:
                raise FieldError(f"{name}.{engine}.{key}", "unknown count")
            _int(counts, key, 0, f"{name}.{engine}.{key}")
    return value


def parse_kvdrain(obj: dict[str, object], line: int) -> TraceRecord:
    """The request, abort or snapshot of a kvdrain line (the header is the reader's)."""
    if "kvdrain_trace" in obj:
        raise FieldError("kvdrain_trace", "a header is allowed only on the first line")
    kind = "abort" if "abort" in obj else "snapshot" if "kv" in obj else "request"
    unknown = sorted(obj.keys() - _KEYS[kind])
    if unknown:
        raise FieldError(unknown[0], f"unknown field in a {kind} line")
    t = _seconds(obj.get("t"), "t")
    if kind == "abort":
        if not isinstance(obj["abort"], str) or not obj["abort"]:
            raise FieldError("abort", f"must be a request id, got {show(obj['abort'])}")
        return TraceAbort(t, obj["abort"], line)
    if kind == "snapshot":
        kv = _engine_counts(obj["kv"], "kv", ("used", "free"), {"used", "free", "cached"})
        queues = _engine_counts(obj.get("queues", {}), "queues", (), None)
        return TraceSnapshot(t, kv, queues, line)
    req_id, pd = obj.get("id"), obj.get("pd")
    if not isinstance(req_id, str) or not req_id:
        raise FieldError("id", f"must be a non-empty string, got {show(req_id)}")
    if pd is not None and not isinstance(pd, bool):
        raise FieldError("pd", f"must be true or false, got {show(pd)}")
    max_tokens = _int(obj, "max_tokens", 1)
    length, token_ids, hash_ids, block = _kvdrain_prompt(obj)
    return TraceRequest(t, req_id, max_tokens, length, token_ids, hash_ids, block, pd, line)


def parse_mooncake(obj: dict[str, object], line: int) -> TraceRequest | None:
    """The request of a Mooncake line, or None for a zero-length row."""
    t = _seconds(obj.get("timestamp"), "timestamp", 1000)
    num_in, num_out = _int(obj, "input_length", 0), _int(obj, "output_length", 0)
    if num_in == 0 or num_out == 0:
        return None
    hash_ids = _ints(obj, "hash_ids", None)
    _check_cover(num_in, hash_ids, MOONCAKE_BLOCK_SIZE, "input_length")
    return TraceRequest(t, f"mc-{line}", num_out, num_in, None, hash_ids,
                        MOONCAKE_BLOCK_SIZE, None, line)


def _azure_ns(text: str) -> int:
    """Nanoseconds since the epoch (by hand: datetime takes 6 fractional digits at most)."""
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise FieldError("TIMESTAMP", f"must be YYYY-MM-DD HH:MM:SS[.fraction][zone], "
                                      f"got {show(text)}")
    zone = m[8] or "Z"
    minutes = 0 if zone == "Z" else int(zone[0] + "1") * (int(zone[1:3]) * 60 + int(zone[-2:]))
    try:
        whole = datetime(*map(int, m.groups()[:6]),
                         tzinfo=timezone(timedelta(minutes=minutes)))
    except ValueError as e:
        raise FieldError("TIMESTAMP", f"{e}, got {show(text)}") from None
    return int(whole.timestamp()) * 10**9 + int((m[7] or "").ljust(9, "0"))


def _csv_int(cell: str, name: str) -> int:
    text = cell.strip()
    if not (text.isascii() and text.isdigit()):
        raise FieldError(name, f"must be an integer >= 0, got {show(cell)}")
    return int(text)


class AzureRows:
    """Azure CSV rows to requests: columns found by header name, t from the first row."""

    def __init__(self, header: list[str]) -> None:
        names = [c.strip() for c in header]
        missing = [c for c in AZURE_COLUMNS if c not in names]
        if missing:
            raise FieldError("header", f"no column {missing[0]!r} (found {', '.join(names)})")
        self.columns, self.width = [names.index(c) for c in AZURE_COLUMNS], len(names)
        self.t0_ns: int | None = None  # the first row's time

    def parse(self, cells: list[str], line: int) -> TraceRequest | None:
        """The request of a row, or None for a zero-length row."""
        if len(cells) != self.width:
            raise FieldError("row", f"has {len(cells)} columns, the header has {self.width}")
        ns = _azure_ns(cells[self.columns[0]])
        num_in = _csv_int(cells[self.columns[1]], "ContextTokens")
        num_out = _csv_int(cells[self.columns[2]], "GeneratedTokens")
        self.t0_ns = ns if self.t0_ns is None else self.t0_ns
        if num_in == 0 or num_out == 0:
            return None
        return TraceRequest((ns - self.t0_ns) / 1e9, f"az-{line}", num_out, num_in, line=line)
