"""Latency and throughput as `vllm bench serve` prints them, from a timeline's request records. Runs in: frontend process.

The keys are vllm bench's (vllm/benchmarks/serve.py, calculate_metrics and the result
dict): completed, failed, duration, total_input_tokens, total_output_tokens,
request_throughput, output_throughput, total_token_throughput and, for each of ttft,
tpot, itl and e2el, mean_*_ms, median_*_ms, std_*_ms and p<q>_*_ms for each of the
percentiles (vllm bench's --metric-percentiles; here 90, 95 and 99 unless told). As there: a request
counts when it finished without error (here: not aborted, not ignored, no error);
TTFT and E2EL are measured from the send; TPOT is (E2EL - TTFT) / (output tokens - 1)
for requests with more than one token; ITLs are the gaps between consecutive outputs
(one per streamed chunk); percentiles interpolate linearly (numpy's default); duration
runs from the first send to the last end. A metric with no values has vllm bench's 0.0
in every key; `num_values` (kvdrain's own key) says so, and the compact lines print it
as unknown.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from replay.verify.timeline import RequestRecord

METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
WIDTH = 50  # vllm bench's banner width
DEFAULT_PERCENTILES = (90.0, 95.0, 99.0)


def percentile_key(q: float) -> str:
    """vllm bench's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{q:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' (vllm bench's --metric-percentiles) -> (50.0, 90.0, 99.0); each in (0, 100]."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: expected numbers like 50,90,99, got {text!r}"
        ) from None
    if not values or not all(0 < q <= 100 for q in values):
        raise ValueError(f"--metric-percentiles: each must be in (0, 100], got {text!r}")
    return values


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile(values, q) with linear interpolation; 0.0 for no values (as vllm bench)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else 0.0
    out = {
        f"mean_{name}_ms": 1000 * mean,
        f"median_{name}_ms": 1000 * percentile(values, 50),
        f"std_{name}_ms": 1000 * std,
    }
    for q in percentiles:
        out[f"{percentile_key(q)}_{name}_ms"] = 1000 * percentile(values, q)
    return out


def is_success(record: RequestRecord) -> bool:
    """Finished with tokens, no error, not aborted (vllm bench's output.success)."""
    return (
        record.end_t is not None
        and record.error is None
        and record.num_output_tokens > 0
        and record.finish_reason not in ("abort", "error", "ignored")
    )


def latency_summary(
    records: Iterable[RequestRecord], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, float | int]:
    """vllm bench serve's metrics of these requests (see the module docstring)."""
    records = list(records)
    done = [r for r in records if is_success(r)]
    ttft = [r.first_token_t - r.send_t for r in done if r.first_token_t is not None]
    e2el = [r.end_t - r.send_t for r in done]
    tpot = [
        (r.end_t - r.first_token_t) / (r.num_output_tokens - 1)
        for r in done
        if r.first_token_t is not None and r.num_output_tokens > 1
    ]
    itl = [x for r in done for x in r.itls]
    sends = [r.send_t for r in records]
    ends = [r.end_t for r in records if r.end_t is not None]
    duration = max(ends) - min(sends) if ends and sends else 0.0
    num_in = sum(r.num_prompt_tokens for r in done)
    num_out = sum(r.num_output_tokens for r in done)
    out: dict[str, float | int] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": duration,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": num_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (num_in + num_out) / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out.update(_stats(name, values, percentiles))
    out["percentiles"] = list(percentiles)
    # kvdrain's own: how many values each metric has (0: its figures are vllm bench's 0.0
    # placeholders, not observations)
    out["num_values"] = {"ttft": len(ttft), "tpot": len(tpot), "itl": len(itl), "e2el": len(e2el)}
    return out


def _percentiles(summary: dict) -> list[float]:
    return list(summary.get("percentiles", [99.0]))


def latency_lines(summary: dict) -> list[str]:
    """The summary as vllm bench serve prints it (its labels, widths and banners)."""

    def row(label: str, value: float | int, fmt: str = "{:<10.2f}") -> str:
        return f"{label:<40} " + fmt.format(value)

    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="="),
        row("Successful requests:", summary["completed"], "{:<10}"),
        row("Failed requests:", summary["failed"], "{:<10}"),
        row("Benchmark duration (s):", summary["duration"]),
        row("Total input tokens:", summary["total_input_tokens"], "{:<10}"),
        row("Total generated tokens:", summary["total_output_tokens"], "{:<10}"),
        row("Request throughput (req/s):", summary["request_throughput"]),
        row("Output token throughput (tok/s):", summary["output_throughput"]),
        row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, name, header in METRICS:
        lines.append("{s:{c}^{n}}".format(s=header, n=WIDTH, c="-"))
        lines += [
            row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"]),
            row(f"Median {name} (ms):", summary[f"median_{key}_ms"]),
        ]
        lines += [
            row(f"P{q:g} {name} (ms):", summary[f"{percentile_key(q)}_{key}_ms"])
            for q in _percentiles(summary)
            if q != 50
        ]  # p50 is the median, shown first
    lines.append("=" * WIDTH)
    return [line.rstrip() for line in lines]


NO_VALUES = {
    "ttft": "no request completed",
    "e2el": "no request completed",
    "tpot": "no completed request had 2 or more tokens",
    "itl": "no completed request was streamed in 2 or more outputs",
}


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def compact_latency_lines(summary: dict) -> list[str]:
    """Five lines under 80 columns: requests and throughput, then per metric the median,
    each percentile and the mean (the full block: latency_lines)."""
    lines = [
        f"latency: {summary['completed']:,} ok, {summary['failed']:,} failed in "
        f"{summary['duration']:.1f} s; {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput']:.1f} out tok/s (ms below)"
    ]
    for key, name, _ in METRICS:
        if summary.get("num_values", {}).get(key, 1) == 0:
            lines.append(f"  {name.lower():<5} unknown ({NO_VALUES[key]})")
            continue
        cells = [f"p50 {_ms(summary[f'median_{key}_ms'])}"]
        cells += [
            f"{percentile_key(q)} {_ms(summary[f'{percentile_key(q)}_{key}_ms'])}"
            for q in _percentiles(summary)
            if q != 50
        ]  # p50 is the median, shown first
        lines.append(
            f"  {name.lower():<5} " + "  ".join(cells) + f"  mean {_ms(summary[f'mean_{key}_ms'])}"
        )
    return lines
