"""Start-up: from `kvdrain replay`'s launch to its first request. Runs in: a bench process.

Usage: .venv/bin/python bench/startup.py [--runs N] [--importtime] [--baseline DIR]
Each run launches the real CLI in a fresh interpreter (P/D, wall clock, examples/pd_idle.jsonl at
--speedup 100), mock and torch runner alternating, under PROBE, which notes when each phase ended.
Prints the medians beside AIMS_S and which child processes mapped torch; --baseline DIR runs
another checkout in the same sitting, interleaved (a phase it lacks shows as -).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import OtherLoad  # noqa: E402

EXAMPLE = ROOT / "examples" / "pd_idle.jsonl"
AIMS_S = {"mock": 1.0, "torch": 2.5}  # the first request at most this long after launch
PHASES = (
    "cli imported",
    "trace validated",
    "engines launched",
    "windows forecast",
    "engines ready",
    "first request",
    "cpu s before it",
)
# Runs the CLI with hooks that only note times: the same code paths, one extra import order.
# It hooks only modules the CLI imports before the engines start, so it moves no import ahead
# of their launch; time.monotonic() is one clock for every process on a host. At the first
# request it also sums every process's CPU time so far (/proc/<pid>/task/*/schedstat), which a
# busy machine disturbs less than the wall-clock times.
PROBE = r"""
import json, os, sys, time
marks = {}
out = sys.argv[1]
def note(name):
    marks.setdefault(name, time.monotonic())
    with open(out, "w") as f:
        json.dump(marks, f)
# As when launched by the `kvdrain` script: spawned children re-run it (multiprocessing
# imports the parent's main file in each child), so their start-up includes that too.
sys.modules["__main__"].__file__ = sys.argv[2]
import cli
note("cli imported")
import replay.pipeline as pipeline
import replay.deploy.topology as topology
import replay.deploy.pd_router as router
def wrap(owner, attr, name):
    inner = getattr(owner, attr)
    def hooked(*a, **k):
        result = inner(*a, **k)
        note(name)
        return result
    setattr(owner, attr, hooked)
wrap(pipeline,
     "validate_replay_trace" if hasattr(pipeline, "validate_replay_trace") else "validate_trace",
     "trace validated")
if hasattr(pipeline, "launch_engines"):  # a checkout that starts the engines early
    wrap(pipeline, "launch_engines", "engines launched")
    wrap(topology.TopologyLaunch, "wait_ready", "engines ready")
else:
    wrap(topology, "start_topology", "engines ready")
wrap(pipeline, "forecast_timeline" if hasattr(pipeline, "forecast_timeline") else "model_timeline",
     "windows forecast")
