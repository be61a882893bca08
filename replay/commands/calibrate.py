"""`kvdrain calibrate`: time the runner's steps, fit their step cost. Runs in: frontend process.

An EngineCore with the real runner (engine/runner/model_runner.py's torch ModelRunner, or the
mock runner) steps in this process through a small grid: prefills of n tokens alone,
decode batches of b requests at context c, and b decodes beside one prefill. Each
step is timed (perf_counter around EngineCore.step: schedule, execute, update) after a
warm-up round, in rounds over the whole grid; a cell's point is its median. The fit is
replay/sim/cost.py's. Then one real
engine-core process (no connector) decodes a request, and what its loop adds per step
(sockets, output encoding, stats) over the in-process step is added to the base. Prefix
caching is off so every prompt token is computed.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import click

from engine.config import EngineConfig, get_model_config
from engine.core.engine_core import EngineCore
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from engine.utils import cdiv
from replay.commands.groups import require_torch
from replay.sim.cost import Calibration, CostPoint, StepCost, StepShape, fit_step_cost

LOOP_DECODE_TOKENS = 200  # the real process's decode, for its loop overhead
LOOP_TIMEOUT_S = 60.0
MAX_FIT_ERROR = 0.5  # a worse fit is warned of: the timings were noise more than cost


@dataclass(frozen=True, slots=True)
class CalibrateOptions:
    """Which runner to time where, and the grid (kept small: seconds on a CPU)."""

    runner: str = "torch"
    model: str = "tiny"
    device: str = "auto"
    prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    context_lens: tuple[int, ...] = (64, 512)
    num_reps: int = 5  # timed steps per grid cell
    loop_overhead: bool = True  # also time one real engine-core process

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_batches", "context_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name}: must be non-empty and >= 1, got {values!r}")
        if min(self.prefill_tokens) < 2:
            raise ValueError("prefill_tokens: a prefill has >= 2 tokens (1 is a decode)")
        if self.num_reps < 1:
            raise ValueError(f"num_reps: must be >= 1, got {self.num_reps}")

    def engine_config(self) -> EngineConfig:
        """A pool and budget that fit the largest cell in one step, prefix caching off."""
        reps, bs = self.num_reps, 16
        longest = max(max(self.context_lens), max(self.prefill_tokens)) + reps + 2
        batch = max(self.decode_batches)
        num_blocks = 2 + batch * cdiv(longest, bs) + (reps + 1) * cdiv(max(self.prefill_tokens), bs)
        return EngineConfig(
            engine_id="calibrate",
            num_blocks=num_blocks,
            block_size=bs,
            max_num_seqs=batch + 2,
            max_num_batched_tokens=max(batch * max(self.context_lens), max(self.prefill_tokens))
            + batch,
            max_model_len=longest,
            enable_prefix_caching=False,
            runner=self.runner,
            device=self.device,
            model=get_model_config(self.model),
        )


class _ShapeRunner:
    """The real runner, noting each step's shape."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.shape = StepShape()

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.shape = StepShape.of(sched_out)
        return self.runner.execute(sched_out)


class _Bench:
    """One EngineCore with the real runner, and prompts that never repeat."""

    def __init__(self, config: EngineConfig) -> None:
        if config.runner == "torch":
            from engine.runner.model_runner import ModelRunner  # torch only where it is needed

            runner = ModelRunner(config)
        else:
            from engine.runner.mock_runner import MockModelRunner

            runner = MockModelRunner(config)
        self.inner = runner
        self.runner = _ShapeRunner(runner)
        self.core = EngineCore(config, self.runner)
        self.vocab_size = config.model.vocab_size
        self.ids = itertools.count()

    def add(self, num_tokens: int, max_tokens: int) -> None:
        i = next(self.ids)
        prompt = [(i * 7919 + k * 31) % self.vocab_size for k in range(num_tokens)]
        if self.core.add_request(f"cal-{i}", prompt, max_tokens):
            raise RuntimeError(f"calibration request of {num_tokens} tokens refused")

    def step(self) -> tuple[StepShape, float]:
        start = time.perf_counter()
        self.core.step()
        return self.runner.shape, time.perf_counter() - start

    def drain(self) -> None:
        while self.core.has_work():
            self.core.step()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


