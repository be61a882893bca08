"""CLI: the parity harness on every supported vLLM version, one table at the end (`make parity-all`).

Runs in: any Python (it imports neither vLLM nor kvdrain); each version runs in its own
venv, from the repo root:

    python -m tests.parity.all --venv 0.32.0=.venv-parity-0.32.0 \
        --venv 0.34.0=.venv-parity-0.34.0 --seeds 10

Every other argument goes to tests.parity.run unchanged; --check-causes and
--check-releases are added, so each version also confirms that every known cause
still shows when switched off, and that kvdrain told the release before a cause
matches vLLM with that cause switched off.
Exit status: 0 when every version has no difference and shows every cause.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_version(version: str, venv: str, run_args: list[str]) -> tuple[dict | None, int]:
    """One version's results (None if it wrote none) and its exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        cmd = [
            os.path.join(venv, "bin", "python"),
            "-m",
            "tests.parity.run",
            *run_args,
            "--check-causes",
            "--check-releases",
            "--json",
            path,
        ]
        print(f"== vLLM {version}: {' '.join(cmd)}", flush=True)
        status = subprocess.call(cmd)
        if not os.path.exists(path):
            return None, status or 1
        with open(path) as f:
            return json.load(f), status


def format_table(reports: dict[str, dict | None]) -> str:
    lines = [
        f"{'vLLM':<8} {'scheduling':<10} {'workload':<20} {'seeds':>5} {'steps':>6} "
        f"{'differences':>11} {'held at end':>11}"
    ]
    for version, report in reports.items():
        if report is None:
            lines.append(f"{version:<8} (no results: the run failed)")
            continue
        for row in report["results"]:
            lines.append(
                f"{version:<8} {row['scheduling']:<10} {row['workload']:<20} "
                f"{row['seeds']:>5} {row['steps']:>6} {row['differences']:>11} "
                f"{row['held_at_end']:>11}"
            )
    lines.append("")
    lines.append(
        f"{'vLLM':<8} {'scheduling':<10} {'cause switched off on the vLLM side':<68} "
        f"{'runs differ':>11}"
    )
    for version, report in reports.items():
        for row in (report or {}).get("causes", ()):
            lines.append(
                f"{version:<8} {row['scheduling']:<10} {row['cause']:<68} "
                f"{row['differ']:>5} of {row['runs']:<3}"
            )
    lines.append("")
    lines.append(
        f"{'vLLM':<8} {'kvdrain':<8} {'vLLM with the cause switched off (sync)':<68} "
        f"{'runs differ':>11}"
    )
    for version, report in reports.items():
        for row in (report or {}).get("releases", ()):
            lines.append(
                f"{version:<8} {row['release']:<8} {row['cause']:<68} "
                f"{row['differ']:>5} of {row['runs']:<3}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.parity.all", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--venv",
        action="append",
        required=True,
        metavar="VERSION=PATH",
        help="a vLLM version and the venv it is installed in (repeat)",
    )
    args, run_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    venvs = dict(item.split("=", 1) for item in args.venv)
    start = time.monotonic()
    reports, statuses = {}, {}
    for version, venv in venvs.items():
        reports[version], statuses[version] = run_version(version, venv, run_args)
    elapsed = time.monotonic() - start
    print()
    print(format_table(reports))
    ok = all(status == 0 for status in statuses.values())
    print(
        f"\nparity-all: {'OK' if ok else 'FAILED'} ({', '.join(f'{v}: exit {s}' for v, s in statuses.items())}) "
        f"in {elapsed:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
