"""Streaming trace readers, and the formats they read. Runs in: frontend process.

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
    fault       optional: "drop_decode" (P's leg runs, the D leg is never sent) or
                "reject_decode" (the D leg is sent in a form D refuses before admission);
                not with pd false
- abort: {"t": 2.0, "abort": "r1"} aborts an earlier request of the file, once; with
  "when": "prefill" | "transfer" | "decode", at the first moment at or after t that the
  request is in that phase (P has it; P answered and D streamed nothing; D streams)
- pause: {"t": 5.0, "pause": "D", "for_s": 40} stops an engine's processes for for_s > 0
  seconds; kill: {"t": 5.0, "kill": "P"} kills them. With TraceLimits.faults, every
  fault is checked against what the target carries out (replay/trace/faults.py)
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

Every pass opens the trace through replay/trace/source.py: a pipe or FIFO is read once
into a bounded copy, a device refused, and a watched file that changes between or during
passes is named as changed. Reading is bounded (the caps are in replay/trace/records.py): a line is at most 8 MiB (a
longer one is an error and is never held whole), UTF-8, JSON nested at most 64 deep; t is at
most 1e7 s; prompts, max_tokens and hash blocks at most 2**20 tokens; ids 256 characters.
Given TraceLimits, each request is also checked against the engines' limits after token
scaling, before any token is synthesised (replay/trace/limits.py); `num_capped` counts
those whose prompt + max_tokens exceed max_model_len (the engine stops them there).
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from replay.trace.formats import (
    AZURE_COLUMNS,
    MOONCAKE_BLOCK_SIZE,
    AzureRows,
    FieldError,
    check_strings,
    parse_json,
    parse_kvdrain,
    parse_mooncake,
    show,
)
from replay.trace.limits import TraceLimits, check_request
from replay.trace.records import (
    DEFAULT_HASH_BLOCK_SIZE,
    MAX_LINE_BYTES,
    TraceAbort,
    TraceEngineFault,
    TraceHeader,
    TraceRecord,
    TraceRequest,
    TraceSnapshot,
)
from replay.trace.source import (
    CHECK_EVERY_LINES,
    TraceError,
    check_digest,
    check_unchanged,
    open_trace,
)

__all__ = [
    "DEFAULT_HASH_BLOCK_SIZE",
    "FORMATS",
    "MAX_BAD_LINE_MESSAGES",
    "MOONCAKE_BLOCK_SIZE",
    "TRACE_VERSION",
    "TraceAbort",
    "TraceEngineFault",
    "TraceError",
    "TraceHeader",
    "TraceLimits",
    "TraceRecord",
    "TraceRequest",
    "TraceSnapshot",
    "TraceSummary",
    "detect_format",
    "read_trace",
    "validate_trace",
]

FORMATS = ("kvdrain", "mooncake", "azure")
TRACE_VERSION = 1
MAX_BAD_LINE_MESSAGES = 10
_TIME_FIELD = {"kvdrain": "t", "mooncake": "timestamp", "azure": "TIMESTAMP"}


@dataclass(frozen=True, slots=True, kw_only=True)
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
    num_capped: int = 0  # requests whose prompt + max_tokens exceed max_model_len
    num_engine_faults: int = 0  # pauses and kills
    max_prompt_token_id: int | None = None  # the largest given prompt token id (None: none given)


def _lines(path: Path, sha256=None) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw bytes) of every line, streaming, each read with a size bound.

    A line over MAX_LINE_BYTES comes as None: its bytes are hashed and skipped in
    bounded chunks, never held whole.
    """
    with open_trace(path) as f:
        line = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            line += 1
            if line % CHECK_EVERY_LINES == 0:
                check_unchanged(path)
            if sha256 is not None:
                sha256.update(raw)
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while rest := f.readline(MAX_LINE_BYTES):
                    if sha256 is not None:
                        sha256.update(rest)
                    if rest.endswith(b"\n"):
                        break
                yield line, None
                continue
            yield line, raw
        check_unchanged(path)


def _text(raw: bytes | None) -> str:
    """The stripped text of a line; a FieldError if it is too long or not UTF-8."""
    if raw is None:
        raise FieldError("line", f"longer than {MAX_LINE_BYTES:,} bytes (the reader's cap)")
    try:
        return raw.decode("utf-8").strip().lstrip("\ufeff")
    except UnicodeDecodeError as e:
        raise FieldError("line", f"not valid UTF-8 at byte {e.start + 1}") from None


