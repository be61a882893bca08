"""Start-up: from launching `kvdrain replay` to its first request, mock vs torch runner. Runs in: a bench process.

Usage: .venv/bin/python bench/startup.py [--runs N] [--importtime]
Each run launches the real CLI in a fresh interpreter (`kvdrain replay
examples/pd_idle.jsonl --clock wall --topology pd --no-live`, --speedup 100 so the
run is short), once with --runner mock and once with --runner torch (--device cpu),
alternating. A probe wrapped around the CLI (PROBE below; it changes nothing the CLI
does) writes the monotonic time at which each phase ended: the CLI imported, the trace
validated, the engines launched (spawned; they start while the frontend goes on), the
idle-window model simulated, every engine Ready, the first request sent
(time.monotonic() is one clock for every process on a host). It hooks only modules the
CLI imports before the engines start, so it moves no import ahead of their launch. The bench prints each
phase's end after launch (medians over the runs), beside the aims of issue 14 (first
request within 1 s with the mock runner, 2.5 s with torch), and which of the spawned
processes imported torch (from /proc/<pid>/maps while the replay runs).
--importtime also prints the 15 slowest imports of an engine-core child and a
connector-worker child for each runner (python -X importtime of the child's imports).
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
AIMS_S = {"mock": 1.0, "torch": 2.5}
PHASES = ("cli imported", "trace validated", "engines launched", "windows modelled", "engines ready",
          "first request")
# Runs the CLI with hooks that only note times: the same code paths, one extra import order.
PROBE = r"""
import json, sys, time
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
import replay.pipeline as pipeline, connector.topology as topology, connector.router as router
def wrap(owner, attr, name):
    inner = getattr(owner, attr)
    def hooked(*a, **k):
        result = inner(*a, **k)
        note(name)
        return result
    setattr(owner, attr, hooked)
wrap(pipeline, "validate_replay_trace", "trace validated")
wrap(pipeline, "launch_engines", "engines launched")
wrap(pipeline, "model_timeline", "windows modelled")
wrap(topology.TopologyLaunch, "wait_ready", "engines ready")
add = router.PDRouter.add_request  # what the wall driver's first send calls
def first_add(self, *a, **k):
    add(self, *a, **k)
    if "first request" not in marks:
        note("first request")
        with open(out + ".pids", "w") as f:
            f.write(" ".join(str(c.pid) for c in __import__("multiprocessing").active_children()))
router.PDRouter.add_request = first_add
sys.argv = ["kvdrain", *sys.argv[3:]]
cli.cli()
"""


def replay_args(runner: str) -> list[str]:
    return ["replay", str(EXAMPLE), "--clock", "wall", "--topology", "pd", "--runner", runner,
            "--device", "cpu", "--no-live", "--speedup", "100", "--liveness", "event"]


def one_run(runner: str) -> tuple[dict[str, float], list[str]]:
    """Phase ends in seconds after launch, and the spawned processes that mapped torch."""
    with tempfile.TemporaryDirectory() as tmp:
        marks_path = os.path.join(tmp, "marks.json")
        launch = time.monotonic()
        script = str(Path(sys.executable).parent / "kvdrain")
        proc = subprocess.Popen([sys.executable, "-c", PROBE, marks_path, script, *replay_args(runner)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        with_torch = _torch_children(proc, marks_path + ".pids")
        output = proc.communicate(timeout=300)[0].decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"kvdrain replay --runner {runner} exited {proc.returncode}:\n{output}")
        marks = json.loads(Path(marks_path).read_text())
    return {name: t - launch for name, t in marks.items()}, with_torch


def _torch_children(proc: subprocess.Popen, pids_path: str) -> list[str]:
    """Names of the replay's child processes (engine cores, connector workers) with torch loaded."""
    deadline = time.monotonic() + 120
    while not os.path.exists(pids_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not os.path.exists(pids_path):
        return []
    cores = [int(p) for p in Path(pids_path).read_text().split()]
    workers = [c for p in cores for c in _children(p)]  # connector workers: the cores' children
    return ([f"engine core {p}" for p in cores if _maps_torch(p)]
            + [f"connector worker {p}" for p in workers if _maps_torch(p)])


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
    code = CHILD_IMPORTS[what] + ("; import engine.model_runner" if runner == "torch" and what == "engine core" else "")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, check=True)
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
    args = parser.parse_args()
    load = OtherLoad()
    results: dict[str, list[dict[str, float]]] = {"mock": [], "torch": []}
    torch_in: dict[str, list[str]] = {}
    for _ in range(args.runs):
        for runner in results:
            marks, torch_in[runner] = one_run(runner)
            results[runner].append(marks)
    print("seconds after launch at the end of each phase (median of "
          f"{args.runs} run{'s' if args.runs != 1 else ''}, P/D topology, examples/pd_idle.jsonl)")
    print(f"{'phase':<18}" + "".join(f"{r:>10}" for r in results))
    for phase in PHASES:
        cells = [statistics.median(m[phase] for m in runs) if all(phase in m for m in runs) else None
                 for runs in results.values()]
        print(f"{phase:<18}" + "".join(f"{c:>10.2f}" if c is not None else f"{'-':>10}" for c in cells))
    for runner, runs in results.items():
        first = statistics.median(m["first request"] for m in runs)
        print(f"{runner}: first request {first:.2f} s after launch; aim <= {AIMS_S[runner]} s "
              f"({first / AIMS_S[runner]:.2f}x the aim); torch loaded in: "
              f"{', '.join(torch_in[runner]) or 'no child process'}")
    if args.importtime:
        for runner in results:
            for what in CHILD_IMPORTS:
                print(f"slowest imports of the {what} child ({runner} runner):")
                print("\n".join(importtime(runner, what)))
    print(load.report())


if __name__ == "__main__":
    main()
