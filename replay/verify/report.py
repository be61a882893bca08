"""Replay reports: the terminal summary, the JSON report and per-request JSONL. Runs in: frontend process.

The summary is plain lines, never a table drawn to a terminal's width: piped into a
file or a pager it neither wraps nor truncates. Its last line is the verdict, with the
status and exit code of replay/verify/verdict.py's table. The plot is replay/verify/plot.py.
A figure that was not observed (a server that does not count steps, a usage without
cached tokens and no prefix-cache counter) is None in the report and `-` or "unknown"
in the summary, never 0. Over HTTP the first line describes the server (settings.engine,
as replay/target/client.py read it), not kvdrain's engine options.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from replay.verify.coverage import ignored_cause
from replay.verify.latency import (
    DEFAULT_PERCENTILES,
    compact_latency_lines,
    latency_lines,
    latency_summary,
)
from replay.verify.plot import system_label
from replay.verify.rules import Verdict
from replay.verify.stamp import stamp
from replay.verify.timeline import Timeline
from replay.verify.units import seconds
from replay.verify.verdict import EXIT_CODES

MAX_VIOLATIONS_SHOWN = 12
MAX_REASONS_SHOWN = 8
MAX_CONTRACT_WINDOWS = 10  # windows an unread request's contract judged, listed
ENGINE_COLUMNS = (
    "engine",
    "peak",
    "end",
    "windows",
    "drained",
    "leak",
    "max drain",
    "steps",
    "wakes",
    "expired",
)
LEGEND = """\
Verdicts (exit status):
  VERIFIED (0)      every expected idle window was observed and every engine drained in it
  VIOLATION (1)     a leak (blocks held past their deadline: the drain deadline, or an
                    unread request's contract), a conservation or snapshot mismatch, a
                    request that never ended, or corrupt KV (freed before D read them; an
                    output unlike a single engine's, with --check-outputs)
  error (2)         bad usage or input, or a target that cannot be reached; nothing ran
  INCONCLUSIVE (3)  the run proves nothing either way: an expected idle window was not
                    observed (the engines lagged the forecast), too many requests were
                    ignored, a window was undecided, or KV usage was not observable
                    (--target http://)
  FAULT (4)         an engine or connector worker died, stopped answering or stalled a
                    transfer mid-run (each named on a "fault:" line); a leak after one is
                    a fault_leak, the fault's, not the liveness policy's
  interrupted (130), terminated (143): Ctrl-C or SIGTERM; the verdict covers only what ran
Idle windows: after every request sent so far has ended, until the next arrival at least
  --idle-threshold seconds later, and the tail. Expected: the gaps the virtual clock (the
  forecast of these engines) finds idle; busy: gaps the trace's own work fills, even in the
  forecast.
Contract: P's blocks of a request D never read are due by what the release promises (the
  lease + one extension on 0.22+, at once for a rejection there, held while a <= 0.21 or
  legacy P idles: a leak), from P's answer; a window that ends before that deadline is
  undecided, judged by a later one, and one still draining when it ends is not a leak.
Columns: peak = most used KV blocks / usable blocks (the null block excluded); end = used
  blocks at the end; windows = the idle windows this engine was judged in (its own
  count: the trace's and its own, so engines may differ); drained / leak = their
  verdicts; max drain = longest time from a window's start to no used blocks (ms);
  steps, wakes = engine steps and wake-ups from blocking or polling; expired = P's
  sends freed by lease expiry.
Latency (ms) as vllm bench serve: TTFT to the first token, TPOT per token after it, ITL
  between streamed outputs, E2EL send to last token; virtual clock: simulated seconds."""


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 window', '2 windows', '1,234 requests'."""
    return f"{n:,} {word if n == 1 else words or word + 's'}"


def engine_summary(timeline: Timeline, verdict: Verdict, engine: str) -> dict:
    samples = timeline.samples_for(engine)
    windows = [w for w in verdict.windows if w.engine == engine]
    counters = timeline.counters.get(engine, {})
    return {
        "engine": engine,
        # The key says num_blocks (kept for the report's readers); the value is the usable
        # blocks, the null block excluded, unlike settings.engine.num_blocks.
        "num_blocks": timeline.num_usable_blocks.get(engine, 0),
        "peak_used_blocks": max((s.num_used_blocks for s in samples), default=0),
        "final_used_blocks": samples[-1].num_used_blocks if samples else 0,
        "num_windows": len(windows),
        "num_drained": sum(w.verdict == "drained" for w in windows),
        "num_leaks": sum(w.verdict == "leak" for w in windows),
        "max_time_to_drain_s": max(
            (w.time_to_drain for w in windows if w.time_to_drain is not None), default=None
        ),
        "num_steps": _counted(counters, "num_steps", samples[-1].num_steps if samples else 0),
        "num_wakeups": _counted(counters, "num_wakeups", samples[-1].num_wakeups if samples else 0),
        "num_expired": _counted(counters, "num_expired", 0),
    }


def _counted(counters: dict, name: str, default: int) -> int | None:
    """counters[name] as an int (None: the server does not count it); default if absent."""
    value = counters.get(name, default)
    return None if value is None else int(value)


def prefix_hits(timeline: Timeline) -> tuple[int | None, str | None]:
    """Prefix-cache hit tokens over the run and where the figure comes from (None: unknown).

    The requests' own counts when the server said them (usage's cached_tokens), else the
    engines' prefix-cache hit counters over the run (vllm:prefix_cache_hits_total)."""
    said = [
        r.num_prefix_hit_tokens for r in timeline.requests if r.num_prefix_hit_tokens is not None
    ]
    if said or not timeline.requests:
        return sum(said), "requests"
    counted = [c.get("num_prefix_hit_tokens") for c in timeline.counters.values()]
    counted = [int(c) for c in counted if c is not None]
    if counted:
        return sum(counted), "vllm:prefix_cache_hits_total"
    return None, None


def request_summary(timeline: Timeline) -> dict:
    records = timeline.requests
    late = sorted(r.send_lateness_s for r in records)
    hits, hits_source = prefix_hits(timeline)
    return {
        "num_requests": len(records),
        "num_finished": sum(r.end_t is not None for r in records),
        "num_ignored": sum(ignored_cause(r) is not None for r in records),
        "finish_reasons": _count(r.finish_reason or "unfinished" for r in records),
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in records),
        "num_output_tokens": sum(r.num_output_tokens for r in records),
        "num_prefix_hit_tokens": hits,
        "prefix_hits_source": hits_source,
        "send_lateness_p50_ms": 1000 * _quantile(late, 0.5),
        "send_lateness_p99_ms": 1000 * _quantile(late, 0.99),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def build_report(
    timeline: Timeline,
    verdict: Verdict,
    settings: dict,
    trace: dict,
    shaping: list[str],
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> dict:
    """The machine-readable report (--report FILE.json): status and exit_code first."""
    return {
        "kvdrain_report": 1,
        **verdict.to_dict(),
        "kvdrain": stamp(settings),
        "settings": settings,
        "trace": trace,
        "shaping": shaping,
        "requests": request_summary(timeline),
        "latency": latency_summary(timeline.requests, percentiles),
        "engines": [engine_summary(timeline, verdict, e) for e in timeline.engines],
        "counters": timeline.counters,
    }


def set_status(report: dict, status: str, reason: str | None = None) -> None:
    """Change the report's status (a worse one found after verify: http, a fault...)."""
    report["status"], report["exit_code"] = status, EXIT_CODES[status]
    report["ok"] = status == "verified"
    if reason is not None:
        report["reasons"] = [*report.get("reasons", []), reason]


def write_report(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def request_line(record) -> dict:
    """One --requests line: the record, with ttft_s and e2el_s from its send (None: not seen)."""
    line = asdict(record)
    line["ttft_s"] = None if record.first_token_t is None else record.first_token_t - record.send_t
    line["e2el_s"] = None if record.end_t is None else record.end_t - record.send_t
    return line


def write_requests(path: Path, timeline: Timeline) -> None:
    with path.open("w") as f:
        for record in timeline.requests:
            f.write(json.dumps(request_line(record)) + "\n")


def _engine_rows(report: dict) -> list[str]:
    """The per-engine table as aligned plain text (widths from the content, never cut)."""
    rows = [list(ENGINE_COLUMNS)]
    for e in report["engines"]:
        drain = e["max_time_to_drain_s"]
        rows.append(
            [
                e["engine"],
                f"{e['peak_used_blocks']:,}/{e['num_blocks']:,}",
                f"{e['final_used_blocks']:,}",
                f"{e['num_windows']:,}",
                f"{e['num_drained']:,}",
                f"{e['num_leaks']:,}",
                "-" if drain is None else f"{1000 * drain:.1f} ms",
                *(_figure(e[k]) for k in ("num_steps", "num_wakeups", "num_expired")),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(ENGINE_COLUMNS))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]


def _figure(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _hits(r: dict) -> str:
    hits = r.get("num_prefix_hit_tokens")
    if hits is None:
        return "unknown"
    source = r.get("prefix_hits_source")
    return f"{hits:,}" + (f" ({source})" if source not in (None, "requests") else "")


def _request_line(report: dict) -> str:
    r = report["requests"]
    reasons = ", ".join(f"{k} {v:,}" for k, v in r["finish_reasons"].items())
    return (
        f"requests: {r['num_finished']:,} of {r['num_requests']:,} finished "
        f"({reasons}); tokens in {r['num_prompt_tokens']:,}, out {r['num_output_tokens']:,}, "
        f"prefix-cache hits {_hits(r)}; send lateness p50 "
        f"{r['send_lateness_p50_ms']:.2f} ms, p99 {r['send_lateness_p99_ms']:.2f} ms"
    )


def coverage_line(report: dict) -> str:
    """The expected windows: the trace's gaps (the tail included) and the engines' own the
    forecast foresaw, each counted once; the table's `windows` are each engine's own count."""
    coverage = report.get("coverage", [])
    busy = sum(c["state"] == "busy" for c in coverage)
    own = sum(bool(c.get("engine")) and c["state"] != "busy" for c in coverage)
    what = (
        "the tail included"
        if not own
        else f"{plural(report['num_expected_windows'] - own, 'gap')} of the whole trace, the tail included, "
        f"and {own:,} of one engine's own"
    )
    line = (
        f"idle windows: {report['num_observed_windows']:,} of "
        f"{report['num_expected_windows']:,} expected observed ({what})"
    )
    if any(e["num_windows"] != report["num_expected_windows"] for e in report.get("engines", [])):
        line += "; the table's windows are each engine's own, the ones it was judged in"
    if busy:
        line += (
            f"; {plural(busy, 'gap')} of the trace filled by its own work "
            f"(busy in the forecast too)"
        )
    return line


STOPPED_EARLY = "stopped early: "  # replay/verify/rules.py's reason for windows not reached


def stopped_what(report: dict) -> str:
    """An interrupted run's verdict: who stopped it, when, and the windows it reached."""
    stop = report["stop"]
    if not stop["num_sent"]:
        return (
            f"by {stop['by']} during start-up, before any request was sent; nothing is left running"
        )
    judged = [w for w in report["windows"] if w["verdict"] != "undecided"]
    drained = sum(w["verdict"] == "drained" for w in judged)
    unreached = sum(c["state"] == "unreached" for c in report["coverage"])
    what = (
        f"by {stop['by']} after {seconds(stop['after_s'])} and {stop['num_sent']:,} of "
        f"{stop['num_requests']:,} requests: {drained:,} of {len(judged):,} reached windows "
        f"drained; {unreached:,} not reached"
    )
    if report["violations"]:
        what += f"; {plural(len(report['violations']), 'violation')} in that part (above)"
    if report.get("settings", {}).get("target") is not None:
        return what + "; the target's engines were left as they were (this run owns none)"
    return what + "; the engines were shut down"


def verdict_line(report: dict) -> str:
    """The last line: the status in capitals, what it covered, the exit status."""
    status, code = report["status"], report["exit_code"]
    observed, expected = (
        report.get("num_observed_windows", 0),
        report.get("num_expected_windows", 0),
    )
    if status == "verified":
        what = (
            "every engine drained in the 1 expected idle window"
            if expected == 1
            else f"every engine drained in each of the {plural(expected, 'expected idle window')}"
            if expected
            else "every engine drained in every idle window"
        )
        if report.get("partial_coverage"):
            what = f"partial coverage: {report['partial_coverage']}"
        if report.get("num_too_short_windows"):
            what += (
                f"; {plural(report['num_too_short_windows'], 'engine window')} shorter "
                f"than the drain deadline not judged (too short)"
            )
    elif status == "violation":
        what = plural(len(report["violations"]), "violation")
    elif status == "inconclusive":
        what = (
            f"{observed:,} of {plural(expected, 'expected idle window')} observed; "
            f"{plural(len(report['reasons']), 'reason')}, below"
        )
    elif "stop" in report:  # interrupted or terminated: one line for the part that ran
        what = stopped_what(report)
    elif status == "fault" and report.get("faults"):
        what = (
            f"{plural(len(report['faults']), 'fault')}; the liveness verdict "
            f"does not hold from the first one on"
        )
    else:
        what = report.get("reasons", [status])[-1] if report.get("reasons") else status
    return f"{status.upper()}: {what} (exit {code})"


def contract_lines(report: dict) -> list[str]:
    """The contract the verdict judged by (over a target always; else when an unread
    request's blocks judged a window), then one line per window an unread request's
    contract judged, the first MAX_CONTRACT_WINDOWS of them."""
    contract = report.get("contract")
    if contract is None:
        return []
    judged = [w for w in report.get("windows", []) if w.get("num_unread")]
    served = (report.get("settings") or {}).get("target") is not None
    if not judged and not served:
        return []
    lines = [f"contract: {contract['text']}"]
    lines += [f"  {window_contract_line(w)}" for w in judged[:MAX_CONTRACT_WINDOWS]]
    if len(judged) > MAX_CONTRACT_WINDOWS:
        lines.append(f"  ... and {len(judged) - MAX_CONTRACT_WINDOWS:,} more (see --report)")
    return lines


def window_contract_line(w: dict) -> str:
    """'P drained 31.2 s in: 1 unread request, lease 30 s + extension 20 s (idle window at
    12.000 s)': what one engine did in one window, and the contract that judged it."""
    where = f"({'tail' if w['is_tail'] else 'idle window'} at {seconds(w['start'])})"
    if w["verdict"] == "drained":
        did = f"drained {w['time_to_drain']:.1f} s in"
    elif w["verdict"] == "leak":
        did = f"leak: {w['num_blocks_held']:,} blocks held past {w['deadline_s']:.1f} s in"
    else:
        did = f"undecided, {(w.get('note') or 'no evidence').split(' (due')[0]}"
    return f"{w['engine']} {did}: {w['contract']} {where}"


def fault_lines(faults: list[dict]) -> list[str]:
    """One line per fault: when, who, what (replay/wall/faults.py)."""
    lines = []
    for f in faults:
        until = f" until {f['end_t']:.3f} s" if f.get("end_t") is not None else ""
        who = f"{f['engine']}: " if f["engine"] else ""
        lines.append(f"fault: {who}{f['cause']} (at {f['t']:.3f} s{until})")
    return lines


def server_lines(settings: dict) -> list[str]:
    """Over HTTP: the server as it described itself, one line, then one per engine."""
    engine = settings.get("engine") or {}
    if engine.get("source") != "http server":
        return []
    vocab = _unknown(engine.get("vocab_size"))
    if engine.get("vocab_size") is not None:
        vocab += f" (from {engine.get('vocab_source')})"
    lines = [
        f"server: {system_label(settings)}, model {engine.get('model')!r}, max_model_len "
        f"{_unknown(engine.get('max_model_len'))}, vocabulary {vocab}"
    ]
    for name, e in (engine.get("engines") or {}).items():
        lines.append(
            f"  {name}: version {_unknown(e.get('version'))}, block size "
            f"{_unknown(e.get('block_size'))}, num_gpu_blocks "
            f"{_unknown(e.get('num_gpu_blocks'))}, connector {_unknown(e.get('connector'))}"
        )
    return lines


def _unknown(value) -> str:
    if value is None:
        return "unknown"
    return f"{value:,}" if type(value) is int else str(value)


def summary_lines(report: dict, latency_block: bool = False) -> list[str]:
    """The terminal summary as plain lines: the server (over HTTP), engines, requests,
    ignored, coverage, verdict, then latency: five compact lines, or vllm bench's full
    block (latency_block); a run stopped before it sent anything has only its verdict line."""
    if "stop" in report and not report["stop"]["num_sent"]:
        return [verdict_line(report)]
    lines = (
        server_lines(report.get("settings") or {}) + _engine_rows(report) + [_request_line(report)]
    )
    if report.get("ignored"):
        causes = ", ".join(f"{n:,} {cause}" for cause, n in report["ignored"].items())
        lines.append(
            f"ignored: {plural(sum(report['ignored'].values()), 'request')} "
            f'({causes}); each request\'s cause is in --requests (its "error")'
        )
    if latency_block:
        lines += latency_lines(report["latency"])
    if "coverage" in report and report["coverage"]:
        lines.append(coverage_line(report))
    lines += contract_lines(report)
    lines += fault_lines(report.get("faults", []))
    for v in report["violations"][:MAX_VIOLATIONS_SHOWN]:
        lines.append(f"  {v['kind']:<12} {v['engine']:<3} t={v['t']:9.3f}s  {v['detail']}")
    hidden = len(report["violations"]) - MAX_VIOLATIONS_SHOWN
    if hidden > 0:
        lines.append(f"  ... and {hidden:,} more (see --report)")
    lines.append(verdict_line(report))
    reasons = report.get("reasons", [])
    lines += [f"  - {r}" for r in reasons[:MAX_REASONS_SHOWN]]
    if len(reasons) > MAX_REASONS_SHOWN:
        lines.append(f"  - ... and {len(reasons) - MAX_REASONS_SHOWN:,} more (see --report)")
    if not latency_block:
        lines += compact_latency_lines(report["latency"])
    return lines


STATUS_STYLES = {
    "verified": "bold green",
    "violation": "bold red",
    "inconclusive": "bold yellow",
    "fault": "bold red",
}


def print_summary(
    console: Console, report: dict, explain: bool = False, latency_block: bool = False
) -> None:
    """The summary, one unwrapped line each; the verdict line coloured on a terminal."""
    verdict = verdict_line(report)
    for line in summary_lines(report, latency_block):
        style = STATUS_STYLES.get(report["status"], "bold") if line == verdict else None
        console.print(line, style=style, highlight=False, markup=False, soft_wrap=True)
    if explain:
        console.print(LEGEND, highlight=False, markup=False, soft_wrap=True)


def write_plot(path: Path, timeline: Timeline, verdict: Verdict, title: str = "") -> None:
    """Kept for callers: replay/verify/plot.py draws it."""
    from replay.verify.plot import write_plot as draw

    draw(path, timeline, verdict, title)
