"""One replay from a trace file to a verdict: validate, shape, drive, verify. Runs in: frontend process.

The CLI parses options into a ReplayConfig and calls run_replay; the live view (if
any) is notified on every tick. A bad trace raises TraceError before anything is
sent (the CLI's exit status 2); a verdict's exit code is 0, 1 or 3 (replay/verify/verdict.py).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from engine.config import EngineConfig, KVTransferConfig, config_to_dict
from replay.trace.shaping import ShapingLog, ShapingOptions, shape
from replay.sim.cost import CostProfile
from replay.sim.options import SimOptions
from replay.verify.timeline import Timeline
from replay.trace.reader import (TraceLimits, TraceRecord, TraceSnapshot, TraceSummary, read_trace,
                                 validate_trace)
from replay.verify.coverage import expected_windows
from replay.verify.outputs import can_check_outputs, mock_output_tokens
from replay.verify.rules import Verdict, VerifyOptions, verify

if TYPE_CHECKING:  # imported where used: a wall replay's engines start before they load
    from replay.deploy.topology import TopologyLaunch
    from replay.live.driver import ReplayTarget, WallClockReplay
    from replay.sim.simulation import ProgressCallback

CLOCKS = ("wall", "virtual")  # wall: real processes (replay/live/), virtual: replay/sim/
# A wall-clock replay's start-up phases, in order, as ReplayHooks.on_phase names them.
MODELLING, CONNECTING, STARTING, RUNNING = ("modelling idle windows", "connecting",
                                            "starting engines", "running")


@dataclass(frozen=True, slots=True)
class ReplayHooks:
    """What a live view hears while a replay runs; each is optional and only reads."""

    on_tick: Callable[[WallClockReplay], None] | None = None  # wall clock, every tick
    on_phase: Callable[[str, list[str]], None] | None = None  # start-up: phase, engines ready
    on_progress: ProgressCallback | None = None  # virtual clock (also the wall clock's model)

    def phase(self, name: str, ready: list[str] | None = None) -> None:
        if self.on_phase is not None:
            self.on_phase(name, ready or [])


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    trace: Path
    fmt: str | None = None
    skip_bad_lines: bool = False
    clock: str = "wall"
    topology: str = "pd"
    engine: EngineConfig = field(default_factory=EngineConfig)  # liveness, sizes, runner
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    shaping: ShapingOptions = field(default_factory=ShapingOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    tail_s: float | None = None  # None: long enough to cover the drain deadline
    target: str | None = None  # replay against a running `kvdrain serve`
    target_auth: object | None = None  # its credentials: replay/live/auth.py AuthOptions
    http: object | None = None  # --target http://: replay/http/client.py HttpTargetOptions
    cost_profile: CostProfile | None = None  # the virtual clock's step costs (kvdrain calibrate)
    # Hold every output against a single engine's (replay/verify/outputs.py); None: on
    # where it is cheap (a local wall replay on the mock runner), off elsewhere.
    check_outputs: bool | None = None

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock: must be one of {CLOCKS}, got {self.clock!r}")
        if self.tail_s is not None and self.tail_s <= 0:
            raise ValueError(f"tail: must be > 0, got {self.tail_s}")
        if self.cost_profile is not None and self.clock != "virtual":
            raise ValueError("cost profile: only with the virtual clock (--clock virtual)")
        if self.check_outputs:
            why = ("--check-outputs: only for a local wall-clock replay (the virtual clock has no "
                   "KV memory; a --target's engines are not known here)"
                   if self.clock != "wall" or self.target is not None or self.http is not None
                   else can_check_outputs(self.engine))
            if why is not None:
                raise ValueError(why)

    def effective_check_outputs(self) -> bool:
        if self.check_outputs is not None:
            return self.check_outputs
        return (self.clock == "wall" and self.target is None and self.http is None
                and can_check_outputs(self.engine) is None)

    def effective_tail_s(self) -> float:
        return self.tail_s if self.tail_s is not None else max(2.0, 3 * self.verify.drain_deadline_s)


@dataclass(slots=True)
class ReplayResult:
    config: ReplayConfig
    summary: TraceSummary
    shaping_log: ShapingLog
    timeline: Timeline
    verdict: Verdict
    wall_s: float

    def settings(self) -> dict:
        c = self.config
        return {"trace": str(c.trace), "format": self.summary.format, "clock": c.clock,
                "topology": self.timeline.meta.get("topology", c.topology), "target": c.target,
                "tail_s": c.effective_tail_s(),
                "engine": self.engine_settings(),
                "kv_transfer": None if c.http is not None else config_to_dict(c.kv),
                "shaping": config_to_dict(c.shaping), "verify": config_to_dict(c.verify),
                "wall_s": round(self.wall_s, 3), "check_outputs": c.effective_check_outputs(),
                "cost_profile": c.cost_profile.describe() if c.cost_profile is not None else None}

    def engine_settings(self) -> dict:
        """What really ran: the server's own configuration with --target (over HTTP as it
        described itself), "mock" as the runner under the virtual clock, else the engine
        config given."""
        c = self.config
        if c.http is not None:
            return {"source": "http server", **self.timeline.meta.get("http", {}).get("settings", {})}
        server = self.timeline.meta.get("server")
        if server is not None:
            return {"source": "server", **server}
        engine = config_to_dict(c.engine)
        if c.clock == "virtual":
            engine["runner"] = "mock"  # replay/sim/ always runs the mock runner
        return engine


def _keep_snapshots(records: Iterator[TraceRecord], into: list[TraceSnapshot]) -> Iterator[TraceRecord]:
    for record in records:
        if isinstance(record, TraceSnapshot):
            into.append(record)
        yield record


def trace_limits(config: ReplayConfig) -> TraceLimits:
    """What the engines accept, for checking the trace before anything starts.

    Both clocks run config.engine's sizes; with --target (zmq or http) the server's limits
    are not known before connecting, so only the reader's own caps (after scaling) apply.
    """
    scale = config.shaping.scale_tokens
    if config.target is not None or config.http is not None:
        return TraceLimits(scale_tokens=scale)
    return TraceLimits(config.engine.max_model_len, config.engine.model.vocab_size, scale)


def validate_replay_trace(config: ReplayConfig) -> TraceSummary:
    """The validating pass over config's trace, against the engines' limits; TraceError if bad."""
    return validate_trace(config.trace, config.fmt, config.skip_bad_lines, trace_limits(config))


def launch_engines(config: ReplayConfig) -> TopologyLaunch | None:
    """A local wall-clock replay's engines, spawned now and left starting, so that the
    frontend can model the trace and draw its view meanwhile (run_replay waits for
    them); None under the virtual clock and with a --target. The caller closes it."""
    if config.clock != "wall" or config.target is not None or config.http is not None:
        return None
    from replay.deploy.topology import TopologyLaunch  # engine processes only for a wall replay
    return TopologyLaunch(config.engine, config.kv, config.topology)


def run_replay(config: ReplayConfig, hooks: ReplayHooks | None = None,
               summary: TraceSummary | None = None,
               engines: TopologyLaunch | None = None) -> ReplayResult:
    """Validate (unless a summary of that pass is given), shape, drive, verify.

    engines: launch_engines(config)'s, still starting (the caller closes them: a no-op
    once the run handed them to its router); without, a local wall replay launches its own."""
    hooks = hooks or ReplayHooks()
    if summary is None:
        summary = validate_replay_trace(config)
    log = ShapingLog()
    snapshots: list[TraceSnapshot] = []
    trace = read_trace(config.trace, config.fmt, config.skip_bad_lines, trace_limits(config))
    records = _keep_snapshots(shape(trace, config.shaping, log), snapshots)
    start = time.monotonic()
    if config.clock == "virtual":
        from replay.sim.simulation import simulate
        timeline = model = simulate(records, _sim_options(config), hooks.on_progress)
    else:
        launched = launch_engines(config) if engines is None else None
        with launched or contextlib.nullcontext():  # launched here: closed here, whatever happens
            timeline, model = _model_and_replay_wall(config, records, hooks, summary, engines or launched)
        server = timeline.meta.get("server") or {}  # --target: the serve's engines sized theirs
        sized = timeline.meta.get("num_blocks") or server.get("num_blocks") or config.engine.num_blocks
        if sized != config.engine.num_blocks:  # pools sized from GPU memory: report and model them
            config = replace(config, engine=replace(config.engine, num_blocks=sized))
            model = model_timeline(replace(config, engine=replace(config.engine, gpu_memory_utilization=None)))
    arrivals = timeline.arrivals if model is None else model.arrivals
    expected = expected_windows(arrivals, config.verify.idle_threshold_s, model)
    verdict = verify(timeline, snapshots, config.verify, expected)
    return ReplayResult(config, summary, log, timeline, verdict, time.monotonic() - start)


def _model_and_replay_wall(config: ReplayConfig, records: Iterator[TraceRecord], hooks: ReplayHooks,
                           summary: TraceSummary, engines: TopologyLaunch | None
                           ) -> tuple[Timeline, Timeline | None]:
    """Model the idle windows while the engines start (separate processes), then run."""
    if engines is not None and not engines.is_for(config.engine, config.kv, config.topology):
        raise ValueError("run_replay: the engines given were launched for another configuration")
    ready = engines.ready_engines if engines is not None else list
    hooks.phase(MODELLING, ready())
    dead: list[Exception] = []  # an engine that failed meanwhile (EngineDeadError)

    def on_progress(num_done: int, t: float) -> None:  # the engines ready so far, too
        try:
            now_ready = ready()
        except Exception as e:  # a RuntimeError: model_timeline would take it for the model's
            dead.append(e)
            raise
        hooks.phase(MODELLING, now_ready)
        if hooks.on_progress is not None:
            hooks.on_progress(num_done, t)
    model = model_timeline(config, on_progress)  # before running: which idle windows to expect
    if dead:
        raise dead[0]
    return _replay_wall(config, records, hooks, summary, engines), model


def model_timeline(config: ReplayConfig, on_progress: ProgressCallback | None = None) -> Timeline | None:
    """The virtual clock over the same shaped trace: the model of which gaps become idle
    windows (replay/verify/coverage.py); None if it cannot run (then every gap counts)."""
    from replay.sim.simulation import simulate
    trace = read_trace(config.trace, config.fmt, config.skip_bad_lines, trace_limits(config))
    try:
        return simulate(shape(trace, config.shaping, ShapingLog()), _sim_options(config), on_progress)
    except (ValueError, RuntimeError):
        return None


def _sim_options(config: ReplayConfig) -> SimOptions:
    """The same engine and KV-transfer config; the latency model keeps its defaults
    except the step cost, when a calibrated profile is given."""
    profile = config.cost_profile
    return SimOptions(engine=config.engine, kv=config.kv, topology=config.topology,
                      tail_s=config.effective_tail_s(),
                      cost_model=profile.model if profile is not None else None)


def _replay_wall(config: ReplayConfig, records: Iterator[TraceRecord], hooks: ReplayHooks,
                 summary: TraceSummary, engines: TopologyLaunch | None) -> Timeline:
    if config.http is not None:  # any OpenAI-compatible server, judged from its /metrics
        from replay.http.client import HttpReplay
        return HttpReplay(replace(config.http, tail_s=config.effective_tail_s(),
                                  max_token_id=summary.max_prompt_token_id)).run(records)
    from replay.live.driver import WallClockReplay, WallOptions
    expected = (partial(mock_output_tokens, engine=config.engine)
                if config.effective_check_outputs() else None)
    options = WallOptions(tail_s=config.effective_tail_s(), expected_tokens=expected)
    target = _start_target(config, hooks, engines)
    try:
        hooks.phase(RUNNING, list(target.engines))
        replay = WallClockReplay(target, options, hooks.on_tick)
        timeline = replay.run(records)
    finally:
        target.shutdown()
    info = getattr(target, "info", None)  # a serve's ServeInfo: its own configuration
    if info is not None:
        server = {f.name: getattr(info, f.name) for f in fields(info)}
        timeline.meta.update({"liveness": info.liveness, "topology": info.topology, "server": server})
    else:  # the pool the engines allocated (sized from GPU memory, maybe)
        timeline.meta.update({"liveness": config.engine.liveness, "topology": config.topology,
                              "num_blocks": target.num_blocks})
    return timeline


def _start_target(config: ReplayConfig, hooks: ReplayHooks,
                  engines: TopologyLaunch | None) -> ReplayTarget:
    """A running serve's client (--target), else the local engines once all are ready."""
    if config.target is not None:
        hooks.phase(CONNECTING)
        from replay.live.serve_client import ServeClient
        return ServeClient(config.target, auth=config.target_auth)
    assert engines is not None  # run_replay launches them for a local wall replay
    ready = engines.ready_engines()
    if len(ready) < len(engines.clients):  # a phase only if there is still a wait
        hooks.phase(STARTING, ready)
    return engines.wait_ready(on_wait=lambda ready: hooks.phase(STARTING, ready))


def with_liveness(config: ReplayConfig, liveness: str) -> ReplayConfig:
    return replace(config, engine=replace(config.engine, liveness=liveness))
