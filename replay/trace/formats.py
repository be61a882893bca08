"""Trace line parsers: kvdrain JSONL, Mooncake JSONL and Azure CSV. Runs in: frontend process.

The formats themselves are described in replay/trace/reader.py's docstring, which also owns what
spans lines (format detection, headers, time order, unique ids). A bad field raises
FieldError("name", "what is wrong"); the reader adds the file and line. Every number is
range-checked against the caps in replay/trace/records.py before anything is built from it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

from engine.utils import cdiv
from replay.trace.records import (
    ABORT_PHASES,
    DEFAULT_HASH_BLOCK_SIZE,
    MAX_COUNT,
    MAX_ENGINES,
    MAX_ID_CHARS,
    MAX_JSON_DEPTH,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    MAX_TRACE_T,
    REQUEST_FAULTS,
    TraceAbort,
    TraceEngineFault,
    TraceRecord,
    TraceRequest,
    TraceSnapshot,
)

MOONCAKE_BLOCK_SIZE = 512
_MOONCAKE_MAX_IDS = -(-MAX_PROMPT_TOKENS // MOONCAKE_BLOCK_SIZE)
_MOONCAKE_MAX_MS = MAX_TRACE_T * 1000
_INT_ONLY = {int}
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:?\d\d)?"
)
# What json.loads runs once it has skipped leading whitespace: (object, end index).
_SCAN_ONCE = json.JSONDecoder().scan_once
_KEYS = {
    "abort": {"t", "abort", "when"},
    "pause": {"t", "pause", "for_s"},
    "kill": {"t", "kill"},
    "snapshot": {"t", "kv", "queues"},
    "request": {
        "t",
        "id",
        "max_tokens",
        "prompt_len",
        "prompt_token_ids",
        "hash_ids",
        "hash_block_size",
        "pd",
        "fault",
    },
}


class FieldError(Exception):
    """One bad field of one line: `name: what is wrong`."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"{name}: {what}")


def show(value: object) -> str:
    """A value as JSON, cut to 40 characters, for error messages (never dumps much)."""
    if isinstance(value, (str, list)):
        value = value[:40]
    elif isinstance(value, dict):
        value = dict(list(value.items())[:8]) if len(value) > 8 else value
    elif isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of {len(str(value))} digits"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _at_most(value: int, maximum: int, label: str) -> int:
    if value > maximum:
        raise FieldError(
            label, f"must be at most {maximum:,} (the reader's cap), got {show(value)}"
        )
    return value


def _int(obj: dict[str, object], name: str, minimum: int, maximum: int, label: str = "") -> int:
    if name not in obj:
        raise FieldError(label or name, f"missing, must be an integer >= {minimum}")
    value = obj[name]
    if type(value) is not int or value < minimum:
        raise FieldError(label or name, f"must be an integer >= {minimum}, got {show(value)}")
    return value if value <= maximum else _at_most(value, maximum, label or name)


def _ints(
    obj: dict[str, object], name: str, max_len: int, bounds: tuple[int, int] | None = None
) -> tuple[int, ...]:
    """A non-empty list of at most max_len integers, each within `bounds` if given."""
    value = obj.get(name)
    if isinstance(value, list) and len(value) > max_len:
        raise FieldError(
            name, f"has {len(value):,} entries, at most {max_len:,} (the reader's cap)"
        )
    if (
        not isinstance(value, list)
        or not value
        or set(map(type, value)) != {int}
        or (bounds is not None and not bounds[0] <= min(value) <= max(value) <= bounds[1])
    ):
        within = "" if bounds is None else f" from {bounds[0]:,} to {bounds[1]:,}"
        raise FieldError(name, f"must be a non-empty list of integers{within}, got {show(value)}")
    return tuple(value)


def _seconds(value: object, name: str, per_second: int = 1) -> float:
    # Comparisons, not math.isfinite: exact for ints of any size; NaN fails them too.
    unit = "milliseconds" if per_second == 1000 else "seconds"
    if type(value) not in (int, float) or not value >= 0:
        raise FieldError(name, f"must be a number >= 0 ({unit}), got {show(value)}")
    if not value <= MAX_TRACE_T * per_second:
        raise FieldError(
            name,
            f"must be at most {MAX_TRACE_T * per_second:.0f} {unit} (the "
            f"reader's cap), got {show(value)}",
        )
    return value / per_second


