"""Instructions per scheduler step under callgrind. Runs in: a bench process.

scheduler_step.py's workload; counts do not change with the machine's load, so they compare
revisions on a busy machine. STEPS steps run inside itertools.starmap, so callgrind collects them
alone (their garbage collections included); the "model" is one C call. Per step = Collected / STEPS:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=starmap_next --callgrind-out-file=/dev/null \\
        .venv/bin/python bench/scheduler_ir.py [--nano-vllm DIR] RUNNING [--prefill] [--steps N]
"""

from __future__ import annotations

import argparse
from collections import deque
from itertools import repeat, starmap
from pathlib import Path

import scheduler_step as bench  # bench/ is on sys.path: this script's own folder

from engine.core.outputs import ModelRunnerOutput  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("running", type=int, help="running decodes")
    parser.add_argument("--prefill", action="store_true", help="with the 8k prefill")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--nano-vllm", type=Path, help="a nano-vllm checkout: step its scheduler instead"
    )
    args = parser.parse_args()
    kept: list = []  # the steps' outputs, released after them: their disposal is the consumer's
    if args.nano_vllm is not None:
        bench.NanoBench.nano = bench.load_nano_vllm(args.nano_vllm)
        sched = bench.NanoBench(args.running, args.prefill).sched

        def step() -> None:
            seqs, is_prefill = sched.schedule()
            sched.postprocess(seqs, [7] * len(seqs), is_prefill)
    else:
        sched = bench.KvdrainBench(args.running, args.prefill).sched

        def step() -> None:
            out = sched.schedule()
            sampled = dict.fromkeys(out.req_ids, 7)
            for req_id in out.partial_req_ids:
                del sampled[req_id]
            kept.append(sched.update_from_output(out, ModelRunnerOutput(sampled)))

    for _ in range(3):
        step()
    kept.clear()
    deque(starmap(step, repeat((), args.steps)), maxlen=0)


if __name__ == "__main__":
    main()
