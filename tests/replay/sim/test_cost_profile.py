"""The virtual clock's calibrated step cost: fit, profile round trip, the simulator's use of it, calibrate."""

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
from replay.sim.cost import CostModel, CostPoint, CostProfile, StepShape, fit_cost_model
from replay.sim.options import SimOptions
from replay.sim.simulation import simulate
from replay.trace.reader import read_trace
from replay.trace.shaping import ShapingOptions, shape

TRUE = CostModel(
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
    fitted = fit_cost_model(points)
    for got, want in zip(fitted.coefficients(), TRUE.coefficients()):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_with_noise_stays_within_the_noise():
    rng = random.Random(7)
    points = [CostPoint(s, TRUE.cost_s(s) * rng.uniform(0.97, 1.03)) for s in GRID]
    fitted = fit_cost_model(points)
    for s in GRID:
        assert fitted.cost_s(s) == pytest.approx(TRUE.cost_s(s), rel=0.06)


def test_fit_keeps_every_coefficient_non_negative():
    # Cost falls with context here (noise can do that): the coefficient is held at 0.
    points = [
        CostPoint(s, 1e-3 + 1e-5 * s.num_decode_seqs - 1e-9 * s.num_context_tokens) for s in GRID
    ]
    fitted = fit_cost_model(points)
    assert fitted.per_context_token_s == 0.0
    assert all(c >= 0 for c in fitted.coefficients()) and fitted.base_s > 0


def test_fit_of_a_feature_no_point_varies_is_zero():
    points = [CostPoint(StepShape(n, 0, 0), 2e-4 + 1e-6 * n) for n in (16, 64, 256)]
    fitted = fit_cost_model(points)
    assert (fitted.per_decode_seq_s, fitted.per_context_token_s) == (0.0, 0.0)
    assert fitted.per_prefill_token_s == pytest.approx(1e-6)


def test_fit_refuses_no_points_or_non_positive_times():
    with pytest.raises(ValueError):
        fit_cost_model([])
    with pytest.raises(ValueError):
        fit_cost_model([CostPoint(StepShape(16), 0.0)])


def profile() -> CostProfile:
    points = tuple(CostPoint(s, TRUE.cost_s(s), 5) for s in GRID)
    return CostProfile(
        model=TRUE,
        points=points,
        runner="torch",
        model_preset="tiny",
        device="cpu",
        dtype="float32",
        torch_version="2.5.0",
        loop_overhead_s=1e-5,
    )


def test_profile_save_load_round_trip(tmp_path: Path):
    path = tmp_path / "profile.json"
    profile().save(path)
    loaded = CostProfile.load(path)
    assert loaded == profile()
    assert loaded.model.cost_s(StepShape(256, 4, 1000)) == TRUE.cost_s(StepShape(256, 4, 1000))
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
def test_profile_refuses_malformed_data(mutate, tmp_path: Path):
    data = profile().to_dict()
    mutate(data)
    with pytest.raises(ValueError, match="cost"):
        CostProfile.from_dict(data)
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cost profile"):
        CostProfile.load(path)


def example_timeline(**options):
    records = shape(read_trace(EXAMPLE), ShapingOptions(speedup=4))
    return simulate(records, SimOptions(engine=EngineConfig(num_blocks=512), **options))


def test_a_cost_model_equal_to_the_default_gives_the_same_timeline():
    default = SimOptions()
    same = CostModel(
        base_s=default.step_base_s,
        per_prefill_token_s=default.step_per_token_s,
        per_decode_seq_s=default.step_per_token_s,
    )
    modelled, default_run = (
        example_timeline(cost_model=same).to_dict(),
        example_timeline().to_dict(),
    )
    assert modelled["meta"].pop("cost_model") == asdict(same)
    assert default_run["meta"].pop("cost_model") is None
    assert modelled == default_run


def test_the_cost_model_sets_step_times():
    fast = example_timeline(cost_model=CostModel(base_s=1e-4))
    slow = example_timeline(cost_model=CostModel(base_s=1e-4, per_decode_seq_s=1e-2))
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
    assert result.model.base_s > 0


def test_calibrate_refuses_a_bad_grid():
    with pytest.raises(ValueError, match="prefill_tokens"):
        CalibrateOptions(prefill_tokens=(1, 16))
    with pytest.raises(ValueError, match="decode_batches"):
        CalibrateOptions(decode_batches=())


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_cli_calibrate_then_replay_with_the_profile(tmp_path: Path):
    path, report = tmp_path / "mock.json", tmp_path / "report.json"
    result = invoke(
        "calibrate", "--runner", "mock", "--reps", "1", "--no-loop-overhead", "-o", str(path)
    )
    assert result.exit_code == 0, result.output
    assert "step cost =" in result.output and "Example" in invoke("calibrate", "--help").output
    loaded = CostProfile.load(path)
    replayed = invoke(
        "replay",
        str(EXAMPLE),
        "--clock",
        "virtual",
        "--runner",
        "mock",
        "--no-live",
        "--cost-profile",
        str(path),
        "--report",
        str(report),
    )
    assert replayed.exit_code == 0, replayed.output
    settings = json.loads(report.read_text())["settings"]
    assert settings["cost_profile"]["base_s"] == loaded.model.base_s


def test_cli_cost_profile_usage_errors(tmp_path: Path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    profile().save(good)  # measured on the torch runner
    bad.write_text(json.dumps({"kvdrain_cost_profile": 1}))
    other = invoke(
        "replay", str(EXAMPLE), "--runner", "mock", "--cost-profile", str(good), "--no-live"
    )
    assert other.exit_code == 2 and "runner torch" in other.output and "runner mock" in other.output
    assert "kvdrain calibrate --runner mock" in other.output
    broken = invoke(
        "replay", str(EXAMPLE), "--clock", "virtual", "--cost-profile", str(bad), "--no-live"
    )
    assert broken.exit_code == 2 and "--cost-profile" in broken.output


def test_replay_config_takes_a_profile_for_either_clock_refusing_one_of_another_runner():
    from replay.pipeline import ReplayConfig

    assert ReplayConfig(trace=EXAMPLE, clock="virtual", cost_profile=profile()).cost_profile
    assert ReplayConfig(
        trace=EXAMPLE,
        clock="wall",
        engine=EngineConfig(runner="torch", device="cpu"),
        cost_profile=profile(),
    ).cost_profile
    assert ReplayConfig(
        trace=EXAMPLE,
        clock="wall",
        engine=EngineConfig(runner="mock"),
        target="tcp://127.0.0.1:5555",
        cost_profile=profile(),
    ).cost_profile
    with pytest.raises(ValueError, match="runner torch, model tiny.*runner mock"):
        ReplayConfig(
            trace=EXAMPLE, clock="wall", engine=EngineConfig(runner="mock"), cost_profile=profile()
        )
    with pytest.raises(ValueError, match="model small"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="torch", model=get_model_config("small")),
            cost_profile=profile(),
        )
    # a GPU's step costs would model windows a CPU's lag swallows; an unknown model, any model
    on_gpu = replace(profile(), device="cuda:0")
    with pytest.raises(ValueError, match="device cuda:0.*device cpu"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="torch", device="cpu"),
            cost_profile=on_gpu,
        )
    with pytest.raises(ValueError, match="model custom-7b"):
        ReplayConfig(
            trace=EXAMPLE,
            clock="wall",
            engine=EngineConfig(runner="torch", device="cpu"),
            cost_profile=replace(profile(), model_preset="custom-7b"),
        )