def _csv_cells(text: str) -> list[str]:
    try:
        return next(csv.reader([text]))
    except csv.Error as e:  # a field over the csv module's limit, a NUL byte
        raise FieldError("row", f"not valid CSV: {e}") from None


class _Scan:
    """One streaming pass over a trace file: parse, check order and ids, count, hash."""

    def __init__(
        self, path: Path, fmt: str, skip_bad_lines: bool, limits: TraceLimits | None
    ) -> None:
        self.path, self.fmt, self.skip_bad_lines, self.limits = path, fmt, skip_bad_lines, limits
        self.sha256 = hashlib.sha256()
        self.num_skipped = self.num_bad_lines = self.num_capped = 0
        self.bad_line_messages: list[str] = []
        self.last_t = 0.0
        self.req_lines: dict[str, int] = {}  # kvdrain: request id -> its line
        self.abort_lines: dict[str, int] = {}  # request id -> the line that aborted it
        self.azure: AzureRows | None = None  # Azure: set by the header

    def records(self) -> Iterator[TraceRecord]:
        first = True
        for line, raw in _lines(self.path, self.sha256):
            try:
                text = _text(raw)
                if not text:
                    continue
                record = self._parse(text, line, first)
                if record is not None:
                    self._check(record)
            except FieldError as e:
                check_unchanged(self.path)  # a rewritten file's bad line is not the trace's
                if first and self.fmt == "azure":  # fatal: every row needs the header
                    raise TraceError(f"{self.path}:{line}: {e}") from None
                self._bad(f"{self.path}:{line}: {e}")
                record = None
            first = False
            if record is not None:
                yield record
        if first:
            raise TraceError(f"{self.path}: file: empty, no records")
        check_digest(self.path, self.sha256.hexdigest())

    def _bad(self, message: str) -> None:
        if not self.skip_bad_lines:
            raise TraceError(message)
        self.num_bad_lines += 1
        if len(self.bad_line_messages) < MAX_BAD_LINE_MESSAGES:
            self.bad_line_messages.append(message)

    def _parse(self, text: str, line: int, first: bool) -> TraceRecord | None:
        """The line's record; None for the Azure header and for skipped zero-length rows."""
        if self.fmt == "azure":
            cells = _csv_cells(text)
            if first:
                self.azure = self._azure_header(cells, line)
                return None
            record = self.azure.parse(cells, line)
        else:
            obj = parse_json(text)
            if self.fmt == "kvdrain":  # the format whose strings are used (ids, names)
                check_strings(text, obj)
            if first and self.fmt == "kvdrain" and "kvdrain_trace" in obj:
                return self._kvdrain_header(obj, line)
            parse = parse_mooncake if self.fmt == "mooncake" else parse_kvdrain
            record = parse(obj, line)
        self.num_skipped += record is None
        return record

    def _azure_header(self, cells: list[str], line: int) -> AzureRows:
        try:
            return AzureRows(cells)
        except FieldError as e:  # fatal, even when skipping: every row would be bad
            raise TraceError(f"{self.path}:{line}: {e}") from None

    def _kvdrain_header(self, obj: dict[str, object], line: int) -> TraceHeader:
        if obj["kvdrain_trace"] != TRACE_VERSION:
            raise TraceError(
                f"{self.path}:{line}: kvdrain_trace: unsupported version "
                f"{show(obj['kvdrain_trace'])}, this reader knows 1"
            )
        obj.pop("kvdrain_trace")
        return TraceHeader(TRACE_VERSION, obj, line)

    def _check(self, record: TraceRecord) -> None:
        """Times non-decreasing; kvdrain ids unique; aborts name an earlier request."""
        if isinstance(record, TraceHeader):
            return
        if record.t < self.last_t:
            raise FieldError(
                _TIME_FIELD[self.fmt],
                f"times must be non-decreasing, got {record.t:.9g} s after {self.last_t:.9g} s",
            )
        if isinstance(record, TraceRequest) and self.fmt == "kvdrain":
            first = self.req_lines.setdefault(record.req_id, record.line)
            if first != record.line:
                raise FieldError(
                    "id", f"duplicate request id {show(record.req_id)} (first on line {first})"
                )
        if isinstance(record, TraceAbort):
            self._check_abort(record)
        if isinstance(record, TraceRequest) and self.limits is not None:
            self.num_capped += check_request(record, self.fmt, self.limits)
        if self.limits is not None and self.limits.faults is not None:
            self.limits.faults.check(record)
        self.last_t = record.t

    def _check_abort(self, record: TraceAbort) -> None:
        """An abort names an earlier request, and aborts it once."""
        if record.req_id not in self.req_lines:
            raise FieldError("abort", f"no earlier request with id {show(record.req_id)}")
        first = self.abort_lines.setdefault(record.req_id, record.line)
        if first != record.line:
            raise FieldError(
                "abort", f"request {show(record.req_id)} is already aborted (on line {first})"
            )


