"""`kvdrain serve --http` and `kvdrain replay --target http://` end to end, from the command line.

One legacy serve (mock runner) answers every replay: the leak is found from /metrics
alone (exit 1, the report says which metric), a metrics URL that does not exist is
exit 2 before any request, and the zmq protocol keeps working beside HTTP.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_cli import EXAMPLE, Serve, invoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
FAST = [
    "--speedup",
    "4",
    "--no-live",
    "--idle-threshold",
    "0.5",
    "--drain-deadline",
    "0.3",
    "--tail",
    "1",
    "--scrape-interval",
    "0.05",
]


def test_serve_http_legacy_leak_found_from_metrics_alone(tmp_path: Path):
    serve = Serve("--liveness", "legacy", "--http", "0")
    try:
        url = serve.wait_for(r"HTTP on (http://\S+)", 30).group(1)
        report = tmp_path / "report.json"
        result = invoke(
            "replay",
            str(EXAMPLE),
            "--target",
            url,
            "--metrics",
            f"{url}/metrics",
            "--report",
            str(report),
            *FAST,
        )
        assert result.exit_code == 1, result.output
        http = json.loads(report.read_text())["http"]
        assert http["verdict"] == "violation"
        assert http["metrics"][0]["metric"] == "vllm:kv_cache_usage_perc"
        assert http["server"]["model"] == "kvdrain/tiny" and "kvdrain" in http["server"]["server"]
        assert "VIOLATION" in result.output and "vllm:kv_cache_usage_perc" in result.output
        leaks = [w for w in json.loads(report.read_text())["windows"] if w["verdict"] == "leak"]
        assert leaks and {w["engine"] for w in leaks} == {"P"}

        missing = invoke(
            "replay",
            str(EXAMPLE),
            "--target",
            url,
            "--metrics",
            f"{url}/nope",
            "--max-requests",
            "8",
            *FAST,
        )
        assert missing.exit_code == 2, missing.output
        assert f"{url}/nope: HTTP 404 (before any request was sent" in missing.output

        zmq = invoke(
            "replay", str(EXAMPLE), "--target", serve.address, "--max-requests", "8", *FAST[:-2]
        )
        assert zmq.exit_code == 1, zmq.output  # the zmq serve still works beside HTTP
        _burst_over_zmq_loses_nothing(serve.address, tmp_path)
    finally:
        assert serve.stop() == 0
    counted = serve.wait_for(r"stopped after (\d+) requests \((\d+) over HTTP\)", 10)
    assert (int(counted.group(1)), int(counted.group(2))) == (32 + 8 + 600, 32)


def _burst_over_zmq_loses_nothing(address: str, tmp_path: Path) -> None:
    """A burst outruns a client still sending: the serve's ROUTER once dropped outputs at its HWM."""
    trace, requests = tmp_path / "burst.jsonl", tmp_path / "requests.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"t": 0, "id": f"b{i}", "prompt_len": 16, "max_tokens": 16}) + "\n"
            for i in range(600)
        )
    )
    result = invoke(
        "replay",
        str(trace),
        "--target",
        address,
        "--no-live",
        "--tail",
        "0.5",
        "--requests",
        str(requests),
    )
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    assert len(records) == 600 and all(r["num_output_tokens"] == 16 for r in records), result.output


def test_http_options_are_usage_errors_elsewhere():
    assert invoke("replay", str(EXAMPLE), "--metrics", "http://h:1/metrics").exit_code == 2
    assert invoke("replay", str(EXAMPLE), "--model", "llama").exit_code == 2
    assert (
        invoke(
            "replay", str(EXAMPLE), "--target", "http://127.0.0.1:1", "--metrics", "h:1/metrics"
        ).exit_code
        == 2
    )
    assert invoke("serve", "--api-key", "k").exit_code == 2
    assert invoke("serve", "--http", "host:port").exit_code == 2


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    import urllib.request

    body = json.dumps(
        {"model": "kvdrain/tiny", "prompt": prompt, "max_tokens": max_tokens}
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_serve_http_record_records_http_clients_from_the_first_request(tmp_path: Path):
    recording = tmp_path / "recorded.jsonl"
    serve = Serve("--http", "0", "--record", str(recording))
    try:
        url = serve.wait_for(r"HTTP on (http://\S+)", 30).group(1)
        answers = [_complete(url, [1, 2, 3, 4, 5], 3), _complete(url, list(range(7, 40)), 5)]
        assert [a["usage"]["completion_tokens"] for a in answers] == [3, 5]
    finally:
        assert serve.stop() == 0
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    requests = [line for line in lines if "id" in line]
    assert lines[0]["recorded_by"] == "kvdrain serve" and lines[0]["num_blocks"] == 256
    assert [(r["prompt_token_ids"], r["max_tokens"]) for r in requests] == [
        ([1, 2, 3, 4, 5], 3),
        (list(range(7, 40)), 5),
    ]
    assert requests[0]["t"] == 0.0 < requests[1]["t"]  # t = 0 at the first request
    replayed = invoke("replay", str(recording), "--clock", "virtual", "--no-live")
    assert replayed.exit_code == 0, replayed.output
