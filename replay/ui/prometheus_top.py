"""`kvdrain top --prometheus URL --metrics SELECTOR`: engines watched through a Prometheus. Runs in: frontend process.

The selectors' series are read as `replay --prometheus` reads them
(replay/metrics/prometheus.py) and shown on `top --metrics`'s dashboard
(replay/ui/metrics_top.py). Before watching it waits (bounded) for the series. top only
watches, so a scrape interval too coarse for the drain deadline is not refused: the
windows are judged with the shortest deadline the samples can prove (twice the
interval), and a message line says which.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp
from rich.markup import escape

from replay.metrics.prometheus import (
    PrometheusOptions,
    PromReader,
    interval_refusal,
    provable_deadline,
    wait_for_series,
)
from replay.ui.dashboard import DashboardState
from replay.ui.metrics_top import MetricsWatch, watch_metrics
from replay.verify.rules import VerifyOptions


def judged_options(options: VerifyOptions, interval_s: float) -> tuple[VerifyOptions, str | None]:
    """The options top judges with, and the line saying so when the deadline changed."""
    if interval_refusal(interval_s, "", options.drain_deadline_s) is None:
        return options, None
    deadline = provable_deadline(interval_s, options.drain_deadline_s)
    note = (
        f"judging with a drain deadline of {deadline:g} s, the shortest that Prometheus's "
        f"{interval_s:g} s scrape interval can prove (not {options.drain_deadline_s:g} s)"
    )
    return replace(options, drain_deadline_s=deadline), note


async def ready_readers(
    prometheus: PrometheusOptions, origin: float, timeout_s: float
) -> tuple[list[PromReader], list[str]]:
    """The selectors' readers once their series exist, and a line for each that did not."""
    readers = [PromReader(prometheus.url, s, origin, timeout_s) for s in prometheus.selectors]
    problems = []
    async with aiohttp.ClientSession() as session:
        for reader in readers:
            why = await wait_for_series(session, reader, prometheus.series_wait_s)
            if why is not None:
                problems.append(f"{reader.source.url}: {why}")
    return readers, problems


def prometheus_top_main(
    prometheus: PrometheusOptions,
    seconds: float | None,
    interval_s: float,
    console,
    options: VerifyOptions = VerifyOptions(),
) -> int:
    """`kvdrain top --prometheus URL --metrics SELECTOR ...`: the exit status."""
    from replay.ui.tui import LiveView
    from replay.verify.verdict import EXIT_OK, EXIT_USAGE

    origin = time.monotonic()
    readers, problems = asyncio.run(ready_readers(prometheus, origin, 2.0))
    for line in problems:  # a server's text: never markup
        console.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if problems:
        return EXIT_USAGE
    options, note = judged_options(options, max(r.interval_s for r in readers))
    title = f"kvdrain top {prometheus.url} " + " ".join(str(s) for s in prometheus.selectors)
    state = DashboardState(title=title, messages=[note] if note else [])
    sources = [r.source for r in readers]
    watch = MetricsWatch(sources, state, options, origin, scrapers=readers)
    view = LiveView(state, console)
    try:
        with view:
            asyncio.run(watch_metrics(watch, view, seconds, interval_s))
    except KeyboardInterrupt:  # Ctrl-C is how top is left
        pass
    return EXIT_OK
