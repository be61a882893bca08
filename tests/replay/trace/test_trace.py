"""Tests of trace reading, prompt synthesis, shaping and inspection."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.trace import synth
from replay.trace.inspect import format_inspection, inspect_trace
from replay.trace.reader import (
    FORMATS,
    TraceAbort,
    TraceError,
    TraceHeader,
    TraceLimits,
    TraceRequest,
    TraceSnapshot,
    detect_format,
    read_trace,
    validate_trace,
)
from replay.trace.records import MAX_LINE_BYTES
from replay.trace.shaping import ShapingLog, ShapingOptions, scale_request, shape
from replay.trace.synth import synth_prompt
from tests.paths import AZURE, EXAMPLE, MOONCAKE, ROOT, public_trace

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def write(tmp_path: Path, name: str, lines: list[str | dict]) -> Path:
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def requests(records) -> list[TraceRequest]:
    return [r for r in records if isinstance(r, TraceRequest)]


def test_kvdrain_records(tmp_path):
    path = write(
        tmp_path,
        "t.jsonl",
        [
            {"kvdrain_trace": 1, "name": "demo"},
            "",
            {"t": 0, "id": "a", "prompt_len": 5, "max_tokens": 2},
            {"t": 0.5, "id": "b", "prompt_token_ids": [3, 4], "max_tokens": 1, "pd": False},
            {"t": 1, "id": "c", "hash_ids": [7, 8], "max_tokens": 3},
            {
                "t": 1,
                "id": "d",
                "hash_ids": [7, 9],
                "hash_block_size": 4,
                "prompt_len": 5,
                "max_tokens": 3,
                "pd": True,
            },
            {"t": 2, "abort": "c"},
            {
                "t": 3,
                "kv": {"P": {"used": 1, "free": 9, "cached": 2}},
                "queues": {"P": {"running": 0}},
            },
        ],
    )
    recs = list(read_trace(path))
    assert detect_format(path) == "kvdrain"
    assert recs[0] == TraceHeader(1, {"name": "demo"}, 1)
    assert recs[1] == TraceRequest(0, "a", 2, 5, line=3)
    assert recs[2] == TraceRequest(0.5, "b", 1, 2, prompt_token_ids=(3, 4), pd=False, line=4)
    assert recs[3] == TraceRequest(1, "c", 3, 32, hash_ids=(7, 8), hash_block_size=16, line=5)
    assert (recs[4].prompt_len, recs[4].hash_block_size, recs[4].pd) == (5, 4, True)
    assert recs[5] == TraceAbort(2, "c", 7)
    assert recs[6] == TraceSnapshot(
        3, {"P": {"used": 1, "free": 9, "cached": 2}}, {"P": {"running": 0}}, 8
    )
    s = validate_trace(path)
    assert (s.num_requests, s.num_aborts, s.num_snapshots, s.duration) == (4, 1, 1, 3)
    assert (s.total_prompt_tokens, s.total_output_tokens) == (44, 9)
    assert s.header.metadata == {"name": "demo"}


REQ = '"t": 1, "id": "x", "max_tokens": 1'
BAD_KVDRAIN = [
    (
        '{"t": 1, "id": "x", "prompt_len": 4, "max_tokens": "x"}',
        'max_tokens: must be an integer >= 1, got "x"',
    ),
    (f'{{{REQ}, "prompt_len": 0}}', "prompt_len: must be an integer >= 1, got 0"),
    (
        '{"t": -1, "id": "x", "prompt_len": 4, "max_tokens": 1}',
        "t: must be a number >= 0 (seconds), got -1",
    ),
    (
        '{"t": 1, "id": 5, "prompt_len": 4, "max_tokens": 1}',
        "id: must be a non-empty string, got 5",
    ),
    (f"{{{REQ}}}", "prompt_len: missing: give prompt_len, prompt_token_ids or hash_ids"),
    (f'{{{REQ}, "prompt_len": 4, "max_token": 1}}', "max_token: unknown field in a request line"),
    (
        f'{{{REQ}, "hash_ids": [1, 2], "prompt_len": 40}}',
        "hash_ids: has 2 ids but ceil(prompt_len 40 / 16) = 3",
    ),
    (
        f'{{{REQ}, "prompt_token_ids": [1], "prompt_len": 1}}',
        "prompt_token_ids: cannot be combined with prompt_len, hash_ids or hash_block_size",
    ),
    (f'{{{REQ}, "prompt_len": 4, "hash_block_size": 8}}', "hash_block_size: needs hash_ids"),
    (f'{{{REQ}, "prompt_len": 4, "pd": 1}}', "pd: must be true or false, got 1"),
    ("[1, 2]", "json: must be a JSON object, got [1, 2]"),
    ('{"t": 1, "id": ', "json: invalid JSON: Expecting value at column 15"),
    (
        '{"t": 0.5, "id": "y", "prompt_len": 4, "max_tokens": 1}',
        "t: times must be non-decreasing, got 0.5 s after 1 s",
    ),
    (
        '{"t": 1, "id": "a", "prompt_len": 4, "max_tokens": 1}',
        'id: duplicate request id "a" (first on line 1)',
    ),
    ('{"t": 1, "abort": "zz"}', 'abort: no earlier request with id "zz"'),
    ('{"t": 1, "kv": {"P": {"used": 1}}}', "kv.P.free: missing, must be an integer >= 0"),
    ('{"t": 1, "kv": {"P": {"used": 1, "free": 2, "hot": 3}}}', "kv.P.hot: unknown count"),
    ('{"kvdrain_trace": 1}', "kvdrain_trace: a header is allowed only on the first line"),
]


@pytest.mark.parametrize("line, message", BAD_KVDRAIN)
def test_bad_kvdrain_line_names_file_line_and_field(tmp_path, line, message):
    path = write(
        tmp_path, "bad.jsonl", ['{"t": 1, "id": "a", "prompt_len": 4, "max_tokens": 1}', line]
    )
    with pytest.raises(TraceError) as e:
        validate_trace(path)
    assert str(e.value) == f"{path}:2: {message}"


def test_skip_bad_lines_counts_and_keeps_messages(tmp_path):
    lines = [{"t": i, "id": f"r{i}", "prompt_len": 4, "max_tokens": 1} for i in range(5)]
    lines[1], lines[3] = "not json", {"t": 3, "id": "r3", "prompt_len": 4, "max_tokens": 0}
    path = write(tmp_path, "t.jsonl", lines)
    s = validate_trace(path, skip_bad_lines=True)
    assert (s.num_requests, s.num_bad_lines) == (3, 2)
    assert s.bad_line_messages[1] == f"{path}:4: max_tokens: must be an integer >= 1, got 0"
    assert [r.req_id for r in read_trace(path, skip_bad_lines=True)] == ["r0", "r2", "r4"]


def test_empty_unknown_and_headerless_files(tmp_path):
    for lines in ([], ["", "  "]):
        with pytest.raises(TraceError, match="empty"):
            validate_trace(write(tmp_path, "e.jsonl", lines))
    with pytest.raises(TraceError, match=r"u.txt:2: format: unknown"):
        detect_format(write(tmp_path, "u.txt", ["", "hello,world"]))
    with pytest.raises(TraceError, match="format: unknown format 'csv'"):
        validate_trace(write(tmp_path, "x.csv", [AZ_HEADER]), fmt="csv")
    with pytest.raises(TraceError, match="no requests"):
        validate_trace(write(tmp_path, "h.csv", [AZ_HEADER]))
    with pytest.raises(TraceError, match=r"v.jsonl:1: kvdrain_trace: unsupported version 2"):
        validate_trace(write(tmp_path, "v.jsonl", [{"kvdrain_trace": 2}]))
    with pytest.raises(TraceError, match=r"c.csv:1: header: no column 'ContextTokens'"):
        validate_trace(
            write(tmp_path, "c.csv", ["TIMESTAMP,GeneratedTokens"]),
            fmt="azure",
            skip_bad_lines=True,
        )  # a bad header is fatal even when skipping
    with pytest.raises(TraceError) as bad:  # a header's text is shown escaped, as JSON
        validate_trace(write(tmp_path, "e.csv", ["TIMESTAMP,\x1b[2JX"]), fmt="azure")
    assert '(found "TIMESTAMP", "\\u001b[2JX")' in str(bad.value)
    assert "\x1b" not in str(bad.value)


def test_reading_streams_records_before_a_bad_last_line(tmp_path):
    lines = [{"t": i / 10, "id": f"r{i}", "prompt_len": 100, "max_tokens": 8} for i in range(5000)]
    late = {"t": 0, "id": "late", "prompt_len": 1, "max_tokens": 1}
    path = write(tmp_path, "big.jsonl", lines + [late])
    records = read_trace(path)
    assert [next(records).req_id for _ in range(3)] == ["r0", "r1", "r2"]
    with pytest.raises(TraceError, match=r"big.jsonl:5001: t: times must be non-decreasing"):
        list(records)


def test_mooncake_small_and_ceil_rule(tmp_path):
    ok = {"timestamp": 1500, "input_length": 1025, "output_length": 7, "hash_ids": [0, 1, 2]}
    path = write(
        tmp_path, "m.jsonl", [ok, {**ok, "output_length": 0}, {**ok, "input_length": 1024}]
    )
    assert detect_format(path) == "mooncake"
    with pytest.raises(TraceError) as e:
        validate_trace(path)
    assert str(e.value) == f"{path}:3: hash_ids: has 3 ids but ceil(input_length 1024 / 512) = 2"
    first = next(read_trace(path))
    assert first == TraceRequest(1.5, "mc-1", 7, 1025, None, (0, 1, 2), 512, None, 1)
    s = validate_trace(write(tmp_path, "m2.jsonl", [ok, {**ok, "output_length": 0}]))
    assert (s.num_requests, s.num_skipped) == (1, 1)


@public_trace(MOONCAKE)
def test_mooncake_real_trace():
    s = validate_trace(MOONCAKE)
    assert (s.format, s.num_requests, s.num_skipped) == ("mooncake", 12031, 0)
    assert s.duration == 3536.999 and s.total_prompt_tokens == 144_793_823
    assert s.sha256 == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    first = next(read_trace(MOONCAKE))
    assert (first.t, first.prompt_len, first.max_tokens, len(first.hash_ids)) == (0, 6758, 500, 14)
    insp = inspect_trace(MOONCAKE, idle_threshold=3.01)
    assert insp.num_idle_gaps == 0  # bursts every 3 s at most: no real idle period
    assert (insp.num_reused_refs, insp.num_hash_refs) == (105_710, 288_500)
    scaled = list(shape(read_trace(MOONCAKE), ShapingOptions(scale_tokens=0.05, max_requests=50)))
    prompts = [synth_prompt(r, 32000) for r in scaled]
    assert [len(p) for p in prompts] == [r.prompt_len for r in scaled]
    assert scaled[0].hash_block_size == 26 and len({tuple(p[:26]) for p in prompts}) == 1


AZ_VARIANTS = [
    ("18:17:03", 0.0),
    ("18:17:03.5", 0.5),
    ("18:17:03.123456", 0.123456),
    ("18:17:03.1234567", 0.1234567),
    ("18:17:03.000000001", 1e-9),
    ("18:17:03+00:00", 0.0),
    ("18:17:03.25Z", 0.25),
    ("19:17:03.75+01:00", 0.75),
    ("18:17:04-00:30", 1801.0),
]


@pytest.mark.parametrize("clock, t", AZ_VARIANTS)
def test_azure_timestamp_variants(tmp_path, clock, t):
    path = write(
        tmp_path, "a.csv", [AZ_HEADER, "2023-11-16 18:17:03,10,2", f"2023-11-16 {clock},20,3"]
    )
    assert [r.t for r in read_trace(path)] == [0.0, pytest.approx(t, abs=1e-12)]


def test_azure_columns_by_name_and_bad_rows(tmp_path):
    path = write(
        tmp_path,
        "a.csv",
        [
            "GeneratedTokens,Model,TIMESTAMP,ContextTokens",
            "5,gpt,2023-11-16T18:17:03.9799600,4808",
            "0,gpt,2023-11-16 18:17:04,33",
            "7,gpt,2023-11-16 18:17:05,9",
        ],
    )
    recs = list(read_trace(path))
    assert detect_format(path) == "azure"
    assert [(r.req_id, r.t) for r in recs] == [("az-2", 0), ("az-4", 1.02004)]
    assert validate_trace(path).num_skipped == 1
    for row, message in [
        (
            "5,gpt,2023-11-16 18:17:0,1",
            'TIMESTAMP: must be YYYY-MM-DD HH:MM:SS[.fraction][zone], got "2023-11-16 18:17:0"',
        ),
        (
            "5,gpt,2023-13-16 18:17:05,1",
            'TIMESTAMP: month must be in 1..12, got "2023-13-16 18:17:05"',
        ),
        ("x,gpt,2023-11-16 18:17:05,1", 'GeneratedTokens: must be an integer >= 0, got "x"'),
        ("5,2023-11-16 18:17:05,1", "row: has 3 columns, the header has 4"),
    ]:
        bad = write(tmp_path, "b.csv", ["GeneratedTokens,Model,TIMESTAMP,ContextTokens", row])
        with pytest.raises(TraceError) as e:
            validate_trace(bad)
        assert str(e.value) == f"{bad}:2: {message}"


@public_trace(AZURE)
def test_azure_real_trace():
    recs = requests(read_trace(AZURE))
    assert (recs[0].t, recs[0].prompt_len, recs[0].max_tokens, len(recs)) == (0, 4808, 10, 8819)
    insp = inspect_trace(AZURE, idle_threshold=30)
    assert insp.num_idle_gaps >= 25 and insp.top_gaps[0].length == pytest.approx(217.17, abs=0.01)
    assert insp.top_gaps[0].after_line == 8101 and insp.prefix_reuse is None
    assert validate_trace(AZURE).sha256.startswith("54e9a6d2")


def mk(req_id: str, hash_ids: tuple[int, ...], prompt_len: int, block: int = 16) -> TraceRequest:
    return TraceRequest(0.0, req_id, 4, prompt_len, hash_ids=hash_ids, hash_block_size=block)


def test_synth_shares_hash_blocks_and_is_deterministic():
    a, b = synth_prompt(mk("a", (1, 2, 3), 40), 100), synth_prompt(mk("b", (1, 2, 4), 35), 100)
    assert (len(a), len(b)) == (40, 35) and a[:32] == b[:32] and a[32:35] != b[32:]
    assert all(0 <= x < 100 for x in a + b)
    assert synth_prompt(mk("c", (1, 2, 3), 40), 100) == a  # same ids, same tokens, any request
    assert synth_prompt(mk("d", (1,), 5, block=512), 100) == a[:5]  # a block prefixes a longer one
    u, v = TraceRequest(0, "u", 1, 300), TraceRequest(0, "v", 1, 300)
    assert synth_prompt(u, 7) == synth_prompt(u, 7) != synth_prompt(v, 7)
    assert len(synth_prompt(u, 7)) == 300 and max(synth_prompt(u, 7)) < 7
    assert synth_prompt(TraceRequest(0, "w", 1, 2, prompt_token_ids=(5, 6)), 7) == [5, 6]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        synth_prompt(TraceRequest(0, "w", 1, 2, prompt_token_ids=(5, 7)), 7)
    with pytest.raises(ValueError, match="hash_ids"):
        synth_prompt(mk("e", (1, 2), 40), 100)


def timed(*ts: float, gap_snapshot: float | None = None) -> list:
    recs = [TraceRequest(t, f"r{i}", 10, 100, line=i) for i, t in enumerate(ts)]
    if gap_snapshot is not None:
        recs.append(TraceSnapshot(gap_snapshot, {}))
        recs.sort(key=lambda r: r.t)
    return recs


def test_shape_speedup_window_and_max_requests():
    log = ShapingLog()
    opts = ShapingOptions(speedup=2, start=10, end=35)
    out = list(shape(iter(timed(0, 10, 20, 30, 40)), opts, log))
    assert [(r.req_id, r.t) for r in out] == [("r1", 0), ("r2", 5), ("r3", 10)]
    assert log.counts == {"speedup": 1, "dropped before start": 1, "stopped at end": 1}
    out = list(shape(iter(timed(5, 10, 20)), ShapingOptions(max_requests=2)))
    assert [(r.req_id, r.t) for r in out] == [("r0", 5), ("r1", 10)]  # keeps its own offset
    aborts = [
        TraceRequest(0, "a", 1, 1),
        TraceAbort(1, "a"),
        TraceRequest(2, "b", 1, 1),
        TraceAbort(3, "b"),
    ]
    out = list(shape(iter(aborts), ShapingOptions(start=1.5)))
    assert [type(r).__name__ for r in out] == ["TraceRequest", "TraceAbort"]


def test_the_shaping_log_counts_only_changes_made_more_than_once():
    """'stopped at max_requests: 1 (100 requests kept, ...)' read as max_requests 1."""
    log = ShapingLog()
    list(shape(iter(timed(0, 1, 2, 9, 20, 30)), ShapingOptions(max_requests=5, max_gap=2), log))
    assert log.lines() == [
        "capped gap: 2 times (at t=2.000 s from 7.000 s to 2 s; at t=9.000 s from 11.000 s to 2 s)",
        "stopped at max_requests: 5 requests kept, stopped at t=30.000 s",
    ]


def test_shape_caps_gaps_and_inserts_idle():
    log = ShapingLog()
    out = list(shape(iter(timed(0, 1, 101, 102, gap_snapshot=50)), ShapingOptions(max_gap=5), log))
    assert [r.t for r in out] == [0, 1, 6, 6, 7]  # the snapshot in the gap waits at most 5 s
    assert log.lines() == ["capped gap: at t=1.000 s from 100.000 s to 5 s"]
    out = shape(iter(timed(0, 1, 2, 3, 4)), ShapingOptions(insert_idle=10, insert_idle_every=2))
    assert [r.t for r in out] == [0, 1, 12, 13, 24]
    out = shape(iter(timed(0, 1, 2, 3)), ShapingOptions(insert_idle=10, insert_idle_at=(1.5,)))
    assert [r.t for r in out] == [0, 1, 12, 13]
    out = shape(
        iter(timed(0, 1, 100)),
        ShapingOptions(max_gap=2, insert_idle=30, insert_idle_at=(50,), speedup=2),
    )
    assert [r.t for r in out] == [0, 0.5, 16.5]  # cap first, then idle, then speedup


def test_shape_scales_tokens_keeping_prefix_structure():
    req = TraceRequest(0, "m", 500, 6758, hash_ids=tuple(range(14)), hash_block_size=512)
    small = scale_request(req, 0.05)
    assert (small.hash_block_size, small.prompt_len, small.max_tokens) == (26, 339, 25)
    assert math.ceil(small.prompt_len / small.hash_block_size) == len(small.hash_ids)
    ids = scale_request(TraceRequest(0, "i", 4, 3, prompt_token_ids=(1, 2, 3)), 2)
    assert ids.prompt_token_ids == (1, 2, 3, 1, 2, 3) and ids.prompt_len == 6
    assert scale_request(TraceRequest(0, "p", 1, 3), 0.01).prompt_len == 1
    log = ShapingLog()
    assert next(shape(iter([req]), ShapingOptions(scale_tokens=0.05), log)).prompt_len == 339
    assert log.lines() == ["scaled tokens: m: prompt 6758 -> 339, output 500 -> 25"]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 600), st.integers(0, 599), st.floats(0.001, 3.0))
def test_scaled_hash_prompts_stay_covered_by_their_ids(num_ids, block, cut, factor):
    prompt_len = max(1, num_ids * block - cut % block)
    req = scale_request(mk("h", tuple(range(num_ids)), prompt_len, block), factor)
    assert math.ceil(req.prompt_len / req.hash_block_size) == num_ids
    assert len(synth_prompt(req, 50)) == req.prompt_len


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"speedup": 0}, "speedup"),
        ({"start": -1}, "start"),
        ({"start": 5, "end": 5}, "end"),
        ({"max_requests": 0}, "max_requests"),
        ({"max_gap": -1}, "max_gap"),
        ({"scale_tokens": 0}, "scale_tokens"),
        ({"insert_idle": 3}, "insert_idle"),
        ({"insert_idle_every": 3}, "insert_idle"),
        ({"insert_idle": 1, "insert_idle_every": 0}, "insert_idle_every"),
    ],
)
def test_shaping_options_are_validated(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        ShapingOptions(**kwargs)


def test_inspect_is_a_dry_run_with_replays_defaults(tmp_path):
    example = inspect_trace(EXAMPLE)  # replay's idle threshold, 1 s: the example's 3 gaps
    assert example.idle_threshold == 1.0 and example.num_idle_gaps == 3
    shaped = inspect_trace(EXAMPLE, shaping=ShapingOptions(max_requests=10, speedup=2.0))
    assert (shaped.num_requests, shaped.num_trace_requests) == (10, 32)
    lines = format_inspection(shaped)
    assert "a replay would send 10 of the trace's 32 requests (shaping drops 22)" in lines
    assert shaped.wall_s == pytest.approx(shaped.last_arrival + 2.0) and shaped.last_arrival < 8.5
    path = write(
        tmp_path,
        "long.jsonl",
        [
            {"t": 0, "id": "a", "prompt_len": 5000, "max_tokens": 4},  # over 4,096: refused
            {"t": 1, "id": "b", "prompt_len": 4000, "max_tokens": 200},  # capped at 4,096
            {"t": 2, "id": "c", "prompt_len": 10, "max_tokens": 2},
        ],
    )
    wall, virtual = inspect_trace(path).length_checks
    assert (wall.max_model_len, wall.num_refused, wall.num_capped) == (4096, 1, 1)
    assert (virtual.max_model_len, virtual.num_refused, virtual.num_capped) == (131072, 0, 0)
    text = "\n".join(format_inspection(inspect_trace(path)))
    assert "max_model_len 4,096 (wall default): 1 too long, 1 capped" in text
    assert (
        "the engine rejects it, counted as ignored" in text
    )  # as replay does, not a refused trace


def test_inspect_says_what_replay_does_with_max_tokens_that_can_never_be_generated(tmp_path):
    """A prompt that fits with max_tokens over max_model_len is a refused trace in replay
    (exit 2), not a request the engine rejects: inspect said 'too long, counted as ignored'."""
    path = write(tmp_path, "out.jsonl", [{"t": 0, "id": "a", "prompt_len": 10, "max_tokens": 5000}])
    wall, virtual = inspect_trace(path).length_checks
    assert (wall.num_refused, wall.num_invalid, virtual.num_invalid) == (0, 1, 0)
    assert "can never be generated (replay refuses the trace, exit 2)" in "\n".join(
        format_inspection(inspect_trace(path))
    )
    result = subprocess.run(
        [sys.executable, "-m", "cli", "replay", str(path), "--no-live"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "can never be generated" in result.stdout + result.stderr


def _hour_long_trace(tmp_path: Path) -> Path:
    """Requests every 10 s over an hour, then one 3,000 s gap closing on a last request."""
    lines = [{"t": 10.0 * i, "id": f"r{i}", "prompt_len": 16, "max_tokens": 2} for i in range(60)]
    return write(
        tmp_path,
        "hour.jsonl",
        [*lines, {"t": 3590.0, "id": "last", "prompt_len": 16, "max_tokens": 2}],
    )


def test_a_long_wall_replay_says_how_long_it_takes_before_it_starts(tmp_path):
    from replay.trace.inspect import wall_time_note

    path = _hour_long_trace(tmp_path)
    note = wall_time_note("wall", path, None, ShapingOptions(), 3590.0)
    assert note.startswith(
        "this wall-clock replay takes about 59 min 52 s (last arrival 3,590.0 s + 2 s tail"
    )
    assert "--clock virtual" in note and "kvdrain inspect" in note
    assert wall_time_note("wall", path, None, ShapingOptions(speedup=16), 3590.0) is None  # 3.7 min
    assert wall_time_note("wall", path, None, ShapingOptions(end=200), 3590.0) is None
    assert wall_time_note("virtual", path, None, ShapingOptions(), 3590.0) is None


def test_the_wall_time_note_counts_max_requests_and_max_gap(tmp_path):
    """The note took the whole trace's span whatever --max-requests or --max-gap left of it."""
    from replay.trace.inspect import wall_time_note

    path = _hour_long_trace(tmp_path)
    assert (
        wall_time_note("wall", path, None, ShapingOptions(max_requests=10), 3590.0) is None
    )  # 92 s
    assert wall_time_note("wall", path, None, ShapingOptions(max_gap=1), 3590.0) is None  # 62 s
    note = wall_time_note("wall", path, None, ShapingOptions(max_requests=40), 3590.0)
    assert note.startswith("this wall-clock replay takes about 6 min 32 s (last arrival 390.0 s")
    note = wall_time_note(
        "wall", path, None, ShapingOptions(end=600, insert_idle=60, insert_idle_every=10), 3590.0
    )
    assert "last arrival 890.0 s" in note  # 590 s and five idles, after the 10th, ..., 50th


