"""`replay --prometheus` against a real Prometheus (Debian's `prometheus`, `make prometheus`)
scraping two `kvdrain serve --http` every 250 ms: the legacy serve leaks (exit 1), the
event one drains (exit 0), judged from Prometheus alone; a job scraped every 30 s is
refused before the run, naming the interval it needs. Skipped, saying so, without the
binary. The usage errors need no Prometheus."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.test_cli import Serve, invoke

PROMETHEUS = shutil.which("prometheus")
READY_S = 60.0
# Bursts of six requests 3 s apart, long enough for a 250 ms scrape to see both engines
# hold blocks (D decodes 300 tokens; the serves' D waits 400 ms before each read).
BURSTS = [
    {"t": round(b * 3.0 + i * 0.05, 3), "id": f"b{b}r{i}", "prompt_len": 96, "max_tokens": 300}
    for b in range(3)
    for i in range(6)
]
JUDGED = ["--no-live", "--idle-threshold", "1", "--drain-deadline", "1", "--tail", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(jobs: dict[str, tuple[str, str]]) -> str:
    """job -> (scrape interval, host:port), as Prometheus's YAML (JSON is YAML)."""
    configs = [
        {
            "job_name": job,
            "scrape_interval": interval,
            "scrape_timeout": "200ms",
            "static_configs": [{"targets": [address]}],
        }
        for job, (interval, address) in jobs.items()
    ]
    return json.dumps({"scrape_configs": configs})


def wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "prometheus exited"
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)  # polling a process we do not control: bounded by READY_S
    raise AssertionError(f"prometheus not ready in {READY_S} s")


@pytest.mark.prometheus
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    PROMETHEUS is None, reason="no `prometheus` binary on PATH: `make prometheus` installs it"
)
def test_real_prometheus_legacy_leaks_event_drains_and_30s_is_refused(tmp_path: Path):
    trace = tmp_path / "bursts.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in BURSTS))
    serves = [
        Serve("--liveness", liveness, "--pull-delay-ms", "400", "--http", "0")
        for liveness in ("legacy", "event")
    ]
    prometheus = None
    try:
        urls = [s.wait_for(r"HTTP on (http://\S+)", 60).group(1) for s in serves]
        hosts = [u.removeprefix("http://") for u in urls]
        config = tmp_path / "prometheus.yml"
        config.write_text(
            prometheus_config(
                {
                    "legacy": ("250ms", hosts[0]),
                    "event": ("250ms", hosts[1]),
                    "slow": ("30s", hosts[1]),
                }
            )
        )
        address = f"127.0.0.1:{free_port()}"
        prometheus = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={address}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_ready(f"http://{address}", prometheus)
        through = ["--prometheus", f"http://{address}"]
        for job, url, code in (("legacy", urls[0], 1), ("event", urls[1], 0)):
            report = tmp_path / f"{job}.json"
            result = invoke(
                "replay", str(trace), "--target", url, *through,
                "--metrics", f'{{job="{job}"}}', "--report", str(report), *JUDGED,
            )  # fmt: skip
            assert result.exit_code == code, result.output
            http = json.loads(report.read_text())["http"]
            assert http["metrics_from"] == "--prometheus" and len(http["metrics"]) == 1
            assert http["metrics"][0]["prometheus"] == f"http://{address}"
            assert http["metrics"][0]["scrape_interval_s"] == 0.25
        slow = invoke(
            "replay", str(trace), "--target", urls[1], *through,
            "--metrics", '{job="slow"}', "--no-live",
        )  # fmt: skip
        assert slow.exit_code == 2, slow.output
        assert "every 30 s" in slow.output and "at most 0.25 s" in slow.output
        assert "before any request was sent" in slow.output
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        for serve in serves:
            serve.stop()


def test_prometheus_options_are_usage_errors_without_a_selector_or_an_http_target():
    trace = str(Path(__file__).resolve().parents[2] / "examples" / "pd_idle.jsonl")
    prometheus = ["--prometheus", "http://127.0.0.1:9"]
    no_selector = invoke("replay", trace, "--target", "http://127.0.0.1:9", *prometheus)
    assert no_selector.exit_code == 2 and "--metrics SELECTOR" in no_selector.output
    bad = invoke(
        "replay", trace, "--target", "http://127.0.0.1:9", *prometheus, "--metrics", "job=x"
    )
    assert bad.exit_code == 2 and "[NAME=]{label" in bad.output
    assert invoke("replay", trace, *prometheus, "--metrics", '{job="x"}').exit_code == 2
