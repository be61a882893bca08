"""CLI: drive vLLM 0.32's Scheduler and kvdrain's side by side and report the first difference.

Runs in: the parity venv (`make parity`), from the repo root:

    PYTHONHASHSEED=0 .venv-parity/bin/python -m tests.parity.run --seeds 10 --workload all

Each tick applies the workload's arrivals and aborts to both sides, steps each (a side
whose has_requests() is false does not step, as its engine loop would block), and
compares the two snapshots. Exit status: 0 no difference, 1 a difference, 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

from tests.parity.fakes import FakeKVWorker, FakeModel
from tests.parity.kvdrain_side import KvdrainSide
from tests.parity.spec import Abort, Arrival, Snapshot, Workload
from tests.parity.switches import VllmSwitches
from tests.parity.vllm_side import VllmSide
from tests.parity.workloads import WORKLOADS


@dataclass(slots=True)
class Divergence:
    workload: str
    seed: int
    tick: int
    fields: list[str]
    vllm: Snapshot
    kvdrain: Snapshot


def make_sides(workload: Workload, switches: VllmSwitches) -> tuple[VllmSide, KvdrainSide]:
    """Each side gets its own fake model and worker: same seed, same answers."""
    vllm = VllmSide(workload.config, FakeModel(workload), FakeKVWorker(workload), switches)
    kvdrain = KvdrainSide(workload.config, FakeModel(workload), FakeKVWorker(workload))
    return vllm, kvdrain


def apply_events(sides: tuple, events: list, tick: int) -> None:
    for event in events:
        if event.tick != tick:
            continue
        for side in sides:
            if isinstance(event, Arrival):
                side.add(event.spec)
            elif isinstance(event, Abort):
                side.abort(event.req_id)


def run_one(workload: Workload, switches: VllmSwitches,
            ignore: frozenset[str] = frozenset()) -> tuple[int, Divergence | None]:
    """Ticks run and the first divergence (None if the sides agreed throughout)."""
    vllm, kvdrain = make_sides(workload, switches)
    for tick in range(workload.num_ticks):
        apply_events((vllm, kvdrain), workload.events, tick)
        ours, theirs = kvdrain.step(tick), vllm.step(tick)
        fields = [f for f in theirs.diff(ours) if f not in ignore]
        if fields:
            return tick + 1, Divergence(workload.name, workload.seed, tick, fields, theirs, ours)
    return workload.num_ticks, None


def format_divergence(d: Divergence) -> str:
    lines = [f"FIRST DIFFERENCE: workload {d.workload} seed {d.seed} tick {d.tick}: "
             f"{', '.join(d.fields)}",
             f"  {'field':<24} {'vllm 0.32.0':<48} kvdrain"]
    for name in Snapshot.__slots__:
        mark = "*" if name in d.fields else " "
        theirs, ours = _short(getattr(d.vllm, name)), _short(getattr(d.kvdrain, name))
        lines.append(f"{mark} {name:<24} {theirs:<48} {ours}")
    return "\n".join(lines)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def run_workload(name: str, seeds: range, args: argparse.Namespace, switches: VllmSwitches) -> int:
    """Runs every seed; prints the summary line and the first divergence. Returns #differences."""
    num_ticks, divergences = 0, []
    for seed in seeds:
        workload = WORKLOADS[name](seed)
        if args.steps is not None:
            workload = replace(workload, num_ticks=args.steps)
        ran, divergence = run_one(workload, switches, frozenset(args.ignore))
        num_ticks += ran
        if divergence is not None:
            divergences.append(divergence)
    print(f"workload {name}: {len(seeds)} seeds, {num_ticks} steps, {len(divergences)} differences")
    if divergences:
        print("  seeds that differ (seed@tick): "
              + " ".join(f"{d.seed}@{d.tick}" for d in divergences))
        for d in divergences if args.show_all else divergences[:1]:
            print(format_divergence(d))
    return len(divergences)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.parity.run", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 per workload")
    parser.add_argument("--workload", default="all", choices=["all", *WORKLOADS])
    parser.add_argument("--steps", type=int, default=None, help="ticks per run (default: per workload)")
    parser.add_argument("--no-reserve-full-isl", action="store_true",
                        help="vLLM side only: scheduler_reserve_full_isl=False (shows cause 1)")
    parser.add_argument("--vllm-load-failure-policy", default=None, choices=["fail", "recompute"],
                        help="vLLM side only: kv_load_failure_policy (default: the workload's, "
                             "which both sides use)")
    parser.add_argument("--append-all-frees", action="store_true",
                        help="vLLM side: freed blocks all join the free queue's tail (shows cause 2)")
    parser.add_argument("--one-block-per-hash", action="store_true",
                        help="vLLM side: never cache a second block under a cached hash (shows cause 3)")
    parser.add_argument("--length-before-stop", action="store_true",
                        help="vLLM side: check_stop tests length before EOS/stop ids (shows cause 7)")
    parser.add_argument("--ignore", nargs="*", default=[], choices=Snapshot.__slots__,
                        help="snapshot fields not to compare (say, block_tables)")
    parser.add_argument("--show-all", action="store_true", help="print every seed's first difference")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("warning: PYTHONHASHSEED is not 0; vLLM's set iteration order may vary", file=sys.stderr)
    switches = VllmSwitches(reserve_full_isl=not args.no_reserve_full_isl,
                            kv_load_failure_policy=args.vllm_load_failure_policy,
                            append_all_frees=args.append_all_frees,
                            one_block_per_hash=args.one_block_per_hash,
                            length_before_stop=args.length_before_stop)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    start = time.monotonic()
    total = sum(run_workload(name, range(args.seeds), args, switches) for name in names)
    print(f"total: {total} differences in {time.monotonic() - start:.1f} s")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
