"""`replay --engine vllm`: launch vLLM, replay through it, tear it down. Runs in: frontend process.

In order: the venv is checked and the trace validated (exit 2, before anything starts);
the instances and the proxy start at once (replay/vllm/launch.py) while each
instance's start-up is printed as it changes (starting..., loading, ready in N s, or the
last log line of one that died); the usual HTTP replay then runs against the proxy (or
the single instance) with every instance's /metrics scraped under its name; last, every
process started is stopped, whatever happened. A start that failed, or an instance that
died during the replay, is a fault (exit 4) naming its log. Ctrl-C and SIGTERM during
start-up stop it alike (exit 130, 143).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from rich.markup import escape

from engine.core.release import KV_LEASE_S
from engine.proc.run_dir import run_root
from replay.commands.replay_options import Display, OutputFiles
from replay.commands.replay_run import replay_and_report
from replay.pipeline import LAUNCHED, ReplayConfig, trace_limits
from replay.runtime.interrupt import SIGNALS, Interrupted, interruptible
from replay.runtime.startup import StartupStarved
from replay.trace.reader import TraceError, validate_trace
from replay.verify.verdict import EXIT_FAULT, EXIT_INCONCLUSIVE, EXIT_USAGE
from replay.vllm.idle_cpu import idle_note, lower_spinners
from replay.vllm.launch import (
    InstanceStatus,
    VllmDeployment,
    VllmFault,
    VllmVenvError,
    check_venv,
    gpu_count,
)
from replay.vllm.options import VllmOptions
from replay.vllm.orphans import RUN_PREFIX

# The drain deadline a CPU host's vLLM is judged by unless --drain-deadline is given: two
# vLLM instances on a few busy cores answer /metrics in up to 1.5 s (measured on 2 cores),
# so a drain by 0.5 s cannot be proven from their readings and such windows stay
# undecided; a leak (blocks held for the whole window) is still one.
CPU_DRAIN_DEADLINE_S = 2.0
# And how long a scrape waits for such an instance's /metrics: answers took up to 1.5 s
# there, so at the default 2 s some were dropped as failures (a run with a failed scrape is
# inconclusive); a later answer is still evidence (its reading is bounded by its sending
# and its answer), so waiting longer costs only that scrape's next slot.
CPU_SCRAPE_TIMEOUT_S = 5.0
HEARTBEAT_S = 15.0  # a start-up line at least this often while waiting


def _say(console, text: str) -> None:
    console.print(text, highlight=False, soft_wrap=True)


def _fault(console, fault: VllmFault) -> None:
    _say(console, f"[red]fault:[/] {escape(str(fault))}")
    for line in fault.last_lines:  # a log's text: "[rank0]:" is not markup
        _say(console, f"  {fault.name} | {escape(line)}")


def vllm_replay_main(
    options: VllmOptions,
    config: ReplayConfig,
    outputs: OutputFiles,
    display: Display,
    console,
    run_dir: Path | None = None,
    deadline_given: bool = True,
    threshold_given: bool = True,
) -> int:
    """config: an HTTP replay whose target the launched deployment replaces; deadline_given,
    threshold_given: False when --drain-deadline, --idle-threshold were left at their
    defaults (then a CPU host's deadline is wider, and the threshold no shorter)."""
    try:
        install = check_venv(options.venv)
        validate_trace(config.trace, config.fmt, config.skip_bad_lines, trace_limits(config))
    except (VllmVenvError, TraceError) as e:
        _say(console, f"[red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    on_cpu = gpu_count() == 0
    if on_cpu:
        config = _cpu_config(config, console, deadline_given, threshold_given)
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=run_root()))
    _say(
        console,
        f"vLLM {install.version} ({options.venv}), topology {options.topology}"
        f"{'; each P in-process (LLM class)' if options.producer == 'inproc' else ''}; "
        f"logs in {run_dir}",
    )
    with interruptible():
        deployment = VllmDeployment(options, install, run_dir)
        try:
            return _launch_and_replay(deployment, config, outputs, display, console, on_cpu)
        except VllmFault as e:
            _fault(console, e)
            return EXIT_FAULT
        except StartupStarved as e:
            console.print(f"inconclusive: {e}", highlight=False, markup=False, soft_wrap=True)
            return EXIT_INCONCLUSIVE
        except Interrupted as e:
            _say(console, f"[red]error:[/] interrupted by {e.name} during start-up")
            return e.exit_code
        finally:
            with _signals_held():
                deployment.close()
            _say(
                console,
                f"vllm: stopped every process started ({len(deployment.processes())} "
                f"and their children); logs: "
                f"{', '.join(map(str, deployment.log_paths))}",
            )


def _cpu_config(
    config: ReplayConfig, console, deadline_given: bool, threshold_given: bool
) -> ReplayConfig:
    """What judging vLLM on a CPU host takes: a wider drain deadline and scrape timeout, and
    no idle window shorter than the deadline (the options the user gave stay theirs)."""
    verify = config.verify
    if not deadline_given and verify.drain_deadline_s < CPU_DRAIN_DEADLINE_S:
        verify = replace(verify, drain_deadline_s=CPU_DRAIN_DEADLINE_S)
        _say(
            console,
            f"drain deadline {CPU_DRAIN_DEADLINE_S:g} s: vLLM on the CPU answers /metrics too "
            f"slowly to prove a drain by a shorter one (--drain-deadline sets it)",
        )
    if not threshold_given and verify.idle_threshold_s < verify.drain_deadline_s:
        verify = replace(verify, idle_threshold_s=verify.drain_deadline_s)
        _say(
            console,
            f"idle threshold {verify.idle_threshold_s:g} s: a window shorter than the "
            f"drain deadline can be judged neither drained nor leaking (--idle-threshold sets it)",
        )
    http = replace(
        config.http, scrape_timeout_s=max(config.http.scrape_timeout_s, CPU_SCRAPE_TIMEOUT_S)
    )
    return replace(config, verify=verify, http=http)


