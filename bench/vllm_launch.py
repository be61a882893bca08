"""Launch to ready of a real vLLM P/D pair beside its instances alone. Runs in: a script process.

`python bench/vllm_launch.py [--venv .venv-vllm] [--runs N]`: per run, P alone, D alone (each as
`replay --engine vllm` launches it: command line, cores, environment), then the pair, each until
healthy. Prints each launch to ready, the pair's (its slower instance's) over the slower instance
alone (AIM), and the load average at each launch (others' CPU use lengthens a start-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay.vllm.launch import VllmDeployment, check_venv  # noqa: E402
from replay.vllm.options import VllmOptions  # noqa: E402

AIM = 1.2


def launch(install, run_dir: Path, names: tuple[str, ...] | None) -> dict[str, float]:
    """Each started instance's launch to ready (s)."""
    deployment = VllmDeployment(VllmOptions(venv=install.venv, topology="pd"), install, run_dir)
    load = os.getloadavg()[0]
    try:
        deployment.start(names)
        deployment.wait_ready()
    finally:
        deployment.close()
    ready = {s.name: s.ready_s for s in deployment.statuses()}
    print(
        f"  {'+'.join(ready)}: "
        + ", ".join(f"{n} {t:.1f} s" for n, t in ready.items())
        + f" (load average {load:.1f} at launch)",
        flush=True,
    )
    return ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    install = check_venv(args.venv)
    out = Path(tempfile.mkdtemp(prefix="kvdrain-vllm-launch-"))
    alone: dict[str, list[float]] = {"P": [], "D": []}
    pair: dict[str, list[float]] = {"P": [], "D": []}
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs} (vLLM {install.version}; logs in {out})", flush=True)
        for name in ("P", "D"):
            alone[name].append(launch(install, out / f"{run}-{name}", (name,))[name])
        for name, t in launch(install, out / f"{run}-pd", None).items():
            pair[name].append(t)
    median = {
        k: {n: statistics.median(v) for n, v in d.items()}
        for k, d in (("alone", alone), ("pair", pair))
    }
    print(f"\n{'instance':<9} {'alone s':>8} {'in P/D s':>9}")
    for name in ("P", "D"):
        print(f"{name:<9} {median['alone'][name]:>8.1f} {median['pair'][name]:>9.1f}")
    slower_alone = max(median["alone"].values())
    pair_ready = statistics.median(max(p, d) for p, d in zip(pair["P"], pair["D"]))
    ratio = pair_ready / slower_alone
    print(
        f"P/D launch to ready {pair_ready:.1f} s = {ratio:.2f}x the slower instance alone "
        f"({slower_alone:.1f} s); aim <= {AIM}x: {'met' if ratio <= AIM else 'NOT met'}"
        f" (medians of {args.runs} runs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