def test_a_speedup_that_leaves_only_the_tail_says_so():
    from click.testing import CliRunner

    from cli import cli

    result = CliRunner().invoke(
        cli, ["replay", str(EXAMPLE), "--clock", "virtual", "--no-live", "--speedup", "8"]
    )
    assert (
        "note: at --speedup 8 no gap between arrivals is 1 s or longer, so only the tail"
        in result.output
    )
    plain = CliRunner().invoke(cli, ["replay", str(EXAMPLE), "--clock", "virtual", "--no-live"])
    assert "only the tail" not in plain.output


def test_inspect_says_how_many_gaps_it_did_not_list(tmp_path):
    path = write(
        tmp_path,
        "gaps.jsonl",
        [{"t": 2 * i, "id": f"r{i}", "prompt_len": 8, "max_tokens": 2} for i in range(9)],
    )
    lines = format_inspection(inspect_trace(path))
    assert "idle gaps of 1 s or more: 8, longest 2.0 s" in lines and "  ... and 3 more" in lines


def test_inspect_reports_every_bad_line_up_to_a_bound_as_one_line_each(tmp_path):
    from click.testing import CliRunner

    from cli import cli

    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"t": 0, "id": "a", "prompt_len": 8, "max_tokens": 2}\n'
        + "not json\n" * 3
        + '{"t": 1, "id": "b", "prompt_len": -1, "max_tokens": 2}\n'
    )
    result = CliRunner().invoke(cli, ["inspect", str(path)])
    assert result.exit_code == 2 and "Usage:" not in result.output
    assert sum(1 for line in result.output.splitlines() if line.startswith("bad line: ")) == 4
    assert "error: 4 bad lines: replay stops at the first" in result.output
    skipped = CliRunner().invoke(cli, ["inspect", str(path), "--skip-bad-lines"])
    assert (
        skipped.exit_code == 0
        and "a replay would send 1 of the trace's 1 requests" in skipped.output
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    refused = CliRunner().invoke(cli, ["inspect", str(empty)])
    assert refused.exit_code == 2 and "Usage:" not in refused.output
    assert refused.output.startswith("error: ") and len(refused.output.splitlines()) == 1


def test_inspect_small_file_and_bundled_example(tmp_path):
    path = write(
        tmp_path,
        "s.jsonl",
        [
            {"t": 0, "id": "a", "hash_ids": [1, 2], "max_tokens": 4},
            {"t": 10, "id": "b", "hash_ids": [1, 3], "prompt_len": 20, "max_tokens": 2},
            {"t": 11, "id": "c", "prompt_len": 8, "max_tokens": 6},
            {"t": 12, "abort": "c"},
        ],
    )
    insp = inspect_trace(path, idle_threshold=5)
    assert (insp.num_requests, insp.num_aborts, insp.duration, insp.mean_rate) == (3, 1, 11, 3 / 11)
    assert (insp.total_prompt_tokens, insp.mean_output_len, insp.num_idle_gaps) == (60, 4, 1)
    assert (insp.top_gaps[0].start, insp.top_gaps[0].length, insp.prefix_reuse) == (0, 10, 0.25)
    assert any(
        line.startswith("prefix-block reuse: 25.0% (1 of 4") for line in format_inspection(insp)
    )
    example = inspect_trace(EXAMPLE, idle_threshold=3)
    assert example.num_requests == 32 and example.num_idle_gaps == 3 and example.duration < 20
    assert {r.pd for r in requests(read_trace(EXAMPLE))} == {True}


# ---- bounded reading: each case was measured to traceback, hang or
# blow up memory before the caps; now each is `file:line: field: what`, before any send.

GOOD = '{"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 2}'
LIMITS = TraceLimits(max_model_len=4096, vocab_size=512)


def error_of(path: Path, **kwargs) -> str:
    with pytest.raises(TraceError) as e:
        validate_trace(path, **kwargs)
    return str(e.value)


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"t": %s, "id": "b", "prompt_len": 4, "max_tokens": 2}' % ("9" * 400),
            "t: must be at most 10000000 seconds (the reader's cap), got an integer of 400 digits",
        ),
        (
            '{"t": %s, "id": "b", "prompt_len": 4, "max_tokens": 2}' % ("9" * 5001),
            "json: invalid JSON: Exceeds the limit (4300 digits)",
        ),
        (
            '{"t": 1e300, "id": "b", "prompt_len": 4, "max_tokens": 2}',
            "t: must be at most 10000000 seconds (the reader's cap), got 1e+300",
        ),
        ('{"t": NaN, "id": "b", "prompt_len": 4, "max_tokens": 2}', "t: must be a number >= 0"),
        ("[" * 100_000, "json: nested deeper than 64 levels"),
        ('{"t": 1, "x": ' + "[" * 65 + "]" * 65 + "}", "json: nested deeper than 64 levels"),
        (
            '{"t": 1, "id": "b\\ud800", "prompt_len": 4, "max_tokens": 2}',
            "id: not valid UTF-8: a lone surrogate \\ud800 at character 1",
        ),
        (
            '{"t": 1, "id": "b", "prompt_len": 1000000000000, "max_tokens": 2}',
            "prompt_len: must be at most 1,048,576 (the reader's cap), got 1000000000000",
        ),
        (
            '{"t": 1, "id": "b", "prompt_len": 300000000, "max_tokens": 2}',  # 123 bytes, >2 GB
            "prompt_len: must be at most 1,048,576 (the reader's cap), got 300000000",
        ),
        (
            '{"t": 1, "id": "b", "hash_ids": [1], "prompt_len": 5, "hash_block_size": 1000000000000, '
            '"max_tokens": 2}',
            "hash_block_size: must be at most 1,048,576 (the reader's cap)",
        ),
        (
            '{"t": 1, "id": "b", "hash_ids": ['
            + ",".join(["0"] * 2_000_000)
            + '], "max_tokens": 2}',
            "hash_ids: has 2,000,000 entries, at most 1,048,576 (the reader's cap)",
        ),
        (
            '{"t": 1, "id": "b", "hash_ids": [' + ",".join(["0"] * 70_000) + '], "max_tokens": 2}',
            "hash_ids: must be at most 1,048,576 (the reader's cap), got 1120000",
        ),
        (
            '{"t": 1, "id": "b", "prompt_len": 4, "max_tokens": 1000000000000}',
            "max_tokens: must be at most 1,048,576 (the reader's cap), got 1000000000000",
        ),
        (
            '{"t": 1, "id": "%s", "prompt_len": 4, "max_tokens": 2}' % ("x" * 257),
            "id: has 257 characters, at most 256",
        ),
        (
            '{"t": 1, "id": "b", "prompt_token_ids": [4294967296], "max_tokens": 2}',
            "prompt_token_ids: must be a non-empty list of integers from 0 to 2,147,483,647",
        ),
    ],
)
def test_hostile_kvdrain_line_is_a_field_error(tmp_path, line, message):
    path = write(tmp_path, "h.jsonl", [GOOD, line])
    assert error_of(path).startswith(f"{path}:2: {message}")
    assert error_of(path, fmt="kvdrain", limits=LIMITS).startswith(f"{path}:2: {message}")


