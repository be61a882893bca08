"""Instructions per scheduler step, for callgrind: the workload of bench/scheduler_step.py.

Runs STEPS steps inside itertools.starmap, so that callgrind collects the steps alone
(their garbage collections included; set-up, import and exit left out); the returned
outputs are kept and released after the steps (their disposal is the consumer's, as in
scheduler_step.py). The "model" is one C call: a token 7 per sampled request for
kvdrain, `[7] * n` for nano-vllm. Instruction counts do not change with the machine's
load, so they compare revisions on a busy machine. Per step = Collected / STEPS:

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
    kept: list = []
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
