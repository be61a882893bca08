"""CLI: drive vLLM's Scheduler and kvdrain's side by side and report the first difference.

Runs in: a parity venv (`make parity VLLM=0.32.0`), from the repo root:

    PYTHONHASHSEED=0 .venv-parity-0.32.0/bin/python -m tests.parity.run --seeds 10 --workload all

Each tick applies the workload's arrivals, aborts and refusals (D refuses a request
before admission) to both sides, steps each (a side whose engine has no work does not
step, as its engine loop would block), and compares the two snapshots; with
--scheduling both (the default) every workload runs with the synchronous scheduler and
again with async scheduling. kvdrain follows the release it is compared against. A
run that agrees to its end also reports the requests still held then (finished,
blocks not freed: the pre-#43433 leak under legacy). Exit status: 0 no difference, 1
a difference, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

from tests.parity.fakes import FakeKVWorker, FakeModel
from tests.parity.kvdrain_side import Coverage, KvdrainSide
from tests.parity.spec import Abort, Arrival, Reject, Snapshot, Workload
from tests.parity.switches import CAUSES, VllmSwitches
from tests.parity.vllm_side import VllmSide
from tests.parity.workloads import WORKLOADS


@dataclass(slots=True)
class Result:
    """One workload in one scheduling mode over its seeds (a row of `make parity-all`)."""

    workload: str
    scheduling: str  # "sync" | "async"
    seeds: int
    steps: int
    differences: int
    held_at_end: int  # requests still held after the last tick, over the seeds that agreed
    coverage: dict[str, int]  # the in-flight cases reached (kvdrain_side.Coverage)


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
    aborts = workload.aborts_in_last_prefill
    vllm = VllmSide(workload.config, FakeModel(workload), FakeKVWorker(workload), switches, aborts)
    kvdrain = KvdrainSide(workload.config, FakeModel(workload), FakeKVWorker(workload), aborts)
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
            elif isinstance(event, Reject):
                side.reject(event.spec)


def run_one(
    workload: Workload, switches: VllmSwitches, ignore: frozenset[str] = frozenset()
) -> tuple[int, Divergence | None, Snapshot | None, dict]:
    """Ticks run, the first divergence (None if the sides agreed throughout), the last
    snapshot (None after a divergence) and the in-flight cases reached."""
    vllm, kvdrain = make_sides(workload, switches)
    theirs = None
    for tick in range(workload.num_ticks):
        apply_events((vllm, kvdrain), workload.events, tick)
        ours, theirs = kvdrain.step(tick), vllm.step(tick)
        fields = [f for f in theirs.diff(ours) if f not in ignore]
        if fields:
            divergence = Divergence(workload.name, workload.seed, tick, fields, theirs, ours)
            return tick + 1, divergence, None, kvdrain.coverage.counts
    return workload.num_ticks, None, theirs, kvdrain.coverage.counts


def format_divergence(d: Divergence) -> str:
    lines = [
        f"FIRST DIFFERENCE: workload {d.workload} seed {d.seed} tick {d.tick}: "
        f"{', '.join(d.fields)}",
        f"  {'field':<24} {'vllm ' + vllm_version():<48} kvdrain",
    ]
    for name in Snapshot.__slots__:
        mark = "*" if name in d.fields else " "
        theirs, ours = _short(getattr(d.vllm, name)), _short(getattr(d.kvdrain, name))
        lines.append(f"{mark} {name:<24} {theirs:<48} {ours}")
    return "\n".join(lines)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def run_workload(
    name: str,
    scheduling: str,
    seeds: range,
    args: argparse.Namespace,
    switches: VllmSwitches,
    quiet: bool = False,
) -> Result:
    """Runs every seed; prints the summary line and the first divergence."""
    num_ticks, held, divergences = 0, 0, []
    coverage = dict.fromkeys(Coverage.NAMES, 0)
    for seed in seeds:
        workload = WORKLOADS[name](seed)
        config = replace(
            workload.config,
            async_scheduling=scheduling == "async",
            vllm_release=args.kvdrain_release or vllm_version(),
        )
        workload = replace(workload, config=config)
        if args.steps is not None:
            workload = replace(workload, num_ticks=args.steps)
        ran, divergence, last, reached = run_one(workload, switches, frozenset(args.ignore))
        num_ticks += ran
        for case, count in reached.items():
            coverage[case] += count
        if divergence is not None:
            divergences.append(divergence)
        else:
            held += last.held
    result = Result(name, scheduling, len(seeds), num_ticks, len(divergences), held, coverage)
    if quiet:
        return result
    print(
        f"workload {name} ({scheduling}): {len(seeds)} seeds, {num_ticks} steps, "
        f"{len(divergences)} differences, {held} held at the end; reached: "
        + ", ".join(f"{n} {k}" for k, n in coverage.items()),
        flush=True,
    )
    if divergences:
        print(
            "  seeds that differ (seed@tick): "
            + " ".join(f"{d.seed}@{d.tick}" for d in divergences)
        )
        for d in divergences if args.show_all else divergences[:1]:
            print(format_divergence(d))
    return result


def check_causes(args: argparse.Namespace) -> list[dict]:
    """Each known cause, switched off on the vLLM side, must make some seed differ."""
    rows = []
    for cause in CAUSES:
        for mode in cause.modes:
            found = sum(
                run_workload(
                    name, mode, range(args.cause_seeds), args, cause.switches, quiet=True
                ).differences
                for name in cause.workloads
            )
            runs = args.cause_seeds * len(cause.workloads)
            rows.append({"cause": cause.name, "scheduling": mode, "runs": runs, "differ": found})
            print(
                f"cause switched off: {cause.name} ({mode}): {found} of {runs} runs differ"
                + ("" if found else "  <- NOT SHOWN"),
                flush=True,
            )
    return rows


def check_releases(args: argparse.Namespace) -> list[dict]:
    """Each cause with a release before it: kvdrain told that release, against vLLM with
    the cause switched off (standing in for that release), must not differ. Sync only:
    under async scheduling the older release also caches blocks later than 0.33+."""
    rows = []
    for cause in (c for c in CAUSES if c.before is not None):
        older = argparse.Namespace(**{**vars(args), "kvdrain_release": cause.before})
        found = sum(
            run_workload(
                name, "sync", range(args.seeds), older, cause.switches, quiet=True
            ).differences
            for name in cause.workloads
        )
        runs = args.seeds * len(cause.workloads)
        rows.append({"release": cause.before, "cause": cause.name, "runs": runs, "differ": found})
        print(
            f"kvdrain told {cause.before}, vLLM without '{cause.name}' (sync): "
            f"{found} of {runs} runs differ" + ("  <- DIFFERENT" if found else ""),
            flush=True,
        )
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.parity.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 per workload")
    parser.add_argument("--workload", default="all", choices=["all", *WORKLOADS])
    parser.add_argument(
        "--steps", type=int, default=None, help="ticks per run (default: per workload)"
    )
    parser.add_argument(
        "--scheduling",
        default="both",
        choices=["both", "sync", "async"],
        help="sync: vLLM's Scheduler; async: its AsyncScheduler and batch queue",
    )
    parser.add_argument(
        "--json",
        default=None,
        help="also write the results (one row per workload and mode) to this file",
    )
    parser.add_argument(
        "--no-reserve-full-isl",
        action="store_true",
        help="vLLM side only: scheduler_reserve_full_isl=False (shows cause 1)",
    )
    parser.add_argument(
        "--vllm-load-failure-policy",
        default=None,
        choices=["fail", "recompute"],
        help="vLLM side only: kv_load_failure_policy (default: the workload's, "
        "which both sides use)",
    )
    parser.add_argument(
        "--append-all-frees",
        action="store_true",
        help="vLLM side: freed blocks all join the free queue's tail (shows cause 2)",
    )
    parser.add_argument(
        "--one-block-per-hash",
        action="store_true",
        help="vLLM side: never cache a second block under a cached hash (shows cause 3)",
    )
    parser.add_argument(
        "--length-before-stop",
        action="store_true",
        help="vLLM side: check_stop tests length before EOS/stop ids (shows cause 7)",
    )
    parser.add_argument(
        "--no-defer-block-free",
        action="store_true",
        help="vLLM side, async: a consumer frees at once (shows defer_block_free)",
    )
    parser.add_argument(
        "--deliver-stale-on-producer",
        action="store_true",
        help="vLLM side, async: a producer delivers stale output (shows requires_kv_delivery)",
    )
    parser.add_argument(
        "--abort-after-output",
        action="store_true",
        help="vLLM side: an abort during a step is taken after its output (before #29987)",
    )
    parser.add_argument(
        "--no-rejection-notice",
        action="store_true",
        help="vLLM side: D's refusal before admission never reaches its engine (before #41269)",
    )
    parser.add_argument(
        "--kvdrain-release",
        default=None,
        help="kvdrain follows this vLLM release (default: the installed vLLM's), to see "
        "which of engine/core/release.py's facts the workloads can tell apart",
    )
    parser.add_argument(
        "--check-causes",
        action="store_true",
        help="then turn each known cause off on the vLLM side (switches.CAUSES), "
        "one at a time, and confirm the harness finds differences",
    )
    parser.add_argument(
        "--check-releases",
        action="store_true",
        help="then run kvdrain told the release before each cause that has one "
        "(switches.CAUSES) against vLLM with that cause switched off: no difference",
    )
    parser.add_argument("--cause-seeds", type=int, default=3, help="seeds per cause and workload")
    parser.add_argument("--no-parity", action="store_true", help="skip the parity runs")
    parser.add_argument(
        "--ignore",
        nargs="*",
        default=[],
        choices=Snapshot.__slots__,
        help="snapshot fields not to compare (say, block_tables)",
    )
    parser.add_argument(
        "--show-all", action="store_true", help="print every seed's first difference"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        print(
            "warning: PYTHONHASHSEED is not 0; vLLM's set iteration order may vary", file=sys.stderr
        )
    switches = VllmSwitches(
        reserve_full_isl=not args.no_reserve_full_isl,
        kv_load_failure_policy=args.vllm_load_failure_policy,
        append_all_frees=args.append_all_frees,
        one_block_per_hash=args.one_block_per_hash,
        length_before_stop=args.length_before_stop,
        no_defer_block_free=args.no_defer_block_free,
        deliver_stale_on_producer=args.deliver_stale_on_producer,
        abort_after_output=args.abort_after_output,
        no_rejection_notice=args.no_rejection_notice,
    )

    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    modes = ["sync", "async"] if args.scheduling == "both" else [args.scheduling]
    start = time.monotonic()
    results = (
        []
        if args.no_parity
        else [
            run_workload(name, mode, range(args.seeds), args, switches)
            for mode in modes
            for name in names
        ]
    )
    elapsed = time.monotonic() - start
    total = sum(r.differences for r in results)
    print(f"total: {total} differences in {elapsed:.1f} s (vLLM {vllm_version()})")
    causes = check_causes(args) if args.check_causes else []
    missed = sum(row["differ"] == 0 for row in causes)
    if causes:
        print(f"causes: {missed} of {len(causes)} not shown (vLLM {vllm_version()})")
    releases = check_releases(args) if args.check_releases else []
    total += sum(row["differ"] for row in releases)
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "vllm": vllm_version(),
                    "seconds": round(elapsed, 1),
                    "results": [asdict(r) for r in results],
                    "causes": causes,
                    "releases": releases,
                },
                f,
            )
    return 1 if total or missed else 0


if __name__ == "__main__":
    sys.exit(main())