def _string(value: object, name: str) -> str:
    """A request id: a non-empty string of at most MAX_ID_CHARS characters."""
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string, got {show(value)}")
    if len(value) > MAX_ID_CHARS:
        raise FieldError(name, f"has {len(value):,} characters, at most {MAX_ID_CHARS}")
    return value


def _check_cover(length: int, hash_ids: tuple[int, ...], block: int, name: str) -> None:
    need = cdiv(length, block)
    if need != len(hash_ids):
        raise FieldError(
            "hash_ids", f"has {len(hash_ids)} ids but ceil({name} {length} / {block}) = {need}"
        )


def parse_json(text: str) -> dict[str, object]:
    """The JSON object of one JSONL line: nesting, numbers and strings bounded and valid."""
    try:  # json.loads' own scan, without its passes for whitespace the reader stripped
        obj, end = _SCAN_ONCE(text, 0)
    except (StopIteration, ValueError, RecursionError):
        end = -1
    if end != len(text):  # anything else json.loads parses itself, or names what is wrong
        obj = _loads(text)
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(obj) > MAX_JSON_DEPTH:
        raise FieldError("json", f"nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(obj, dict):
        raise FieldError("json", f"must be a JSON object, got {show(obj)}")
    return obj


def _loads(text: str) -> object:
    """json.loads, its errors as FieldErrors."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError("json", f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise FieldError("json", f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise FieldError("json", f"invalid JSON: {str(e)[:80]}") from None


def check_strings(text: str, obj: dict[str, object]) -> None:
    """Every string of a line's object (keys too) encodes as UTF-8: no lone surrogate."""
    if "\\u" in text:  # only an escape can make one
        _check_utf8(obj, "")


def _depth(obj: object) -> int:
    """How deeply arrays and objects nest in `obj`, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend(
                (v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)
            )
    return deepest


def _check_utf8(value: object, name: str) -> None:
    """Every string (keys too) encodes as UTF-8: no lone surrogate from a \\u escape."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise FieldError(
                name or "json",
                f"not valid UTF-8: a lone surrogate "
                f"\\u{ord(value[e.start]):04x} at character "
                f"{e.start}",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_utf8(key, name)
            _check_utf8(item, f"{name}.{key}" if name else key)
    elif isinstance(value, list):
        for item in value:
            _check_utf8(item, name)


def _kvdrain_prompt(
    obj: dict[str, object],
) -> tuple[int, tuple[int, ...] | None, tuple[int, ...] | None, int]:
    """(prompt_len, prompt_token_ids, hash_ids, hash_block_size) of a request line."""
    block = DEFAULT_HASH_BLOCK_SIZE
    if "prompt_token_ids" in obj:
        if obj.keys() & {"prompt_len", "hash_ids", "hash_block_size"}:
            raise FieldError(
                "prompt_token_ids",
                "cannot be combined with prompt_len, hash_ids or hash_block_size",
            )
        token_ids = _ints(obj, "prompt_token_ids", MAX_PROMPT_TOKENS, (0, MAX_TOKEN_ID))
        return len(token_ids), token_ids, None, block
    if "hash_ids" in obj:
        hash_ids = _ints(obj, "hash_ids", MAX_PROMPT_TOKENS)
        if "hash_block_size" in obj:
            block = _int(obj, "hash_block_size", 1, MAX_PROMPT_TOKENS)
        if "prompt_len" not in obj:
            length = _at_most(len(hash_ids) * block, MAX_PROMPT_TOKENS, "hash_ids")
            return length, None, hash_ids, block
        length = _int(obj, "prompt_len", 1, MAX_PROMPT_TOKENS)
        _check_cover(length, hash_ids, block, "prompt_len")
        return length, None, hash_ids, block
    if "hash_block_size" in obj:
        raise FieldError("hash_block_size", "needs hash_ids")
    if "prompt_len" not in obj:
        raise FieldError("prompt_len", "missing: give prompt_len, prompt_token_ids or hash_ids")
    return _int(obj, "prompt_len", 1, MAX_PROMPT_TOKENS), None, None, block


def _engine_counts(
    value: object, name: str, required: tuple[str, ...], allowed: set[str] | None
) -> dict[str, dict[str, int]]:
    """{engine: {count name: integer >= 0}}, as in a snapshot's kv and queues."""
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise FieldError(name, f"must be an object of engine -> counts, got {show(value)}")
    if len(value) > MAX_ENGINES or any(len(c) > MAX_ENGINES for c in value.values()):
        raise FieldError(name, f"more than {MAX_ENGINES} engines or counts (the reader's cap)")
    for engine, counts in value.items():
        _string(engine, f"{name} engine")
        for key in set(required) | counts.keys():
            if allowed is not None and key not in allowed:
                raise FieldError(f"{name}.{engine}.{key}", "unknown count")
            _int(counts, key, 0, MAX_COUNT, f"{name}.{engine}.{_string(key, name)}")
    return value


def _kind(obj: dict[str, object]) -> str:
    """Which record a kvdrain line is, by its keys."""
    for kind in ("abort", "pause", "kill"):
        if kind in obj:
            return kind
    return "snapshot" if "kv" in obj else "request"


def _choice(obj: dict[str, object], name: str, choices: tuple[str, ...]) -> str | None:
    """An optional field that must be one of `choices`; None when absent."""
    value = obj.get(name)
    if name in obj and value not in choices:
        raise FieldError(name, f"must be one of {', '.join(choices)}, got {show(value)}")
    return value


def _abort(obj: dict[str, object], t: float, line: int) -> TraceAbort:
    if not isinstance(obj["abort"], str) or not obj["abort"]:
        raise FieldError("abort", f"must be a request id, got {show(obj['abort'])}")
    when = _choice(obj, "when", ABORT_PHASES)
    return TraceAbort(t, _string(obj["abort"], "abort"), line, when)


def _engine_fault(obj: dict[str, object], kind: str, t: float, line: int) -> TraceEngineFault:
    """A pause (its for_s required) or a kill of the engine the line names."""
    engine = obj[kind]
    if not isinstance(engine, str) or not engine:
        raise FieldError(kind, f"must be an engine name (P, D, P0, ...), got {show(engine)}")
    for_s = None
    if kind == "pause":
        if "for_s" not in obj:
            raise FieldError("for_s", "missing: how long the pause lasts (seconds)")
        for_s = _seconds(obj["for_s"], "for_s")
        if for_s == 0:
            raise FieldError("for_s", "must be > 0 seconds, got 0")
    return TraceEngineFault(t, kind, _string(engine, kind), for_s, line)


def parse_kvdrain(obj: dict[str, object], line: int) -> TraceRecord:
    """The request, abort, pause, kill or snapshot of a kvdrain line (the header is the
    reader's)."""
    if "kvdrain_trace" in obj:
        raise FieldError("kvdrain_trace", "a header is allowed only on the first line")
    kind = _kind(obj)
    unknown = sorted(obj.keys() - _KEYS[kind])
    if unknown:
        raise FieldError(unknown[0], f"unknown field in a {kind} line")
    t = _seconds(obj.get("t"), "t")
    if kind == "abort":
        return _abort(obj, t, line)
    if kind in ("pause", "kill"):
        return _engine_fault(obj, kind, t, line)
    if kind == "snapshot":
        kv = _engine_counts(obj["kv"], "kv", ("used", "free"), {"used", "free", "cached"})
        queues = _engine_counts(obj.get("queues", {}), "queues", (), None)
        return TraceSnapshot(t, kv, queues, line)
    req_id, pd = _string(obj.get("id"), "id"), obj.get("pd")
    if pd is not None and not isinstance(pd, bool):
        raise FieldError("pd", f"must be true or false, got {show(pd)}")
    fault = _choice(obj, "fault", REQUEST_FAULTS)
    if fault is not None and pd is False:
        raise FieldError("fault", f"{fault}: a request with pd false has no D leg")
    max_tokens = _int(obj, "max_tokens", 1, MAX_OUTPUT_TOKENS)
    length, token_ids, hash_ids, block = _kvdrain_prompt(obj)
    return TraceRequest(t, req_id, max_tokens, length, token_ids, hash_ids, block, pd, line, fault)


def parse_mooncake(obj: dict[str, object], line: int) -> TraceRequest | None:
    """The request of a Mooncake line, or None for a zero-length row.

    A fast path takes a line whose every field is plainly right in one test, and builds
    what checked_mooncake would; any other line (zero-length, bad) goes field by field
    through checked_mooncake, which names the first bad field."""
    t, num_in, num_out = obj.get("timestamp"), obj.get("input_length"), obj.get("output_length")
    hash_ids = obj.get("hash_ids")
    if (
        (type(t) is int or type(t) is float)
        and 0 <= t <= _MOONCAKE_MAX_MS
        and type(num_in) is int
        and 0 < num_in <= MAX_PROMPT_TOKENS
        and type(num_out) is int
        and 0 < num_out <= MAX_OUTPUT_TOKENS
        and type(hash_ids) is list
        and len(hash_ids) == -(-num_in // MOONCAKE_BLOCK_SIZE)
        and set(map(type, hash_ids)) == _INT_ONLY
    ):
        return TraceRequest(
            t / 1000,
            f"mc-{line}",
            num_out,
            num_in,
            None,
            tuple(hash_ids),
            MOONCAKE_BLOCK_SIZE,
            None,
            line,
        )
    return checked_mooncake(obj, line)


def checked_mooncake(obj: dict[str, object], line: int) -> TraceRequest | None:
    """parse_mooncake field by field: the first bad field's FieldError."""
    t = _seconds(obj.get("timestamp"), "timestamp", 1000)
    num_in = _int(obj, "input_length", 0, MAX_PROMPT_TOKENS)
    num_out = _int(obj, "output_length", 0, MAX_OUTPUT_TOKENS)
    if num_in == 0 or num_out == 0:
        return None
    hash_ids = _ints(obj, "hash_ids", _MOONCAKE_MAX_IDS)
    _check_cover(num_in, hash_ids, MOONCAKE_BLOCK_SIZE, "input_length")
    return TraceRequest(
        t, f"mc-{line}", num_out, num_in, None, hash_ids, MOONCAKE_BLOCK_SIZE, None, line
    )


def _azure_ns(text: str) -> int:
    """Nanoseconds since the epoch (by hand: datetime takes 6 fractional digits at most)."""
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise FieldError(
            "TIMESTAMP", f"must be YYYY-MM-DD HH:MM:SS[.fraction][zone], got {show(text)}"
        )
    zone = m[8] or "Z"
    minutes = 0 if zone == "Z" else int(zone[0] + "1") * (int(zone[1:3]) * 60 + int(zone[-2:]))
    try:
        whole = datetime(*map(int, m.groups()[:6]), tzinfo=timezone(timedelta(minutes=minutes)))
    except ValueError as e:
        raise FieldError("TIMESTAMP", f"{e}, got {show(text)}") from None
    return int(whole.timestamp()) * 10**9 + int((m[7] or "").ljust(9, "0"))


def _csv_int(cell: str, name: str, maximum: int) -> int:
    text = cell.strip()
    if not (text.isascii() and text.isdigit()):
        raise FieldError(name, f"must be an integer >= 0, got {show(cell)}")
    if len(text) > 18 and len(text.lstrip("0")) > 18:  # never int() a huge digit string
        raise FieldError(name, f"must be at most {maximum:,} (the reader's cap), got {show(cell)}")
    value = int(text.lstrip("0") or "0") if len(text) > 18 else int(text)
    return value if value <= maximum else _at_most(value, maximum, name)


class AzureRows:
    """Azure CSV rows to requests: columns found by header name, t from the first row."""

    def __init__(self, header: list[str]) -> None:
        names = [c.strip() for c in header]
        missing = [c for c in AZURE_COLUMNS if c not in names]
        if missing:
            found = ", ".join(show(name) for name in names)
            raise FieldError("header", f"no column {missing[0]!r} (found {found})")
        self.columns, self.width = [names.index(c) for c in AZURE_COLUMNS], len(names)
        self.t0_ns: int | None = None  # the first row's time

    def parse(self, cells: list[str], line: int) -> TraceRequest | None:
        """The request of a row, or None for a zero-length row."""
        if len(cells) != self.width:
            raise FieldError("row", f"has {len(cells)} columns, the header has {self.width}")
        ns = _azure_ns(cells[self.columns[0]])
        num_in = _csv_int(cells[self.columns[1]], "ContextTokens", MAX_PROMPT_TOKENS)
        num_out = _csv_int(cells[self.columns[2]], "GeneratedTokens", MAX_OUTPUT_TOKENS)
        t = (ns - (ns if self.t0_ns is None else self.t0_ns)) / 1e9
        if t > MAX_TRACE_T:
            raise FieldError(
                "TIMESTAMP",
                f"{t:,.0f} s after the first row, at most {MAX_TRACE_T:.0f} s (the reader's cap)",
            )
        self.t0_ns = ns if self.t0_ns is None else self.t0_ns
        if num_in == 0 or num_out == 0:
            return None
        return TraceRequest(t, f"az-{line}", num_out, num_in, line=line)
