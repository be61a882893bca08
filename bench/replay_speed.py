"""Replay speed: public traces on the virtual clock, lateness on the wall. Runs in: a bench process.

Usage: .venv/bin/python bench/replay_speed.py [--traces DIR_OR_FILE] [--scale-tokens F] [--runs N]
1. The Mooncake and Azure traces on the virtual clock, per liveness policy; 2. the example on the
wall clock, with send lateness. Aims: the whole Mooncake trace at AIM_SPEEDUP x real time or more
per policy on two cores; 4p4d at least half 1p1d's requests per wall second. Columns:
bench/README.md. `--code <checkout>` runs another checkout's code under this script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# --code DIR: measure another checkout's code (say, a baseline) with this script.
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv[:-1] else ROOT
sys.path.insert(0, str(CODE))
sys.path.insert(0, str(ROOT / "bench"))

from common import OtherLoad  # noqa: E402  (bench/common.py)

# run_replay imports the simulator (and numpy, for prompt synthesis) on its first virtual
# run, inside its timed span: imported here, so the first row does not pay for it.
import replay.sim.simulation  # noqa: E402,F401
from engine.config import LIVENESS_POLICIES, EngineConfig  # noqa: E402
from engine.profiles import DEFAULT_VIRTUAL_DEPLOYMENT, DEPLOYMENT_PRESETS  # noqa: E402
from replay.pipeline import PreparedReplay, ReplayConfig, ReplayResult, run_replay, with_liveness  # noqa: E402
from replay.trace.reader import validate_trace  # noqa: E402
from replay.trace.shaping import ShapingOptions  # noqa: E402
from replay.verify.report import request_summary  # noqa: E402
from replay.verify.rules import VerifyOptions  # noqa: E402

MOONCAKE_NAME = "conversation_trace.jsonl"
AZURE_NAME = "AzureLLMInferenceTrace_code.csv"
DEFAULT_TRACES = Path(os.environ.get("KVDRAIN_TRACES", ROOT / "traces"))
EXAMPLE = ROOT / "examples" / "pd_idle.jsonl"
SCALE_TOKENS = 0.03125
SPEEDUPS = (10.0, 1.0)
XPYD = "4p4d"  # the many-engine row, beside 1p1d
WALL_RUNS = 2  # per speedup: lateness on two shared cores is noisy
AIM_SPEEDUP = 1000.0  # simulated seconds per wall second, every policy
# The CLI's sizes (kvdrain replay: 512 blocks of 16 tokens per engine), the mock runner
# (the virtual clock steps the mock runner whatever the config says).
BASE = EngineConfig(num_blocks=512, block_size=16, runner="mock")


def format_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of an aligned table: the first column left, the others right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def num_steps(result: ReplayResult) -> int:
    """Both engines' steps: timeline.counters, else each engine's last sample."""
    timeline, total = result.timeline, 0
    for engine in timeline.engines:
        counters = timeline.counters.get(engine, {})
        if "num_steps" in counters:
            total += counters["num_steps"]
        else:
            samples = timeline.samples_for(engine)
            total += samples[-1].num_steps if samples else 0
    return total


def num_leak_windows(result: ReplayResult) -> int:
    return sum(w.verdict == "leak" for w in result.verdict.windows)


def virtual_row(name: str, result: ReplayResult, cpu_s: float) -> list[str]:
    wall_s, sim_s, steps = result.wall_s, result.timeline.end_t, num_steps(result)
    num_requests = len(result.timeline.requests)
    return [
        name,
        f"{wall_s:.2f}",
        f"{cpu_s:.2f}",
        f"{sim_s:.1f}",
        f"{steps:,}",
        f"{num_requests / wall_s:,.0f}",
        f"{steps / wall_s:,.0f}",
        f"{steps / cpu_s:,.0f}",
        f"{sim_s / wall_s:,.0f}x",
        str(result.verdict.exit_code),
        f"{num_leak_windows(result)}/{len(result.verdict.windows)}",
    ]


def timed_replay(config: ReplayConfig, summary) -> tuple[ReplayResult, float]:
    """One run and this process's CPU seconds over it (as its wall_s: from the first
    record on; the trace's check, done once, is `summary`)."""
    cpu = time.process_time()
    result = PreparedReplay(config=config, summary=summary, engines=None).run()
    return result, time.process_time() - cpu


