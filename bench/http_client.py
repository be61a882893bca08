"""kvdrain's HTTP replay client beside `vllm bench serve`, on one serve. Runs in: a bench process.

Usage: .venv/bin/python bench/http_client.py [--rates 10,50,100,200] [--duration 30]
       [--vllm-venv .venv-vllm] [--prompt-len 32] [--max-tokens 16] [--code DIR]
One `kvdrain serve --http 0 --runner mock` child takes both clients in turn, rate by rate, on
Poisson arrivals, then one more kvdrain run that scrapes its /metrics. Aims: kvdrain's achieved
rate >= vllm bench's at every rate; p99 lateness < LATENESS_AIM_S at 100 req/s with the scrapes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# --code DIR: measure another checkout's client with this script, against this checkout's
# serve: before and after in one sitting (read before the imports).
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv[:-1] else ROOT
sys.path.insert(0, str(CODE))

from common import OtherLoad, start_serve  # noqa: E402  (bench/common.py)

from replay.metrics.scrape import MetricsSource  # noqa: E402
from replay.runtime.interrupt import interruptible  # noqa: E402
from replay.target.client import HttpReplay, HttpTargetOptions  # noqa: E402
from replay.trace.records import TraceRequest  # noqa: E402
from replay.vllm.tiny_model import SERVED_NAME, write_tiny_model  # noqa: E402

LATENESS_AIM_S = 0.005
NUM_SCRAPES = 4
SCRAPE_INTERVAL_S = 0.1
VLLM_STARTUP_S = 300.0  # its CLI imports torch and transformers: slow on a loaded machine


@dataclass(slots=True, kw_only=True)
class Row:
    """One client's run at one rate; None where that client does not say."""

    achieved: float | None = None
    ttft_p50_ms: float | None = None
    lateness_p50_ms: float | None = None
    lateness_p99_ms: float | None = None
    cpu_us: float | None = None  # the client's CPU (this process) per request
    num_completed: int = 0
    num_failed: int = 0
    error: str | None = None
    scrapes: tuple[tuple[int, int], ...] = ()  # (scrapes, failed) per /metrics URL


def poisson_times(rate: float, num_requests: int, seed: int) -> list[float]:
    """Exponential gaps, cumulative, scaled so the last arrival is at num_requests / rate
    (vllm bench's get_request: the first gap is drawn too)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    times = np.cumsum(gaps)
    return (times * (num_requests / rate / times[-1])).tolist()


def poisson_trace(rate: float, num_requests: int, seed: int, args) -> list[TraceRequest]:
    return [
        TraceRequest(
            t=t, req_id=f"s{seed}-r{i}", max_tokens=args.max_tokens, prompt_len=args.prompt_len
        )
        for i, t in enumerate(poisson_times(rate, num_requests, seed))
    ]


def _ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def run_kvdrain(url: str, rate: float, seed: int, args, scrapes: int = 0) -> Row:
    """The HTTP replay client (`replay --target http://`) on rate * duration requests, each a
    fresh request id so nothing hits the prefix cache; `scrapes` /metrics names at 10 Hz.

    Lateness: when its request task stamped the send minus the trace's time. CPU per request:
    this process's over the whole replay (less disturbed by other load than the latencies).
    Achieved rate: completed / from t = 0 to the last end (vllm bench's request_throughput).
    """
    num_requests = round(rate * args.duration)
    metrics = tuple(MetricsSource(f"{url}/metrics", f"m{k}") for k in range(scrapes))
    options = HttpTargetOptions(
        url, metrics=metrics, scrape_interval_s=SCRAPE_INTERVAL_S, tail_s=0.01
    )
    trace = poisson_trace(rate, num_requests, seed, args)
    cpu = time.process_time()
    timeline = HttpReplay(options).run(trace)
    cpu = time.process_time() - cpu
    done = [r for r in timeline.requests if r.error is None and r.end_t is not None]
    lateness = [r.send_lateness_s for r in timeline.requests if r.send_lateness_s is not None]
    ttfts = [r.first_token_t - r.send_t for r in done if r.first_token_t is not None]
    end = max((r.end_t for r in done), default=None)
    return Row(
        achieved=len(done) / end if end else None,
        ttft_p50_ms=_ms(ttfts, 50),
        lateness_p50_ms=_ms(lateness, 50),
        lateness_p99_ms=_ms(lateness, 99),
        cpu_us=cpu / num_requests * 1e6,
        num_completed=len(done),
        num_failed=len(timeline.requests) - len(done),
        scrapes=tuple(
            (m["num_scrapes"], m["num_failures"]) for m in timeline.meta["http"]["metrics"]
        ),
    )


def vllm_command(
    venv: Path, url: str, rate: float, seed: int, args, tokenizer: Path, out: Path
) -> list[str]:
    return [
        str(venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.prompt_len),
        "--random-output-len",
        str(args.max_tokens),
        "--random-range-ratio",
        "0",
        "--ignore-eos",
        "--request-rate",
        f"{rate:g}",
        "--num-prompts",
        str(round(rate * args.duration)),
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


def run_vllm(venv: Path, url: str, rate: float, seed: int, args, tokenizer: Path, tmp: Path) -> Row:
    """`vllm bench serve` on the same lengths, read from its --save-result json. Its tokenizer is
    the word-level one of kvdrain's vLLM launcher (replay/vllm/tiny_model.py): `w<N>` is token N,
    the ids kvdrain's serve reads from a text prompt."""
    out = tmp / f"vllm-{rate:g}.json"
    command = vllm_command(venv, url, rate, seed, args, tokenizer, out)
    try:
        done = subprocess.run(
            command,
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=VLLM_STARTUP_S + 3 * args.duration,
        )
    except subprocess.TimeoutExpired:
        return Row(error=f"vllm bench serve ran past {VLLM_STARTUP_S + 3 * args.duration:g} s")
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-6:]
        return Row(error=f"vllm bench serve exited {done.returncode}: " + " | ".join(tail))
    result = json.loads(out.read_text())
    return Row(
        achieved=result.get("request_throughput"),
        ttft_p50_ms=result.get("median_ttft_ms"),
        num_completed=result.get("completed", 0),
        num_failed=result.get("failed", 0),
    )