def tree(pid):
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        for task in os.listdir(f"/proc/{found[-1]}/task"):
            with open(f"/proc/{found[-1]}/task/{task}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return found
def cpu_s(pid):
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9
add = router.PDRouter.add_request  # what the wall driver's first send calls
def first_add(self, *a, **k):
    add(self, *a, **k)
    if "first request" not in marks:
        note("first request")  # the time first; then the CPU, written by a second note
        marks["cpu s before it"] = sum(cpu_s(pid) for pid in tree(os.getpid()))
        note("first request")
        with open(out + ".pids", "w") as f:
            f.write(" ".join(str(c.pid) for c in __import__("multiprocessing").active_children()))
router.PDRouter.add_request = first_add
sys.argv = ["kvdrain", *sys.argv[3:]]
cli.cli()
"""


def replay_args(runner: str) -> list[str]:
    return [
        "replay",
        str(EXAMPLE),
        "--clock",
        "wall",
        "--topology",
        "pd",
        "--runner",
        runner,
        "--device",
        "cpu",
        "--no-live",
        "--speedup",
        "100",
        "--liveness",
        "event",
    ]


def one_run(runner: str, root: Path = ROOT) -> tuple[dict[str, float], list[str]]:
    """Phase ends in seconds after launch (and the CPU seconds used before the first
    request), and the spawned processes that mapped torch; root: the checkout to run."""
    with tempfile.TemporaryDirectory() as tmp:
        marks_path = os.path.join(tmp, "marks.json")
        launch = time.monotonic()
        script = str(Path(sys.executable).parent / "kvdrain")
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, marks_path, script, *replay_args(runner)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        with_torch = _torch_children(proc, marks_path + ".pids")
        output = proc.communicate(timeout=300)[0].decode(errors="replace")
        marks = json.loads(Path(marks_path).read_text()) if os.path.exists(marks_path) else {}
        if proc.returncode in (1, 3, 4) and "first request" in marks:  # a verdict after start-up
            why = [
                line
                for line in output.splitlines()
                if line.startswith(("fault:", "FAULT", "VIOLATION", "INCONCLUSIVE"))
            ]
            print(
                f"note: {runner} in {root} exited {proc.returncode} after its start-up: "
                f"{' '.join(why)}",
                flush=True,
            )
        elif proc.returncode != 0:
            raise RuntimeError(
                f"kvdrain replay --runner {runner} in {root} exited {proc.returncode}:\n{output}"
            )
    return {
        name: t if name == "cpu s before it" else t - launch for name, t in marks.items()
    }, with_torch


def _torch_children(proc: subprocess.Popen, pids_path: str) -> list[str]:
    """Names of the replay's child processes (engine cores, connector workers) with torch
    loaded (from /proc/<pid>/maps while the replay runs)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(pids_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not os.path.exists(pids_path):
        return []
    cores = [int(p) for p in Path(pids_path).read_text().split()]
    workers = [c for p in cores for c in _children(p)]  # connector workers: the cores' children
    return [f"engine core {p}" for p in cores if _maps_torch(p)] + [
        f"connector worker {p}" for p in workers if _maps_torch(p)
    ]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


CHILD_IMPORTS = {
    "engine core": "import engine.core_proc, connector.factory, connector.agent, connector.pd",
    "connector worker": "import connector.worker_proc",
}


def importtime(runner: str, what: str) -> list[str]:
    """The 15 slowest cumulative imports of what a child imports (-X importtime)."""
    code = CHILD_IMPORTS[what] + (
        "; import engine.model_runner" if runner == "torch" and what == "engine core" else ""
    )
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    return [f"  {us / 1000:8.1f} ms {name}" for us, name in rows[:15]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--importtime", action="store_true")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout to run beside this one, interleaved",
    )
    args = parser.parse_args()
    load = OtherLoad()
    roots = {"": ROOT} if args.baseline is None else {"": ROOT, " base": args.baseline.resolve()}
    columns = [(runner, label) for runner in AIMS_S for label in roots]
    results: dict[tuple[str, str], list[dict[str, float]]] = {c: [] for c in columns}
    torch_in: dict[tuple[str, str], list[str]] = {}
    for _ in range(args.runs):
        for runner, label in columns:
            marks, torch_in[runner, label] = one_run(runner, roots[label])
            results[runner, label].append(marks)
    print(
        "seconds after launch at the end of each phase (median of "
        f"{args.runs} run{'s' if args.runs != 1 else ''}, P/D topology, examples/pd_idle.jsonl)"
        + (f"; base: {args.baseline}" if args.baseline else "")
    )
    print(f"{'phase':<18}" + "".join(f"{r + label:>12}" for r, label in columns))
    for phase in PHASES:
        cells = [
            statistics.median(m[phase] for m in runs) if all(phase in m for m in runs) else None
            for runs in results.values()
        ]
        print(
            f"{phase:<18}"
            + "".join(f"{c:>12.2f}" if c is not None else f"{'-':>12}" for c in cells)
        )
    for (runner, label), runs in results.items():
        first = statistics.median(m["first request"] for m in runs)
        print(
            f"{runner}{label}: first request {first:.2f} s after launch; aim <= {AIMS_S[runner]} s "
            f"({first / AIMS_S[runner]:.2f}x the aim); torch loaded in: "
            f"{', '.join(torch_in[runner, label]) or 'no child process'}"
        )
    if args.importtime:
        for runner in AIMS_S:
            for what in CHILD_IMPORTS:
                print(f"slowest imports of the {what} child ({runner} runner):")
                print("\n".join(importtime(runner, what)))
    print(load.report())


if __name__ == "__main__":
    main()
