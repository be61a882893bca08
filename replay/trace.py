"""Trace records and streaming trace readers. Runs in: frontend process.

The format is detected from the first non-empty line (or named by `fmt`). Blank lines are
skipped; line numbers count every physical line from 1. In every format times must be
non-decreasing in file order. A bad line is reported as `file:line: field: what is wrong`.

kvdrain JSONL, the native format, one JSON object a line:
- header, optional, first non-empty line only: {"kvdrain_trace": 1, ...free-form metadata}
- request: {"t": 0.5, "id": "r1", "max_tokens": 16, <prompt>, "pd": true}
    t           seconds from the trace start, a number >= 0
    id          a non-empty string, unique in the file
    max_tokens  tokens to generate, an integer >= 1
    <prompt>    exactly one of
      "prompt_token_ids": [int >= 0, ...]  the prompt itself (no other prompt key with it)
      "prompt_len": n                      n >= 1 tokens unique to this request
      "hash_ids": [int, ...]               prefix-chained block ids (equal ids, equal tokens)
                                           + optional "hash_block_size" (tokens per id;
                                           default 16, vLLM's block size) + optional
                                           "prompt_len": without it every block is full;
                                           with it ceil(prompt_len / hash_block_size) ==
                                           len(hash_ids), so only the last block is partial
    pd          optional: true = prefill/decode pair, false = one engine, absent = default
- abort: {"t": 2.0, "abort": "r1"} aborts an earlier request of the file
- snapshot: {"t": 9.0, "kv": {"P": {"used": 3, "free": 60, "cached": 2}},
             "queues": {"P": {"waiting": 0, "running": 1}}}
    recorded state per engine; "used" and "free" required, "cached" optional; "queues"
    optional, with counts of any name; every count an integer >= 0
Unknown keys in a record line are errors, so a typo cannot silently change a replay.

Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token
blocks, len(hash_ids) == ceil(input_length / 512)); t = timestamp / 1000; request ids are
"mc-<line>"; other keys are ignored.
Azure LLM inference CSV: columns found by header name: `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS`,
optional `.` and 1 to 9 fractional digits, optional `Z` or `+HH:MM` zone, no zone = UTC),
`ContextTokens`, `GeneratedTokens`; t = seconds since the first row; request ids are
"az-<line>" (the header is line 1). In both public formats a row with zero input or
output tokens (a failed request) is skipped and counted (`num_skipped`), not an error.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

FORMATS = ("kvdrain", "mooncake", "azure")
TRACE_VERSION = 1
DEFAULT_HASH_BLOCK_SIZE = 16
MOONCAKE_BLOCK_SIZE = 512
MAX_BAD_LINE_MESSAGES = 10
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:?\d\d)?")
_TIME_FIELD = {"kvdrain": "t", "mooncake": "timestamp", "azure": "TIMESTAMP"}
_KEYS = {"abort": {"t", "abort"}, "snapshot": {"t", "kv", "queues"},
         "request": {"t", "id", "max_tokens", "prompt_len", "prompt_token_ids", "hash_ids",
                     "hash_block_size", "pd"}}


class TraceError(ValueError):
    """A trace that cannot be read; the message says where and why."""


class _FieldError(Exception):
    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"{name}: {what}")


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """The optional first line of a kvdrain trace: version and free-form metadata."""

    version: int
    metadata: dict[str, object]
    line: int = 1


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request arriving at `t` seconds of trace time."""

    t: float
    req_id: str
    max_tokens: int
    prompt_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
    pd: bool | None = None
    line: int = 0


@dataclass(frozen=True, slots=True)
class TraceAbort:
    """The client aborts request `req_id` at `t`."""

    t: float
    req_id: str
    line: int = 0


@dataclass(frozen=True, slots=True)
class TraceSnapshot:
    """Recorded per-engine KV block counts and queue lengths at `t`."""

    t: float
    kv: dict[str, dict[str, int]]
    queues: dict[str, dict[str, int]] = field(default_factory=dict)
    line: int = 0


