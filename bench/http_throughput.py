"""Requests/s through `serve --http` against the zmq serve protocol. Runs in: a bench process.

Usage: .venv/bin/python bench/http_throughput.py  (not http.py: it would shadow the stdlib's http)
One `kvdrain serve --http 0` child (mock runner, P/D, event) serves both protocols on the same
engines; a saturating burst of NUM_REQUESTS at t = 0 goes through each, REPEATS times, alternating,
the median kept. Prints both rows and the ratio HTTP / zmq.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import OtherLoad, start_serve  # noqa: E402  (bench/common.py)

from replay.serve.client import ServeClient  # noqa: E402
from replay.target.client import HttpReplay, HttpTargetOptions  # noqa: E402
from replay.trace.reader import read_trace  # noqa: E402
from replay.wall.driver import WallClockReplay, WallOptions  # noqa: E402

NUM_REQUESTS = 1000
PROMPT_LEN = 32
MAX_TOKENS = 16
REPEATS = 3


def write_trace(path: Path, run: int) -> None:
    """Prompts are keyed by request id: a fresh id per run, so no run hits the prefix cache."""
    with path.open("w") as f:
        for i in range(NUM_REQUESTS):
            f.write(
                json.dumps(
                    {
                        "t": 0.0,
                        "id": f"run{run}-r{i}",
                        "prompt_len": PROMPT_LEN,
                        "max_tokens": MAX_TOKENS,
                    }
                )
                + "\n"
            )


def rate(timeline) -> float:
    """Requests / (last end - first send); every request must finish with all its tokens."""
    records = timeline.requests
    bad = [r for r in records if r.end_t is None or r.num_output_tokens != MAX_TOKENS or r.error]
    if len(records) != NUM_REQUESTS or bad:
        raise AssertionError(f"{len(bad)} of {len(records)} requests incomplete, e.g. {bad[:1]}")
    return len(records) / (max(r.end_t for r in records) - min(r.send_t for r in records))


def run_zmq(address: str, trace: Path) -> float:
    """The wall-clock driver over a ServeClient (`replay --target tcp://`)."""
    client = ServeClient(address)
    try:
        return rate(WallClockReplay(client, WallOptions(tail_s=0.01)).run(read_trace(trace)))
    finally:
        client.shutdown()


def run_http(url: str, trace: Path) -> float:
    """The HTTP replay client (`replay --target http://`): one streaming POST per request,
    aiohttp, usage in the last chunk."""
    options = HttpTargetOptions(url, tail_s=0.01)
    return rate(HttpReplay(options).run(read_trace(trace)))


def main() -> None:
    load = OtherLoad()
    proc, zmq_address, http_url = start_serve()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            traces = [Path(tmp) / f"burst-{run}.jsonl" for run in range(2 * REPEATS + 2)]
            for run, trace in enumerate(traces):
                write_trace(trace, run)
            run_zmq(zmq_address, traces[0]), run_http(http_url, traces[1])  # warm-up
            zmq_rates, http_rates = [], []
            for k in range(REPEATS):
                zmq_rates.append(run_zmq(zmq_address, traces[2 + 2 * k]))
                http_rates.append(run_http(http_url, traces[3 + 2 * k]))
    finally:
        proc.terminate()
        proc.wait(60)
    zmq_rate, http_rate = statistics.median(zmq_rates), statistics.median(http_rates)
    print(
        f"mock runner, P/D, event; {NUM_REQUESTS} requests at t=0, {PROMPT_LEN}-token prompts, "
        f"max_tokens {MAX_TOKENS}; one serve, both protocols; median of {REPEATS}"
    )
    print(f"{'protocol':<44} {'req/s':>8} {'out tok/s':>10}")
    print(
        f"{'zmq serve protocol (replay --target tcp://)':<44} {zmq_rate:>8.0f} "
        f"{zmq_rate * MAX_TOKENS:>10.0f}"
    )
    print(
        f"{'HTTP, streaming (replay --target http://)':<44} {http_rate:>8.0f} "
        f"{http_rate * MAX_TOKENS:>10.0f}"
    )
    print(f"ratio HTTP / zmq: {http_rate / zmq_rate:.2f}x (aim >= 0.5x)")
    print(load.report())


if __name__ == "__main__":
    main()
