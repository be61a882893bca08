"""Faults as trace records: parsed, checked against what a target carries out, put into
any trace in seeded shares (`--fault`), and shown by inspect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import cli
from replay.trace.fault_shares import FaultShares
from replay.trace.faults import FAULT_NAMES, FaultSupport
from replay.trace.inspect import format_inspection, inspect_trace
from replay.trace.reader import (
    TraceAbort,
    TraceEngineFault,
    TraceError,
    TraceLimits,
    TraceRequest,
    read_trace,
    validate_trace,
)
from replay.trace.shaping import ShapingLog, ShapingOptions, shape
from tests.paths import MOONCAKE, public_trace

R1 = {"t": 0.0, "id": "r1", "prompt_len": 64, "max_tokens": 8}


def write(tmp_path: Path, lines: list[dict | str]) -> Path:
    path = tmp_path / "faults.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_each_fault_record_is_read(tmp_path):
    path = write(
        tmp_path,
        [
            {**R1, "fault": "drop_decode"},
            {"t": 0.5, "id": "r2", "prompt_len": 64, "max_tokens": 8, "fault": "reject_decode"},
            {"t": 2.0, "abort": "r1", "when": "prefill"},
            {"t": 2.0, "abort": "r2"},
            {"t": 5.0, "pause": "D", "for_s": 40},
            {"t": 6.0, "kill": "P"},
        ],
    )
    records = list(read_trace(path))
    assert [getattr(r, "fault", None) for r in records[:2]] == ["drop_decode", "reject_decode"]
    assert records[2:4] == [TraceAbort(2.0, "r1", 3, "prefill"), TraceAbort(2.0, "r2", 4)]
    assert records[4:] == [
        TraceEngineFault(5.0, "pause", "D", 40, 5),
        TraceEngineFault(6.0, "kill", "P", None, 6),
    ]
    summary = validate_trace(path)
    assert (summary.num_aborts, summary.num_engine_faults) == (2, 2)


BAD_FAULT_LINES = [
    (
        {**R1, "id": "x", "fault": "drop"},
        'fault: must be one of drop_decode, reject_decode, got "drop"',
    ),
    ({**R1, "id": "x", "fault": "drop_decode", "pd": False}, "fault: drop_decode: a request"),
    ({"t": 1, "abort": "r1", "when": "later"}, "when: must be one of prefill, transfer, decode"),
    ({"t": 1, "pause": "D"}, "for_s: missing: how long the pause lasts (seconds)"),
    ({"t": 1, "pause": "D", "for_s": 0}, "for_s: must be > 0 seconds, got 0"),
    ({"t": 1, "pause": "D", "for_s": -2}, "for_s: must be a number >= 0 (seconds), got -2"),
    ({"t": 1, "pause": 3, "for_s": 1}, "pause: must be an engine name (P, D, P0, ...), got 3"),
    ({"t": 1, "pause": "D", "for_s": 1, "kill": "P"}, "kill: unknown field in a pause line"),
    ({"t": 1, "kill": "P", "for_s": 1}, "for_s: unknown field in a kill line"),
    ({"t": 1, "kill": ""}, 'kill: must be an engine name (P, D, P0, ...), got ""'),
]


@pytest.mark.parametrize("line, message", BAD_FAULT_LINES)
def test_a_bad_fault_line_names_file_line_and_field(tmp_path, line, message):
    path = write(tmp_path, [R1, line])
    with pytest.raises(TraceError) as e:
        validate_trace(path)
    assert str(e.value).startswith(f"{path}:2: {message}")


OWNED = FaultSupport("the virtual clock", ("P", "D"))
SERVE = FaultSupport("a --target serve", routes=False)
SINGLE = FaultSupport("the virtual clock", ("E",), has_decode_leg=False)


@pytest.mark.parametrize(
    "support, line, message",
    [
        (SERVE, {"t": 1, "pause": "D", "for_s": 4}, "pause: a --target serve runs processes"),
        (SERVE, {"t": 1, "kill": "P"}, "kill: a --target serve runs processes kvdrain does not"),
        (SERVE, {"t": 1, "abort": "r1", "when": "decode"}, "when: an abort in the decode phase"),
        (SERVE, {**R1, "id": "x", "fault": "drop_decode"}, "fault: drop_decode: a --target"),
        (OWNED, {"t": 1, "kill": "X"}, "kill: no engine 'X' in this topology (it has P, D)"),
        (SINGLE, {**R1, "id": "x", "fault": "reject_decode"}, "fault: reject_decode: topology"),
    ],
)
def test_a_fault_the_target_cannot_carry_out_names_its_line(tmp_path, support, line, message):
    path = write(tmp_path, [R1, line])
    with pytest.raises(TraceError) as e:
        validate_trace(path, limits=TraceLimits(faults=support))
    assert str(e.value).startswith(f"{path}:2: {message}")


def test_a_plain_abort_goes_to_any_target(tmp_path):
    path = write(tmp_path, [R1, {"t": 1, "abort": "r1"}])
    assert validate_trace(path, limits=TraceLimits(faults=SERVE)).num_aborts == 1


def _requests(n: int) -> list[TraceRequest]:
    return [TraceRequest(i * 0.1, f"r{i}", 8, 64, line=i + 1) for i in range(n)]


def _faults(records) -> dict[str, str]:
    """req_id -> its --fault name, from shaped records."""
    out = {}
    for record in records:
        if isinstance(record, TraceRequest) and record.fault:
            out[record.req_id] = record.fault
        elif isinstance(record, TraceAbort):
            out[record.req_id] = f"abort_{record.when}"
    return out


def test_fault_shares_are_the_same_for_a_seed_and_differ_across_seeds():
    opts = ShapingOptions(faults=FaultShares.parse(["drop_decode=0.1", "abort_prefill=0.05"], 7))
    first = _faults(shape(iter(_requests(2000)), opts))
    assert first == _faults(shape(iter(_requests(2000)), opts))
    assert 150 < list(first.values()).count("drop_decode") < 250
    assert 60 < list(first.values()).count("abort_prefill") < 140
    other = ShapingOptions(faults=FaultShares.parse(["drop_decode=0.1", "abort_prefill=0.05"], 8))
    assert _faults(shape(iter(_requests(2000)), other)) != first


def test_a_requests_fault_does_not_depend_on_the_window_or_the_order_of_the_shares():
    shares = FaultShares.parse(["abort_decode=0.2", "reject_decode=0.2"], 3)
    whole = _faults(shape(iter(_requests(400)), ShapingOptions(faults=shares)))
    window = ShapingOptions(start=10.0, faults=FaultShares.parse(shares_in_reverse(shares), 3))
    part = _faults(shape(iter(_requests(400)), window))
    assert part and part == {k: v for k, v in whole.items() if int(k[1:]) >= 100}


def shares_in_reverse(shares: FaultShares) -> list[str]:
    return [f"{name}={share}" for name, share in reversed(shares.shares)]


def test_an_abort_share_is_an_abort_record_in_its_phase_right_after_the_request():
    log = ShapingLog()
    opts = ShapingOptions(faults=FaultShares.parse(["abort_transfer=1"], 0))
    records = list(shape(iter(_requests(2)), opts, log))
    assert [type(r).__name__ for r in records] == ["TraceRequest", "TraceAbort"] * 2
    assert records[1] == TraceAbort(0.0, "r0", 1, "transfer")
    assert log.lines() == ["fault abort_transfer: 2 times (r0; r1)"]


def test_a_request_fault_share_spares_requests_without_a_d_leg_and_own_faults():
    reqs = [
        TraceRequest(0.0, "alone", 8, 64, pd=False),
        TraceRequest(0.0, "own", 8, 64, fault="reject_decode"),
        TraceRequest(0.0, "any", 8, 64),
    ]
    opts = ShapingOptions(faults=FaultShares.parse(["drop_decode=1"], 0))
    assert [r.fault for r in shape(iter(reqs), opts)] == [None, "reject_decode", "drop_decode"]


@pytest.mark.parametrize(
    "specs, message",
    [
        (["drop=0.1"], "--fault drop: unknown fault, expected one of drop_decode,"),
        (["drop_decode"], "--fault drop_decode: expected NAME=SHARE, as drop_decode=0.05"),
        (["drop_decode=x"], "--fault drop_decode=x: expected NAME=SHARE"),
        (["drop_decode=0"], "--fault drop_decode: the share must be in (0, 1], got 0"),
        (["drop_decode=0.6", "abort_decode=0.6"], "--fault: the shares add up to more than 1"),
        (["drop_decode=0.1", "drop_decode=0.2"], "--fault drop_decode: given more than once"),
    ],
)
def test_bad_fault_shares_are_named(specs, message):
    with pytest.raises(ValueError) as e:
        FaultShares.parse(specs)
    assert str(e.value).startswith(message)


def test_fault_names_are_the_records_own():
    assert FAULT_NAMES == (
        "drop_decode",
        "reject_decode",
        "abort_prefill",
        "abort_transfer",
        "abort_decode",
    )


def test_inspect_shows_the_faults_with_the_shares_put_in(tmp_path):
    path = write(
        tmp_path,
        [
            {**R1, "fault": "drop_decode"},  # keeps its own: no share on it
            {"t": 0.5, "id": "r2", "prompt_len": 64, "max_tokens": 8},
            {"t": 0.5, "abort": "r2", "when": "transfer"},
            {"t": 0.6, "id": "r3", "prompt_len": 64, "max_tokens": 8},
            {"t": 5.0, "pause": "D", "for_s": 40},
            {"t": 6.0, "kill": "P"},
        ],
    )
    shares = FaultShares.parse(["abort_decode=1"], 0)
    lines = format_inspection(inspect_trace(path, shaping=ShapingOptions(faults=shares)))
    assert "faults: 1 drop_decode, 1 abort_transfer, 2 abort_decode" in lines
    assert (
        "engine faults: pause D at t=5.000 s for 40 s (line 5); kill P at t=6.000 s (line 6)"
    ) in lines


@public_trace(MOONCAKE)
def test_inspect_takes_fault_options_on_a_public_trace():
    path = MOONCAKE
    args = ["--max-requests", "200", "--fault", "drop_decode=0.05", "--fault-seed", "1"]
    result = CliRunner().invoke(cli, ["inspect", str(path), *args])
    assert result.exit_code == 0, result.output
    assert "faults: " in result.output and "drop_decode" in result.output
    again = CliRunner().invoke(cli, ["inspect", str(path), *args])
    assert again.output == result.output


def test_a_fault_share_a_target_cannot_carry_out_is_exit_2_naming_it(tmp_path):
    path = write(tmp_path, [R1])
    result = CliRunner().invoke(
        cli,
        ["replay", str(path), "--target", "tcp://127.0.0.1:9", "--fault", "abort_decode=0.1"],
    )
    assert result.exit_code == 2
    assert "--fault abort_decode: a --target serve routes requests itself" in result.output


def test_a_fault_share_over_http_or_engine_vllm_is_exit_2_naming_it(tmp_path):
    path = write(tmp_path, [R1])
    for target in (["--target", "http://127.0.0.1:9"], ["--engine", "vllm"]):
        result = CliRunner().invoke(cli, ["replay", str(path), *target, "--fault", "drop_decode=1"])
        assert result.exit_code == 2
        assert "--fault drop_decode: an HTTP --target (or --engine vllm) routes" in result.output


def test_a_pause_on_a_bare_target_is_exit_2_naming_its_line(tmp_path):
    path = write(tmp_path, [R1, {"t": 1.0, "pause": "D", "for_s": 4}])
    result = CliRunner().invoke(
        cli, ["replay", str(path), "--target", "tcp://127.0.0.1:9", "--no-live"]
    )
    assert result.exit_code == 2
    assert f"{path}:2: pause: a --target serve runs processes kvdrain does not own" in (
        result.output
    )
