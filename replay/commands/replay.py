"""What each CLI verb does, once its options are parsed: replay, serve, top. Runs in: frontend process.

A wall-clock replay's engines start (replay/deploy/topology.py) as soon as its trace is
known to be good, so what the frontend does next (import the live view and the wall
driver, model the idle windows, draw) overlaps their start: this module imports those
where they are used, not here.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from engine.config import MODEL_PRESETS, EngineConfig, KVTransferConfig
from engine.proc.client import EngineDeadError
from replay.deploy.topology import start_topology
from replay.pipeline import PreparedReplay, ReplayConfig, ReplayResult, prepare_replay
from replay.runtime.interrupt import Interrupted, interruptible, stopping_line
from replay.runtime.startup import StartupStarved
from replay.serve.messages import ServeInfo
from replay.trace.reader import TraceError, TraceSummary
from replay.verify.verdict import (
    EXIT_FAULT,
    EXIT_INCONCLUSIVE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    status_for,
    worst,
)

if TYPE_CHECKING:
    from replay.serve.auth import AuthOptions
    from replay.serve.client import ServeClient
    from replay.ui.monitor import ServeMonitor


PLOT_SUFFIX = ".png"


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputFiles:
    """The files a replay writes once it has a verdict (None: not written)."""

    report: Path | None = None  # the machine-readable report (JSON)
    requests: Path | None = None  # one JSON line per request
    plot: Path | None = None  # a PNG of blocks used over time
    series: Path | None = None  # the plot's time series as CSV

    def given(self) -> list[tuple[str, Path]]:
        """(--flag, path) of each file asked for."""
        return [
            (f"--{f.name}", getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        ]

    def check(self) -> None:
        """A ValueError naming the first file that could not be written, before a run
        that may take hours; a write can still fail later (a full disk: /dev/full)."""
        for flag, path in self.given():
            why = unwritable(path)
            if why is not None:
                raise ValueError(f"{flag} {path}: {why}")
        if self.plot is not None and self.plot.suffix.lower() != PLOT_SUFFIX:
            raise ValueError(f"--plot {self.plot}: the plot is a PNG; name the file *{PLOT_SUFFIX}")
        paths = [path.resolve() for _, path in self.given()]
        if len(set(paths)) < len(paths):
            raise ValueError("--report/--requests/--plot/--series: two outputs name the same file")


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be opened for writing, or None."""
    if path.is_dir():
        return "is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else "not writable"
    parent = path.parent
    if not parent.is_dir():
        return f"no such directory: {parent}"
    return (
        None if os.access(parent, os.W_OK | os.X_OK) else f"the directory {parent} is not writable"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Display:
    """What the terminal shows while and after a replay runs."""

    live: bool = True  # the live dashboard (else only the final summary)
    max_window_lines: int | None = 10  # idle windows listed at the end (None: all)
    latency_block: bool = False  # vllm bench's 25-line latency block, not the compact lines
    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)  # --metric-percentiles


