"""Review of the early engine launch: an engine dying while the forecast runs (exit 4), signals during start-up, the forecast on a --target serve's pool."""

from __future__ import annotations

import multiprocessing

import pytest

from tests.paths import EXAMPLE, ROOT


def _wall_config():
    from engine.config import EngineConfig
    from replay.pipeline import ReplayConfig
    from replay.trace.shaping import ShapingOptions

    return ReplayConfig(
        trace=EXAMPLE,
        engine=EngineConfig(num_blocks=256, runner="mock"),
        shaping=ShapingOptions(speedup=100),
        tail_s=1.0,
    )


def _dying_launch(config, launch_engines=None):
    """launch_engines' engines, P killed at the forecast's first look at them (while it is
    still starting), so the forecast's last progress call is the one that finds it dead."""
    from replay import pipeline

    engines = (launch_engines or pipeline.launch_engines)(config)
    real = engines.ready_engines
    calls = []

    def ready_engines():
        calls.append(1)
        ready = real()
        if len(calls) == 1:  # the forecast's first look: P dies right after it
            p = next(c for c in engines.clients if c.engine_id == "P")
            assert ready == [] and p.ready is None  # still starting: a later look finds it dead
            p.process.kill()
            p.process.join(5)
        return ready

    engines.ready_engines = ready_engines
    return engines, calls


def test_an_engine_dying_while_the_forecast_runs_is_a_fault_not_a_crash():
    """EngineDeadError found in the forecast's progress callback is the run's error (the
    engine's own), not swallowed with the forecast's errors and followed by a RuntimeError
    about a closed launch; nothing is left running."""
    from engine.proc.client import EngineDeadError
    from replay.pipeline import PreparedReplay, validate_trace

    config = _wall_config()
    engines, calls = _dying_launch(config)
    prepared = PreparedReplay(config=config, summary=validate_trace(config.trace), engines=engines)
    with prepared:
        with pytest.raises(EngineDeadError, match="engine core P"):
            prepared.run()
        assert len(calls) >= 2  # the death was found inside the forecast's progress
    assert multiprocessing.active_children() == []


def test_an_engine_dying_while_the_forecast_runs_exits_4(monkeypatch):
    """Through the CLI: exit 4 (fault) as the verdict table says, with the engine named."""
    from click.testing import CliRunner

    import replay.pipeline
    from cli import cli

    launch = replay.pipeline.launch_engines
    monkeypatch.setattr(
        replay.pipeline, "launch_engines", lambda config: _dying_launch(config, launch)[0]
    )
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(EXAMPLE),
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "256",
            "--speedup",
            "100",
            "--tail",
            "1",
        ],
    )
    assert result.exit_code == 4, (result.output, result.exception)
    assert "engine core P" in result.output
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("served,forecast_on", [(300, 300), (0, 256)])
def test_a_replay_against_a_serve_forecasts_on_the_pool_the_serve_allocated(
    tmp_path, monkeypatch, served, forecast_on
):
    """--target: the serve's engines sized their own pools (from GPU memory, maybe) and say
    so in ServeInfo; the idle-window forecast runs on that size (as for a local replay), not
    on the replay's own default. A serve that does not say (num_blocks 0: before issue 12)
    leaves the replay's own."""
    import threading

    from engine.config import EngineConfig, KVTransferConfig
    from replay import pipeline
    from replay.deploy.topology import start_topology
    from replay.serve.messages import ServeInfo
    from replay.serve.server import ServeOptions, Server
    from replay.trace.shaping import ShapingOptions

    forecast_pools: list[int] = []
    forecast_timeline = pipeline.forecast_timeline
    monkeypatch.setattr(
        pipeline,
        "forecast_timeline",
        lambda records, config, on_progress=None: (
            forecast_pools.append(config.engine.num_blocks)
            or forecast_timeline(records, config, on_progress)
        ),
    )
    router = start_topology(EngineConfig(num_blocks=300, runner="mock"), KVTransferConfig(), "pd")
    stop = threading.Event()
    try:
        server = Server(
            router,
            ServeOptions(f"ipc://{tmp_path}/serve"),
            ServeInfo(
                router.engines, "pd", "event", router.vocab_size, 16, "mock", 4096, served, "tiny"
            ),
        )
        thread = threading.Thread(target=server.serve_forever, args=(None, stop.is_set))
        thread.start()
        try:
            config = pipeline.ReplayConfig(
                trace=EXAMPLE,
                engine=EngineConfig(num_blocks=256, runner="mock"),
                shaping=ShapingOptions(speedup=100),
                tail_s=1.0,
                target=server.address,
            )
            result = pipeline.run_replay(config)
        finally:
            stop.set()
            thread.join(10)
            server.close()
    finally:
        router.shutdown()
    assert result.engine_settings()["num_blocks"] == served
    assert forecast_pools[-1] == forecast_on, forecast_pools
    assert result.verdict.exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(15, 143), (2, 130)])
