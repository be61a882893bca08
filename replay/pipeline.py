"""One replay from a trace file to a verdict: prepare, then run. Runs in: frontend process.

prepare_replay checks the trace against the engines' limits (a bad one raises TraceError
with nothing started: the CLI's exit status 2) and launches a local wall replay's
engines; PreparedReplay.run forecasts the idle windows once (FORECASTING), drives
the trace (virtual clock, local engines, a serve or an HTTP server) and verifies the
timeline; the live view (if any) hears every phase and tick through ReplayHooks. A
verdict's exit code is 0, 1 or 3 (replay/verify/verdict.py). A run stopped (Ctrl-C,
SIGTERM, `q`) before its first request still gives a result: an empty timeline whose
meta "interrupted" names the stop, so the report is written on that path too.

The trace is streamed, never held: the virtual clock reads it twice (the check, the run),
the wall clock three times (the check, which ends before anything starts; the forecast,
which runs while the engines start; the run), each pass in the format the check found.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import MODEL_PRESETS, EngineConfig, KVTransferConfig, config_to_dict
from engine.core.release import VllmRelease
from replay.deploy.placement import RouterPolicy
from replay.runtime.clocks import CLOCKS, Clock
from replay.runtime.interrupt import Interrupted
from replay.sim.cost import Calibration
from replay.sim.options import SimOptions
from replay.trace.faults import FaultSupport
from replay.trace.inspect import no_request_left
from replay.trace.reader import (
    TraceError,
    TraceHeader,
    TraceLimits,
    TraceRecord,
    TraceSnapshot,
    TraceSummary,
    read_trace,
    validate_trace,
)
from replay.trace.shaping import ShapingLog, ShapingOptions, shape
from replay.trace.source import watch_trace
from replay.verify.contract import Contract, resolve_contract, tail_for
from replay.verify.coverage import expected_windows
from replay.verify.outputs import can_check_outputs, mock_output_tokens
from replay.verify.rules import Verdict, VerifyOptions, verify
from replay.verify.safety import EXPIRY_LOG, expiry_logs
from replay.verify.timeline import Timeline
from replay.verify.windows import expected_engine_windows

if TYPE_CHECKING:  # imported where used: a wall replay's engines start before they load
    from replay.deploy.topology import TopologyLaunch
    from replay.sim.simulation import ProgressCallback
    from replay.wall.driver import ReplayTarget, WallClockReplay, WallOptions

# A wall-clock replay's start-up phases, in order, as ReplayHooks.on_phase names them.
FORECASTING, CONNECTING, STARTING, RUNNING = (
    "forecasting idle windows",
    "connecting",
    "starting engines",
    "running",
)


@dataclass(frozen=True, slots=True)
class ReplayHooks:
    """What a live view hears while a replay runs; each is optional and only reads."""

    on_tick: Callable[[WallClockReplay], None] | None = None  # wall clock, every tick
    on_phase: Callable[[str, list[str]], None] | None = None  # start-up: phase, engines ready
    on_progress: ProgressCallback | None = None  # virtual clock (also the wall clock's forecast)
    on_http_tick: Callable[[object], None] | None = (
        None  # --target http://: HttpReplay, every scrape
    )
    on_note: Callable[[str], None] | None = None  # start-up: an engine found starved

    def phase(self, name: str, ready: list[str] | None = None) -> None:
        if self.on_phase is not None:
            self.on_phase(name, ready or [])


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    trace: Path
    fmt: str | None = None
    skip_bad_lines: bool = False
    clock: Clock = "wall"
    topology: str = "pd"
    router: RouterPolicy = (
        "round-robin"  # which P and D take each request (replay/deploy/placement.py)
    )
    engine: EngineConfig = field(default_factory=EngineConfig)  # liveness, sizes, runner
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    shaping: ShapingOptions = field(default_factory=ShapingOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    tail_s: float | None = None  # None: long enough to cover the drain deadline
    target: str | None = None  # replay against a running `kvdrain serve`
    target_auth: object | None = None  # its credentials: replay/serve/auth.py AuthOptions
    http: object | None = None  # --target http://: replay/target/client.py HttpTargetOptions
    # Step costs measured by `kvdrain calibrate`: the virtual clock's, and under the wall
    # clock its forecast's (the expected idle windows); None: the default step cost.
    calibration: Calibration | None = None
    # Hold every output against a single engine's (replay/verify/outputs.py); None: on
    # where it is cheap (a local wall replay on the mock runner), off elsewhere.
    check_outputs: bool | None = None
    # What a target's deployment runs, as (value, where it was said): --vllm-release and
    # --kv-lease-s, or what `--engine vllm` launched; None: learned from the server, else
    # the defaults (replay/verify/contract.py). A local replay's are its engine's own.
    served_release: tuple[str, str] | None = None
    served_lease_s: tuple[float, str] | None = None
    engine_logs: tuple[tuple[str, Path], ...] = ()  # (engine, its log): `--engine vllm`'s
    # The default tail's length to reach the contract deadlines the forecast left pending
    # at its last request (with_contract_tail); 0: none.
    contract_tail_s: float = 0.0

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock: must be one of {CLOCKS}, got {self.clock!r}")
        if self.tail_s is not None and self.tail_s <= 0:
            raise ValueError(f"tail: must be > 0, got {self.tail_s}")
        if self.calibration is not None:
            mismatch = self.calibration_mismatch()
            if mismatch is not None:
                raise ValueError(mismatch)
        for name, _ in self.shaping.faults.shares:
            why = fault_support(self).why_not(name)
            if why is not None:
                raise ValueError(f"--fault {why}")
        if self.check_outputs:
            why = (
                "--check-outputs: only for a local wall-clock replay (the virtual clock has no "
                "KV memory; a --target's engines are not known here)"
                if self.clock != "wall" or self.target is not None or self.http is not None
                else can_check_outputs(self.engine)
            )
            if why is not None:
                raise ValueError(why)

    def calibration_mismatch(self) -> str | None:
        """Why the calibration cannot stand for a local wall replay's engines (measured on
        another runner or model), or None. The virtual clock runs the mock runner with any
        calibration's costs; a --target's engines are not known here."""
        calibration, engine = self.calibration, self.engine
        if self.clock != "wall" or self.target is not None or self.http is not None:
            return None
        device = (
            "cpu"
            if engine.runner == "mock"
            or not (engine.device == "cuda" or (engine.device == "auto" and _may_have_cuda()))
            else "cuda"
        )
        if (
            calibration.runner == engine.runner
            and MODEL_PRESETS.get(calibration.model_preset) == engine.model
            and calibration.device.partition(":")[0] == device
        ):
            return None
        model = next((name for name, m in MODEL_PRESETS.items() if m == engine.model), None)
        hint = f"kvdrain calibrate --runner {engine.runner}" + (
            f" --model {model}" if model else ""
        )
        return (
            f"--calibration: measured on runner {calibration.runner}, model "
            f"{calibration.model_preset}, device {calibration.device}; this replay's engines "
            f"run runner {engine.runner}, model {model or 'a custom one'}, device {device}: "
            f"calibrate them (`{hint}`)"
        )

    def effective_check_outputs(self) -> bool:
        if self.check_outputs is not None:
            return self.check_outputs
        return (
            self.clock == "wall"
            and self.target is None
            and self.http is None
            and can_check_outputs(self.engine) is None
        )

    def effective_tail_s(self) -> float:
        if self.tail_s is not None:
            return self.tail_s
        return max(2.0, 3 * self.verify.drain_deadline_s, self.contract_tail_s)


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
        return {
            "trace": str(c.trace),
            "format": self.summary.format,
            "clock": c.clock,
            "topology": self.timeline.meta.get("topology", c.topology),
            "target": c.target,
            **({"router": c.router} if c.router != "round-robin" else {}),
            "tail_s": c.effective_tail_s(),
            "engine": self.engine_settings(),
            "kv_transfer": None if c.http is not None else config_to_dict(c.kv),
            "shaping": config_to_dict(c.shaping),
            "verify": config_to_dict(c.verify),
            "wall_s": round(self.wall_s, 3),
            "check_outputs": c.effective_check_outputs(),
            "cost_profile": c.calibration.describe() if c.calibration is not None else None,
        }

    def engine_settings(self) -> dict:
        """What really ran: the server's own configuration with --target (over HTTP as it
        described itself), "mock" as the runner under the virtual clock, else the engine
        config given."""
        c = self.config
        if c.http is not None:
            return {
                "source": "http server",
                **self.timeline.meta.get("http", {}).get("settings", {}),
            }
        server = self.timeline.meta.get("server")
        if server is not None:
            return {"source": "server", **server}
        engine = config_to_dict(c.engine)
        if c.clock == "virtual":
            engine["runner"] = "mock"  # replay/sim/ always runs the mock runner
        return engine


def _keep_snapshots(
    records: Iterator[TraceRecord], into: list[TraceSnapshot]
) -> Iterator[TraceRecord]:
    for record in records:
        if isinstance(record, TraceSnapshot):
            into.append(record)
        yield record


def trace_limits(config: ReplayConfig) -> TraceLimits:
    """What the engines accept, for checking the trace before anything starts.

    Both clocks run config.engine's sizes; with --target (zmq or http) the server's limits
    are not known before connecting, so only the reader's own caps (after scaling) apply.
    """
    scale, faults = config.shaping.scale_tokens, fault_support(config)
    if config.target is not None or config.http is not None:
        return TraceLimits(scale_tokens=scale, faults=faults)
    return TraceLimits(config.engine.max_model_len, config.engine.model.vocab_size, scale, faults)


def fault_support(config: ReplayConfig) -> FaultSupport:
    """What the run carries out of the faults a trace asks for: all of them on kvdrain's
    own engines; over a --target (or --engine vllm) only plain aborts."""
    if config.http is not None:  # its address is config.target's too
        return FaultSupport("an HTTP --target (or --engine vllm)", routes=False)
    if config.target is not None:
        return FaultSupport("a --target serve", routes=False)
    from replay.deploy.pd_flow import engine_names

    prefill, decode = engine_names(config.topology)
    clock = "the virtual clock" if config.clock == "virtual" else "a local wall replay"
    return FaultSupport(clock, tuple(prefill + decode), has_decode_leg=bool(prefill))


def is_pool_sized_by_engines(config: ReplayConfig) -> bool:
    """Whether only the engines know their pool's size until they are ready: a --target
    serve's, or the torch runner's on CUDA sized from GPU memory (vLLM's profile run).
    Without torch here, "auto" counts as CUDA wherever a GPU driver is present."""
    if config.target is not None:
        return True
    engine = config.engine
    if config.http is not None or engine.runner != "torch" or engine.gpu_memory_utilization is None:
        return False
    return engine.device == "cuda" or (engine.device == "auto" and _may_have_cuda())


def _may_have_cuda() -> bool:
    return os.environ.get("CUDA_VISIBLE_DEVICES") != "" and os.path.exists("/dev/nvidiactl")


def prepare_replay(
    config: ReplayConfig, adopt: Callable[[TraceHeader], ReplayConfig] | None = None
) -> PreparedReplay:
    """The trace checked against the engines' limits (TraceError if bad: nothing started),
    then a local wall-clock replay's engines launched, left starting while the caller
    draws its view and the run forecasts the idle windows. The caller closes it.

    adopt: the config a recording's header makes of this one (replay/serve/recorder.py),
    taken in the checking pass before its first request is checked."""
    watch_trace(config.trace)  # every later pass reads these bytes (replay/trace/source.py)
    adopted = [config]

    def on_header(header: TraceHeader) -> TraceLimits:
        adopted[0] = adopt(header)
        return trace_limits(adopted[0])

    summary = validate_trace(
        config.trace,
        config.fmt,
        config.skip_bad_lines,
        trace_limits(config),
        on_header if adopt is not None else None,
    )
    config = adopted[0]
    why = no_request_left(
        config.trace, config.fmt, config.shaping, summary.num_requests, config.skip_bad_lines
    )
    if why is not None:
        raise TraceError(why)
    return PreparedReplay(config=config, summary=summary, engines=launch_engines(config))


def launch_engines(config: ReplayConfig) -> TopologyLaunch | None:
    """A local wall-clock replay's engines, spawned now; None under the virtual clock and
    with a --target."""
    if config.clock != "wall" or config.target is not None or config.http is not None:
        return None
    from replay.deploy.topology import TopologyLaunch  # engine processes only for a wall replay

    return TopologyLaunch(config.engine, config.kv, config.topology, router=config.router)


def run_replay(config: ReplayConfig, hooks: ReplayHooks | None = None) -> ReplayResult:
    """prepare_replay then PreparedReplay.run, for a caller with nothing to show between."""
    with prepare_replay(config) as prepared:
        return prepared.run(hooks)


@dataclass(slots=True, kw_only=True)
class PreparedReplay:
    """A replay whose trace was checked, its engines (a local wall replay's) starting.

    run() goes through the phases: the idle windows forecast once, on the pool the
    engines run (FORECASTING: while they start when that pool is known beforehand), the
    trace driven (CONNECTING or STARTING, then RUNNING), the timeline verified."""

    config: ReplayConfig
    summary: TraceSummary  # the checking pass's
    engines: TopologyLaunch | None  # a local wall replay's, handed to its router by run()

    def close(self) -> None:
        """Shut down engines not handed to a run (a no-op once run() took them)."""
        if self.engines is not None:
            self.engines.close()

    def __enter__(self) -> PreparedReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def launched_at(self) -> float | None:
        """When the engines were launched (the live view's start-up clock counts from it)."""
        return self.engines.launched_at if self.engines is not None else None

    def records(self, config: ReplayConfig, log: ShapingLog) -> Iterator[TraceRecord]:
        """A pass over the shaped trace, in the format the checking pass found."""
        trace = read_trace(
            config.trace, self.summary.format, config.skip_bad_lines, trace_limits(config)
        )
        return shape(trace, config.shaping, log)

    def run(self, hooks: ReplayHooks | None = None) -> ReplayResult:
        hooks = hooks or ReplayHooks()
        config, log, snapshots = self.config, ShapingLog(), []
        start = time.monotonic()
        if config.clock == "virtual":
            config, timeline, log, snapshots = self._run_virtual(config, hooks)
            expected = timeline
        else:
            try:
                config, timeline, expected = self._run_wall(hooks, log, snapshots)
            except Interrupted as e:  # before the first request: the forecast, a start, a check
                timeline, expected = stopped_before_start(e.name), None
        windows = expected_windows(
            timeline.arrivals if expected is None else expected.arrivals,
            config.verify.idle_threshold_s,
            expected,
        )
        own = expected_engine_windows(expected, config.verify.idle_threshold_s)
        if config.engine_logs:  # what P's log says of expired leases (replay/verify/safety.py)
            timeline.meta[EXPIRY_LOG] = expiry_logs(config.engine_logs)
        contract = deployment_contract(config, timeline)
        verdict = verify(timeline, snapshots, config.verify, windows, own, contract)
        return ReplayResult(config, self.summary, log, timeline, verdict, time.monotonic() - start)

    def _run_virtual(
        self, config: ReplayConfig, hooks: ReplayHooks
    ) -> tuple[ReplayConfig, Timeline, ShapingLog, list[TraceSnapshot]]:
        """The virtual clock's run; once more with a longer default tail when the first
        left an unread request's contract pending past its end (it is its own forecast)."""
        while True:
            log, snapshots = ShapingLog(), []
            timeline = simulate_interruptible(
                _keep_snapshots(self.records(config, log), snapshots),
                _sim_options(config),
                hooks.on_progress,
            )
            longer = with_contract_tail(config, timeline)
            if longer is config or timeline.meta.get("interrupted") is not None:
                return config, timeline, log, snapshots
            config = longer

    def _run_wall(
        self, hooks: ReplayHooks, log: ShapingLog, snapshots: list[TraceSnapshot]
    ) -> tuple[ReplayConfig, Timeline, Timeline | None]:
        """(the config as run, its pool as the engines sized it; the timeline; the expected one)."""
        config = self.config
        if config.http is not None:  # any OpenAI-compatible server, judged from its /metrics
            hooks.phase(CONNECTING)
            from replay.target.preflight import (
                preflight,  # every URL checked once: nothing sent yet
            )

            checked = preflight(config.http, config.verify.drain_deadline_s)
            config = replace(config, http=checked.options)
            expected = self._forecast(config, hooks, list)
            config = with_contract_tail(config, expected)
            return config, self._run_http(hooks, config, log, snapshots, checked.identity), expected
        sized_by_engines = is_pool_sized_by_engines(config)
        starting = self.engines.ready_engines if self.engines is not None else list
        if not sized_by_engines:
            expected = self._forecast(config, hooks, starting)  # while the engines start
            config = with_contract_tail(config, expected)
        target = self._start_target(config, hooks)
        try:
            if sized_by_engines:
                config = _sized(config, target)
                expected = self._forecast(config, hooks, lambda: list(target.engines))
                config = with_contract_tail(config, expected)
            hooks.phase(RUNNING, list(target.engines))
            from replay.wall.driver import WallClockReplay

            replay = WallClockReplay(target, _wall_options(config), hooks.on_tick)
            timeline = replay.run(_keep_snapshots(self.records(config, log), snapshots))
        finally:
            target.shutdown()
        timeline.meta.update(_target_meta(config, target))
        return _sized(config, target), timeline, expected

    def _forecast(
        self, config: ReplayConfig, hooks: ReplayHooks, ready: Callable[[], list[str]]
    ) -> Timeline | None:
        """FORECASTING: the virtual clock over the same shaped trace, on config's pool: which
        gaps become idle windows (replay/verify/coverage.py); None if it cannot run (then
        every gap counts). `ready`: the engines ready so far, shown meanwhile; one still
        starting that fails then (EngineDeadError from `ready`) is the run's error."""
        hooks.phase(FORECASTING, ready())
        dead: list[Exception] = []  # an engine that failed meanwhile (EngineDeadError)

        def on_progress(num_done: int, t: float) -> None:  # the engines ready so far, too
            try:
                now_ready = ready()
            except Exception as e:  # a RuntimeError: it would pass for the forecast's own
                dead.append(e)
                raise
            hooks.phase(FORECASTING, now_ready)
            if hooks.on_progress is not None:
                hooks.on_progress(num_done, t)

        expected = forecast_timeline(self.records(config, ShapingLog()), config, on_progress)
        if dead:
            raise dead[0]
        return expected

    def _start_target(self, config: ReplayConfig, hooks: ReplayHooks) -> ReplayTarget:
        """A running serve's client (--target), else the local engines once all are ready."""
        if config.target is not None:
            hooks.phase(CONNECTING)
            from replay.serve.client import ServeClient

            return ServeClient(config.target, auth=config.target_auth)
        engines = self.engines
        ready = engines.ready_engines()
        if len(ready) < len(engines.clients):  # a phase only if there is still a wait
            hooks.phase(STARTING, ready)
        return engines.wait_ready(
            on_wait=lambda ready: hooks.phase(STARTING, ready), on_note=hooks.on_note
        )

    def _run_http(
        self,
        hooks: ReplayHooks,
        config: ReplayConfig,
        log: ShapingLog,
        snapshots: list[TraceSnapshot],
        identity: object,
    ) -> Timeline:
        from replay.target.client import HttpReplay

        options = replace(
            config.http,
            tail_s=config.effective_tail_s(),
            max_token_id=self.summary.max_prompt_token_id,
        )
        return HttpReplay(options, identity, on_tick=hooks.on_http_tick).run(
            _keep_snapshots(self.records(config, log), snapshots)
        )


MINIATURE = "the miniature's settings"
LAUNCHED = "the launched venv"  # served_release's source under `--engine vllm`


def deployment_contract(config: ReplayConfig, timeline: Timeline | None = None) -> Contract:
    """What the deployment promises for an unread request's blocks: a local replay's
    engines by their own settings (release, liveness, lease); a target by what launched
    it, else its /version (after the run: the timeline's), else --vllm-release, else the
    newest release modelled, said so; its lease by the launcher or --kv-lease-s, else
    NIXL's default, said so."""
    if config.target is None and config.http is None:
        return Contract(
            release=VllmRelease.parse(config.engine.vllm_release),
            release_from=MINIATURE,
            lease_s=config.kv.kv_lease_s,
            lease_from="the miniature's --kv-lease-s",
            legacy=config.engine.liveness == "legacy",
        )
    from replay.target.server_facts import release_of, served_release

    meta = timeline.meta if timeline is not None else {}
    given = config.served_release
    said = None
    if given is not None and (release := release_of(given[0])) is not None:
        said = release, f"{given[1]}: {given[0]}" if given[1] == LAUNCHED else given[1]
    launched = given is not None and given[1] == LAUNCHED
    learned = said if launched else served_release(meta)
    liveness = meta.get("liveness") or (meta.get("http") or {}).get("settings", {}).get("liveness")
    return resolve_contract(
        learned=learned,
        given=said,
        lease=config.served_lease_s,
        legacy=None if liveness is None else liveness == "legacy",
    )


def with_contract_tail(config: ReplayConfig, forecast: Timeline | None) -> ReplayConfig:
    """config whose default tail reaches every unread request's contract deadline the
    forecast leaves pending at its last request (contract.py tail_for); config itself
    when --tail was given or the default already does."""
    if config.tail_s is not None or forecast is None:
        return config
    needed = tail_for(
        forecast.requests, deployment_contract(config), config.verify.drain_deadline_s
    )
    if needed <= config.effective_tail_s():
        return config
    return replace(config, contract_tail_s=needed)


def forecast_timeline(
    records: Iterator[TraceRecord],
    config: ReplayConfig,
    on_progress: ProgressCallback | None = None,
) -> Timeline | None:
    """The virtual clock over `records` on config's engines: the expected timeline; None
    if it cannot run."""
    from replay.sim.simulation import simulate

    try:
        return simulate(records, _sim_options(config), on_progress)
    except (ValueError, RuntimeError):
        return None


def simulate_interruptible(
    records: Iterator[TraceRecord], options: SimOptions, on_progress: ProgressCallback | None
) -> Timeline:
    """The virtual clock's replay; Ctrl-C or SIGTERM stops it where it is, with the
    timeline so far (meta "interrupted" names the signal), as the wall clock's driver does."""
    from replay.sim.simulation import Simulation

    simulation = Simulation(records, options, on_progress)
    try:
        return simulation.run()
    except Interrupted as e:
        return simulation.stopped(e.name)


def stopped_before_start(name: str) -> Timeline:
    """The timeline of a run stopped (meta "interrupted": `name`) before it sent anything."""
    return Timeline(
        engines=[],
        num_usable_blocks={},
        samples=[],
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=0.0,
        meta={"interrupted": name},
    )


def _sized(config: ReplayConfig, target: ReplayTarget) -> ReplayConfig:
    """config with the pool the engines allocated (from GPU memory, or a serve's own)."""
    info = getattr(target, "info", None)  # a serve's ServeInfo; num_blocks 0: not said
    sized = (info.num_blocks if info is not None else target.num_blocks) or config.engine.num_blocks
    if sized == config.engine.num_blocks:
        return config
    return replace(config, engine=replace(config.engine, num_blocks=sized))


def _target_meta(config: ReplayConfig, target: ReplayTarget) -> dict:
    info = getattr(target, "info", None)  # a serve's ServeInfo: its own configuration
    if info is not None:
        server = {f.name: getattr(info, f.name) for f in fields(info)}
        return {"liveness": info.liveness, "topology": info.topology, "server": server}
    # the pool the engines allocated (sized from GPU memory, maybe)
    return {
        "liveness": config.engine.liveness,
        "topology": config.topology,
        "num_blocks": target.num_blocks,
    }


def _wall_options(config: ReplayConfig) -> WallOptions:
    from replay.wall.driver import WallOptions

    expected = (
        partial(mock_output_tokens, engine=config.engine)
        if config.effective_check_outputs()
        else None
    )
    return WallOptions(tail_s=config.effective_tail_s(), expected_tokens=expected)


def _sim_options(config: ReplayConfig) -> SimOptions:
    """The same engine and KV-transfer config; the latencies keep their defaults except
    the step cost, when a calibration is given (the virtual clock's run, and the wall
    clock's forecast of the idle windows alike)."""
    calibration = config.calibration
    return SimOptions(
        engine=config.engine,
        kv=config.kv,
        topology=config.topology,
        router=config.router,
        tail_s=config.effective_tail_s(),
        step_cost=calibration.step_cost if calibration is not None else None,
    )


def with_liveness(config: ReplayConfig, liveness: str) -> ReplayConfig:
    return replace(config, engine=replace(config.engine, liveness=liveness))
