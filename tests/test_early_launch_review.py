"""The early engine launch's failure paths: an engine that dies while the idle windows are modelled."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pd_idle.jsonl"


def _wall_config():
    from engine.config import EngineConfig
    from replay.pipeline import ReplayConfig
    from replay.trace.shaping import ShapingOptions
    return ReplayConfig(trace=EXAMPLE, engine=EngineConfig(num_blocks=256, runner="mock"),
                        shaping=ShapingOptions(speedup=100), tail_s=1.0)


def _dying_launch(config):
    """launch_engines' engines, P killed at the model's first look at them (while it is
    still starting), so the model's last progress call is the one that finds it dead."""
    from replay.pipeline import launch_engines
    engines = launch_engines(config)
    real = engines.ready_engines
    calls = []

    def ready_engines():
        calls.append(1)
        ready = real()
        if len(calls) == 1:  # the model's first look: P dies right after it
            p = next(c for c in engines.clients if c.engine_id == "P")
            assert ready == [] and p.ready is None  # still starting: a later look finds it dead
            p.process.kill()
            p.process.join(5)
        return ready
    engines.ready_engines = ready_engines
    return engines, calls


def test_an_engine_dying_while_the_model_runs_is_a_fault_not_a_crash():
    """EngineDeadError found in the model's progress callback is the run's error (the
    engine's own), not swallowed with the model's errors and followed by a RuntimeError
    about a closed launch; nothing is left running."""
    from engine.client import EngineDeadError
    from replay.pipeline import run_replay
    config = _wall_config()
    engines, calls = _dying_launch(config)
    try:
        with pytest.raises(EngineDeadError, match="engine core P"):
            run_replay(config, engines=engines)
        assert len(calls) >= 2  # the death was found inside the model's progress
    finally:
        engines.close()
    assert multiprocessing.active_children() == []


def test_an_engine_dying_while_the_model_runs_exits_4(monkeypatch):
    """Through the CLI: exit 4 (fault) as the verdict table says, with the engine named."""
    from click.testing import CliRunner

    import replay.commands
    from cli import cli
    monkeypatch.setattr(replay.commands, "launch_engines", lambda config: _dying_launch(config)[0])
    result = CliRunner().invoke(cli, ["replay", str(EXAMPLE), "--runner", "mock", "--no-live",
                                      "--num-blocks", "256", "--speedup", "100", "--tail", "1"])
    assert result.exit_code == 4, (result.output, result.exception)
    assert "engine core P" in result.output
    assert multiprocessing.active_children() == []


def test_a_replay_against_a_serve_models_the_pool_the_serve_allocated(tmp_path, monkeypatch):
    """--target: the serve's engines sized their own pools (from GPU memory, maybe) and say
    so in ServeInfo; the idle-window model runs on that size (as for a local replay), not
    on the replay's own default."""
    import threading

    from connector.topology import start_topology
    from engine.config import EngineConfig, KVTransferConfig
    from engine.messages import ServeInfo
    from replay import pipeline
    from replay.live.serve import Server, ServeOptions
    from replay.trace.shaping import ShapingOptions
    modelled: list[int] = []
    model_timeline = pipeline.model_timeline
    monkeypatch.setattr(pipeline, "model_timeline", lambda config, on_progress=None: (
        modelled.append(config.engine.num_blocks) or model_timeline(config, on_progress)))
    router = start_topology(EngineConfig(num_blocks=300, runner="mock"), KVTransferConfig(), "pd")
    stop = threading.Event()
    try:
        server = Server(router, ServeOptions(f"ipc://{tmp_path}/serve"),
                        ServeInfo(router.engines, "pd", "event", router.vocab_size, 16, "mock", 4096,
                                  router.num_blocks, "tiny"))
        thread = threading.Thread(target=server.serve_forever, args=(None, stop.is_set))
        thread.start()
        try:
            config = pipeline.ReplayConfig(trace=EXAMPLE, engine=EngineConfig(num_blocks=256, runner="mock"),
                                           shaping=ShapingOptions(speedup=100), tail_s=1.0,
                                           target=server.address)
            result = pipeline.run_replay(config)
        finally:
            stop.set()
            thread.join(10)
            server.close()
    finally:
        router.shutdown()
    assert result.engine_settings()["num_blocks"] == 300
    assert modelled[-1] == 300, modelled
    assert result.verdict.exit_code == 0
