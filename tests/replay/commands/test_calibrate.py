"""`kvdrain calibrate`'s output: a calibration whose fit is poor says so and what to do."""

from __future__ import annotations

from pathlib import Path

from replay.commands import calibrate as calibrate_module
from replay.commands.calibrate import CalibrateOptions, write_calibration
from replay.sim.cost import Calibration, CostPoint, StepCost, StepShape


def calibration_with_worst_error(measured_s: float) -> Calibration:
    """A fit of 100 us per step against one point measured at 100 us and one at measured_s."""
    points = (
        CostPoint(shape=StepShape(num_decode_seqs=1), seconds=100e-6),
        CostPoint(shape=StepShape(num_decode_seqs=4), seconds=measured_s),
    )
    return Calibration(
        step_cost=StepCost(base_s=100e-6),
        points=points,
        runner="mock",
        model_preset="tiny",
        device="cpu",
        dtype="float32",
        torch_version=None,
    )


def run_main(monkeypatch, tmp_path: Path, measured_s: float, reps: int) -> list[str]:
    monkeypatch.setattr(
        calibrate_module,
        "calibrate",
        lambda options, echo: calibration_with_worst_error(measured_s),
    )
    lines: list[str] = []
    assert (
        write_calibration(
            CalibrateOptions(runner="mock", num_reps=reps), tmp_path / "p.json", lines.append
        )
        == 0
    )
    return lines


def test_a_fit_off_by_more_than_half_warns_to_rerun_with_more_reps_on_a_quieter_machine(
    monkeypatch, tmp_path
):
    lines = run_main(monkeypatch, tmp_path, measured_s=2000e-6, reps=1)
    warning = [line for line in lines if line.startswith("warning:")]
    assert (
        warning
        and "95%" in warning[0]
        and "--reps" in warning[0]
        and "(now 1)" in warning[0]
        and "quieter machine" in warning[0]
    ), lines
    assert (tmp_path / "p.json").exists()


def test_a_close_fit_has_no_warning(monkeypatch, tmp_path):
    lines = run_main(monkeypatch, tmp_path, measured_s=110e-6, reps=5)
    assert not [line for line in lines if line.startswith("warning:")], lines