@pytest.mark.parametrize(
    "first",
    ["[" * 100_000, "{" * 100_000, '{"t": %s}' % ("9" * 5001), "x" * 140_000, '"' + "x" * 140_000],
)
def test_hostile_first_line_is_sniffed_without_a_traceback(tmp_path, first):
    path = write(tmp_path, "f.txt", [first, GOOD])
    with pytest.raises(TraceError, match=r"f.txt:1: format: unknown; .* \(the line: "):
        detect_format(path)
    for fmt in FORMATS:  # named: the first line is bad in that format, never a traceback
        with pytest.raises(TraceError, match=r"f.txt:1: "):
            validate_trace(path, fmt=fmt)


def test_out_of_vocabulary_or_overlong_prompt_is_found_before_line_1_is_sent(tmp_path):
    over = {"t": 1, "id": "b", "prompt_len": 4096, "max_tokens": 2}
    path = write(
        tmp_path,
        "v.jsonl",
        [GOOD, {"t": 1, "id": "b", "prompt_token_ids": [99999], "max_tokens": 2}],
    )
    assert error_of(path, limits=LIMITS) == (
        f"{path}:2: prompt_token_ids: token 99999 is outside the vocabulary [0, 512)"
    )
    path = write(tmp_path, "l.jsonl", [GOOD, over])  # the deployment's limit: the engine rejects it
    assert validate_trace(path, limits=LIMITS).num_requests == 2
    path = write(tmp_path, "m.jsonl", [GOOD, {**over, "prompt_len": 8, "max_tokens": 4096}])
    assert error_of(path, limits=LIMITS).startswith(
        f"{path}:2: max_tokens: 4,096 tokens can never be generated: max_model_len 4,096"
    )
    s = validate_trace(path, skip_bad_lines=True, limits=LIMITS)  # skipped, counted
    assert (s.num_requests, s.num_bad_lines) == (1, 1)
    assert validate_trace(path).num_requests == 2  # no engines named, no engine limits