def test_a_signal_while_the_forecast_runs_leaves_nothing(tmp_path, monkeypatch, signum, code):
    """`kvdrain replay` of a long trace: its engines are launched before the idle windows
    are forecast, and SIGTERM or Ctrl-C while the forecast runs (the engines still starting
    or idle) ends it with 143 or 130, no traceback, and no process, run dir or KV
    segment left (the engines and every connector worker seen are gone at exit)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from engine.proc.run_dir import is_alive
    from tests.proc_utils import descendants, wait_until

    run_root = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")
    trace = tmp_path / "long.jsonl"
    with trace.open("w") as f:  # long enough that forecasting takes seconds
        for i in range(30000):
            f.write(
                json.dumps({"t": i * 0.05, "id": f"r{i}", "prompt_len": 24, "max_tokens": 2}) + "\n"
            )
    root = ROOT
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "replay",
            str(trace),
            "--runner",
            "mock",
            "--no-live",
            "--num-blocks",
            "256",
        ],
        cwd=root,
        env=dict(os.environ, KVDRAIN_RUN_ROOT=run_root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: dict[int, str | None] = {}
    try:
        # Both engine cores spawned and one has started its connector worker (a signal in
        # the middle of a spawn is test_a_signal_during_a_spawn_leaves_no_traceback's case).
        wait_until(lambda: len(descendants(proc.pid)) >= 3, 120, "the engines launched")
        proc.send_signal(signum)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(proc.pid))  # connector workers may start meanwhile
            time.sleep(0.05)  # sampling /proc, an outside condition
        out, _ = proc.communicate(timeout=10)
        left = [pid for pid, start in seen.items() if is_alive(pid, start)]
        run_dirs = os.listdir(run_root)
    finally:
        for pid, start in [(proc.pid, None), *seen.items()]:
            if is_alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        import shutil

        shutil.rmtree(run_root, ignore_errors=True)
    assert proc.returncode == code, out
    assert "Traceback" not in out and "nothing is left running" in out, out
    assert left == [] and run_dirs == [], (left, run_dirs, out)


def test_a_signal_during_a_spawn_leaves_no_traceback(capfd, monkeypatch):
    """Ctrl-C while TopologyLaunch spawns D's engine core (after the process exists, before
    multiprocessing wrote its start data down the pipe): the launch is undone, and no
    child prints a traceback to the user's terminal."""
    import os
    import signal
    import time
    from multiprocessing import util

    from engine.config import EngineConfig, KVTransferConfig
    from replay.deploy.topology import TopologyLaunch
    from replay.runtime.interrupt import Interrupted, interruptible

    real, pids = util.spawnv_passfds, []

    def spawn_then_signal(path, args, passfds):
        pid = real(path, args, passfds)
        pids.append(pid)
        if len(pids) == 2:  # D's engine core: Ctrl-C lands right after its fork-exec
            os.kill(os.getpid(), signal.SIGINT)
        return pid

    monkeypatch.setattr(util, "spawnv_passfds", spawn_then_signal)
    with pytest.raises(Interrupted):
        with interruptible():
            TopologyLaunch(EngineConfig(num_blocks=32, runner="mock"), KVTransferConfig(), "pd")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # D's child exits; ours to reap if its Popen never got it
        try:
            done, _ = os.waitpid(pids[1], os.WNOHANG)
        except ChildProcessError:  # reaped already: the launch closed it as its own client
            break
        if done:
            break
        time.sleep(0.05)  # a child's exit, outside the test's control
    assert "Traceback" not in capfd.readouterr().err
