"""Start-up: which processes import torch, and the KV memory's torch-free byte paths."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest

from engine.config import ModelConfig
from engine.core.outputs import RequestOutput
from engine.proc.messages import StatsSnapshot
from engine.proc.stats_check import REQUIRED_COUNTS
from engine.runner.kv_cache import KVCache, KVCacheHandle
from tests.mp_utils import mock_tokens, topology
from tests.paths import EXAMPLE, ROOT

HAS_PROC = os.path.exists("/proc/self/maps")


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc/<pid>/maps")
@pytest.mark.parametrize("runner", ["mock", "torch"])
def test_only_the_torch_runners_engine_cores_load_torch(runner):
    """A P/D topology after a request moved its blocks over shm: the connector workers
    never load torch (CPU memory moves as bytes), the engine cores only for the torch runner."""
    with topology(runner=runner, transport="shm") as h:
        prompt = list(range(1, 19))
        h.add_request("r", prompt, 3)
        result = h.collect({"r"})
        cores = {e: c.ready.pid for e, c in h.clients.items()}
        workers = {e: h.stats(e).counts["connector_worker_pid"] for e in cores}
        assert h.stats("D").counts["num_recved"] == 1  # a real pull ran in D's worker
        torch_in = {f"{e} core" for e, pid in cores.items() if _maps_torch(pid)}
        torch_in |= {f"{e} worker" for e, pid in workers.items() if _maps_torch(pid)}
    assert torch_in == ({"P core", "D core"} if runner == "torch" else set())
    if runner == "mock":
        assert result["tokens"]["r"] == mock_tokens(prompt, 3)


def _copy_without_torch(handle: dict, results) -> None:
    """A connector worker's imports and its copy paths, in a fresh process."""
    import connector.worker_proc  # noqa: F401  (what the worker process imports)

    peer = KVCache.open(KVCacheHandle.from_dict(handle))
    local = KVCache.allocate(ModelConfig(), 8, 4, dtype=peer.handle.dtype)
    try:
        local.copy_blocks_from(peer, [2, 3], [5, 4])  # shm pull
        local.write_blocks([6], peer.read_blocks([3]))  # zmq pull
        results.put(("torch" in sys.modules, local.read_blocks([5, 4, 6])))
    finally:
        local.close()


def test_worker_copy_paths_run_without_torch():
    """In a spawned process: pulls by copy and by bytes never import torch, and give
    the bytes the torch view of the owner's memory holds."""
    import torch

    owner = KVCache.allocate(ModelConfig(), 8, 4, dtype="bfloat16")
    try:
        owner.tensor.copy_(torch.randn(owner.tensor.shape).to(torch.bfloat16))
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_copy_without_torch, args=(owner.handle.to_dict(), results))
        child.start()
        try:
            imported_torch, data = results.get(timeout=60)
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
        assert not imported_torch and child.exitcode == 0
        want = owner.tensor.permute(2, 0, 1, 3, 4, 5)[[2, 3, 3]].contiguous()
        assert data == want.view(torch.uint8).numpy().tobytes()
    finally:
        owner.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_byte_paths_match_the_torch_view(dtype):
    """pages (numpy) and tensor (torch) are one memory: bytes read, written and copied
    through pages are exactly what the torch view holds, for every dtype."""
    import torch

    src = KVCache.allocate(ModelConfig(), 8, 4, dtype=dtype)
    dst = KVCache.allocate(ModelConfig(), 8, 4, dtype=dtype)
    try:
        src.tensor.copy_(torch.randn(src.tensor.shape, dtype=torch.float64).to(src.tensor.dtype))
        assert src.nbytes == src.tensor.nbytes
        blocks = src.tensor.permute(2, 0, 1, 3, 4, 5)
        assert (
            src.read_blocks([1, 7])
            == blocks[[1, 7]].contiguous().view(torch.uint8).numpy().tobytes()
        )
        dst.copy_blocks_from(src, [1, 2], [3, 6])
        dst.write_blocks([7], src.read_blocks([5]))
        for d, s in ((3, 1), (6, 2), (7, 5)):
            assert torch.equal(
                dst.tensor[:, :, d].view(torch.uint8), src.tensor[:, :, s].view(torch.uint8)
            )
        assert not dst.tensor[:, :, 1].view(torch.uint8).any()  # untouched blocks stay zero
    finally:
        src.close()
        dst.close()