def test_limits_apply_to_scaled_lengths_and_count_capped_outputs(tmp_path):
    path = write(
        tmp_path,
        "s.jsonl",
        [
            {"t": 0, "id": "a", "prompt_len": 6000, "max_tokens": 10},
            {"t": 1, "id": "b", "prompt_len": 3000, "max_tokens": 4500},
            {
                "t": 2,
                "id": "c",
                "hash_ids": list(range(14)),
                "hash_block_size": 512,
                "prompt_len": 6758,
                "max_tokens": 500,
            },
        ],
    )
    half = validate_trace(path, limits=TraceLimits(4096, 512, scale_tokens=0.5))
    assert (half.num_requests, half.num_capped) == (3, 0)
    assert validate_trace(path, limits=TraceLimits(8192, 512)).num_capped == 0
    assert validate_trace(path, limits=TraceLimits(7000, 512)).num_capped == 2  # b and c
    doubled = validate_trace(path, limits=TraceLimits(4096, 512, scale_tokens=2.0))
    assert (doubled.num_requests, doubled.num_capped) == (3, 0)  # all three rejected, not capped
    assert error_of(path, limits=TraceLimits(scale_tokens=1000.0)).startswith(
        f"{path}:1: prompt_len: 6,000,000 tokens (scaled by 1000), more than the reader's cap"
    )