TraceRecord = TraceHeader | TraceRequest | TraceAbort | TraceSnapshot


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What one full validating pass over a trace found."""

    path: str
    format: str
    header: TraceHeader | None
    num_requests: int
    num_aborts: int
    num_snapshots: int
    num_skipped: int  # public-format rows with zero input or output tokens
    duration: float  # last record's t minus the first's
    total_prompt_tokens: int
    total_output_tokens: int
    num_bad_lines: int
    bad_line_messages: tuple[str, ...]  # the first MAX_BAD_LINE_MESSAGES
    sha256: str  # of the file's bytes


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(obj: dict[str, object], name: str, minimum: int, label: str = "") -> int:
    if name not in obj:
        raise _FieldError(label or name, f"missing, must be an integer >= {minimum}")
    value = obj[name]
    if type(value) is not int or value < minimum:
        raise _FieldError(label or name, f"must be an integer >= {minimum}, got {_show(value)}")
    return value


def _ints(obj: dict[str, object], name: str, minimum: int | None) -> tuple[int, ...]:
    value = obj.get(name)
    if not isinstance(value, list) or not value or not all(
            type(x) is int and (minimum is None or x >= minimum) for x in value):
        bound = "" if minimum is None else f" >= {minimum}"
        raise _FieldError(name, f"must be a non-empty list of integers{bound}, "
                                f"got {_show(value)}")
    return tuple(value)


def _seconds(value: object, name: str, per_second: int = 1) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        unit = "milliseconds" if per_second == 1000 else "seconds"
        raise _FieldError(name, f"must be a number >= 0 ({unit}), got {_show(value)}")
    return value / per_second


def _check_cover(length: int, hash_ids: tuple[int, ...], block: int, name: str) -> None:
    need = -(-length // block)
    if need != len(hash_ids):
        raise _FieldError("hash_ids", f"has {len(hash_ids)} ids but ceil({name} {length} "
                                      f"/ {block}) = {need}")


def _azure_ns(text: str) -> int:
    """Nanoseconds since the epoch (by hand: datetime takes 6 fractional digits at most)."""
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise _FieldError("TIMESTAMP", f"must be YYYY-MM-DD HH:MM:SS[.fraction][zone], "
                                       f"got {_show(text)}")
    zone = m[8] or "Z"
    minutes = 0 if zone == "Z" else int(zone[0] + "1") * (int(zone[1:3]) * 60 + int(zone[-2:]))
    try:
        whole = datetime(*map(int, m.groups()[:6]),
                         tzinfo=timezone(timedelta(minutes=minutes)))
    except ValueError as e:
        raise _FieldError("TIMESTAMP", f"{e}, got {_show(text)}") from None
    return int(whole.timestamp()) * 10**9 + int((m[7] or "").ljust(9, "0"))


def _csv_int(cell: str, name: str) -> int:
    text = cell.strip()
    if not (text.isascii() and text.isdigit()):
        raise _FieldError(name, f"must be an integer >= 0, got {_show(cell)}")
    return int(text)


def _kvdrain_prompt(obj: dict[str, object]) -> tuple[int, tuple[int, ...] | None,
                                                     tuple[int, ...] | None, int]:
    """(prompt_len, prompt_token_ids, hash_ids, hash_block_size) of a request line."""
    block = DEFAULT_HASH_BLOCK_SIZE
    if "prompt_token_ids" in obj:
        if obj.keys() & {"prompt_len", "hash_ids", "hash_block_size"}:
            raise _FieldError("prompt_token_ids", "cannot be combined with prompt_len, "
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
        raise _FieldError("hash_block_size", "needs hash_ids")
    if "prompt_len" not in obj:
        raise _FieldError("prompt_len", "missing: give prompt_len, prompt_token_ids or hash_ids")
    return _int(obj, "prompt_len", 1), None, None, block


def _engine_counts(value: object, name: str, required: tuple[str, ...],
                   allowed: set[str] | None) -> dict[str, dict[str, int]]:
    """{engine: {count name: integer >= 0}}, as in a snapshot's kv and queues."""
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise _FieldError(name, f"must be an object of engine -> counts, got {_show(value)}")
    for engine, counts in value.items():
        for key in set(required) | counts.keys():
            if allowed is not None and key not in allowed:
                raise _FieldError(f"{name}.{engine}.{key}", "unknown count")
            _int(counts, key, 0, f"{name}.{engine}.{key}")
    return value


