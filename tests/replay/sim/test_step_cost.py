"""The virtual clock's step cost: its fit, the calibration file, the simulator's use of it."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import EXAMPLE, cli
from engine.config import EngineConfig, get_model_config
from engine.core.outputs import ScheduledRequest, SchedulerOutput
from replay.commands.calibrate import CalibrateOptions, calibrate
from replay.sim.cost import Calibration, CostPoint, StepCost, StepShape, fit_step_cost
from replay.sim.options import SimOptions
from replay.sim.simulation import simulate
from replay.trace.reader import read_trace
from replay.trace.shaping import ShapingOptions, shape

TRUE = StepCost(
    base_s=1e-3, per_prefill_token_s=5e-6, per_decode_seq_s=2e-5, per_context_token_s=1.5e-7
)
GRID = [
    StepShape(n, b, c)
    for n in (0, 16, 256, 1024)
    for b in (0, 1, 16)
    for c in (0, 64, 4096)
    if n or b
]


def test_step_shape_counts_prefill_tokens_decode_seqs_and_context():
    out = SchedulerOutput(
        scheduled=[
            ScheduledRequest(
                req_id="p",
                token_ids=list(range(10)),
                num_computed_tokens=32,
                new_block_ids=[],
                is_new=False,
                sample=True,
            ),  # a chunk after 32 cached
            ScheduledRequest(
                req_id="d1",
                token_ids=[5],
                num_computed_tokens=100,
                new_block_ids=[],
                is_new=False,
                sample=True,
            ),
            ScheduledRequest(
                req_id="d2",
                token_ids=[6],
                num_computed_tokens=7,
                new_block_ids=[],
                is_new=False,
                sample=True,
            ),
        ],
        total_num_scheduled_tokens=12,
    )
    assert StepShape.of(out) == StepShape(
        num_prefill_tokens=10, num_decode_seqs=2, num_context_tokens=139
    )


def test_fit_recovers_exact_coefficients():
    points = [CostPoint(s, TRUE.cost_s(s)) for s in GRID]
    fitted = fit_step_cost(points)
    for got, want in zip(fitted.coefficients(), TRUE.coefficients()):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_with_noise_stays_within_the_noise():
    rng = random.Random(7)
    points = [CostPoint(s, TRUE.cost_s(s) * rng.uniform(0.97, 1.03)) for s in GRID]
    fitted = fit_step_cost(points)
    for s in GRID:
        assert fitted.cost_s(s) == pytest.approx(TRUE.cost_s(s), rel=0.06)


def test_fit_keeps_every_coefficient_non_negative():
    # Cost falls with context here (noise can do that): the coefficient is held at 0.
    points = [
        CostPoint(s, 1e-3 + 1e-5 * s.num_decode_seqs - 1e-9 * s.num_context_tokens) for s in GRID
    ]
    fitted = fit_step_cost(points)
    assert fitted.per_context_token_s == 0.0
    assert all(c >= 0 for c in fitted.coefficients()) and fitted.base_s > 0


def test_fit_of_a_feature_no_point_varies_is_zero():
    points = [CostPoint(StepShape(n, 0, 0), 2e-4 + 1e-6 * n) for n in (16, 64, 256)]
    fitted = fit_step_cost(points)
    assert (fitted.per_decode_seq_s, fitted.per_context_token_s) == (0.0, 0.0)
    assert fitted.per_prefill_token_s == pytest.approx(1e-6)


def test_fit_refuses_no_points_or_non_positive_times():
    with pytest.raises(ValueError):
        fit_step_cost([])
    with pytest.raises(ValueError):
        fit_step_cost([CostPoint(StepShape(16), 0.0)])


def calibration() -> Calibration:
    points = tuple(CostPoint(s, TRUE.cost_s(s), 5) for s in GRID)
    return Calibration(
        step_cost=TRUE,
        points=points,
        runner="torch",
        model_preset="tiny",
        device="cpu",
        dtype="float32",
        torch_version="2.5.0",
        loop_overhead_s=1e-5,
    )


def test_calibration_save_load_round_trip(tmp_path: Path):
    path = tmp_path / "calibration.json"
    calibration().save(path)
    loaded = Calibration.load(path)
    assert loaded == calibration()
    assert loaded.step_cost.cost_s(StepShape(256, 4, 1000)) == TRUE.cost_s(StepShape(256, 4, 1000))
    data = json.loads(path.read_text())
    assert data["kvdrain_cost_profile"] == 1 and data["cost_model"]["base_s"] == TRUE.base_s


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(kvdrain_cost_profile=2),
        lambda d: d.pop("cost_model"),
        lambda d: d["cost_model"].update(base_s=-1.0),
        lambda d: d["cost_model"].update(per_decode_seq_s=float("nan")),
        lambda d: d["points"][0].pop("seconds"),
    ],
)
def test_calibration_refuses_malformed_data(mutate, tmp_path: Path):
    data = calibration().to_dict()
    mutate(data)
    with pytest.raises(ValueError, match="calibration|step cost"):
        Calibration.from_dict(data)
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibration"):
        Calibration.load(path)


def example_timeline(**options):
    records = shape(read_trace(EXAMPLE), ShapingOptions(speedup=4))
    return simulate(records, SimOptions(engine=EngineConfig(num_blocks=512), **options))


def test_a_step_cost_equal_to_the_default_gives_the_same_timeline():
    default = SimOptions()
    same = StepCost(
        base_s=default.step_base_s,
        per_prefill_token_s=default.step_per_token_s,
        per_decode_seq_s=default.step_per_token_s,
    )
    calibrated, default_run = (
        example_timeline(step_cost=same).to_dict(),
        example_timeline().to_dict(),
    )
    assert calibrated["meta"].pop("step_cost") == asdict(same)
    assert default_run["meta"].pop("step_cost") is None
    assert calibrated == default_run


def test_the_step_cost_sets_step_times():
    fast = example_timeline(step_cost=StepCost(base_s=1e-4))
    slow = example_timeline(step_cost=StepCost(base_s=1e-4, per_decode_seq_s=1e-2))
    for f, s in zip(fast.requests, slow.requests):
        assert f.req_id == s.req_id and f.output_digest == s.output_digest
        # Each of D's decode steps costs 10 ms more: at least that per token after the first.
        assert (s.end_t - f.end_t) >= 0.01 * (f.num_output_tokens - 1) - 1e-9


def test_calibrate_the_mock_runner_measures_every_grid_cell():
    options = CalibrateOptions(
        runner="mock",
        prefill_tokens=(16, 64),
        decode_batches=(1, 4),
        context_lens=(32,),
        num_reps=2,
        loop_overhead=False,
    )
    result = calibrate(options)
    shapes = [p.shape for p in result.points]
    assert shapes[:2] == [StepShape(16, 0, 0), StepShape(64, 0, 0)]
    assert [(s.num_prefill_tokens, s.num_decode_seqs) for s in shapes[2:]] == [
        (0, 1),
        (0, 4),
        (64, 1),
        (64, 4),
    ]
    assert all(p.seconds > 0 and p.num_samples >= 2 for p in result.points)
    assert (result.runner, result.device, result.torch_version, result.loop_overhead_s) == (
        "mock",
        "cpu",
        None,
        0.0,
    )
    assert result.step_cost.base_s > 0


def test_calibrate_refuses_a_bad_grid():
    with pytest.raises(ValueError, match="prefill_tokens"):
        CalibrateOptions(prefill_tokens=(1, 16))
    with pytest.raises(ValueError, match="decode_batches"):
        CalibrateOptions(decode_batches=())


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_cli_calibrate_then_replay_with_the_calibration(tmp_path: Path):
    path, report = tmp_path / "mock.json", tmp_path / "report.json"
    result = invoke(
        "calibrate", "--runner", "mock", "--reps", "1", "--no-loop-overhead", "-o", str(path)
    )
    assert result.exit_code == 0, result.output
    assert "step cost =" in result.output and "Example" in invoke("calibrate", "--help").output
    loaded = Calibration.load(path)
    replayed = invoke(
        "replay",
        str(EXAMPLE),
        "--clock",
        "virtual",
        "--runner",
        "mock",
        "--no-live",
        "--calibration",
        str(path),
        "--report",
        str(report),
    )
    assert replayed.exit_code == 0, replayed.output
    settings = json.loads(report.read_text())["settings"]
    assert settings["cost_profile"]["base_s"] == loaded.step_cost.base_s  # the key keeps its name


def test_the_old_cost_profile_flag_still_works_and_says_it_is_deprecated(tmp_path: Path):
    path, report = tmp_path / "c.json", tmp_path / "report.json"
    calibration().save(path)
    result = CliRunner().invoke(
        cli,
        ["replay", str(EXAMPLE), "--clock", "virtual", "--no-live", "--cost-profile", str(path)]
        + ["--report", str(report)],
    )
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "kvdrain: --cost-profile is deprecated, use --calibration (it means the same)"
    ]
    assert json.loads(report.read_text())["settings"]["cost_profile"]["base_s"] == TRUE.base_s
    both = invoke("replay", str(EXAMPLE), "--cost-profile", str(path), "--calibration", str(path))
    assert both.exit_code == 2 and "give --calibration alone" in both.output


def test_cli_calibration_usage_errors(tmp_path: Path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    calibration().save(good)  # measured on the torch runner
    bad.write_text(json.dumps({"kvdrain_cost_profile": 1}))
    other = invoke(
        "replay", str(EXAMPLE), "--runner", "mock", "--calibration", str(good), "--no-live"
    )
    assert other.exit_code == 2 and "runner torch" in other.output and "runner mock" in other.output
    assert "kvdrain calibrate --runner mock" in other.output
    broken = invoke(
        "replay", str(EXAMPLE), "--clock", "virtual", "--calibration", str(bad), "--no-live"
    )
    assert broken.exit_code == 2 and "--calibration" in broken.output


def test_replay_config_takes_a_calibration_for_either_clock_refusing_one_of_another_runner():
    from replay.pipeline import ReplayConfig

    assert ReplayConfig(trace=EXAMPLE, clock="virtual", calibration=calibration()).calibration
    assert ReplayConfig(
        trace=EXAMPLE,
        clock="wall",
        engine=EngineConfig(runner="torch", device="cpu"),
        calibration=calibration(),
    ).calibration
    assert ReplayConfig(
        trace=EXAMPLE,
        clock="wall",
        engine=EngineConfig(runner="mock"),
        target="tcp://127.0.0.1:5555",
        calibration=calibration(),
    ).calibration
    with pytest.raises(ValueError, match="runner torch, model tiny.*runner mock"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="mock"),
            calibration=calibration(),
        )
    with pytest.raises(ValueError, match="model small"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="torch", model=get_model_config("small")),
            calibration=calibration(),
        )
    # a GPU's step costs would forecast windows a CPU's lag swallows; an unknown model, any model
    on_gpu = replace(calibration(), device="cuda:0")
    with pytest.raises(ValueError, match="device cuda:0.*device cpu"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="torch", device="cpu"),
            calibration=on_gpu,
        )
    with pytest.raises(ValueError, match="model custom-7b"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="torch", device="cpu"),
            calibration=replace(calibration(), model_preset="custom-7b"),
        )


SLOW_STEP_S = 0.25  # a calibrated step cost far above the default's 4 ms


def forecast_quiet_of_the_gap(tmp_path: Path, calibration: Calibration | None) -> float:
    """A wall replay (mock runner) of one request at t=0 and one at 1.5 s: when the
    forecast behind its expected windows had the first request ended (the run's quiet
    minus its lag)."""
    from replay.pipeline import ReplayConfig, run_replay
    from replay.verify.rules import VerifyOptions

    trace = tmp_path / "gap.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"t": t, "id": f"r{t}", "prompt_len": 40, "max_tokens": 4}) + "\n"
            for t in (0.0, 1.5)
        )
    )
    result = run_replay(
        ReplayConfig(
            trace=trace,
            clock="wall",
            engine=EngineConfig(runner="mock", num_blocks=256),
            tail_s=0.5,
            verify=VerifyOptions(0.5, 0.25, 2),
            calibration=calibration,
        )
    )
    gap = next(c for c in result.verdict.coverage if not c.is_tail and not c.engine)
    assert (
        (gap.start, gap.end) == (0.0, 1.5) and gap.quiet_from is not None and gap.lag_s is not None
    )
    return gap.quiet_from - gap.lag_s


def test_a_wall_replay_forecasts_its_idle_windows_with_the_calibration(tmp_path: Path):
    slow = Calibration(
        step_cost=StepCost(base_s=SLOW_STEP_S),
        points=(),
        runner="mock",
        model_preset="tiny",
        device="cpu",
        dtype="float32",
        torch_version=None,
    )
    # The request's P prefill and D's four tokens take a step each: at least five of the
    # calibration's steps; the default step cost is done in tens of milliseconds.
    assert forecast_quiet_of_the_gap(tmp_path, slow) >= 5 * SLOW_STEP_S - 1e-6
    assert forecast_quiet_of_the_gap(tmp_path, None) < 0.2