@pytest.mark.parametrize(
    "fmt, lines, message",
    [
        (
            "mooncake",
            ['{"timestamp": 1e300, "input_length": 5, "output_length": 1, "hash_ids": [1]}'],
            "timestamp: must be at most 10000000000 milliseconds (the reader's cap)",
        ),
        (
            "mooncake",
            ['{"timestamp": 0, "input_length": 1073741824, "output_length": 1, "hash_ids": [1]}'],
            "input_length: must be at most 1,048,576",
        ),
        (
            "azure",
            [AZ_HEADER, "2023-11-16 18:17:03,10,2", "9999-11-16 18:17:03,10,2"],
            "TIMESTAMP: 251,698,233,600 s after the first row, at most 10000000 s",
        ),
        (
            "azure",
            [AZ_HEADER, "2023-11-16 18:17:03,%s,2" % ("9" * 5001)],
            "ContextTokens: must be at most 1,048,576 (the reader's cap)",
        ),
        ("azure", [AZ_HEADER, "2023-11-16 18:17:03,%s1,2" % ("0" * 5001)], None),
        (
            "azure",
            [AZ_HEADER, "2023-11-16 18:17:03,10,%s" % ("9" * 140_000)],
            "row: not valid CSV: field larger than field limit (131072)",
        ),
    ],
)
def test_hostile_public_format_rows(tmp_path, fmt, lines, message):
    path = write(tmp_path, "p.txt", lines)
    if message is None:  # leading zeros of any length are still a small number
        assert validate_trace(path, fmt=fmt).total_prompt_tokens == 1
        return
    assert error_of(path, fmt=fmt).startswith(f"{path}:{len(lines)}: {message}")