def _parse_kvdrain(obj: dict[str, object], line: int) -> TraceRecord:
    if "kvdrain_trace" in obj:
        raise _FieldError("kvdrain_trace", "a header is allowed only on the first line")
    kind = "abort" if "abort" in obj else "snapshot" if "kv" in obj else "request"
    unknown = sorted(obj.keys() - _KEYS[kind])
    if unknown:
        raise _FieldError(unknown[0], f"unknown field in a {kind} line")
    t = _seconds(obj.get("t"), "t")
    if kind == "abort":
        if not isinstance(obj["abort"], str) or not obj["abort"]:
            raise _FieldError("abort", f"must be a request id, got {_show(obj['abort'])}")
        return TraceAbort(t, obj["abort"], line)
    if kind == "snapshot":
        kv = _engine_counts(obj["kv"], "kv", ("used", "free"), {"used", "free", "cached"})
        queues = _engine_counts(obj.get("queues", {}), "queues", (), None)
        return TraceSnapshot(t, kv, queues, line)
    req_id, pd = obj.get("id"), obj.get("pd")
    if not isinstance(req_id, str) or not req_id:
        raise _FieldError("id", f"must be a non-empty string, got {_show(req_id)}")
    if pd is not None and not isinstance(pd, bool):
        raise _FieldError("pd", f"must be true or false, got {_show(pd)}")
    max_tokens = _int(obj, "max_tokens", 1)
    length, token_ids, hash_ids, block = _kvdrain_prompt(obj)
    return TraceRequest(t, req_id, max_tokens, length, token_ids, hash_ids, block, pd, line)


def _parse_mooncake(obj: dict[str, object], line: int) -> TraceRequest | None:
    """The request of a Mooncake line, or None for a zero-length row."""
    t = _seconds(obj.get("timestamp"), "timestamp", 1000)
    num_in, num_out = _int(obj, "input_length", 0), _int(obj, "output_length", 0)
    if num_in == 0 or num_out == 0:
        return None
    hash_ids = _ints(obj, "hash_ids", None)
    _check_cover(num_in, hash_ids, MOONCAKE_BLOCK_SIZE, "input_length")
    return TraceRequest(t, f"mc-{line}", num_out, num_in, None, hash_ids,
                        MOONCAKE_BLOCK_SIZE, None, line)


