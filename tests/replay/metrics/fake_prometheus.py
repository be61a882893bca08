"""A small Prometheus for tests: scrapes /metrics URLs on an interval and answers the HTTP API calls kvdrain makes (`time()`, a range vector of raw samples under a selector, /api/v1/targets)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from replay.metrics.scrape import parse_metrics

_SELECTOR = re.compile(r"\{(.*)\}\[(\d+)ms\]")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)(=~|!~|!=|=)"((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class FakeTarget:
    job: str
    url: str  # its /metrics
    labels: dict[str, str]
    interval_s: float
    is_scraped: bool = True  # False: gone from service discovery (no more samples)
    starts: list[float] = field(default_factory=list)  # time.monotonic() of each scrape

    @property
    def instance(self) -> str:
        return self.url.split("//", 1)[1].split("/", 1)[0]


@dataclass(slots=True)
class FakePrometheus:
    """Stores what it scrapes as (labels with __name__, Unix time in ms, value); names
    with `:` are stored underscored when `underscore` (an OpenMetrics scrape of
    prometheus_client 0.26)."""

    targets: list[FakeTarget] = field(default_factory=list)
    store: list[tuple[dict[str, str], float, float]] = field(default_factory=list)
    underscore: bool = False
    has_targets_api: bool = True
    configured_interval: str | None = None  # what /api/v1/targets says, if not the real one
    url: str = ""
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # every target scraped twice

    def add(self, job: str, url: str, interval_s: float = 0.05, **labels: str) -> FakeTarget:
        target = FakeTarget(job, url, labels, interval_s)
        self.targets.append(target)
        return target

    async def scrape_forever(self, target: FakeTarget) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                if target.is_scraped:
                    await self._scrape(session, target)
                await asyncio.sleep(target.interval_s)

    async def _scrape(self, session: aiohttp.ClientSession, target: FakeTarget) -> None:
        stamp, began = round(time.time(), 3), time.monotonic()
        target.starts.append(began)
        base = {"job": target.job, "instance": target.instance, **target.labels}
        try:
            async with session.get(target.url) as response:
                samples = parse_metrics(await response.text())
            up = 1.0
        except aiohttp.ClientError:
            samples, up = {}, 0.0
        for name, series in samples.items():
            stored = name.replace(":", "_") if self.underscore else name
            for s in series:
                self.store.append(({**base, **s.labels, "__name__": stored}, stamp, s.value))
        self.store.append(({**base, "__name__": "up"}, stamp, up))
        took = time.monotonic() - began
        self.store.append(({**base, "__name__": "scrape_duration_seconds"}, stamp, took))
        if all(len(t.starts) >= 2 for t in self.targets if t.is_scraped):
            self.ready.set()

    async def query(self, request: web.Request) -> web.Response:
        text = request.query["query"]
        now = round(time.time(), 3)
        if text == "time()":
            return _ok({"resultType": "scalar", "result": [now, str(now)]})
        m = _SELECTOR.fullmatch(text)
        matchers = [
            (k, op, v.replace('\\"', '"').replace("\\\\", "\\"))
            for k, op, v in _MATCHER.findall(m[1])
        ]
        since = now - int(m[2]) / 1000
        series: dict[tuple, list] = {}
        for labels, stamp, value in self.store:
            if since < stamp <= now and all(_holds(labels, *mm) for mm in matchers):
                series.setdefault(tuple(sorted(labels.items())), []).append([stamp, repr(value)])
        result = [{"metric": dict(k), "values": v} for k, v in series.items()]
        return _ok({"resultType": "matrix", "result": result})

    async def targets_api(self, request: web.Request) -> web.Response:
        if not self.has_targets_api:
            raise web.HTTPNotFound()
        active = [
            {
                "labels": {"job": t.job, "instance": t.instance, **t.labels},
                "scrapeInterval": self.configured_interval or f"{round(t.interval_s * 1000)}ms",
                "health": "up",
            }
            for t in self.targets
            if t.is_scraped
        ]
        return _ok({"activeTargets": active, "droppedTargets": []})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/query", self.query)
        app.router.add_get("/api/v1/targets", self.targets_api)
        return app


def _holds(labels: dict[str, str], key: str, op: str, value: str) -> bool:
    have = labels.get(key, "")
    if op in ("=", "!="):
        return (have == value) == (op == "=")
    return (re.fullmatch(value, have) is not None) == (op == "=~")


def _ok(data: dict) -> web.Response:
    return web.json_response({"status": "success", "data": data})


@contextlib.asynccontextmanager
async def prometheus_scraping(prometheus: FakePrometheus):
    """`prometheus` served on a free loopback port (its url set), scraping its targets."""
    from tests.http_utils import serving

    tasks = [asyncio.create_task(prometheus.scrape_forever(t)) for t in prometheus.targets]
    try:
        async with serving(prometheus.app()) as url:
            prometheus.url = url
            await asyncio.wait_for(prometheus.ready.wait(), 10)
            yield prometheus
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