def _first_line(path: Path) -> tuple[int, str]:
    """The number and text of the first non-empty line."""
    for line, raw in _lines(path):
        try:
            text = _text(raw)
        except FieldError as e:
            raise TraceError(f"{path}:{line}: {e}") from None
        if text:
            return line, text
    raise TraceError(f"{path}: file: empty, no records")


def _sniff(text: str) -> str | None:
    """The format a first line is in, or None; a FieldError if it cannot be parsed."""
    if text.startswith(("{", "[")):
        obj = parse_json(text)
        if "kvdrain_trace" in obj or "t" in obj:
            return "kvdrain"
        return "mooncake" if "timestamp" in obj and "input_length" in obj else None
    return "azure" if set(AZURE_COLUMNS) <= {c.strip() for c in _csv_cells(text)} else None


def detect_format(path: str | Path) -> str:
    """The format of a trace ("kvdrain", "mooncake" or "azure"), from its first non-empty line."""
    line, text = _first_line(Path(path))
    try:
        fmt, why = _sniff(text), ""
    except FieldError as e:
        fmt, why = None, f" (the line: {e})"
    if fmt is None:
        raise TraceError(
            f"{path}:{line}: format: unknown; expected a kvdrain header or record, "
            f"a Mooncake line or an Azure CSV header; name the format to "
            f"override{why}"
        )
    return fmt


def _resolve_format(path: str | Path, fmt: str | None) -> str:
    if fmt is None:
        return detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"format: unknown format {fmt!r}, expected one of {', '.join(FORMATS)}")
    return fmt


def read_trace(
    path: str | Path,
    fmt: str | None = None,
    skip_bad_lines: bool = False,
    limits: TraceLimits | None = None,
) -> Iterator[TraceRecord]:
    """Stream a trace's records in file order (its header first when it has one)."""
    return _Scan(Path(path), _resolve_format(path, fmt), skip_bad_lines, limits).records()


def validate_trace(
    path: str | Path,
    fmt: str | None = None,
    skip_bad_lines: bool = False,
    limits: TraceLimits | None = None,
    on_header: Callable[[TraceHeader], TraceLimits | None] | None = None,
) -> TraceSummary:
    """Read a whole trace once, streaming, and summarise it; a bad line raises TraceError.

    With `limits`, every request is also checked against the engines' limits (see above);
    `on_header` hears a header before any request is read, and its limits check the rest.
    """
    scan = _Scan(Path(path), _resolve_format(path, fmt), skip_bad_lines, limits)
    counts = {TraceRequest: 0, TraceAbort: 0, TraceSnapshot: 0, TraceEngineFault: 0}
    header, first_t, last_t, prompt, output, max_id = None, None, 0.0, 0, 0, None
    for record in scan.records():
        if isinstance(record, TraceHeader):
            header = record
            if on_header is not None:
                scan.limits = on_header(record)
            continue
        counts[type(record)] += 1
        first_t, last_t = record.t if first_t is None else first_t, record.t
        if isinstance(record, TraceRequest):
            prompt, output = prompt + record.prompt_len, output + record.max_tokens
            if record.prompt_token_ids:
                max_id = max(max_id or 0, max(record.prompt_token_ids))
    if counts[TraceRequest] == 0:
        raise TraceError(
            f"{path}: trace: no requests ({scan.num_bad_lines} bad lines, "
            f"{scan.num_skipped} zero-length rows skipped)"
        )
    return TraceSummary(
        path=str(path),
        format=scan.fmt,
        header=header,
        num_requests=counts[TraceRequest],
        num_aborts=counts[TraceAbort],
        num_snapshots=counts[TraceSnapshot],
        num_skipped=scan.num_skipped,
        duration=last_t - (first_t or 0.0),
        total_prompt_tokens=prompt,
        total_output_tokens=output,
        num_bad_lines=scan.num_bad_lines,
        bad_line_messages=tuple(scan.bad_line_messages),
        sha256=scan.sha256.hexdigest(),
        num_capped=scan.num_capped,
        num_engine_faults=counts[TraceEngineFault],
        max_prompt_token_id=max_id,
    )
