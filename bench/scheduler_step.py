"""Cost of one schedule() + update_from_output(), beside nano-vllm's. Runs in: a bench process.

    python bench/scheduler_step.py [--nano-vllm DIR] [--sizes 1,64,256,1024] [--rounds 7]
        [--clock cpu|wall] [--workload step|spread|both]
    python bench/scheduler_step.py --opcodes [--nano-vllm DIR] [--sizes 1,64,1024]
N running decodes (prompt 128 tokens, block 16, token budget 8192), with or without an 8k-token
prefill chunked in; the mock runner is not timed. --nano-vllm needs `xxhash` (`make bench`).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.runner.mock_runner import MockModelRunner  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 128
TOKEN_BUDGET = 8192
PREFILL_LEN = 8192
NUM_BLOCKS = 80_000
MAX_NUM_SEQS = 2048
VOCAB_SIZE = (
    EngineConfig().model.vocab_size
)  # the mock runner's next token: (last + 1) % VOCAB_SIZE
# What a step costs: this thread's CPU time by default (a busy machine's other processes
# do not inflate it, as they inflate wall time), or --clock wall (time.perf_counter).
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]
spread = False  # the spread workload: prompts of PROMPT_LEN + i % BLOCK_SIZE tokens


def prompt(i: int) -> list[int]:
    return [(i * 7 + j) % 500 + 1 for j in range(PROMPT_LEN + (i % BLOCK_SIZE if spread else 0))]


class KvdrainBench:
    """kvdrain's Scheduler: decodes running, optionally a chunked 8k prefill waiting."""

    name = "kvdrain"

    def __init__(self, num_running: int, with_prefill: bool) -> None:
        config = EngineConfig(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=TOKEN_BUDGET,
            max_model_len=1 << 20,
        )
        # Everyone prefilled in one step, so that all decode in step, as nano-vllm's do
        # (its prefills go first: nobody decodes before the last is prefilled). Spread
        # over the budget's chunks they would sit at different places in their blocks,
        # and the median step would hold block allocations and hashes on this side only.
        prompts = [prompt(i) for i in range(num_running)]
        num_prompt_tokens = sum(map(len, prompts))
        self.sched = Scheduler(
            replace(config, max_num_batched_tokens=max(TOKEN_BUDGET, num_prompt_tokens))
        )
        self.runner = MockModelRunner(config)
        for i, prompt_token_ids in enumerate(prompts):
            self.sched.add_request(Request(f"d{i}", prompt_token_ids, 1 << 30, BLOCK_SIZE))
        while self.sched.waiting:  # prefill everyone, so the measured steps are decodes
            self._step()
        self.sched.config = config
        if with_prefill:
            self.sched.add_request(
                Request("prefill", [j % 500 + 1 for j in range(PREFILL_LEN)], 1 << 30, BLOCK_SIZE)
            )

    def _step(self) -> None:
        out = self.sched.schedule()
        self.sched.update_from_output(out, self.runner.execute(out))

    def timed_step(self) -> float:
        start = clock()
        out = self.sched.schedule()
        elapsed = clock() - start
        runner_out = self.runner.execute(out)  # not timed: the scheduler's cost only
        start = clock()
        outputs = self.sched.update_from_output(out, runner_out)
        elapsed += clock() - start
        del outputs  # released after the clock stops: disposing of them is the consumer's work
        return elapsed


