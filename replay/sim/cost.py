"""The virtual clock's step cost, fitted from a calibration. Runs in: frontend process.

A step's cost is linear in its shape, what the scheduler handed the runner:

    cost = base_s + per_prefill_token_s * num_prefill_tokens + per_decode_seq_s * num_decode_seqs
           + per_context_token_s * num_context_tokens

A chunk of one token is a decode (the runner batches them first); num_context_tokens
counts the tokens already in the KV cache that the step's chunks attend to. `kvdrain
calibrate` (replay/commands/calibrate.py) times real steps on a device, fits this step
cost (least squares on relative error, every coefficient >= 0) and writes a Calibration
as JSON; `replay --calibration FILE` loads it: the virtual clock's step costs, and the
wall clock's forecast of the idle windows (replay/verify/coverage.py), so a slow
machine's windows are expected where its engines can really idle. Pure: no torch, no clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.core.outputs import SchedulerOutput

CALIBRATION_VERSION = 1  # its file's "kvdrain_cost_profile"
FEATURES = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens")
COEFFICIENTS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")
MIN_BASE_S = 1e-9  # a step always takes some virtual time


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on."""

    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_context_tokens: int = 0

    @staticmethod
    def of(sched_out: SchedulerOutput) -> StepShape:
        prefill = decode = 0
        for num_new in sched_out.num_scheduled_tokens:  # the columns, not the records
            if num_new == 1:
                decode += 1
            else:
                prefill += num_new
        return StepShape(prefill, decode, sum(sched_out.num_computed_tokens))

    def features(self) -> tuple[float, ...]:
        """1 (for the base), then each feature, in COEFFICIENTS order."""
        return (1.0, *(float(getattr(self, name)) for name in FEATURES))


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per step as a linear function of its StepShape."""

    base_s: float
    per_prefill_token_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= (MIN_BASE_S if name == "base_s" else 0)):
                raise ValueError(
                    f"step cost: {name} must be finite and >= "
                    f"{MIN_BASE_S if name == 'base_s' else 0}, got {value!r}"
                )

    def cost_s(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), shape.features()))

    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in COEFFICIENTS)


@dataclass(frozen=True, slots=True)
class CostPoint:
    """One measured grid point: a step shape and its median cost over num_samples steps."""

    shape: StepShape
    seconds: float
    num_samples: int = 1


def fit_step_cost(points: list[CostPoint]) -> StepCost:
    """Least squares on relative error, every coefficient >= 0 (an active set).

    A coefficient the unconstrained fit makes negative is fixed at 0 and the rest refit,
    the most negative first; a feature no point varies is fixed at 0 too.
    """
    if not points or any(not p.seconds > 0 for p in points):
        raise ValueError("cost fit: needs points with seconds > 0")
    rows = [[x / p.seconds for x in p.shape.features()] for p in points]  # weights 1/seconds
    free = [j for j in range(len(COEFFICIENTS)) if any(row[j] for row in rows)]
    while True:
        solution = _least_squares([[row[j] for j in free] for row in rows], [1.0] * len(rows))
        negative = [(value, j) for value, j in zip(solution, free) if value < 0]
        if not negative:
            break
        free.remove(min(negative)[1])
    coefficients = [0.0] * len(COEFFICIENTS)
    for value, j in zip(solution, free):
        coefficients[j] = value
    coefficients[0] = max(coefficients[0], MIN_BASE_S)
    return StepCost(*coefficients)


def _least_squares(a: list[list[float]], b: list[float]) -> list[float]:
    """min |a x - b| by the normal equations on max-scaled columns (a few unknowns)."""
    n = len(a[0]) if a else 0
    scale = [max(abs(row[j]) for row in a) or 1.0 for j in range(n)]
    a = [[row[j] / scale[j] for j in range(n)] for row in a]
    m = [
        [sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))]
        for i in range(n)
    ]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            raise ValueError("cost fit: the points do not tell the coefficients apart")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """A calibration: where it was measured, the points, and the fitted step cost."""

    step_cost: StepCost
    points: tuple[CostPoint, ...]
    runner: str  # "torch" | "mock"
    model_preset: str
    device: str
    dtype: str
    torch_version: str | None
    loop_overhead_s: float = 0.0  # the process loop's per-step cost, included in base_s

    def max_relative_error(self) -> float:
        """The fit's worst relative error over the measured points (loop overhead aside)."""
        return max(
            (
                abs(self.step_cost.cost_s(p.shape) - self.loop_overhead_s - p.seconds) / p.seconds
                for p in self.points
            ),
            default=0.0,
        )

    def to_dict(self) -> dict:
        return {
            "kvdrain_cost_profile": CALIBRATION_VERSION,
            "runner": self.runner,
            "model_preset": self.model_preset,
            "device": self.device,
            "dtype": self.dtype,
            "torch_version": self.torch_version,
            "loop_overhead_s": self.loop_overhead_s,
            "cost_model": asdict(self.step_cost),
            "max_relative_error": round(self.max_relative_error(), 4),
            "points": [
                {**asdict(p.shape), "seconds": p.seconds, "num_samples": p.num_samples}
                for p in self.points
            ],
        }

    @staticmethod
    def from_dict(data: dict) -> Calibration:
        """The inverse of to_dict; ValueError naming what is wrong."""
        if not isinstance(data, dict) or data.get("kvdrain_cost_profile") != CALIBRATION_VERSION:
            raise ValueError(
                f"calibration: not a version {CALIBRATION_VERSION} kvdrain calibration "
                f"(`kvdrain calibrate` writes one)"
            )
        try:
            step_cost = StepCost(**{name: float(data["cost_model"][name]) for name in COEFFICIENTS})
            points = tuple(
                CostPoint(
                    StepShape(*(int(p[f]) for f in FEATURES)),
                    float(p["seconds"]),
                    int(p["num_samples"]),
                )
                for p in data["points"]
            )
            return Calibration(
                step_cost=step_cost,
                points=points,
                runner=str(data["runner"]),
                model_preset=str(data["model_preset"]),
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                torch_version=data["torch_version"],
                loop_overhead_s=float(data["loop_overhead_s"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"calibration: malformed: missing or bad {e}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"calibration {path}: {e}") from None
        return Calibration.from_dict(data)

    def describe(self) -> dict:
        """What a replay report says about the calibration it ran with."""
        return {
            "runner": self.runner,
            "model_preset": self.model_preset,
            "device": self.device,
            "dtype": self.dtype,
            "torch_version": self.torch_version,
            **asdict(self.step_cost),
        }
