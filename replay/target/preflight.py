"""The checks before an HTTP replay's first request: the target answers, every metrics URL reads. Runs in: frontend process.

`replay --target http://...` calls preflight() before it forecasts the idle windows or
sends anything:
- one GET /v1/models (replay/target/client.py probe): no answer, a refusal (401, 403) or a
  failure (a 5xx: a proxy whose decode server is down), or no model list and no --model,
  is a PreflightError naming the URL, the HTTP status or connection error and what to do;
- one scrape of every --metrics URL (replay/metrics/scrape.py Scraper): any failure (no
  answer, not 200, no KV-usage metric, none of the model under test's series) is a
  PreflightError naming the URL and why;
- without --metrics, a kvdrain proxy's upstreams (its /health names them) are scraped
  the same way, without the API key (one on another host than the target's is a
  PreflightError naming the --metrics NAME=URL that gives it: server_facts.is_followable),
  else the target's own /metrics when it exposes a KV-usage metric; when neither, the
  replay runs without metrics and says so.
- with --prometheus, each selector's series waited for (bounded) through that
  Prometheus, and its scrape interval checked against the drain deadline: one longer
  than half of it is a PreflightError naming the interval the replay needs, at once when
  Prometheus's configuration says it (/api/v1/targets), before waiting for any series.
The CLI turns a PreflightError into exit 2 with no request sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import aiohttp
from yarl import URL

from replay.metrics.prometheus import (
    PrometheusOptions,
    configured_interval,
    interval_refusal,
    wait_for_series,
)
from replay.metrics.scrape import MetricsSource, Scraper
from replay.target.client import (
    HttpTargetOptions,
    ServerIdentity,
    api_root,
    probe,
    target_session,
)
from replay.target.server_facts import UpstreamRefused, discover_metrics

FROM_GIVEN, FROM_PROXY, FROM_TARGET = "--metrics", "the proxy's /health", "the target's /metrics"
FROM_PROMETHEUS = "--prometheus"


class PreflightError(ConnectionError):
    """A URL the replay needs that failed its one check (the CLI's exit 2)."""

    def __init__(self, url: str, why: str, named_by: str = FROM_GIVEN) -> None:
        super().__init__(f"{url}: {why} (before any request was sent; from {named_by})")
        self.url = url
        self.why = why


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckedTarget:
    """What the checks found: the options with the metrics URLs the replay will scrape,
    and the server's /v1/models answer (HttpReplay takes it rather than asking again)."""

    options: HttpTargetOptions
    identity: ServerIdentity


def preflight(options: HttpTargetOptions, drain_deadline_s: float = 0.5) -> CheckedTarget:
    """The target and its metrics URLs checked (see the module docstring), or a
    PreflightError (a ConnectionError from /v1/models) with nothing sent."""
    return asyncio.run(_preflight(options, drain_deadline_s))


async def _preflight(options: HttpTargetOptions, drain_deadline_s: float) -> CheckedTarget:
    origins = {URL(u).origin() for u in (options.base_url, *(m.url for m in options.metrics))}
    if options.prometheus is not None:
        origins.add(URL(options.prometheus.url).origin())
    async with target_session(options, origins) as session:
        identity = await probe(
            session, options
        )  # a ConnectionError naming the URL and what answered
        if options.prometheus is not None:
            await _check_prometheus(session, options, identity.model, drain_deadline_s)
            return CheckedTarget(options=options, identity=identity)
        metrics, named_by = options.metrics, FROM_GIVEN
        if not metrics:
            try:
                metrics, named_by = (
                    await discover_metrics(session, api_root(options.base_url)),
                    FROM_PROXY,
                )
            except UpstreamRefused as e:
                raise PreflightError(e.url, e.why, FROM_PROXY) from None
            origins.update(URL(m.url).origin() for m in metrics)
        for source in metrics:
            why = await _scrape_once(session, source, identity.model)
            if why is not None:
                raise PreflightError(source.url, why, named_by)
        if not metrics:
            own = MetricsSource(api_root(options.base_url) + "/metrics")
            if await _scrape_once(session, own, identity.model) is None:
                metrics, named_by = (own,), FROM_TARGET
    checked = replace(options, metrics=metrics, metrics_from=named_by if metrics else None)
    return CheckedTarget(options=checked, identity=identity)


async def _check_prometheus(
    session: aiohttp.ClientSession, options: HttpTargetOptions, model: str, deadline_s: float
) -> None:
    """Every selector's interval fine by Prometheus's configuration, its series there
    (bounded), and their interval fine: else a PreflightError."""
    prometheus: PrometheusOptions = options.prometheus
    readers = prometheus.readers(options.scrape_timeout_s)
    for reader in readers:
        reader.model = model
        try:
            await reader.prepare(session)
        except ConnectionError as e:
            raise PreflightError(prometheus.url, str(e), FROM_PROMETHEUS) from None
        _refuse_interval(reader.source.url, configured_interval(reader), deadline_s)
    for reader in readers:
        why = await wait_for_series(session, reader, prometheus.series_wait_s)
        if why is None and reader.refused_targets:
            why = reader.errors[-1]
        if why is not None:
            raise PreflightError(reader.source.url, why, FROM_PROMETHEUS)
        where = max((t.interval_s, t.instance) for t in reader.targets.values())
        _refuse_interval(reader.source.url, where, deadline_s)


def _refuse_interval(url: str, found: tuple[float, str] | None, deadline_s: float) -> None:
    why = None if found is None else interval_refusal(found[0], found[1], deadline_s)
    if why is not None:
        raise PreflightError(url, why, FROM_PROMETHEUS)


async def _scrape_once(
    session: aiohttp.ClientSession, source: MetricsSource, model: str
) -> str | None:
    """Why one scrape of `source` gave no KV reading of `model`, or None when it gave one."""
    scraper = Scraper(source, time.monotonic(), model=model)
    if await scraper.scrape(session):
        return None
    why = scraper.errors[0] if scraper.errors else "no KV-usage reading"
    return why.removeprefix("ValueError: ")  # "HTTP 404", not the exception's type
