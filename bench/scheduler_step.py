"""Cost of one schedule() + update_from_output() with the mock runner.

Prints microseconds per step and scheduled requests per second at 1, 64 and 256
running decode requests, with and without an 8k-token prefill in the mix (chunked
by the 2k token budget). Aim: under 1 ms per step at 256 running requests.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.mock_runner import MockModelRunner  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 16


def make_scheduler(num_running: int, with_prefill: bool) -> tuple[Scheduler, MockModelRunner]:
    config = EngineConfig(num_blocks=40_000, block_size=BLOCK_SIZE, max_num_seqs=512,
                          max_num_batched_tokens=2048, max_model_len=32_768)
    sched = Scheduler(config)
    for i in range(num_running):
        prompt = [(i * 7 + j) % 500 for j in range(128)]
        sched.add_request(Request(f"d{i}", prompt, 100_000, BLOCK_SIZE))
    runner = MockModelRunner(config)
    while sched.waiting:  # prefill everyone, so the measured steps are decodes
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    if with_prefill:
        sched.add_request(Request("prefill", [j % 500 for j in range(8192)], 1, BLOCK_SIZE))
    return sched, runner


def time_steps(num_running: int, with_prefill: bool, num_steps: int = 200) -> tuple[float, float]:
    sched, runner = make_scheduler(num_running, with_prefill)
    num_scheduled = 0
    elapsed = 0.0
    for _ in range(num_steps):
        out = sched.schedule()
        runner_out = runner.execute(out)  # not timed: the scheduler's cost only
        start = time.perf_counter()
        sched.update_from_output(out, runner_out)
        elapsed += time.perf_counter() - start
        num_scheduled += len(out.scheduled)
    # schedule() is timed separately so that the runner is excluded.
    sched, runner = make_scheduler(num_running, with_prefill)
    for _ in range(num_steps):
        start = time.perf_counter()
        out = sched.schedule()
        elapsed += time.perf_counter() - start
        sched.update_from_output(out, runner.execute(out))
    per_step = elapsed / num_steps
    return per_step * 1e6, num_scheduled / num_steps / per_step


def main() -> None:
    print(f"{'running':>8} {'+8k prefill':>12} {'us/step':>10} {'sched req/s':>14}")
    for num_running in (1, 64, 256):
        for with_prefill in (False, True):
            us, rps = time_steps(num_running, with_prefill)
            print(f"{num_running:>8} {str(with_prefill):>12} {us:>10.1f} {rps:>14,.0f}")


if __name__ == "__main__":
    main()