def find_traces(traces: Path) -> list[Path]:
    return [traces] if traces.is_file() else [traces / MOONCAKE_NAME, traces / AZURE_NAME]


def bench_virtual(trace: Path, scale_tokens: float, runs: int) -> None:
    """The whole trace, P/D, once per liveness policy, then event at the sizes `kvdrain replay
    --clock virtual` uses by default (its deployment preset) and event on 4p4d (round-robin); tokens
    scaled (the default turns 512-token hash blocks into 16 tokens). Wall s: read + shape +
    simulate + verify (validation runs once, up front, timed apart); CPU s: this process's
    over the same span (what a busy machine cannot inflate much)."""
    print(f"== 1. virtual clock: {trace}")
    if not trace.is_file():
        print(f"skipped: no trace at {trace} (pass --traces DIR_OR_FILE or set $KVDRAIN_TRACES)")
        return
    start = time.monotonic()
    summary = validate_trace(trace)
    print(
        f"{summary.num_requests:,} requests over {summary.duration:,.1f} s ({summary.format}); "
        f"validated in {time.monotonic() - start:.2f} s (once, not in the rows below)"
    )
    print(
        f"P/D, {BASE.num_blocks} blocks x {BASE.block_size} tokens per engine, "
        f"--scale-tokens {scale_tokens:g}; leak windows = engine x idle window"
    )
    config = ReplayConfig(
        trace=trace,
        clock="virtual",
        engine=BASE,
        shaping=ShapingOptions(scale_tokens=scale_tokens),
        verify=VerifyOptions(snapshot_tolerance_blocks=0),
    )
    profile = replace(
        config,
        engine=DEPLOYMENT_PRESETS[DEFAULT_VIRTUAL_DEPLOYMENT].apply(
            replace(BASE, liveness="event")
        ),
    )
    cases = [(p, with_liveness(config, p)) for p in LIVENESS_POLICIES]
    cases.append((f"event, --deployment {DEFAULT_VIRTUAL_DEPLOYMENT}", profile))
    cases.append(("event, 4p4d", replace(with_liveness(config, "event"), topology=XPYD)))
    results: dict[str, list[tuple[ReplayResult, float]]] = {name: [] for name, _ in cases}
    for _ in range(runs):  # interleaved, so a burst of load hits every case alike
        for name, case in cases:
            results[name].append(timed_replay(case, summary))
    header = [
        "case",
        "wall s",
        "cpu s",
        "sim s",
        "steps (P+D)",
        "req/wall s",
        "steps/wall s",
        "steps/cpu s",
        "speed-up",
        "exit",
        "leak windows",
    ]
    rows, slowest = [], float("inf")
    for name, runs_of in results.items():
        result, cpu_s = sorted(runs_of, key=lambda r: r[0].wall_s)[len(runs_of) // 2]
        rows.append(virtual_row(name, result, cpu_s))
        if "--deployment" not in name and XPYD not in name:
            slowest = min(slowest, result.timeline.end_t / result.wall_s)
    print("\n".join(format_table(header, rows)))
    if runs > 1:
        print(
            f"median of {runs} runs each; wall s of every run: "
            + "; ".join(
                f"{name} " + " ".join(f"{r.wall_s:.2f}" for r, _ in runs_of)
                for name, runs_of in results.items()
            )
        )
    rate = _rates(results)
    ratio = rate[f"event, {XPYD}"] / rate["event"]
    print(
        f"{XPYD} vs 1p1d (event): {rate[f'event, {XPYD}']:,.0f} vs {rate['event']:,.0f} "
        f"requests per wall s, {ratio:.2f}x (aim >= 0.5: {'met' if ratio >= 0.5 else 'MISSED'})"
    )
    if trace.name == MOONCAKE_NAME and scale_tokens == SCALE_TOKENS:  # the aim's own workload
        verdict = "met" if slowest >= AIM_SPEEDUP else "MISSED"
        print(
            f"aim: whole trace >= {AIM_SPEEDUP:,.0f}x real time per policy: {verdict} "
            f"(slowest {slowest:,.0f}x, median run)"
        )


def _rates(results: dict[str, list[tuple[ReplayResult, float]]]) -> dict[str, float]:
    """Requests per wall second of each case's median run."""
    out = {}
    for name, runs_of in results.items():
        result = sorted(runs_of, key=lambda r: r[0].wall_s)[len(runs_of) // 2][0]
        out[name] = len(result.timeline.requests) / result.wall_s
    return out


def wall_row(speedup: float, run: int, result: ReplayResult) -> list[str]:
    r = request_summary(result.timeline)
    return [
        f"{speedup:g}",
        str(run),
        f"{r['num_finished']}/{r['num_requests']}",
        f"{result.timeline.end_t:.2f}",
        f"{result.wall_s:.2f}",
        f"{r['send_lateness_p50_ms']:.3f}",
        f"{r['send_lateness_p99_ms']:.3f}",
        str(result.verdict.exit_code),
        f"{num_leak_windows(result)}/{len(result.verdict.windows)}",
    ]


def bench_wall() -> None:
    """examples/pd_idle.jsonl with real processes at each of SPEEDUPS, WALL_RUNS runs each:
    send lateness (send time minus the trace's; request_summary's p50, p99) and verdict."""
    print(f"== 2. wall clock: {EXAMPLE.relative_to(ROOT)}, P/D, mock runner, event policy")
    engine = replace(BASE, liveness="event")
    header = [
        "speedup",
        "run",
        "finished",
        "replay s",
        "wall s",
        "late p50 ms",
        "late p99 ms",
        "exit",
        "leak windows",
    ]
    rows = []
    for speedup in SPEEDUPS:
        config = ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=engine,
            shaping=ShapingOptions(speedup=speedup),
            verify=VerifyOptions(snapshot_tolerance_blocks=2),
        )
        rows += [wall_row(speedup, run, run_replay(config)) for run in range(1, WALL_RUNS + 1)]
    print("\n".join(format_table(header, rows)))
    print(
        "replay s: the timeline (trace / speedup + lead-in + tail); wall s adds engine "
        "start-up and shutdown. With 32 requests p99 is the latest send."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traces",
        type=Path,
        default=DEFAULT_TRACES,
        help=f"directory holding {MOONCAKE_NAME}, or the file itself",
    )
    parser.add_argument("--scale-tokens", type=float, default=SCALE_TOKENS)
    parser.add_argument("--runs", type=int, default=1, help="virtual-clock runs per case (median)")
    parser.add_argument("--no-wall", action="store_true", help="skip the wall-clock part")
    parser.add_argument(
        "--code", type=Path, default=ROOT, help="the checkout whose code runs (default: this one's)"
    )
    args = parser.parse_args()
    if args.code.resolve() != CODE:  # read from sys.argv before the imports: "--code DIR" only
        parser.error(f"--code: give it as two words (--code DIR); this run would measure {CODE}")
    load, start = OtherLoad(), time.monotonic()
    print(f"code: {CODE}")
    for trace in find_traces(args.traces):
        bench_virtual(trace, args.scale_tokens, max(1, args.runs))
        print()
    if not args.no_wall:
        bench_wall()
    print(f"\ntotal {time.monotonic() - start:.1f} s; {load.report()}")


if __name__ == "__main__":
    main()
