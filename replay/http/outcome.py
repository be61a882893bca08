"""The outcome of a replay over HTTP: latency as vllm bench prints it, and a verdict that can be inconclusive. Runs in: frontend process.

The idle-window rules (replay/verify/rules.py) judge what the scrapes saw; this module
says whether what they saw is enough to call the run verified. Statuses map to the exit
codes of issue 12's table (EXIT_CODES).
"""
from __future__ import annotations

from replay.verify.timeline import Timeline

EXIT_CODES = {"verified": 0, "violation": 1, "inconclusive": 3}


def http_verdict(timeline: Timeline, verdict) -> tuple[str, list[str]]:
    """verified | violation | inconclusive, and why it is inconclusive.

    A leak seen in the server's own metrics is a violation whatever else went wrong;
    otherwise the run proves nothing (inconclusive) when KV usage was not observed
    throughout: no metrics URL, no KV-usage metric, a failed scrape, a metric that never
    moved (always one value: the check would be vacuous), or no idle window at all; or
    when the trace was not replayed as written (a request failed).
    """
    if not verdict.ok:
        return "violation", []
    http = timeline.meta.get("http", {})
    reasons = [] if http.get("metrics") else ["no --metrics URL: KV usage was not observed"]
    for status in http.get("metrics", []):
        if status["metric"] is None:
            why = status["errors"][0] if status["errors"] else "none exposed"
            reasons.append(f"{status['url']}: no KV-usage metric read ({why})")
        elif status["num_failures"]:
            reasons.append(f"{status['url']}: {status['num_failures']} of {status['num_scrapes']} "
                           f"scrapes failed (first: {status['errors'][0]})")
    failed = [r for r in timeline.requests if r.error is not None]
    if failed:
        reasons.append(f"{len(failed)} of {len(timeline.requests)} requests failed "
                       f"(first: {failed[0].req_id}: {failed[0].error})")
    for engine in timeline.engines:
        values = {s.num_used_blocks for s in timeline.samples_for(engine)}
        if len(values) <= 1:
            reasons.append(f"{engine}: KV usage never moved (always {next(iter(values), 0)})")
    if timeline.engines and not verdict.windows:
        reasons.append("no idle window to check")
    return ("inconclusive" if reasons else "verified"), reasons


def http_outcome(timeline: Timeline, verdict) -> dict | None:
    """The report's "http" part (None unless the timeline came from --target http://)."""
    if timeline.meta.get("driver") != "http":
        return None
    status, reasons = http_verdict(timeline, verdict)
    return {**timeline.meta["http"], "verdict": status, "reasons": reasons,
            "exit_code": EXIT_CODES[status]}


def outcome_lines(outcome: dict) -> list[str]:
    """Plain lines for the terminal: who answered, what was scraped, latency, the verdict."""
    server = outcome.get("server") or {}
    lines = [f"server: {server.get('server') or 'no Server header'}, model {server.get('model')!r} "
             f"(owned_by {server.get('owned_by')}), max_model_len {server.get('max_model_len')}"]
    for m in outcome.get("metrics", []):
        engines = ", ".join(m["engines"].values()) or "none"
        lines.append(f"metrics {m['url']}: {m['metric'] or 'no KV-usage metric'}"
                     f" ({m['unit'] or '-'}), engines {engines}; {m['num_scrapes']} scrapes, "
                     f"{m['num_failures']} failed; {len(m['metric_names_found'])} metric names found")
    lat = outcome.get("latency") or {}
    if lat.get("completed"):
        lines.append("latency (ms, median/p99): " + ", ".join(
            f"{k.upper()} {lat[f'median_{k}_ms']:.1f}/{lat[f'p99_{k}_ms']:.1f}"
            for k in ("ttft", "tpot", "itl", "e2el")) + f"; {lat['completed']} completed")
    word = {"verified": "VERIFIED from the server's own metrics", "violation": "VIOLATION",
            "inconclusive": "INCONCLUSIVE"}[outcome["verdict"]]
    lines.append(word + "".join(f"\n  - {r}" for r in outcome["reasons"]))
    return lines


def latency_summary(records, itls: dict[str, list[float]]) -> dict:
    """vllm bench serve's keys (ms): mean, median and p99 of TTFT, TPOT, ITL and E2E."""
    done = [r for r in records if r.end_t is not None and r.error is None and r.finish_reason != "abort"]
    ttft = [r.first_token_t - r.send_t for r in done if r.first_token_t is not None]
    e2e = [r.end_t - r.send_t for r in done]
    tpot = [(r.end_t - r.first_token_t) / (r.num_output_tokens - 1) for r in done
            if r.first_token_t is not None and r.num_output_tokens > 1]
    itl = [x for r in done for x in itls.get(r.req_id, ())]
    out: dict[str, float | int] = {"completed": len(done)}
    for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        values = sorted(values)
        out[f"mean_{key}_ms"] = 1000 * sum(values) / len(values) if values else 0.0
        out[f"median_{key}_ms"] = 1000 * values[len(values) // 2] if values else 0.0
        out[f"p99_{key}_ms"] = 1000 * values[min(len(values) - 1, int(0.99 * len(values)))] if values else 0.0
    return out