def load_nano_vllm(root: Path) -> types.SimpleNamespace:
    """nano-vllm's scheduler modules, loaded by path with a stub Config (no transformers)."""
    pkg = root / "nanovllm"
    if not (pkg / "engine" / "scheduler.py").is_file():
        raise SystemExit(
            f"--nano-vllm: {root} is not a nano-vllm checkout (no nanovllm/engine/scheduler.py)"
        )
    for name in ("nanovllm", "nanovllm.engine"):
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
    config = types.ModuleType("nanovllm.config")
    config.Config = types.SimpleNamespace  # the scheduler only reads plain fields
    sys.modules["nanovllm.config"] = config
    loaded = {}
    for name in ("sampling_params", "engine.sequence", "engine.block_manager", "engine.scheduler"):
        path = pkg / (name.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(f"nanovllm.{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        loaded[name.rpartition(".")[2]] = module
    loaded["sequence"].Sequence.block_size = BLOCK_SIZE
    return types.SimpleNamespace(**loaded)


class NanoBench:
    """nano-vllm's Scheduler + BlockManager on the same workload; token ids are made outside
    the timing. nano-vllm lacks most of what kvdrain models (connector hooks,
    skipped_waiting, stop ids, vLLM's preemption order and prefix-cache semantics), so the
    ratio is the price of fidelity."""

    name = "nano-vllm"
    nano: types.SimpleNamespace

    def __init__(self, num_running: int, with_prefill: bool) -> None:
        nano = self.nano
        config = types.SimpleNamespace(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=TOKEN_BUDGET,
            eos=-1,
            kvcache_block_size=BLOCK_SIZE,
            num_kvcache_blocks=NUM_BLOCKS,
        )
        self.sched = nano.scheduler.Scheduler(config)
        params = nano.sampling_params.SamplingParams(max_tokens=1 << 30, ignore_eos=True)
        for i in range(num_running):
            self.sched.add(nano.sequence.Sequence(prompt(i), params))
        while self.sched.waiting:
            self.timed_step()
        if with_prefill:
            self.sched.add(
                nano.sequence.Sequence([j % 500 + 1 for j in range(PREFILL_LEN)], params)
            )

    def timed_step(self) -> float:
        start = clock()
        seqs, is_prefill = self.sched.schedule()
        elapsed = clock() - start
        # The "model", not timed: the tokens kvdrain's mock runner samples (fresh int
        # objects, as real token ids are; a small int like 7 is one shared object).
        token_ids = [(seq.last_token + 1) % VOCAB_SIZE for seq in seqs]
        start = clock()
        self.sched.postprocess(seqs, token_ids, is_prefill)
        return elapsed + clock() - start


# --opcodes: frames of the benchmark itself and of the runner, left out of the census.
NOT_COUNTED = (f"{Path(__file__).name}:", "mock_runner.py:")


def count_opcodes(step: Callable[[], object], num_steps: int) -> Counter:
    """Bytecodes per function over num_steps calls of `step` (its own frame left out), via
    sys.settrace: no other load changes them, but a C call counts one whatever it costs,
    and allocations and garbage collection are not seen."""
    counts: Counter = Counter()

    def on_opcode(frame, event, _):
        if event == "opcode":
            code = frame.f_code
            counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return on_opcode

    def on_call(frame, event, _):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return on_opcode

    sys.settrace(on_call)
    try:
        for _ in range(num_steps):
            step()
    finally:
        sys.settrace(None)
    return counts


def census(sizes: list[int], num_steps: int, with_nano: bool) -> None:
    """Bytecodes per step of each scheduler, in total and in its costliest functions."""
    benches = [KvdrainBench] + ([NanoBench] if with_nano else [])
    for num_running in sizes:
        for cls in benches:
            bench = cls(num_running, False)
            counts = count_opcodes(bench.timed_step, num_steps)
            for name in [n for n in counts if n.startswith(NOT_COUNTED)]:
                del counts[name]  # the clock's calls and the "model" are not the scheduler's
            top = ", ".join(f"{name} {n / num_steps:,.0f}" for name, n in counts.most_common(4))
            print(
                f"{num_running:>6} {cls.name:>10} "
                f"{sum(counts.values()) / num_steps:>9,.0f} opcodes/step  ({top})",
                flush=True,
            )


def median_us(make: Callable[[], object], num_steps: int) -> float:
    bench = make()
    return 1e6 * statistics.median(bench.timed_step() for _ in range(num_steps))


def run(sizes: list[int], rounds: int, num_steps: int, with_nano: bool) -> None:
    """One table of median step costs: in the `step` workload every request is at the same
    place in its blocks (every 16th step starts a block for all and one fills it, so the
    median step does neither); in `spread` every step 1/16 of them start a block and 1/16
    fill one (hashing it), so the median step holds that work. Both sides sample the mock
    runner's tokens ((last + 1) % vocab_size)."""
    benches = [KvdrainBench] + ([NanoBench] if with_nano else [])
    header = f"{'running':>8} {'+8k prefill':>12} {'kvdrain us':>11}"
    print(
        header + (f" {'nano-vllm us':>13} {'ratio':>6}" if with_nano else f" {'sched req/s':>12}")
    )
    for num_running in sizes:
        for with_prefill in (False, True):
            samples: dict[str, list[float]] = {b.name: [] for b in benches}
            for _ in range(rounds):  # interleaved, so drift hits both alike
                for cls in benches:
                    samples[cls.name].append(
                        median_us(lambda: cls(num_running, with_prefill), num_steps)  # noqa: B023
                    )
            ours = statistics.median(samples["kvdrain"])
            line = f"{num_running:>8} {str(with_prefill):>12} {ours:>11.1f}"
            if with_nano:
                theirs = statistics.median(samples["nano-vllm"])
                line += f" {theirs:>13.1f} {ours / theirs:>5.2f}x"
            else:
                line += f" {(num_running + with_prefill) / ours * 1e6:>12,.0f}"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nano-vllm", type=Path, help="a checkout of GeeeekExplorer/nano-vllm")
    parser.add_argument("--sizes", default="1,64,256,1024", help="running decodes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="this thread's CPU time (default) or wall time per step",
    )
    parser.add_argument(
        "--opcodes",
        action="store_true",
        help="count the bytecodes of a step per function instead of timing it",
    )
    parser.add_argument(
        "--workload",
        choices=("step", "spread", "both"),
        default="both",
        help="requests in step (every 16th step starts a block for all), spread "
        "(prompts of 128 + i %% 16 tokens: every step, 1/16 start a block), or both tables",
    )
    args = parser.parse_args()
    global clock, spread
    clock = CLOCKS[args.clock]
    print(f"clock: {args.clock} ({clock.__name__})")
    if args.nano_vllm is not None:
        NanoBench.nano = load_nano_vllm(args.nano_vllm)
    sizes = [int(s) for s in args.sizes.split(",")]
    for workload in ("step", "spread") if args.workload == "both" else (args.workload,):
        spread = workload == "spread"
        print(f"workload: {workload}")
        if args.opcodes:
            census(sizes, args.steps, args.nano_vllm is not None)
        else:
            run(sizes, args.rounds, args.steps, args.nano_vllm is not None)


if __name__ == "__main__":
    main()