Cell = tuple[int, int, int]  # (prefill tokens, decode batch, context): one grid point
DECODE_STEPS = 2  # timed decode steps per cell and round


def _grid(options: CalibrateOptions) -> list[Cell]:
    """Prefills alone, decode batches at each context, and decodes beside a middle prefill."""
    mid = sorted(options.prefill_tokens)[len(options.prefill_tokens) // 2]
    ctx = min(options.context_lens)
    return (
        [(n, 0, 0) for n in options.prefill_tokens]
        + [(0, b, c) for b in options.decode_batches for c in options.context_lens]
        + [(mid, b, ctx) for b in options.decode_batches]
    )


def _time_cell(bench: _Bench, cell: Cell) -> list[tuple[StepShape, float]]:
    """One round of a cell: its timed steps; the engine is empty before and after."""
    prefill, batch, context = cell
    if not batch:
        bench.add(prefill, max_tokens=1)  # finishes in the step that computes it
        return [bench.step()]
    for _ in range(batch):
        bench.add(context, max_tokens=DECODE_STEPS + 1)
    bench.step()  # every prompt in one step (the budget fits them), the first token sampled
    samples = []
    for _ in range(DECODE_STEPS):
        if prefill:
            bench.add(prefill, max_tokens=1)
        samples.append(bench.step())
    bench.drain()
    return samples


def _point(samples: list[tuple[StepShape, float]]) -> CostPoint:
    """A cell's point: its mean shape (rounded) and median seconds."""
    shape = StepShape(
        *(
            round(statistics.fmean(getattr(s, f) for s, _ in samples))
            for f in ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens")
        )
    )
    return CostPoint(shape, statistics.median(t for _, t in samples), len(samples))


def measure_points(bench: _Bench, options: CalibrateOptions) -> list[CostPoint]:
    """num_reps rounds over the grid after a warm-up round, so a burst of load on a
    shared machine spoils one sample of many cells rather than a whole cell."""
    grid = _grid(options)
    samples: dict[Cell, list[tuple[StepShape, float]]] = {cell: [] for cell in grid}
    for cell in grid:  # warm-up: first-call costs of every shape
        _time_cell(bench, cell)
    for _ in range(options.num_reps):
        for cell in grid:
            samples[cell] += _time_cell(bench, cell)
    return [_point(samples[cell]) for cell in grid]


def measure_loop_overhead(config: EngineConfig, step_cost: StepCost, context: int = 16) -> float:
    """Per step, what a real engine-core process takes beyond `step_cost`'s in-process cost.

    One request of `context` tokens decodes LOOP_DECODE_TOKENS tokens, one step each;
    from sending it to its last output, over that many steps (the send and the last
    receive are amortised; outputs read in batches do not matter).
    """
    from engine.proc.client import MPClient  # a process only when asked for

    client = MPClient(replace(config, liveness="event"))
    try:
        start, deadline = time.perf_counter(), time.monotonic() + LOOP_TIMEOUT_S
        client.add_request("loop", [1] * context, LOOP_DECODE_TOKENS)
        num_tokens = 0
        while time.monotonic() < deadline:
            outputs = client.get_outputs(0.05)
            num_tokens += sum(len(out.new_token_ids) for out in outputs)
            if any(out.finished for out in outputs):
                break
        end = time.perf_counter()
        if num_tokens != LOOP_DECODE_TOKENS:
            raise RuntimeError(
                f"loop overhead: {num_tokens} of {LOOP_DECODE_TOKENS} tokens "
                f"within {LOOP_TIMEOUT_S} s"
            )
    finally:
        client.shutdown()
    in_process = step_cost.cost_s(StepShape(context, 0, 0)) + sum(
        step_cost.cost_s(StepShape(0, 1, context + i)) for i in range(LOOP_DECODE_TOKENS - 1)
    )
    return max(0.0, (end - start - in_process) / LOOP_DECODE_TOKENS)


def calibrate(
    options: CalibrateOptions, log: Callable[[str], None] = lambda line: None
) -> Calibration:
    """Measure, fit, and (if asked) add the real process loop's per-step overhead."""
    config = options.engine_config()
    bench = _Bench(config)
    try:
        start = time.monotonic()
        points = measure_points(bench, options)
        log(f"measured {len(points)} points in {time.monotonic() - start:.1f} s")
        device, dtype = _where(bench)
    finally:
        bench.close()
    step_cost = fit_step_cost(points)
    overhead = measure_loop_overhead(config, step_cost) if options.loop_overhead else 0.0
    if overhead:
        step_cost = replace(step_cost, base_s=step_cost.base_s + overhead)
    return Calibration(
        step_cost=step_cost,
        points=tuple(points),
        runner=options.runner,
        model_preset=options.model,
        device=device,
        dtype=dtype,
        torch_version=_torch_version(options.runner),
        loop_overhead_s=overhead,
    )


def _where(bench: _Bench) -> tuple[str, str]:
    """(device, dtype) the runner ran on: the mock runner's is the CPU, no dtype."""
    kv_cache = getattr(bench.inner, "kv_cache", None)
    if kv_cache is None:
        return "cpu", "none"
    tensor = kv_cache.tensor
    name = str(tensor.device)
    if tensor.device.type == "cuda":
        import torch

        name = f"{name} ({torch.cuda.get_device_name(tensor.device)})"
    return name, str(tensor.dtype).removeprefix("torch.")


def _torch_version(runner: str) -> str | None:
    if runner != "torch":
        return None
    import torch

    return torch.__version__


def format_calibration(calibration: Calibration) -> list[str]:
    """The calibration as lines: where, the fitted step cost, each point against the fit."""
    c, m = calibration, calibration.step_cost
    lines = [
        f"runner {c.runner}, model {c.model_preset}, device {c.device}, "
        f"dtype {c.dtype}, torch {c.torch_version or '-'}",
        f"step cost = {m.base_s * 1e6:.1f} us + {m.per_prefill_token_s * 1e6:.4f} us/prefill token"
        f" + {m.per_decode_seq_s * 1e6:.3f} us/decode seq + {m.per_context_token_s * 1e6:.5f}"
        f" us/context token (base includes {c.loop_overhead_s * 1e6:.1f} us of process loop)",
        f"{'prefill':>8} {'decode':>7} {'context':>8} {'measured us':>12} {'fit us':>9}",
    ]
    for p in c.points:
        s = p.shape
        fit = m.cost_s(s) - c.loop_overhead_s
        lines.append(
            f"{s.num_prefill_tokens:>8} {s.num_decode_seqs:>7} {s.num_context_tokens:>8} "
            f"{p.seconds * 1e6:>12.1f} {fit * 1e6:>9.1f}"
        )
    lines.append(f"worst relative error of the fit: {c.max_relative_error():.0%}")
    return lines


def calibrate_main(
    runner: str, model: str, device: str, reps: int, loop_overhead: bool, output: Path
) -> int:
    """`kvdrain calibrate`: the exit status."""
    require_torch(runner)
    try:
        options = CalibrateOptions(
            runner=runner, model=model, device=device, num_reps=reps, loop_overhead=loop_overhead
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return write_calibration(options, output, click.echo)


def write_calibration(options: CalibrateOptions, output: Path, echo: Callable[[str], None]) -> int:
    """Measure, write the calibration to `output`, print it."""
    calibration = calibrate(options, echo)
    calibration.save(output)
    for line in format_calibration(calibration):
        echo(line)
    error = calibration.max_relative_error()
    if error > MAX_FIT_ERROR:
        echo(
            f"warning: the fit is off by up to {error:.0%} (over {MAX_FIT_ERROR:.0%}): the step "
            f"timings were noisy; calibrate again with more --reps (now {options.num_reps}) on a "
            f"quieter machine (fewer jobs beside it) before trusting this calibration"
        )
    echo(
        f"wrote {output}; use it with: kvdrain replay TRACE --calibration {output} (the wall "
        f"clock's forecast of its idle windows; with --clock virtual, its step costs)"
    )
    return 0