def test_closed_cache_does_not_map_again():
    cache = KVCache.allocate(ModelConfig(), 8, 4)
    cache.close()
    assert cache.pages is None
    with pytest.raises(ValueError, match="closed"):
        _ = cache.tensor


def test_start_topology_reports_engines_as_they_become_ready():
    """on_wait hears the engines ready so far while they start (never fewer than before),
    and all of them at the end."""
    from engine.config import EngineConfig, KVTransferConfig
    from replay.deploy.topology import start_topology

    heard: list[list[str]] = []
    router = start_topology(
        EngineConfig(num_blocks=32, block_size=4, runner="mock"),
        KVTransferConfig(),
        "pd",
        on_wait=heard.append,
    )
    try:
        assert sorted(heard[-1]) == ["D", "P"]
        assert all(set(a) <= set(b) for a, b in zip(heard, heard[1:]))
        assert all(c.ready is not None for c in router.clients.values())
    finally:
        router.shutdown()


HEAVY = ("torch", "numpy", "zmq", "rich.live", "matplotlib", "aiohttp", "replay.pipeline")


def test_help_and_the_cli_module_import_nothing_heavy():
    """`kvdrain --help` and `import cli` (which every spawned engine and connector worker
    repeats: multiprocessing re-runs the parent's main file) load none of HEAVY."""
    import subprocess

    probe = (
        "import sys; sys.argv = ['kvdrain', '--help']; import cli\n"
        "try:\n    cli.cli()\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    ).stdout
    assert out.splitlines()[-1] == "[]", out


def test_cli_clocks_are_the_pipelines():
    import cli
    from replay.pipeline import CLOCKS

    assert cli.CLOCKS is CLOCKS  # one definition, replay/runtime/clocks.py


# ---- the early launch: engines spawned before the frontend is ready for them -----------


def _fake_main(tmp_path, monkeypatch):
    """A __main__ whose file, when a spawned child re-runs it, leaves a marker named by its pid."""
    import types

    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "fake_main.py"
    script.write_text(
        f"import os\nopen(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close()\n"
    )
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return marks


def _one_request(router) -> list[int]:
    from tests.mp_utils import Harness

    harness = Harness(router)
    harness.add_request("r", list(range(1, 19)), 3)
    return harness.collect({"r"})["tokens"]["r"]


def test_topology_children_skip_the_main_file_and_give_the_same_tokens(tmp_path, monkeypatch):
    """spawning_without_main: no engine core or connector worker of a topology re-runs the
    parent's main file (the `kvdrain` script: cli, click, rich), yet a P/D request gives
    the tokens it gives when they do; an engine spawned the plain way does re-run it (so
    the marker works), and the main module is back in place afterwards."""
    from engine.config import EngineConfig, KVTransferConfig
    from engine.proc.client import MPClient
    from engine.proc.run_dir import make_run_dir
    from replay.deploy.pd_router import PDRouter
    from replay.deploy.topology import engine_configs, start_topology

    marks = _fake_main(tmp_path, monkeypatch)
    main = sys.modules["__main__"]
    base = EngineConfig(num_blocks=32, block_size=4, runner="mock")
    router = start_topology(base, KVTransferConfig(), "pd")
    try:
        fast = _one_request(router)
    finally:
        router.shutdown()
    assert sys.modules["__main__"] is main and os.listdir(marks) == []
    plain = MPClient(base)  # the straightforward spawn: the child re-runs the main file
    try:
        assert os.listdir(marks) == [str(plain.ready.pid)]
    finally:
        plain.shutdown()
    run_dir = make_run_dir()  # the same topology, every child spawned the plain way
    slow_router = PDRouter(
        [MPClient(c, run_dir) for c in engine_configs(base, KVTransferConfig(), "pd", run_dir)],
        run_dir,
    )
    try:
        slow = _one_request(slow_router)
    finally:
        slow_router.shutdown()
    assert fast == slow == mock_tokens(list(range(1, 19)), 3)
    assert len(os.listdir(marks)) == 1 + 4  # and two engine cores, two connector workers


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


def _what_ran(result) -> tuple:
    """A wall replay's outcome without its timings: each request's outputs, the verdict,
    the idle windows expected, the engines."""
    requests = sorted(
        (
            r.req_id,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.finish_reason,
            r.output_digest,
            r.expected_digest,
        )
        for r in result.timeline.requests
    )
    return (
        requests,
        result.verdict.status,
        result.verdict.exit_code,
        len(result.verdict.coverage),
        sorted({s.engine for s in result.timeline.samples}),
    )


def test_engines_launched_early_run_the_replay_as_engines_the_replay_launches():
    """A prepared replay whose engines are all Ready before it runs uses them (no second
    launch), reports them ready in its first phase and never waits in STARTING; the
    outcome equals that of a replay prepared and run at once; nothing is left running."""
    import multiprocessing

    from replay.deploy.topology import wait_all_ready
    from replay.pipeline import (
        FORECASTING,
        RUNNING,
        STARTING,
        ReplayHooks,
        prepare_replay,
        run_replay,
    )

    config = _wall_config()
    heard: list[tuple[str, list[str]]] = []
    hooks = ReplayHooks(on_phase=lambda phase, ready: heard.append((phase, sorted(ready))))
    with prepare_replay(config) as prepared:
        wait_all_ready(prepared.engines.clients)
        early = prepared.run(hooks)
        assert prepared.engines.clients == [] and prepared.engines.run_dir is None  # the router's
    assert heard[0] == (FORECASTING, ["D", "P"]) and heard[-1] == (RUNNING, ["D", "P"])
    assert STARTING not in {phase for phase, _ in heard}
    heard.clear()
    late = run_replay(config, hooks)
    assert [p for p, _ in heard][0] == FORECASTING and heard[-1] == (RUNNING, ["D", "P"])
    assert _what_ran(early) == _what_ran(late)
    assert early.verdict.exit_code == 0 and len(early.timeline.requests) == 32
    assert multiprocessing.active_children() == []


def test_a_launch_closed_unused_leaves_nothing():
    """Closing engines that are still starting stops them all and removes their run dir
    (a bad trace or Ctrl-C before the run)."""
    import multiprocessing

    from replay.pipeline import launch_engines

    config = _wall_config()
    engines = launch_engines(config)
    run_dir = engines.run_dir
    engines.close()
    engines.close()  # idempotent
    assert not os.path.exists(run_dir) and multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="closed"):
        engines.wait_ready()