def _f(value: float | None, spec: str) -> str:
    return "unknown" if value is None else format(value, spec)


def print_table(
    rates: list[float], kv: dict[float, Row], vl: dict[float, Row], vllm_note: str | None
) -> None:
    print(f"{'rate':>6} | {'kvdrain':^55} | {'vllm bench serve':^27} | {'rate':>7}")
    print(
        f"{'req/s':>6} | {'late p50':>9} {'p99 ms':>7} {'req/s':>8} {'TTFT p50':>9} "
        f"{'CPU us':>7} {'ok/fail':>9} | "
        f"{'req/s':>8} {'TTFT p50':>9} {'ok/fail':>8} | {'kv/vllm':>7}"
    )
    for rate in rates:
        k, v = kv[rate], vl.get(rate, Row())
        print(
            f"{rate:>6g} | {_f(k.lateness_p50_ms, '.2f'):>9} {_f(k.lateness_p99_ms, '.2f'):>7} "
            f"{_f(k.achieved, '.2f'):>8} {_f(k.ttft_p50_ms, '.1f'):>9} {_f(k.cpu_us, '.0f'):>7} "
            f"{f'{k.num_completed}/{k.num_failed}':>9} | "
            f"{_f(v.achieved, '.2f'):>8} {_f(v.ttft_p50_ms, '.1f'):>9} "
            f"{f'{v.num_completed}/{v.num_failed}':>8} | "
            f"{_f(_ratio(k, v), '.4f'):>7}"
        )
    for rate in rates:
        if vl.get(rate) is not None and vl[rate].error:
            print(f"vllm bench at {rate:g} req/s: {vl[rate].error}")
    if vllm_note:
        print(f"vllm bench: {vllm_note}")


def _ratio(k: Row, v: Row) -> float | None:
    """Both clients put the last arrival at N / rate, so their achieved rates differ only by
    when the last request ended: printed to 4 decimals."""
    return k.achieved / v.achieved if k.achieved and v.achieved else None


def highest_on_time(rates: list[float], kv: dict[float, Row]) -> float | None:
    """The highest rate whose p99 lateness, and every lower rate's, is under the aim."""
    best = None
    for rate in sorted(rates):
        p99 = kv[rate].lateness_p99_ms
        if p99 is None or p99 >= LATENESS_AIM_S * 1000:
            break
        best = rate
    return best