def test_a_line_over_the_cap_is_an_error_and_is_never_held_whole(tmp_path, monkeypatch):
    import tracemalloc

    import replay.trace.reader as reader

    tail = [{"t": 1, "id": "z", "prompt_len": 4, "max_tokens": 1}]
    path = tmp_path / "long.jsonl"  # just over the real cap: 8 MiB of one JSON string
    path.write_text(
        GOOD + "\n" + '{"t": 1, "x": "' + "x" * MAX_LINE_BYTES + '"}\n' + json.dumps(tail[0]) + "\n"
    )
    assert error_of(path) == f"{path}:2: line: longer than 8,388,608 bytes (the reader's cap)"
    s = validate_trace(path, skip_bad_lines=True)
    assert (s.num_requests, s.num_bad_lines) == (2, 1)
    assert s.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # every byte hashed
    monkeypatch.setattr(reader, "MAX_LINE_BYTES", 64 << 10)  # a 1 MiB line, a 64 KiB cap
    path.write_text(GOOD + "\n" + "[" * (1 << 20) + "\n" + json.dumps(tail[0]) + "\n")
    tracemalloc.start()
    try:
        s = validate_trace(path, skip_bad_lines=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert s.num_requests == 2 and "line: longer than 65,536 bytes" in s.bad_line_messages[0]
    assert peak < 512 << 10


def test_invalid_utf8_and_surrogates_anywhere_are_named(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(
        GOOD.encode() + b'\n{"t": 1, "id": "b\xff", "prompt_len": 4, "max_tokens": 2}\n'
    )
    assert error_of(path) == f"{path}:2: line: not valid UTF-8 at byte 18"
    path = write(
        tmp_path, "k.jsonl", [GOOD, '{"t": 1, "kv": {"P\\udfff": {"used": 1, "free": 2}}}']
    )
    assert "k.jsonl:2: kv: not valid UTF-8: a lone surrogate \\udfff" in error_of(path)
    pair = write(
        tmp_path,
        "p.jsonl",
        [GOOD, '{"t": 1, "id": "\\ud83d\\ude00", "prompt_len": 4, "max_tokens": 2}'],
    )
    assert validate_trace(pair).num_requests == 2  # a valid pair is one character


def test_replay_of_a_trace_bad_on_line_2_starts_nothing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import replay.pipeline as pipeline
    import replay.sim.simulation as simulation
    from cli import cli

    def never(*args, **kwargs):
        raise AssertionError("engines started")

    monkeypatch.setattr(simulation, "simulate", never)  # the virtual clock's engines
    monkeypatch.setattr(pipeline, "launch_engines", never)  # the wall clock's
    path = write(
        tmp_path, "r.jsonl", [GOOD, {"t": 1, "id": "b", "prompt_len": 8, "max_tokens": 5000}]
    )
    for clock in ("virtual", "wall"):
        result = CliRunner().invoke(
            cli,
            [
                "replay",
                str(path),
                "--clock",
                clock,
                "--no-live",
                "--runner",
                "mock",
                "--max-model-len",
                "4096",
            ],
            catch_exceptions=False,
        )  # 4096 beats the virtual --deployment
        assert result.exit_code == 2, result.output
        assert (
            "r.jsonl:2: max_tokens: 5,000 tokens can never be generated: max_model_len 4,096"
            in result.output.replace("\n", "")
        )
    with pytest.raises(TraceError, match="r.jsonl:2: max_tokens"):
        pipeline.run_replay(pipeline.ReplayConfig(trace=path, clock="virtual"))


def test_synth_memo_keeps_only_small_blocks():
    memo = synth.BlockMemo()
    assert len(synth_prompt(mk("big", (1, 2), 2 * 4096, block=4096), 100, memo)) == 8192
    assert memo.by_size == {} and memo.nbytes == 0
    synth_prompt(mk("small", (10**6 + 1,), 16), 100, memo)
    assert list(memo.by_size[16]) == [10**6 + 1]


def test_synth_memo_starts_over_when_full_and_never_changes_a_prompt(monkeypatch):
    monkeypatch.setattr(synth, "MEMO_BYTES", 3 * (4 * 16 + synth.MEMO_ENTRY_BYTES))
    memo, fresh = synth.BlockMemo(), lambda req: synth_prompt(req, 100, synth.BlockMemo())
    for ids in [(1, 2), (1, 2, 3), (3, 4, 4), (5,), (1, 5)]:  # (3, 4, 4): an id twice
        req = mk("m", ids, 16 * len(ids) - 1)
        assert synth_prompt(req, 100, memo) == fresh(req)
        assert memo.nbytes <= synth.MEMO_BYTES and len(memo.by_size.get(16, {})) <= 3


def test_a_second_abort_of_one_request_is_a_file_line_error(tmp_path):
    path = write(
        tmp_path,
        "t.jsonl",
        [
            {"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 1},
            {"t": 1, "abort": "a"},
            {"t": 2, "abort": "a"},
        ],
    )
    with pytest.raises(TraceError) as e:
        validate_trace(path)
    assert str(e.value) == f'{path}:3: abort: request "a" is already aborted (on line 2)'


def test_summary_says_the_largest_given_prompt_token_id(tmp_path):
    path = write(
        tmp_path,
        "t.jsonl",
        [
            {"t": 0, "id": "a", "prompt_token_ids": [3, 70000, 5], "max_tokens": 1},
            {"t": 1, "id": "b", "prompt_len": 4, "max_tokens": 1},
        ],
    )
    assert validate_trace(path).max_prompt_token_id == 70000
    path = write(tmp_path, "u.jsonl", [{"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 1}])
    assert validate_trace(path).max_prompt_token_id is None


def test_a_few_prompts_beyond_max_model_len_are_requests_the_engine_rejects_not_a_refused_trace(
    tmp_path,
):
    """Mooncake's synthetic trace (10 of 3,993 prompts over 128k tokens) was refused whole at
    line 250, exit 2; vLLM answers such a request with a 400 and serves the rest."""
    from click.testing import CliRunner

    from cli import cli

    rows = [
        {"t": i * 0.05, "id": f"r{i}", "prompt_len": 300 if i == 50 else 64, "max_tokens": 4}
        for i in range(150)
    ]
    path = write(tmp_path, "long.jsonl", rows)
    result = CliRunner().invoke(
        cli,
        ["replay", str(path), "--clock", "virtual", "--no-live", "--max-model-len", "256"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output  # 1 of 150 ignored: within the 1%
    assert "1 prompt longer than max_model_len" in result.output


def test_a_window_that_keeps_no_request_is_refused_before_anything_starts():
    """--start past the last arrival replayed nothing and said VERIFIED (exit 0), latency 0.0."""
    from click.testing import CliRunner

    from cli import cli

    result = CliRunner().invoke(
        cli, ["replay", str(EXAMPLE), "--clock", "virtual", "--no-live", "--start", "100"]
    )
    assert result.exit_code == 2, result.output
    assert "--start 100 keeps none of the trace's 32 requests" in result.output
    assert "VERIFIED" not in result.output
    lines = format_inspection(inspect_trace(EXAMPLE, shaping=ShapingOptions(start=2, end=3)))
    assert (
        "a replay would send none of the trace's 32 requests (shaping drops them all): replay "
        "refuses it (exit 2)" in lines
    )
    assert not any("a wall replay takes" in line for line in lines)
