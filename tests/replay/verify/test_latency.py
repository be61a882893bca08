"""Latency as a P/D engineer reads it: five lines under 80 columns after the verdict, vllm
bench's full block behind --latency-block, p90/p95/p99 by default and any
--metric-percentiles as vllm bench spells them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.verify.latency import (
    compact_latency_lines,
    latency_lines,
    latency_summary,
    parse_percentiles,
)
from replay.verify.timeline import RequestRecord
from tests.paths import EXAMPLE


def _records(n: int) -> list[RequestRecord]:
    """Request i: sent at i, first token 10*(i+1) ms later, 4 tokens 5 ms apart."""
    out = []
    for i in range(n):
        ttft = 0.01 * (i + 1)
        record = RequestRecord(
            req_id=f"r{i}",
            arrival_t=float(i),
            send_t=float(i),
            send_lateness_s=0.0,
            first_token_t=i + ttft,
            end_t=i + ttft + 0.015,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
            itls=[0.005] * 3,
        )
        out.append(record)
    return out


def test_p90_and_p95_are_reported_beside_p99_as_vllm_bench_keys():
    summary = latency_summary(_records(100))
    assert summary["p90_ttft_ms"] == pytest.approx(901.0) and summary[
        "p95_ttft_ms"
    ] == pytest.approx(950.5)
    assert summary["p99_ttft_ms"] == pytest.approx(990.1) and summary["percentiles"] == [
        90.0,
        95.0,
        99.0,
    ]


def test_metric_percentiles_are_parsed_like_vllm_bench_and_bad_ones_refused():
    assert parse_percentiles("50,99.9") == (50.0, 99.9)
    summary = latency_summary(_records(10), parse_percentiles("50,99.9"))
    assert "p99.9_e2el_ms" in summary and "p99_e2el_ms" not in summary
    assert "P99.9 E2EL (ms):" in "\n".join(latency_lines(summary))
    for bad in ("", "0", "101", "a,b"):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_percentiles(bad)


def test_the_compact_form_is_five_lines_within_80_columns():
    lines = compact_latency_lines(latency_summary(_records(100)))
    assert len(lines) == 5 and all(len(line) <= 80 for line in lines)
    assert lines[1].split()[:3] == ["ttft", "p50", "505.0"]
    assert (
        len(latency_lines(latency_summary(_records(3)))) == 26 + 4 * 2
    )  # and a p90 and p95 row per metric


def test_replay_prints_the_compact_latency_after_the_verdict_and_the_block_on_request(
    tmp_path: Path,
):
    from cli import cli

    report = tmp_path / "r.json"
    args = ["replay", str(EXAMPLE), "--clock", "virtual", "--no-live", "--max-requests", "8"]
    compact = CliRunner().invoke(
        cli, [*args, "--report", str(report), "--metric-percentiles", "75"]
    )
    lines = compact.output.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith(("VERIFIED", "VIOLATION")))
    assert lines[verdict + 1].startswith("latency: 8 ok") and "p75" in lines[verdict + 2]
    assert "Serving Benchmark Result" not in compact.output
    assert "p75_ttft_ms" in json.loads(report.read_text())["latency"]
    block = CliRunner().invoke(cli, [*args, "--latency-block"])
    assert "Serving Benchmark Result" in block.output and "\nlatency: " not in block.output


def test_the_report_is_stamped_and_requests_carry_ttft_and_e2el(tmp_path: Path):
    from cli import cli
    from replay.verify.stamp import git_commit

    report, requests = tmp_path / "r.json", tmp_path / "q.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(EXAMPLE),
            "--clock",
            "virtual",
            "--no-live",
            "--max-requests",
            "4",
            "--report",
            str(report),
            "--requests",
            str(requests),
        ],
    )
    assert result.exit_code in (0, 1), result.output
    stamp = json.loads(report.read_text())["kvdrain"]
    assert stamp["version"] == "0.1.0" and stamp["commit"] == git_commit() != ""
    assert stamp["date"].endswith("+00:00") and stamp["host"] and stamp["device"] == "mock runner"
    lines = [json.loads(line) for line in requests.read_text().splitlines()]
    assert len(lines) == 4
    for line in lines:
        assert line["ttft_s"] == pytest.approx(line["first_token_t"] - line["send_t"])
        assert (
            line["e2el_s"] == pytest.approx(line["end_t"] - line["send_t"]) and line["e2el_s"] > 0
        )


def test_git_commit_outside_a_checkout_is_unknown(tmp_path: Path):
    from replay.verify.stamp import git_commit

    assert git_commit(tmp_path) == "unknown"


def test_a_p50_asked_for_is_the_median_printed_once():
    summary = latency_summary(_records(10), (50.0, 99.0))
    assert all(line.count("p50") == 1 for line in compact_latency_lines(summary)[1:])


def test_a_metric_with_no_values_prints_as_unknown_not_as_zero():
    """Every request ignored printed 'ttft p50 0.0 ... mean 0.0': figures never observed."""
    ignored = [
        RequestRecord(
            req_id="r0",
            arrival_t=0.0,
            send_t=0.0,
            send_lateness_s=0.0,
            first_token_t=None,
            end_t=0.1,
            num_prompt_tokens=8,
            num_output_tokens=0,
            num_prefix_hit_tokens=0,
            finish_reason="length",
            error="does not fit max_model_len",
        )
    ]
    lines = compact_latency_lines(latency_summary(ignored))
    assert lines[0].startswith("latency: 0 ok, 1 failed")
    assert lines[1:] == [
        "  ttft  unknown (no request completed)",
        "  tpot  unknown (no completed request had 2 or more tokens)",
        "  itl   unknown (no completed request was streamed in 2 or more outputs)",
        "  e2el  unknown (no request completed)",
    ]
    one_token = _records(2)
    for record in one_token:
        record.num_output_tokens, record.itls = 1, []
    lines = compact_latency_lines(latency_summary(one_token))
    assert (
        lines[1].startswith("  ttft  p50 ")
        and lines[2] == "  tpot  unknown (no completed request had 2 or more tokens)"
    )
    assert latency_summary(one_token)["median_tpot_ms"] == 0.0  # vllm bench's key as it has it