SLOW_STEP_S = 0.25  # a calibrated step cost far above the default model's 4 ms


def model_quiet_of_the_gap(tmp_path: Path, cost_profile: CostProfile | None) -> float:
    """A wall replay (mock runner) of one request at t=0 and one at 1.5 s: when the model
    behind its expected windows had the first request ended (the run's quiet minus its lag)."""
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
            cost_profile=cost_profile,
        )
    )
    gap = next(c for c in result.verdict.coverage if not c.is_tail and not c.engine)
    assert (
        (gap.start, gap.end) == (0.0, 1.5) and gap.quiet_from is not None and gap.lag_s is not None
    )
    return gap.quiet_from - gap.lag_s


def test_a_wall_replay_models_its_expected_windows_with_the_cost_profile(tmp_path: Path):
    slow = CostProfile(
        model=CostModel(base_s=SLOW_STEP_S),
        points=(),
        runner="mock",
        model_preset="tiny",
        device="cpu",
        dtype="float32",
        torch_version=None,
    )
    # The request's P prefill and D's four tokens take a step each: at least five of the
    # profile's steps; the default model is done in tens of milliseconds.
    assert model_quiet_of_the_gap(tmp_path, slow) >= 5 * SLOW_STEP_S - 1e-6
    assert model_quiet_of_the_gap(tmp_path, None) < 0.2