def _error(console, error: object) -> None:
    """One unwrapped line, so a file:line stays whole for editors and grep; the error's
    text is never markup (it may quote a server)."""
    console.print(f"[red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)


class _NoView:
    """--no-live: no dashboard at all, only the final summary (and notes on the way)."""

    def __init__(self, console) -> None:
        self.console = console

    def __enter__(self) -> _NoView:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    quit_requested = False

    def tick(self, force: bool = False) -> None:
        return None


def replay_main(config: ReplayConfig, outputs: OutputFiles, display: Display, console) -> int:
    """Ctrl-C, SIGTERM and the live view's `q` stop the replay alike: "stopping" at once,
    the engines shut down, the run dir goes, one verdict line for the part that ran and
    the outputs written (the report even when nothing was sent), and the exit status is
    130 or 143. An output that cannot be written is exit 2: before the run if it is known then."""
    try:
        outputs.check()
    except ValueError as e:
        _error(console, e)
        return EXIT_USAGE

    def on_stop(name: str) -> None:  # at once, from the signal handler
        console.print(stopping_line(name), highlight=False, markup=False, soft_wrap=True)

    with interruptible(on_stop):
        try:
            return _replay_main(config, outputs, display, console)
        except Interrupted as e:  # while the trace was checked or the engines spawned
            return _stopped_before_prepared(e, config, outputs, console)
        except KeyboardInterrupt:  # raised outside the handler's reach (not the main thread)
            _error(console, "interrupted")
            return EXIT_INTERRUPTED


def _stopped_before_prepared(
    e: Interrupted, config: ReplayConfig, outputs: OutputFiles, console
) -> int:
    """The verdict line and --report of a run stopped before its trace was checked."""
    from replay.verify.report import set_status, verdict_line, write_report

    report = {
        "kvdrain_report": 1,
        "reasons": [],
        "settings": {"trace": str(config.trace), "clock": config.clock},
        "interrupted": e.name,
        "stop": {"by": e.name, "after_s": 0.0, "num_sent": 0, "num_requests": None},
    }
    set_status(report, status_for(e.exit_code))
    console.print(verdict_line(report), highlight=False, markup=False, soft_wrap=True)
    if outputs.report is not None:
        try:
            write_report(outputs.report, report)
        except OSError as error:
            _error(console, f"--report {outputs.report}: not written: {error.strerror or error}")
        else:
            console.print(f"wrote {outputs.report}", highlight=False, soft_wrap=True)
    return e.exit_code


def _replay_main(config: ReplayConfig, outputs: OutputFiles, display: Display, console) -> int:
    try:
        prepared = prepare_replay(config)  # a local wall replay's engines start meanwhile
    except TraceError as e:
        _error(console, e)
        return EXIT_USAGE
    with prepared:
        return _run_and_report(prepared, outputs, display, console)


def _run_and_report(
    prepared: PreparedReplay, outputs: OutputFiles, display: Display, console
) -> int:
    from replay.serve.client import TargetLostError
    from replay.ui.monitor import ReplayMonitor, replay_state
    from replay.ui.tui import LiveView

    config, summary = prepared.config, prepared.summary
    _print_trace_notes(summary, config, console)
    state = replay_state(config, summary.num_requests, summary.duration)
    view = (
        LiveView(state, console, max_window_lines=display.max_window_lines)
        if display.live
        else _NoView(console)
    )
    monitor = ReplayMonitor(state, view, config.verify, start=prepared.launched_at)
    try:
        with view:
            result = prepared.run(monitor.hooks())
            monitor.show_final(result)
            view.tick(force=True)
    except EngineDeadError as e:  # an engine or its connector worker died: a fault
        _error(console, f"fault: {e}")
        return EXIT_FAULT
    except StartupStarved as e:  # alive and starting, but starved of CPU: no verdict
        _error(console, f"inconclusive: {e}")
        return EXIT_INCONCLUSIVE
    except TargetLostError as e:  # the serve answered, then went silent mid-run
        _error(console, f"fault: {e}")
        return EXIT_FAULT
    except ConnectionError as e:  # nothing answered at --target
        _error(console, e)
        return EXIT_USAGE
    except ValueError as e:  # TraceError among them: input the target cannot take
        _error(console, e)
        return EXIT_USAGE
    return _report(result, outputs, display, console)


def _print_trace_notes(summary: TraceSummary, config: ReplayConfig, console) -> None:
    """What the checking pass skipped, the requests the engines will stop at max_model_len,
    and how long a long wall replay will take."""
    for message in summary.bad_line_messages:
        console.print(f"[yellow]skipped:[/] {message}", highlight=False, soft_wrap=True)
    if summary.num_capped:
        console.print(
            f"[yellow]note:[/] {summary.num_capped:,} of the trace's {summary.num_requests:,} "
            f"requests (before shaping) ask for more than max_model_len {config.engine.max_model_len:,} "
            f"tokens (prompt + max_tokens); the engines stop them there",
            highlight=False,
            soft_wrap=True,
        )
    from replay.trace.inspect import wall_time_note

    note = wall_time_note(
        config.clock,
        config.trace,
        config.fmt,
        config.shaping,
        summary.duration,
        config.effective_tail_s(),
        config.skip_bad_lines,
    )
    if note is not None:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _report(result: ReplayResult, outputs: OutputFiles, display: Display, console) -> int:
    from replay.verify.report import build_report, print_summary, set_status

    s = result.summary
    trace = {
        "path": s.path,
        "format": s.format,
        "sha256": s.sha256,
        "num_requests": s.num_requests,
        "duration_s": s.duration,
        "num_bad_lines": s.num_bad_lines,
    }
    report = build_report(
        result.timeline,
        result.verdict,
        result.settings(),
        trace,
        result.shaping_log.lines(),
        display.percentiles,
    )
    http = _http_outcome(result)
    if http is not None:
        report["http"] = http
        from replay.verify.outcome import outcome_lines

        for line in outcome_lines(http):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        set_status(report, worst(report["status"], http["verdict"]))
        report["reasons"] = [*report["reasons"], *http["reasons"]]  # what HTTP did not observe
    interrupted = _interruption(result, report)
    print_summary(console, report, latency_block=display.latency_block)
    from replay.trace.inspect import only_tail_note

    note = only_tail_note(
        result.verdict.coverage,
        result.config.shaping.speedup,
        result.config.verify.idle_threshold_s,
    )
    if note is not None:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    _write_outputs(outputs, result, report, console)
    if interrupted is not None:
        return interrupted.exit_code
    return report["exit_code"]  # the verdict's: a file not written is said beside it


def _write_outputs(outputs: OutputFiles, result: ReplayResult, report: dict, console) -> bool:
    """Every file asked for, each said when written; a failure is one line (the verdict
    and its exit status stand) and the rest are still written. False if any failed."""
    from replay.verify.plot import write_plot, write_series
    from replay.verify.report import write_report, write_requests

    writers = {
        "report": lambda path: write_report(path, report),
        "requests": lambda path: write_requests(path, result.timeline),
        "series": lambda path: write_series(path, result.timeline),
        "plot": lambda path: write_plot(
            path,
            result.timeline,
            result.verdict,
            _plot_title(result, report),
            result.config.verify.drain_deadline_s,
        ),
    }
    ok = True
    for flag, path in outputs.given():
        try:
            writers[flag[2:]](path)
        except OSError as e:
            _error(console, f"{flag} {path}: not written: {e.strerror or e}; the verdict stands")
            ok = False
        except RuntimeError as e:  # --plot without matplotlib
            _error(console, f"{flag} {path}: not written: {e}; the verdict stands")
            ok = False
        else:
            console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    return ok


def _plot_title(result: ReplayResult, report: dict) -> str:
    from replay.verify.plot import plot_title, system_label

    return plot_title(
        result.config.trace.name,
        system_label(report["settings"]),
        result.config.clock,
        report["status"],
        report["exit_code"],
    )


def _interruption(result: ReplayResult, report: dict) -> Interrupted | None:
    """A run stopped by a signal or `q`: its status (one exit code, 130 or 143) and what
    ran, for the verdict line (replay/verify/report.py) and the report."""
    from replay.verify.report import STOPPED_EARLY, set_status

    name = result.timeline.meta.get("interrupted")
    if name is None:
        return None
    interrupted = Interrupted.named(name)
    report["interrupted"] = name
    report["stop"] = {
        "by": name,
        "after_s": result.timeline.end_t,
        "num_sent": len(result.timeline.requests),
        "num_requests": result.summary.num_requests,
    }
    set_status(report, status_for(interrupted.exit_code))
    report["reasons"] = [
        r for r in report["reasons"] if not r.startswith(STOPPED_EARLY)
    ]  # the verdict line's
    return interrupted


def _http_outcome(result: ReplayResult) -> dict | None:
    """--target http://: the server, its metrics, latency and a verdict that can be inconclusive."""
    if result.config.http is None:
        return None
    from replay.verify.outcome import http_outcome

    return http_outcome(result.timeline, result.verdict)


class _StopFlag:
    """Set by SIGTERM (Ctrl-C raises KeyboardInterrupt as usual)."""

    def __init__(self) -> None:
        self.stop = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.stop = True

    def __call__(self) -> bool:
        return self.stop


def serve_main(
    engine: EngineConfig,
    kv: KVTransferConfig,
    topology: str,
    address: str,
    record: Path | None,
    live: bool,
    console,
    http=None,
    auth: AuthOptions | None = None,
    policy: str = "round-robin",
) -> int:
    """http: replay/serve/fronts.py HttpServe, to serve OpenAI-compatible HTTP beside zmq;
    auth: the credentials clients must give (replay/serve/auth.py)."""
    from replay.serve.auth import AuthOptions
    from replay.serve.server import ServeError, ServeOptions, Server, open_front, recording_metadata
    from replay.ui.dashboard import DashboardState
    from replay.ui.monitor import ServeMonitor
    from replay.ui.tui import LiveView

    stop = _StopFlag()
    options = ServeOptions(address, record, engine.max_model_len, auth or AuthOptions())
    try:  # the client socket and --record first: a bad one is an error before any engine starts
        front = open_front(
            options, recording_metadata(topology, engine.liveness, engine.block_size)
        )
    except ServeError as e:
        _error(console, e)
        return EXIT_USAGE
    for warning in front.warnings:
        console.print(f"[bold red]{warning}[/]", highlight=False, soft_wrap=True)
    try:
        if http is not None:
            http.bind()
    except OSError as e:
        front.close()
        why = os.strerror(e.errno) if e.errno else str(e)
        _error(console, f"--http {http.options.host}:{http.options.port}: {why}")
        return EXIT_USAGE
    try:
        router = start_topology(engine, kv, topology, router=policy)
    except BaseException:
        front.close()
        http is None or http.close()
        raise
    try:
        info = ServeInfo(
            router.engines,
            topology,
            engine.liveness,
            router.vocab_size,
            engine.block_size,
            engine.runner,
            engine.max_model_len,
            router.num_blocks,
            _preset_name(engine),
        )
        shared = router if http is None else http.share(router)
        server = Server(shared, options, info, front)
    except Exception:
        front.close()
        router.shutdown()
        raise
    print(
        f"kvdrain serve: {topology} topology, liveness {engine.liveness}, listening on "
        f"{server.address}",
        flush=True,
    )
    state = DashboardState(
        title=f"kvdrain serve {server.address}", server=f"{topology}  liveness {engine.liveness}"
    )
    view = LiveView(state, console) if live else _NoView(console)
    monitor = ServeMonitor(state, view, http_url=lambda: getattr(http, "url", None))
    try:
        with view:
            if http is None:
                server.serve_forever(monitor.on_tick, lambda: stop() or view.quit_requested)
            else:
                http.run(
                    server, engine, topology, monitor.on_tick, lambda: stop() or view.quit_requested
                )
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        router.shutdown()
    over_http = "" if http is None else f" ({http.num_requests} over HTTP)"
    print(
        f"kvdrain serve: stopped after {server.num_requests + (http.num_requests if http else 0)} "
        f"requests{over_http}",
        flush=True,
    )
    return EXIT_TERMINATED if stop() else EXIT_OK  # SIGTERM: 128 + 15, as the verdict table says


def _preset_name(engine: EngineConfig) -> str:
    return next((name for name, m in MODEL_PRESETS.items() if m == engine.model), "custom")


def top_main(address: str, seconds: float | None, console, auth: AuthOptions | None = None) -> int:
    from replay.serve.client import ServeClient
    from replay.ui.dashboard import DashboardState
    from replay.ui.monitor import ServeMonitor
    from replay.ui.tui import LiveView

    try:
        client = ServeClient(address, auth=auth)
    except ConnectionError as e:
        _error(console, e)
        return EXIT_USAGE
    state = DashboardState(
        title=f"kvdrain top {address} ({client.info.topology}, {client.info.liveness})"
    )
    code = EXIT_OK
    try:
        view = LiveView(state, console)
        monitor = ServeMonitor(state, view)
        with view:
            code = _watch(client, monitor, seconds)
    except KeyboardInterrupt:  # Ctrl-C is how top is left
        pass
    finally:
        client.shutdown()
    if code != EXIT_OK:
        _error(console, f"disconnected: {state.messages[-1]}")
    return code


def _watch(client: ServeClient, monitor: ServeMonitor, seconds: float | None) -> int:
    """Show the serve's stats until `seconds` pass; EXIT_FAULT once it stops answering."""
    from replay.serve.client import TargetLostError

    while (
        seconds is None or time.monotonic() - monitor.start < seconds
    ) and not monitor.view.quit_requested:  # q quits, as Ctrl-C does
        try:
            client.poll(0.1)
        except TargetLostError as e:
            monitor.state.messages.append(str(e))
            monitor.state.title += " (disconnected)"
            return EXIT_FAULT
        monitor.on_snapshots(client.take_stats())
        monitor.on_restarts(client.restarts)
    return EXIT_OK
