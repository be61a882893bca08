"""What a replay over HTTP could not observe, and the run's status with it. Runs in: frontend process.

The idle-window rules (replay/verify/rules.py) judge what the scrapes saw, and their
Verdict already says what the run did not cover (missed or undecided windows, ignored
requests). Over HTTP more can be missing: no metrics URL, no KV-usage metric, failed
scrapes, failed requests, a metric that never moved. Each is a reason the run proves
nothing; the status is the Verdict's, made inconclusive by any of them (a violation
stays one). Statuses and exit codes are replay/verify/verdict.py's table. Latency is
replay/verify/latency.py's (the report's "latency").
"""

from __future__ import annotations

import math

from replay.verify.coverage import ignored_cause
from replay.verify.text import printable
from replay.verify.timeline import Timeline
from replay.verify.verdict import exit_code_for, worst

NO_METRICS = (
    "no --metrics URL, and no KV-usage metric at the target's own /metrics: KV usage "
    "was not observed"
)


def observation_reasons(timeline: Timeline, verdict) -> list[str]:
    """Why KV usage was not observed well enough over HTTP (empty: it was).

    No metrics URL, no KV-usage metric, a failed scrape, a failed request (ignored
    requests are the Verdict's to count), a metric that never moved (the check would be
    vacuous), or no idle window at all.
    """
    http = timeline.meta.get("http", {})
    reasons = [] if http.get("metrics") else [NO_METRICS]
    for status in http.get("metrics", []):
        if status["metric"] is None:
            why = status["errors"][0] if status["errors"] else "none exposed"
            reasons.append(f"{status['url']}: no KV-usage metric read ({why})")
        elif status["num_failures"] and _failures_matter(status, verdict):
            reasons.append(
                f"{status['url']}: {status['num_failures']} of {status['num_scrapes']} "
                f"scrapes failed (first: {status['errors'][0]})"
            )
    failed = [r for r in timeline.requests if r.error is not None and ignored_cause(r) is None]
    if failed:
        reasons.append(
            f"{len(failed)} of {len(timeline.requests)} requests failed "
            f"(first: {failed[0].req_id}: {failed[0].error})"
        )
    for engine in timeline.engines:
        values = {s.num_used_blocks for s in timeline.samples_for(engine)}
        if len(values) <= 1:
            reasons.append(f"{engine}: KV usage never moved (always {next(iter(values), 0)})")
    if timeline.engines and not verdict.windows:
        reasons.append("no idle window to check")
    return reasons


def _failures_matter(status: dict, verdict) -> bool:
    """A failed scrape leaves a reading missing: it matters inside an idle window the run
    judged or was expected to (a missed reading there could hide held blocks), not in
    busy time, where no reading is judged. Failures not all placed in time all matter."""
    spans = status.get("failure_spans")
    if spans is None or len(spans) < status["num_failures"]:
        return True
    windows = [(w.start, w.end) for w in verdict.windows] + [  # an expected one from its quiet
        (c.start if c.quiet_from is None else c.quiet_from, math.inf if c.end is None else c.end)
        for c in verdict.coverage
    ]
    return any(sent < end and failed > start for sent, failed in spans for start, end in windows)


def http_verdict(timeline: Timeline, verdict) -> tuple[str, list[str]]:
    """The run's status and every reason it is inconclusive: the Verdict's, then HTTP's."""
    observed = observation_reasons(timeline, verdict)
    return (
        worst(verdict.status, "inconclusive" if observed else "verified"),
        [*verdict.reasons, *observed],
    )


def http_outcome(timeline: Timeline, verdict) -> dict | None:
    """The report's "http" part (None unless the timeline came from --target http://):
    the server, the scrapes, the run's status and exit code (the same as the report's
    top level) and the reasons only the HTTP observation adds."""
    if timeline.meta.get("driver") != "http":
        return None
    status, _ = http_verdict(timeline, verdict)
    return {
        **timeline.meta["http"],
        "verdict": status,
        "exit_code": exit_code_for(status),
        "reasons": observation_reasons(timeline, verdict),
    }


def models_note(status: dict) -> list[str]:
    """A line when a metrics URL exposed the series of several models: whose were read."""
    found = status.get("models_found") or []
    if len(found) < 2:
        return []
    named = ", ".join(printable(repr(m)) for m in found)
    model = status.get("model")
    read = "all were read" if model is None else f"only model {printable(repr(model))}'s were read"
    return [f"  series of {len(found)} models at this URL ({named}): {read}"]


def outcome_lines(outcome: dict) -> list[str]:
    """Plain lines for the terminal (print them without markup): who answered, what was
    scraped and at what cost, what it lacked. Every text from the server is printable().

    No verdict word: the summary's last line (replay/verify/report.py) is the verdict.
    """
    server = outcome.get("server") or {}
    p = printable
    lines = [
        f"server: {p(server.get('server') or 'no Server header')}, model "
        f"{p(repr(server.get('model')))} (owned_by {p(server.get('owned_by'))}), "
        f"max_model_len {p(server.get('max_model_len'))}"
    ]
    for m in outcome.get("metrics", []):
        engines = ", ".join(p(e) for e in m["engines"].values()) or "none"
        cost = (
            f"; answers took up to {m['max_answer_s']:.3f} s, parsing up to "
            f"{m['max_parse_s']:.3f} s"
            if "max_parse_s" in m
            else ""
        )
        restarts = m.get("num_restarts", 0)
        lines.append(
            f"metrics {p(m['url'])}: {m['metric'] or 'no KV-usage metric'}"
            f" ({m['unit'] or '-'}), engines {engines}; {m['num_scrapes']} scrapes, "
            f"{m['num_failures']} failed; {len(m['metric_names_found'])} metric names "
            f"found{cost}" + (f"; {restarts} engine restarts seen (faults)" if restarts else "")
        )
        lines += models_note(m)
    if outcome["reasons"]:
        lines.append(
            "KV usage not fully observed over HTTP:"
            + "".join(f"\n  - {p(r, 400)}" for r in outcome["reasons"])
        )
    elif busy_failures := sum(m["num_failures"] for m in outcome.get("metrics", [])):
        lines.append(
            f"KV usage observed from the server's own metrics in every idle window; "
            f"{busy_failures} failed scrape{'s' * (busy_failures != 1)} fell in busy time, "
            f"where nothing is judged"
        )
    else:
        lines.append("KV usage observed from the server's own metrics throughout")
    return lines
