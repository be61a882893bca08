"""Latency and throughput as `vllm bench serve` prints them, from a timeline's request records. Runs in: frontend process.

The keys are vllm bench's (vllm/benchmarks/serve.py, calculate_metrics and the result
dict): completed, failed, duration, total_input_tokens, total_output_tokens,
request_throughput, output_throughput, total_token_throughput and, for each of ttft,
tpot, itl and e2el, mean_*_ms, median_*_ms, std_*_ms and p99_*_ms. As there: a request
counts when it finished without error (here: not aborted, not ignored, no error);
TTFT and E2EL are measured from the send; TPOT is (E2EL - TTFT) / (output tokens - 1)
for requests with more than one token; ITLs are the gaps between consecutive outputs
(one per streamed chunk); percentiles interpolate linearly (numpy's default); duration
runs from the first send to the last end.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from replay.verify.timeline import RequestRecord

METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))
WIDTH = 50  # vllm bench's banner width


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile(values, q) with linear interpolation; 0.0 for no values (as vllm bench)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else 0.0
    return {f"mean_{name}_ms": 1000 * mean, f"median_{name}_ms": 1000 * percentile(values, 50),
            f"std_{name}_ms": 1000 * std, f"p99_{name}_ms": 1000 * percentile(values, 99)}


def is_success(record: RequestRecord) -> bool:
    """Finished with tokens, no error, not aborted (vllm bench's output.success)."""
    return (record.end_t is not None and record.error is None and record.num_output_tokens > 0
            and record.finish_reason not in ("abort", "error", "ignored"))


def latency_summary(records: Iterable[RequestRecord]) -> dict[str, float | int]:
    """vllm bench serve's metrics of these requests (see the module docstring)."""
    records = list(records)
    done = [r for r in records if is_success(r)]
    ttft = [r.first_token_t - r.send_t for r in done if r.first_token_t is not None]
    e2el = [r.end_t - r.send_t for r in done]
    tpot = [(r.end_t - r.first_token_t) / (r.num_output_tokens - 1) for r in done
            if r.first_token_t is not None and r.num_output_tokens > 1]
    itl = [x for r in done for x in r.itls]
    sends = [r.send_t for r in records]
    ends = [r.end_t for r in records if r.end_t is not None]
    duration = max(ends) - min(sends) if ends and sends else 0.0
    num_in = sum(r.num_prompt_tokens for r in done)
    num_out = sum(r.num_output_tokens for r in done)
    out: dict[str, float | int] = {
        "completed": len(done), "failed": len(records) - len(done), "duration": duration,
        "total_input_tokens": num_in, "total_output_tokens": num_out,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": num_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (num_in + num_out) / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out.update(_stats(name, values))
    return out


def latency_lines(summary: dict) -> list[str]:
    """The summary as vllm bench serve prints it (its labels, widths and banners)."""
    def row(label: str, value: float | int, fmt: str = "{:<10.2f}") -> str:
        return "{:<40} ".format(label) + fmt.format(value)
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="="),
             row("Successful requests:", summary["completed"], "{:<10}"),
             row("Failed requests:", summary["failed"], "{:<10}"),
             row("Benchmark duration (s):", summary["duration"]),
             row("Total input tokens:", summary["total_input_tokens"], "{:<10}"),
             row("Total generated tokens:", summary["total_output_tokens"], "{:<10}"),
             row("Request throughput (req/s):", summary["request_throughput"]),
             row("Output token throughput (tok/s):", summary["output_throughput"]),
             row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for key, name, header in METRICS:
        lines.append("{s:{c}^{n}}".format(s=header, n=WIDTH, c="-"))
        lines += [row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"]),
                  row(f"Median {name} (ms):", summary[f"median_{key}_ms"]),
                  row(f"P99 {name} (ms):", summary[f"p99_{key}_ms"])]
    lines.append("=" * WIDTH)
    return [line.rstrip() for line in lines]