def _launch_and_replay(
    deployment: VllmDeployment,
    config: ReplayConfig,
    outputs: OutputFiles,
    display: Display,
    console,
    on_cpu: bool,
) -> int:
    deployment.start()
    for swept in deployment.swept:
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in swept.stopped if p.leader)
        _say(
            console,
            f"vllm: stopped {swept.num_stopped} processes a killed run left running: {names}; "
            f"its logs: {swept.run_dir}",
        )
    for instance in deployment.instances:
        spec = instance.spec
        side = f" (NIXL side channel {spec.side_channel_port})" if spec.kv_role else ""
        who = f" {spec.program}" if spec.producer != "serve" else ""
        _say(console, f"  {spec.name}: starting{who}... {spec.url}{side}, log {spec.log_path}")
    deployment.wait_ready(
        _StartupView(console, [i.spec.name for i in deployment.instances]),
        on_note=lambda note: console.print(
            f"note: {note}", highlight=False, markup=False, soft_wrap=True
        ),
    )
    ready_s = max(s.ready_s or 0.0 for s in deployment.statuses())
    if on_cpu:
        idle = lower_spinners(deployment.instance_pids())  # before the first request: idle
        _say(console, idle_note(idle, len(os.sched_getaffinity(0))))
    _say(
        console, f"vllm: launch to ready {ready_s:.1f} s; replaying through {deployment.target_url}"
    )
    http = replace(
        config.http,
        base_url=deployment.target_url,
        metrics=tuple(_metrics_source(name, url) for name, url in deployment.metrics()),
        model=config.http.model or deployment.served_model,
        vocab_size=config.http.vocab_size or deployment.vocab_size,
        vocab_source=config.http.vocab_source
        if config.http.vocab_size is not None
        else "the launched model's config",
        connector="NixlConnector" if any(s.kv_role for s in deployment.specs) else None,
    )
    started = time.monotonic()
    launched = replace(
        config,
        target=deployment.target_url,
        http=http,
        served_release=(deployment.install.version, LAUNCHED),
        served_lease_s=(KV_LEASE_S, "the launcher sets no kv_lease_duration: NIXL's default"),
        engine_logs=tuple((s.name, s.log_path) for s in deployment.specs if s.kv_role),
    )
    code = replay_and_report(launched, outputs, display, console)
    replay_s = time.monotonic() - started
    _say(console, f"vllm: launch to ready {ready_s:.1f} s, replay {replay_s:.1f} s")
    if outputs.report is not None and outputs.report.exists():
        add_deployment(outputs.report, deployment, replay_s)
    dead = deployment.dead()
    if dead is not None:
        _fault(console, dead)
        return EXIT_FAULT
    return code


def deployment_record(deployment: VllmDeployment, replay_s: float) -> dict:
    """What was launched: vLLM's version, each instance's command line, ports and log."""
    return {
        "engine": "vllm",
        "vllm_version": deployment.install.version,
        "venv": str(deployment.install.venv),
        "topology": deployment.options.topology,
        "producer": deployment.options.producer,
        "model": deployment.options.model or "kvdrain's tiny dummy-weight Llama",
        "proxy": deployment.proxy_url,
        "run_dir": str(deployment.run_dir),
        "replay_s": round(replay_s, 3),
        "instances": [
            {
                "name": i.spec.name,
                "program": i.spec.program,
                "url": i.spec.url,
                "side_channel_port": i.spec.side_channel_port,
                "argv": i.spec.argv[1:],  # after the venv's vllm (or python)
                "log": str(i.spec.log_path),
                "ready_s": i.status.ready_s,
            }
            for i in deployment.instances
        ],
    }


def add_deployment(report_path: Path, deployment: VllmDeployment, replay_s: float) -> None:
    """The written report gains what was launched."""
    report = json.loads(report_path.read_text())
    report["deployment"] = deployment_record(deployment, replay_s)
    report_path.write_text(json.dumps(report, indent=2) + "\n")


def _metrics_source(name: str, url: str):
    from replay.metrics.scrape import MetricsSource

    return MetricsSource(url, name)


class _StartupView:
    """Prints an instance's line when its state changes, and all of them every HEARTBEAT_S."""

    def __init__(self, console, names: list[str]) -> None:
        self.console = console
        self.shown = {name: "starting" for name in names}  # as the launch printed them
        self.last_heartbeat = time.monotonic()

    def __call__(self, statuses: list[InstanceStatus]) -> None:
        changed = [s for s in statuses if self.shown.get(s.name) != s.state]
        if time.monotonic() - self.last_heartbeat >= HEARTBEAT_S:  # and those still starting
            changed += [s for s in statuses if s.state != "ready" and s not in changed]
        for s in changed:
            _say(self.console, f"  {s.name}: {escape(describe(s))}")
            self.shown[s.name] = s.state
        if changed:
            self.last_heartbeat = time.monotonic()


def describe(status: InstanceStatus) -> str:
    if status.state == "ready":
        return f"ready in {status.ready_s:.1f} s"
    if status.state == "exited":
        return f"{status.state} after {status.since_s:.0f} s: {status.last_line}"
    return f"{status.state}{'...' if status.state == 'starting' else ''} ({status.since_s:.0f} s)"


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Teardown is not cut short by a second Ctrl-C (it is bounded anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