def print_aims(
    rates: list[float],
    kv: dict[float, Row],
    vl: dict[float, Row],
    scraped: Row,
    scrape_rate: float,
    duration: float,
) -> None:
    slots = round(
        duration / SCRAPE_INTERVAL_S
    )  # the replay's grid, plus one before t = 0 and one after
    best = highest_on_time(rates, kv)
    print(
        f"highest rate with kvdrain's p99 lateness < {LATENESS_AIM_S * 1000:g} ms: "
        f"{'none of these' if best is None else f'{best:g} req/s'}"
    )
    print(
        f"at {scrape_rate:g} req/s scraping {NUM_SCRAPES} /metrics URLs at "
        f"{1 / SCRAPE_INTERVAL_S:g} Hz: lateness p50 {_f(scraped.lateness_p50_ms, '.2f')} ms, "
        f"p99 {_f(scraped.lateness_p99_ms, '.2f')} ms, "
        f"{_f(scraped.achieved, '.1f')} req/s, TTFT p50 {_f(scraped.ttft_p50_ms, '.1f')} ms "
        f"(aim p99 < {LATENESS_AIM_S * 1000:g} ms: "
        f"{_met(scraped.lateness_p99_ms, lambda p: p < LATENESS_AIM_S * 1000)})"
    )
    print(
        f"  scrapes per URL (of ~{slots} slots): "
        f"{', '.join(f'{n} ({failed} failed)' for n, failed in scraped.scrapes) or 'none'}"
    )
    ratios = {r: _ratio(kv[r], vl[r]) for r in rates if r in vl}
    if ratios and len(ratios) == len(rates) and None not in ratios.values():
        below = [f"{r:g} req/s ({ratio:.4f})" for r, ratio in ratios.items() if ratio < 1]
        print(
            f"aim kvdrain req/s >= vllm bench's at every rate: "
            f"{'not met at ' + ', '.join(below) if below else 'met'}"
        )
    else:
        print(
            "aim kvdrain req/s >= vllm bench's at every rate: "
            "unknown (vllm bench did not run at every rate)"
        )


def _met(value: float | None, ok) -> str:
    return "unknown" if value is None else ("met" if ok(value) else "not met")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", default="10,50,100,200", help="Poisson rates, req/s, comma-separated"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--scrape-rate",
        type=float,
        default=100.0,
        help=f"the rate of the run with {NUM_SCRAPES} /metrics scrapes",
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=ROOT / ".venv-vllm",
        help="a venv with vLLM (its bin/vllm); absent: kvdrain's rows only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--code",
        type=Path,
        default=ROOT,
        help="the checkout whose HTTP client runs (default: this one's)",
    )
    args = parser.parse_args()
    if args.code.resolve() != CODE:  # read from sys.argv before the imports: "--code DIR" only
        parser.error(f"--code: give it as two words (--code DIR); this run would measure {CODE}")
    args.rates = [float(r) for r in args.rates.split(",")]
    if not all(r > 0 for r in args.rates) or args.duration <= 0 or args.scrape_rate <= 0:
        parser.error("--rates, --duration and --scrape-rate must be > 0")
    if min(round(r * args.duration) for r in (*args.rates, args.scrape_rate)) < 1:
        parser.error(
            "--duration: every rate (and --scrape-rate) must send at least one request in it"
        )
    return args


def main() -> None:
    args = parse_args()
    venv = (
        args.vllm_venv.resolve() if (args.vllm_venv / "bin" / "vllm").exists() else None
    )  # runs in a tmp dir
    vllm_note = (
        None if venv else f"not run: no {args.vllm_venv / 'bin' / 'vllm'} (give --vllm-venv)"
    )
    load = OtherLoad()
    kv: dict[float, Row] = {}
    vl: dict[float, Row] = {}
    with interruptible(), tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tiny_model(Path(tmp) / "tiny")
        proc, _, url = start_serve()
        threading.Thread(
            target=proc.stdout.read, daemon=True
        ).start()  # its log never fills the pipe
        try:
            for k, rate in enumerate(args.rates):
                kv[rate] = run_kvdrain(url, rate, args.seed * 100 + k, args)
                if venv is not None:
                    vl[rate] = run_vllm(
                        venv, url, rate, args.seed * 100 + k, args, tokenizer, Path(tmp)
                    )
            scraped = run_kvdrain(
                url, args.scrape_rate, args.seed * 100 + 99, args, scrapes=NUM_SCRAPES
            )
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(
        f"mock runner, P/D; Poisson arrivals, {args.duration:g} s per rate, "
        f"{args.prompt_len}-token prompts, max_tokens {args.max_tokens}; one serve, "
        f"the clients in turn; kvdrain's client: {CODE}"
    )
    print_table(args.rates, kv, vl, vllm_note)
    print_aims(args.rates, kv, vl, scraped, args.scrape_rate, args.duration)
    print(load.report())


if __name__ == "__main__":
    main()
