"""`kvdrain top`: watch a serve's engines or any server's metrics. Runs in: frontend process."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import click

from replay.commands.terminal import print_error
from replay.verify.rules import VerifyOptions
from replay.verify.verdict import EXIT_FAULT, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from replay.serve.auth import AuthOptions
    from replay.serve.client import ServeClient
    from replay.ui.monitor import ServeMonitor


def top_main(
    address: str | None,
    metrics: tuple[str, ...],
    prometheus: str | None,
    interval: float,
    seconds: float | None,
    auth: AuthOptions | None,
    console,
) -> int:
    """`kvdrain top`: the exit status (2 for a URL that never answered, 4 for a serve lost)."""
    problem = connect_problem(address, metrics)
    if problem is not None:
        raise click.UsageError(problem)
    if prometheus is not None:
        from replay.commands.replay_options import prometheus_options
        from replay.ui.prometheus_top import prometheus_top_main

        try:
            options = prometheus_options(prometheus, metrics)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        return prometheus_top_main(options, seconds, interval, console)
    if metrics:
        return watch_metrics_urls(list(metrics), seconds, interval, console)
    return watch_serve(address, seconds, console, auth)


def watch_serve(address: str, seconds: float | None, console, auth: AuthOptions | None) -> int:
    """`top --connect`: a serve's stats until `seconds` pass, `q` or Ctrl-C."""
    from replay.serve.client import ServeClient
    from replay.ui.dashboard import DashboardState
    from replay.ui.monitor import ServeMonitor
    from replay.ui.tui import LiveView

    try:
        client = ServeClient(address, auth=auth)
    except ConnectionError as e:
        print_error(console, e)
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
        print_error(console, f"disconnected: {state.messages[-1]}")
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


def watch_metrics_urls(
    args: list[str],
    seconds: float | None,
    interval_s: float,
    console,
    options: VerifyOptions = VerifyOptions(),
) -> int:
    """`top --metrics [NAME=]URL ...`: the exit status (replay/verify/verdict.py's)."""
    from replay.metrics.scrape import MetricsSource
    from replay.ui.dashboard import DashboardState
    from replay.ui.metrics_top import MetricsWatch, top_title, watch_metrics
    from replay.ui.tui import LiveView

    try:
        sources = [MetricsSource.parse(arg) for arg in args]
    except ValueError as e:
        print_error(console, e)
        return EXIT_USAGE
    state = DashboardState(title=top_title(sources))
    watch = MetricsWatch(sources, state, options)
    view = LiveView(state, console)
    try:
        with view:
            asyncio.run(watch_metrics(watch, view, seconds, interval_s))
    except KeyboardInterrupt:  # Ctrl-C is how top is left
        pass
    for line in watch.failures():
        print_error(console, line)
    # A URL that never gave a reading is a wrong or unreachable target (exit 2, as replay's
    # pre-flight and top --connect say it), not an engine fault.
    return EXIT_USAGE if watch.failures() else EXIT_OK


def metrics_url(address: str) -> str:
    """A server's /metrics URL from its address (a path given is kept)."""
    scheme, _, rest = address.partition("://")
    return address if "/" in rest.rstrip("/") else f"{scheme}://{rest.rstrip('/')}/metrics"


def connect_problem(address: str | None, metrics: tuple[str, ...] | list[str]) -> str | None:
    """What is wrong with top's --connect / --metrics pair, or None."""
    if address is not None and metrics:
        return "give --connect (a kvdrain serve) or --metrics (any server's metrics), not both"
    if address is None and not metrics:
        return "say what to watch: --connect ADDRESS (a kvdrain serve) or --metrics URL"
    if address is not None and address.split("://")[0] in ("http", "https"):
        return (
            f"--connect takes a kvdrain serve's ZMQ address (tcp://HOST:PORT or ipc://PATH), "
            f"not {address!r}; to watch a server's Prometheus metrics: "
            f"--metrics {metrics_url(address)}"
        )
    return None