def test_a_bad_trace_launches_no_engine(tmp_path, monkeypatch):
    """The trace is checked before the engines are launched: a bad one is exit 2 with
    nothing started."""
    from click.testing import CliRunner

    import replay.pipeline
    from cli import cli

    def no_engines(*a, **k):
        raise AssertionError("the engines were launched before the trace was checked")

    monkeypatch.setattr(replay.pipeline, "launch_engines", no_engines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "id": "a", "prompt_len": -1, "max_tokens": 2}\n')
    result = CliRunner().invoke(
        cli, ["replay", str(bad), "--runner", "mock", "--no-live"], catch_exceptions=False
    )
    assert result.exit_code == 2, result.output


class _AnsweringTarget:
    """A ReplayTarget with no processes behind it: each engine in `answering` answers a
    stats request with a snapshot at once; each request finishes with one token."""

    engines = ["P", "D"]
    vocab_size = 512

    def __init__(self, answering: list[str]) -> None:
        self.answering, self.errors = answering, []
        self.stats, self.outputs, self.num_stats_requests = [], [], 0

    def request_stats(self) -> None:
        self.num_stats_requests += 1
        counts = dict.fromkeys(REQUIRED_COUNTS, 0) | {"num_usable_blocks": 8, "num_free_blocks": 7}
        self.stats += [
            StatsSnapshot(e, self.num_stats_requests, time.monotonic(), "blocked", 0, 0, counts)
            for e in self.answering
        ]

    def take_stats(self):
        stats, self.stats = self.stats, []
        return stats

    def add_request(self, req_id, prompt_token_ids, max_tokens, pd=None, trace_t=None) -> None:
        self.outputs.append(RequestOutput(req_id, [(prompt_token_ids[-1] + 1) % 512], "length"))

    def abort(self, req_id) -> None:
        pass

    def poll(self, timeout_s: float):
        outputs, self.outputs = self.outputs, []
        if not outputs:
            time.sleep(timeout_s)  # stands for a socket wait: no process can answer here
        return outputs

    def shutdown(self) -> None:
        pass


