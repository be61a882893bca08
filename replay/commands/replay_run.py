"""One replay run: prepared, run, its verdict and outputs written. Runs in: frontend process.

A wall-clock replay's engines start (replay/deploy/topology.py) as soon as its trace is
known to be good, so what the frontend does next (import the live view and the wall
driver, forecast the idle windows, draw) overlaps their start: this module imports those
where they are used, not here.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.markup import escape

from engine.proc.client import EngineDeadError
from replay.commands.replay_options import Display, OutputFiles
from replay.commands.terminal import NoView, print_error
from replay.pipeline import PreparedReplay, ReplayConfig, ReplayResult, prepare_replay
from replay.runtime.interrupt import Interrupted, interruptible, stopping_line
from replay.runtime.startup import StartupStarved
from replay.trace.reader import TraceError, TraceSummary
from replay.trace.records import TraceHeader
from replay.verify.verdict import (
    EXIT_FAULT,
    EXIT_INCONCLUSIVE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    status_for,
    worst,
)


def replay_and_report(
    config: ReplayConfig,
    outputs: OutputFiles,
    display: Display,
    console,
    adopt: Callable[[TraceHeader], ReplayConfig] | None = None,
) -> int:
    """Ctrl-C, SIGTERM and the live view's `q` stop the replay alike: "stopping" at once,
    the engines shut down, the run dir goes, one verdict line for the part that ran and
    the outputs written (the report even when nothing was sent), and the exit status is
    130 or 143. An output that cannot be written is exit 2: before the run if it is known
    then. adopt: what a recording's header makes of the config (replay/pipeline.py)."""
    try:
        outputs.check()
    except ValueError as e:
        print_error(console, e)
        return EXIT_USAGE

    def on_stop(name: str) -> None:  # at once, from the signal handler
        console.print(stopping_line(name), highlight=False, markup=False, soft_wrap=True)

    with interruptible(on_stop):
        try:
            return _replay_main(config, outputs, display, console, adopt)
        except Interrupted as e:  # while the trace was checked or the engines spawned
            return _stopped_before_prepared(e, config, outputs, console)
        except KeyboardInterrupt:  # raised outside the handler's reach (not the main thread)
            print_error(console, "interrupted")
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
            print_error(
                console, f"--report {outputs.report}: not written: {error.strerror or error}"
            )
        else:
            console.print(f"wrote {escape(str(outputs.report))}", highlight=False, soft_wrap=True)
    return e.exit_code


def _replay_main(
    config: ReplayConfig,
    outputs: OutputFiles,
    display: Display,
    console,
    adopt: Callable[[TraceHeader], ReplayConfig] | None,
) -> int:
    try:
        prepared = prepare_replay(config, adopt)  # a local wall replay's engines start meanwhile
    except TraceError as e:
        print_error(console, e)
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
        else NoView(console)
    )
    monitor = ReplayMonitor(state, view, config.verify, start=prepared.launched_at)
    try:
        with view:
            result = prepared.run(monitor.hooks())
            monitor.show_final(result)
            view.tick(force=True)
    except EngineDeadError as e:  # an engine or its connector worker died: a fault
        print_error(console, f"fault: {e}")
        return EXIT_FAULT
    except StartupStarved as e:  # alive and starting, but starved of CPU: no verdict
        print_error(console, f"inconclusive: {e}")
        return EXIT_INCONCLUSIVE
    except TargetLostError as e:  # the serve answered, then went silent mid-run
        print_error(console, f"fault: {e}")
        return EXIT_FAULT
    except ConnectionError as e:  # nothing answered at --target
        print_error(console, e)
        return EXIT_USAGE
    except ValueError as e:  # TraceError among them: input the target cannot take
        print_error(console, e)
        return EXIT_USAGE
    return _report(result, outputs, display, console)


def _print_trace_notes(summary: TraceSummary, config: ReplayConfig, console) -> None:
    """What the checking pass skipped, the requests the engines will stop at max_model_len,
    and how long a long wall replay will take."""
    for message in summary.bad_line_messages:
        console.print(f"[yellow]skipped:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if summary.num_capped:
        console.print(
            f"[yellow]note:[/] {summary.num_capped:,} of the trace's {summary.num_requests:,} "
            f"requests (before shaping) ask for more than max_model_len "
            f"{config.engine.max_model_len:,} tokens (prompt + max_tokens); the engines stop "
            f"them there",
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
    from replay.verify.timeline import skipped_abort_lines

    for line in skipped_abort_lines(result.timeline):
        console.print(f"[yellow]note:[/] {line}", highlight=False, soft_wrap=True)
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
            print_error(
                console, f"{flag} {path}: not written: {e.strerror or e}; the verdict stands"
            )
            ok = False
        except RuntimeError as e:  # --plot without matplotlib
            print_error(console, f"{flag} {path}: not written: {e}; the verdict stands")
            ok = False
        else:
            console.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
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
