"""Replay reports: the terminal summary, the JSON report, per-request JSONL and the usage plot. Runs in: frontend process."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from replay.verify.timeline import Timeline
from replay.verify.rules import Verdict

MAX_VIOLATIONS_SHOWN = 12


def engine_summary(timeline: Timeline, verdict: Verdict, engine: str) -> dict:
    samples = timeline.samples_for(engine)
    windows = [w for w in verdict.windows if w.engine == engine]
    counters = timeline.counters.get(engine, {})
    return {
        "engine": engine,
        "num_blocks": timeline.num_blocks.get(engine, 0),
        "peak_used_blocks": max((s.num_used_blocks for s in samples), default=0),
        "final_used_blocks": samples[-1].num_used_blocks if samples else 0,
        "num_windows": len(windows),
        "num_drained": sum(w.verdict == "drained" for w in windows),
        "num_leaks": sum(w.verdict == "leak" for w in windows),
        "max_time_to_drain_s": max((w.time_to_drain for w in windows if w.time_to_drain is not None),
                                   default=None),
        "num_steps": counters.get("num_steps", samples[-1].num_steps if samples else 0),
        "num_wakeups": counters.get("num_wakeups", samples[-1].num_wakeups if samples else 0),
        "num_expired": counters.get("num_expired", 0),
    }


def request_summary(timeline: Timeline) -> dict:
    records = timeline.requests
    late = sorted(r.send_lateness_s for r in records)
    return {
        "num_requests": len(records),
        "num_finished": sum(r.end_t is not None for r in records),
        "finish_reasons": _count(r.finish_reason or "unfinished" for r in records),
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in records),
        "num_output_tokens": sum(r.num_output_tokens for r in records),
        "num_prefix_hit_tokens": sum(r.num_prefix_hit_tokens for r in records),
        "send_lateness_p50_ms": 1000 * _quantile(late, 0.5),
        "send_lateness_p99_ms": 1000 * _quantile(late, 0.99),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def build_report(timeline: Timeline, verdict: Verdict, settings: dict, trace: dict,
                 shaping: list[str]) -> dict:
    """The machine-readable report (--report FILE.json)."""
    return {
        "kvdrain_report": 1,
        "ok": verdict.ok,
        "exit_code": verdict.exit_code,
        "settings": settings,
        "trace": trace,
        "shaping": shaping,
        "requests": request_summary(timeline),
        "engines": [engine_summary(timeline, verdict, e) for e in timeline.engines],
        "counters": timeline.counters,
        **verdict.to_dict(),
    }


def write_report(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def write_requests(path: Path, timeline: Timeline) -> None:
    with path.open("w") as f:
        for record in timeline.requests:
            f.write(json.dumps(asdict(record)) + "\n")


def render_summary(report: dict) -> Group:
    """The terminal summary: per engine, then the violations."""
    engines = Table(title="KV blocks per engine (idle windows: drained / leak)", title_justify="left")
    for col in ("engine", "peak", "end", "drained", "leak", "max drain", "steps", "wakes", "expired"):
        engines.add_column(col, justify="left" if col == "engine" else "right", no_wrap=True)
    for e in report["engines"]:
        drain = e["max_time_to_drain_s"]
        engines.add_row(e["engine"], f"{e['peak_used_blocks']}/{e['num_blocks']}",
                        str(e["final_used_blocks"]), str(e["num_drained"]),
                        Text(str(e["num_leaks"]), style="bold red" if e["num_leaks"] else "green"),
                        "-" if drain is None else f"{1000 * drain:.1f}ms",
                        str(e["num_steps"]), str(e["num_wakeups"]), str(e["num_expired"]))
    r = report["requests"]
    lines = [Text(f"requests {r['num_finished']}/{r['num_requests']} finished "
                  f"{r['finish_reasons']}; tokens in {r['num_prompt_tokens']}, out "
                  f"{r['num_output_tokens']}, prefix hits {r['num_prefix_hit_tokens']}; "
                  f"send lateness p50 {r['send_lateness_p50_ms']:.2f} ms, "
                  f"p99 {r['send_lateness_p99_ms']:.2f} ms")]
    for v in report["violations"][:MAX_VIOLATIONS_SHOWN]:
        lines.append(Text(f"  {v['kind']:<12} {v['engine']:<3} t={v['t']:9.3f}s  {v['detail']}",
                          style="red"))
    hidden = len(report["violations"]) - MAX_VIOLATIONS_SHOWN
    if hidden > 0:
        lines.append(Text(f"  ... and {hidden} more (see --report)", style="red"))
    verdict = (Text("VERIFIED: every engine drained in every idle window", style="bold green")
               if report["ok"] else
               Text(f"VIOLATIONS: {len(report['violations'])}", style="bold red"))
    return Group(engines, *lines, verdict)


def print_summary(console: Console, report: dict) -> None:
    console.print(render_summary(report))


def write_plot(path: Path, timeline: Timeline, verdict: Verdict) -> None:
    """Blocks used over time per engine, idle windows shaded (needs the plot extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvdrain[plot]'") from None
    fig, axes = plt.subplots(len(timeline.engines), 1, sharex=True, squeeze=False,
                             figsize=(10, 2.6 * len(timeline.engines)))
    for ax, engine in zip(axes[:, 0], timeline.engines):
        samples = timeline.samples_for(engine)
        ax.step([s.t for s in samples], [s.num_used_blocks for s in samples], where="post",
                label="used")
        ax.step([s.t for s in samples], [s.num_cached_blocks for s in samples], where="post",
                label="cached (free)", alpha=0.6)
        for w in (w for w in verdict.windows if w.engine == engine):
            ax.axvspan(w.start, w.end, color="red" if w.verdict == "leak" else "green", alpha=0.12)
        ax.set_ylabel(f"{engine} blocks")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("replay time (s); shaded: idle windows (green drained, red leak)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