def _drive_one(answering: list[str]):
    from replay.trace.reader import TraceRequest
    from replay.wall.driver import WallClockReplay, WallOptions

    start = time.monotonic()
    replay = WallClockReplay(_AnsweringTarget(answering), WallOptions(tail_s=0.05))
    timeline = replay.run([TraceRequest(0.0, "r", [1, 2, 3], 1)])
    return timeline, replay.origin - start


def test_the_trace_starts_once_every_engine_answered_else_after_the_lead_in():
    """t = 0 comes as soon as both engines have given their first sample (not a fixed
    LEAD_IN_S later); if one never answers, LEAD_IN_S after the start, as before. Either
    way the request, its output and the first samples (before t = 0) are the same."""
    from replay.wall.driver import LEAD_IN_S

    fast, fast_lead = _drive_one(["P", "D"])
    slow, slow_lead = _drive_one(["P"])
    assert fast_lead < LEAD_IN_S / 2 and slow_lead >= LEAD_IN_S
    for timeline in (fast, slow):
        [request] = timeline.requests
        assert (request.req_id, request.num_output_tokens, request.finish_reason) == (
            "r",
            1,
            "length",
        )
        assert 0 <= request.send_lateness_s < LEAD_IN_S / 2
    first = [(s.engine, s.num_usable_blocks, s.num_free_blocks) for s in fast.samples if s.t <= 0]
    assert first == [("P", 8, 7), ("D", 8, 7)]
    assert [x for x in first if x[0] == "P"] == [
        (s.engine, s.num_usable_blocks, s.num_free_blocks) for s in slow.samples if s.t <= 0
    ]
    assert fast.requests[0].output_digest == slow.requests[0].output_digest


def test_start_up_times_count_from_the_engines_launch():
    """The engines start before the live view exists: the dashboard's start-up clock is
    given their launch time, so 'ready in' and each phase's 'at' count from it."""
    from types import SimpleNamespace

    from replay.pipeline import FORECASTING
    from replay.ui.dashboard import DashboardState, StartupState
    from replay.ui.monitor import ReplayMonitor
    from replay.verify.rules import VerifyOptions

    state = DashboardState(startup=StartupState(engines=["P", "D"]))
    view = SimpleNamespace(tick=lambda force=False: None, quit_requested=False)
    monitor = ReplayMonitor(state, view, VerifyOptions(), start=time.monotonic() - 5.0)
    monitor.on_phase(FORECASTING, ["P"])
    assert 5.0 <= state.startup.ready_at["P"] < 6.0 and "D" not in state.startup.ready_at
    assert 5.0 <= state.startup.phase_start_s < 6.0