def _lines(path: Path) -> Iterator[tuple[int, bytes, str]]:
    """(line number, raw bytes, stripped text) of every line, streaming."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            yield line, raw, raw.decode("utf-8", "replace").strip().lstrip("\ufeff")


class _Scan:
    """One streaming pass over a trace file: parse, check order and ids, count, hash."""

    def __init__(self, path: Path, fmt: str, skip_bad_lines: bool) -> None:
        self.path, self.fmt, self.skip_bad_lines = path, fmt, skip_bad_lines
        self.sha256 = hashlib.sha256()
        self.num_skipped = self.num_bad_lines = 0
        self.bad_line_messages: list[str] = []
        self.last_t = 0.0
        self.req_lines: dict[str, int] = {}  # kvdrain: request id -> its line
        self.columns: list[int] = []  # Azure: where _AZURE_COLUMNS are; [] before the header
        self.width = 0  # Azure: number of header columns
        self.t0_ns: int | None = None  # Azure: the first row's time

    def records(self) -> Iterator[TraceRecord]:
        first = True
        for line, raw, text in _lines(self.path):
            self.sha256.update(raw)
            if not text:
                continue
            try:
                record = self._parse(text, line, first)
                if record is not None:
                    self._check(record)
            except _FieldError as e:
                self._bad(f"{self.path}:{line}: {e}")
                record = None
            first = False
            if record is not None:
                yield record
        if first:
            raise TraceError(f"{self.path}: file: empty, no records")

    def _bad(self, message: str) -> None:
        if not self.skip_bad_lines:
            raise TraceError(message)
        self.num_bad_lines += 1
        if len(self.bad_line_messages) < MAX_BAD_LINE_MESSAGES:
            self.bad_line_messages.append(message)

    def _parse(self, text: str, line: int, first: bool) -> TraceRecord | None:
        if self.fmt == "azure":
            return self._parse_azure(next(csv.reader([text])), line, first)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise _FieldError("json", f"invalid JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(obj, dict):
            raise _FieldError("json", f"must be a JSON object, got {_show(obj)}")
        if self.fmt == "mooncake":
            record = _parse_mooncake(obj, line)
            self.num_skipped += record is None
            return record
        if first and "kvdrain_trace" in obj:
            if obj["kvdrain_trace"] != TRACE_VERSION:
                raise TraceError(f"{self.path}:{line}: kvdrain_trace: unsupported version "
                                 f"{_show(obj['kvdrain_trace'])}, this reader knows 1")
            obj.pop("kvdrain_trace")
            return TraceHeader(TRACE_VERSION, obj, line)
        return _parse_kvdrain(obj, line)

    def _parse_azure(self, cells: list[str], line: int, first: bool) -> TraceRequest | None:
        if first:  # the header: a bad one is fatal, as every row would be bad
            names = [c.strip() for c in cells]
            missing = [c for c in _AZURE_COLUMNS if c not in names]
            if missing:
                raise TraceError(f"{self.path}:{line}: header: no column {missing[0]!r} "
                                 f"(found {', '.join(names)})")
            self.columns, self.width = [names.index(c) for c in _AZURE_COLUMNS], len(names)
            return None
        if len(cells) != self.width:
            raise _FieldError("row", f"has {len(cells)} columns, the header has {self.width}")
        ns = _azure_ns(cells[self.columns[0]])
        num_in = _csv_int(cells[self.columns[1]], "ContextTokens")
        num_out = _csv_int(cells[self.columns[2]], "GeneratedTokens")
        self.t0_ns = ns if self.t0_ns is None else self.t0_ns
        if num_in == 0 or num_out == 0:
            self.num_skipped += 1
            return None
        return TraceRequest((ns - self.t0_ns) / 1e9, f"az-{line}", num_out, num_in, line=line)

    def _check(self, record: TraceRecord) -> None:
        """Times non-decreasing; kvdrain ids unique; aborts name an earlier request."""
        if isinstance(record, TraceHeader):
            return
        if record.t < self.last_t:
            raise _FieldError(_TIME_FIELD[self.fmt], f"times must be non-decreasing, got "
                                                     f"{record.t:.9g} s after {self.last_t:.9g} s")
        if isinstance(record, TraceRequest) and self.fmt == "kvdrain":
            first = self.req_lines.setdefault(record.req_id, record.line)
            if first != record.line:
                raise _FieldError("id", f"duplicate request id {_show(record.req_id)} "
                                        f"(first on line {first})")
        if isinstance(record, TraceAbort) and record.req_id not in self.req_lines:
            raise _FieldError("abort", f"no earlier request with id {_show(record.req_id)}")
        self.last_t = record.t


def detect_format(path: str | Path) -> str:
    """The format of a trace ("kvdrain", "mooncake" or "azure"), from its first non-empty line."""
    line, text = next(((n, s) for n, _, s in _lines(Path(path)) if s), (0, ""))
    if not text:
        raise TraceError(f"{path}: file: empty, no records")
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and ("kvdrain_trace" in obj or "t" in obj):
            return "kvdrain"
        if isinstance(obj, dict) and "timestamp" in obj and "input_length" in obj:
            return "mooncake"
    elif set(_AZURE_COLUMNS) <= {c.strip() for c in next(csv.reader([text]))}:
        return "azure"
    raise TraceError(f"{path}:{line}: format: unknown; expected a kvdrain header or record, "
                     f"a Mooncake line or an Azure CSV header; name the format to override")


def _resolve_format(path: str | Path, fmt: str | None) -> str:
    if fmt is None:
        return detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"format: unknown format {fmt!r}, expected one of {', '.join(FORMATS)}")
    return fmt


def read_trace(path: str | Path, fmt: str | None = None,
               skip_bad_lines: bool = False) -> Iterator[TraceRecord]:
    """Stream a trace's records in file order (its header first when it has one)."""
    return _Scan(Path(path), _resolve_format(path, fmt), skip_bad_lines).records()


def validate_trace(path: str | Path, fmt: str | None = None,
                   skip_bad_lines: bool = False) -> TraceSummary:
    """Read a whole trace once, streaming, and summarise it; a bad line raises TraceError."""
    scan = _Scan(Path(path), _resolve_format(path, fmt), skip_bad_lines)
    counts = {TraceRequest: 0, TraceAbort: 0, TraceSnapshot: 0}
    header, first_t, last_t, prompt, output = None, None, 0.0, 0, 0
    for record in scan.records():
        if isinstance(record, TraceHeader):
            header = record
            continue
        counts[type(record)] += 1
        first_t, last_t = record.t if first_t is None else first_t, record.t
        if isinstance(record, TraceRequest):
            prompt, output = prompt + record.prompt_len, output + record.max_tokens
    if counts[TraceRequest] == 0:
        raise TraceError(f"{path}: trace: no requests ({scan.num_bad_lines} bad lines, "
                         f"{scan.num_skipped} zero-length rows skipped)")
    return TraceSummary(str(path), scan.fmt, header, counts[TraceRequest], counts[TraceAbort],
                        counts[TraceSnapshot], scan.num_skipped, last_t - (first_t or 0.0),
                        prompt, output, scan.num_bad_lines, tuple(scan.bad_line_messages),
                        scan.sha256.hexdigest())
