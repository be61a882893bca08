"""One --metrics selector read through a Prometheus server as the run goes. Runs in: frontend process.

`--prometheus URL --metrics [NAME=]SELECTOR`: each poll is one instant query of a range
vector (replay/metrics/promql.py) reaching back to the last samples seen: raw samples,
each stamped by Prometheus with its scrape's start, never query_range's evaluations.
- Time: Prometheus's clock is read against this one with `time()` queries (the one
  answered soonest wins). A sample stamped s was taken in [s, s + its scrape's
  scrape_duration_seconds] (else + the interval, which bounds scrape_timeout), widened
  by the clock's uncertainty: EngineSample.send_t .. t, so replay/verify/rules.py judges
  it by when it was taken, as it judges a scrape of its own.
- A scrape is released once every scrape that started before it has been stored (the
  longest interval later), in time order, to its target's Scraper (replay/metrics/scrape.py
  read), which reads KV usage and queues and watches for restarts
  (replay/metrics/restarts.py).
- Engines: an unnamed selector's series are split by target (`instance`) and vLLM's
  `engine` label. A named selector's are one engine (NAME, or NAME:<engine label>) from
  one target at a time: a new target once the last one went stale is that engine
  restarted elsewhere (a fault); two at once is a usage error.
- No reading: a failed scrape (`up` 0), a gap of more than GAP_SCRAPES intervals, and a
  target whose series stopped (stale: its pod gone, or no longer scraped) are failed
  scrapes placed in time, so no idle window over them is judged drained.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from replay.metrics.promql import (
    QUERY_NAMES,
    SCRAPE_DURATION,
    UP,
    PromSelector,
    active_targets,
    group_scrapes,
    matrix_series,
    scalar_time,
)
from replay.metrics.restarts import Restart, RestartWatch, restart_faults
from replay.metrics.scrape import KV_METRICS, MAX_FAILURE_SPANS, MetricsSource, Scraper
from replay.verify.text import printable
from replay.verify.timeline import EngineSample

FIRST_LOOKBACK_S = 1.0  # the first poll reads back two intervals and this much more
MAX_LOOKBACK_S = 300.0  # a poll never reads further back than this
# A gap between a target's scrapes longer than this many intervals (and GAP_MIN_S) is a
# failed scrape; a target with nothing stored for as long is stale. Prometheus's own
# scrapes run late by up to an interval on a busy host.
GAP_SCRAPES = 4
GAP_MIN_S = 1.0
HOLD_MARGIN_S = 0.1  # past the interval, before a scrape is released
DEFAULT_INTERVAL_S = 1.0  # until a target's interval is known
CLOCK_PROBES = 3
MAX_ERRORS = 5


class PrometheusError(ConnectionError):
    """Prometheus did not answer, or answered with an error."""


@dataclass(frozen=True, slots=True)
class Clock:
    """Prometheus's clock against time.monotonic(): prometheus = monotonic + offset_s,
    known within uncertainty_s."""

    offset_s: float
    uncertainty_s: float


async def api_get(
    session: aiohttp.ClientSession, base_url: str, path: str, params: dict, timeout_s: float
) -> object:
    """One GET of Prometheus's HTTP API: its JSON answer, or a PrometheusError."""
    url = base_url.rstrip("/") + path
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(url, params=params, timeout=timeout) as response:
            answer = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise PrometheusError(f"{url}: {type(e).__name__}: {printable(e)}") from None
    if not isinstance(answer, dict) or answer.get("status") != "success":
        raise PrometheusError(f"{url}: {printable(str(answer), 300)}")
    return answer


async def read_clock(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> Clock:
    """Prometheus's clock from the `time()` query answered soonest of CLOCK_PROBES."""
    best: tuple[float, float] | None = None  # (round trip, offset)
    for _ in range(CLOCK_PROBES):
        sent = time.monotonic()
        answer = await api_get(session, base_url, "/api/v1/query", {"query": "time()"}, timeout_s)
        back = time.monotonic()
        try:
            offset = scalar_time(answer) - (sent + back) / 2
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise PrometheusError(f"{base_url}: time(): {printable(e)}") from None
        if best is None or back - sent < best[0]:
            best = (back - sent, offset)
    return Clock(offset_s=best[1], uncertainty_s=best[0] / 2 + 0.002)  # ms stamps, both ways


async def target_intervals(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> list[tuple[dict[str, str], float | None]]:
    """Every active target's labels and configured scrape interval ([] when the server
    has no /api/v1/targets, as some Prometheus-compatible stores do not)."""
    try:
        answer = await api_get(session, base_url, "/api/v1/targets", {}, timeout_s)
        return active_targets(answer)
    except (PrometheusError, ValueError):
        return []


@dataclass(slots=True)
class PromTarget:
    """One scrape target (job, instance) a selector's series come from."""

    key: tuple[str, str]
    scraper: Scraper  # the engine's (shared by a named selector's targets)
    interval_s: float | None  # configured (/api/v1/targets), else from the spacing
    configured: bool
    seen_until: float = -math.inf  # Prometheus time of the last scrape fetched
    last_stamp: float | None = None  # Prometheus time of the last scrape released
    last_t: float | None = None  # its reading's latest replay time
    pending: dict[float, dict] = field(default_factory=dict)  # stamp -> samples
    last_samples: dict[str, list] = field(default_factory=dict)  # the last reading's
    stamps: list[float] = field(default_factory=list)  # the first few, for the spacing
    is_stale: bool = False

    @property
    def instance(self) -> str:
        return self.key[1]


class PromReader:
    """One selector's engines over a run, read through Prometheus; what HttpReplay and
    `top` take in place of a Scraper (the same samples, status, faults)."""

    def __init__(
        self, base_url: str, selector: PromSelector, origin: float = 0.0, timeout_s: float = 2.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.selector = selector
        self.source = MetricsSource(f"{self.base_url} {selector.text}", selector.name)
        self.origin = origin
        self.timeout_s = timeout_s
        self.clock: Clock | None = None
        self.configured: list[tuple[dict[str, str], float | None]] = []
        self.targets: dict[tuple[str, str], PromTarget] = {}
        self.samples: list[EngineSample] = []
        self.restart_watch = RestartWatch()  # every target's restarts, as they are seen
        self.errors: list[str] = []
        self.refused_targets: list[str] = []  # a named selector's second live target
        self.failure_spans: list[tuple[float, float]] = []
        self.num_scrapes = 0  # scrapes released (readings or failures)
        self.num_failures = 0
        self.num_polls = 0
        self.num_poll_failures = 0
        self.max_answer_s = 0.0
        self.now_t = 0.0  # replay time of the last poll's answer
        self._model: str | None = None
        self._num_restarts: dict[int, int] = {}

    # ---- what HttpReplay and top read, as of a Scraper ------------------------------------

    @property
    def model(self) -> str | None:
        return self._model

    @model.setter
    def model(self, model: str | None) -> None:
        self._model = model
        for scraper in self._scrapers():
            scraper.model = model

    @property
    def metric(self) -> str | None:
        return next((s.metric for s in self._scrapers() if s.metric), None)

    @property
    def unit(self) -> str | None:
        return next((s.unit for s in self._scrapers() if s.unit), None)

    @property
    def names_found(self) -> list[str]:
        return sorted({n for s in self._scrapers() for n in s.names_found})

    @property
    def engines(self) -> dict[str, str]:
        """instance/engine label -> timeline name."""
        return {
            f"{t.instance}/{label}": name
            for t in self.targets.values()
            for label, name in t.scraper.engines.items()
        }

    @property
    def interval_s(self) -> float | None:
        """The longest scrape interval among the targets (None: none known yet)."""
        known = [t.interval_s for t in self.targets.values() if t.interval_s is not None]
        return max(known) if known else None

    def _scrapers(self) -> list[Scraper]:
        return list({id(t.scraper): t.scraper for t in self.targets.values()}.values())

    def latest_samples(self) -> dict[str, tuple[dict[str, list], str]]:
        """Engine name -> (its target's latest scrape's samples, its engine label), for
        the report's cache config and counters (replay/target/server_facts.py)."""
        out = {}
        for target in sorted(self.targets.values(), key=lambda t: t.last_stamp or -math.inf):
            for label, name in target.scraper.engines.items():
                if target.last_samples:
                    out[name] = (target.last_samples, label)
        return out

    def rebase(self, origin: float) -> None:
        """Move the replay's t = 0 to `origin` (a time.monotonic()), readings so far too."""
        shift = self.origin - origin
        for sample in self.samples:
            sample.t += shift
            sample.send_t += shift
        self.failure_spans = [(a + shift, b + shift) for a, b in self.failure_spans]
        for target in self.targets.values():
            if target.last_t is not None:
                target.last_t += shift
        for scraper in self._scrapers():
            scraper.rebase(origin)
        self.restart_watch.rebase(shift)
        self.now_t += shift
        self.origin = origin

    def faults(self) -> list[dict]:
        return restart_faults(self.source.url, self.restart_watch)

    def status(self) -> dict:
        spans = [*self.failure_spans, *self._stale_spans()]
        return {
            "url": self.source.url,
            "prometheus": self.base_url,
            "selector": str(self.selector),
            "metric": self.metric,
            "unit": self.unit,
            "engines": self.engines,
            "metric_names_found": self.names_found,
            "num_scrapes": self.num_scrapes,
            "num_failures": self.num_failures + len(spans) - len(self.failure_spans),
            "num_polls": self.num_polls,
            "num_poll_failures": self.num_poll_failures,
            "max_answer_s": self.max_answer_s,
            "errors": list(self.errors),
            "failure_spans": [list(s) for s in spans],
            "model": self.model,
            "models_found": sorted({m for s in self._scrapers() for m in s.models_found}),
            "num_restarts": self.restart_watch.num_restarts,
            "scrape_interval_s": self.interval_s,
            "targets": {
                t.instance: {"interval_s": t.interval_s, "configured": t.configured}
                for t in self.targets.values()
            },
            "clock_uncertainty_s": self.clock.uncertainty_s if self.clock else None,
        }

    def _stale_spans(self) -> list[tuple[float, float]]:
        """Each stale target's silence, from its last reading to the last poll."""
        return [
            (t.last_t, self.now_t)
            for t in self.targets.values()
            if t.is_stale and t.last_t is not None and t.last_t < self.now_t
        ]

    # ---- polling ---------------------------------------------------------------------------

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        """Prometheus's clock and its targets' intervals (once, before the first poll)."""
        if self.clock is None:
            self.clock = await read_clock(session, self.base_url, self.timeout_s)
            self.configured = await target_intervals(session, self.base_url, self.timeout_s)

    async def scrape(self, session: aiohttp.ClientSession) -> bool:
        """One poll: the samples stored since the last, released when due. False (an
        error said) when Prometheus did not answer it; the next poll reaches back."""
        self.num_polls += 1
        try:
            await self.prepare(session)
            sent = time.monotonic()
            answer = await api_get(
                session, self.base_url, "/api/v1/query", {"query": self._query()}, self.timeout_s
            )
            self.max_answer_s = max(self.max_answer_s, time.monotonic() - sent)
            series = matrix_series(answer)
        except (PrometheusError, ValueError, KeyError, TypeError) as e:
            self.num_poll_failures += 1
            self._error(f"query failed: {e}")
            return False
        self.now_t = time.monotonic() - self.origin
        self._take(group_scrapes(series))
        self._release(self._prom_now() - self._hold_s())
        self._mark_stale()
        return True

    def _query(self) -> str:
        now = self._prom_now()
        live = [t.seen_until for t in self.targets.values() if not t.is_stale]
        since = min(live) if live else now - self._first_lookback_s()
        reach = min(
            max(now - since + 2 * (self.interval_s or DEFAULT_INTERVAL_S), 1.0), MAX_LOOKBACK_S
        )
        return self.selector.promql(QUERY_NAMES, math.ceil(reach * 1000))

    def _first_lookback_s(self) -> float:
        """Two of the longest configured intervals (else DEFAULT_INTERVAL_S) and a margin:
        enough for the spacing, not so much that an old restart counts as the run's."""
        found = configured_interval(self)
        return 2 * (found[0] if found else DEFAULT_INTERVAL_S) + FIRST_LOOKBACK_S

    def _prom_now(self) -> float:
        return time.monotonic() + self.clock.offset_s

    def _hold_s(self) -> float:
        return (self.interval_s or DEFAULT_INTERVAL_S) + HOLD_MARGIN_S

    def _take(self, scrapes: dict[tuple[str, str], dict[float, dict]]) -> None:
        """Buffer the scrapes not fetched before."""
        for key, by_stamp in scrapes.items():
            is_engine = any(n in KV_METRICS for samples in by_stamp.values() for n in samples)
            target = self.targets.get(key) or (self._new_target(key) if is_engine else None)
            if target is None:
                continue
            for stamp in sorted(s for s in by_stamp if s > target.seen_until):
                target.pending[stamp] = by_stamp[stamp]
                if len(target.stamps) < 8:
                    target.stamps.append(stamp)
            target.seen_until = max([target.seen_until, *by_stamp])
            if not target.configured and len(target.stamps) >= 2:
                target.interval_s = statistics.median(
                    b - a for a, b in zip(target.stamps, target.stamps[1:])
                )

    def _release(self, until: float) -> None:
        """Every buffered scrape stamped up to `until`, oldest first, read."""
        due = sorted(
            ((stamp, target) for target in self.targets.values() for stamp in target.pending),
            key=lambda due: (due[0], due[1].key),
        )
        due = [(stamp, target) for stamp, target in due if stamp <= until]
        for stamp, target in due:
            self._read(target, stamp, target.pending.pop(stamp))
        self._sync_restarts()

    def _read(self, target: PromTarget, stamp: float, samples: dict[str, list]) -> None:
        send_t, t = self._reading_span(target, stamp, samples)
        if target.last_stamp is not None and stamp - target.last_stamp > _gap_s(target):
            self._fail(
                (target.last_t, send_t),
                f"{target.instance}: no scrape stored between "
                f"{target.last_t:.3f} s and {send_t:.3f} s",
            )
        target.last_stamp, target.last_t = stamp, t
        self.num_scrapes += 1
        up = samples.get(UP)
        if up and up[0].value == 0:
            self._fail((send_t, t), f"{target.instance}: Prometheus's scrape failed (up 0)")
            return
        scraper = target.scraper
        num_before = len(scraper.samples)
        if not scraper.read(samples, send_t, t):
            why = scraper.errors[-1] if scraper.errors else "no KV reading"
            self._fail((send_t, t), f"{target.instance}: {why}")
            return
        target.last_samples = samples
        self.samples += scraper.samples[num_before:]
        del scraper.samples[:]

    def _reading_span(
        self, target: PromTarget, stamp: float, samples: dict[str, list]
    ) -> tuple[float, float]:
        """When the reading stamped `stamp` was taken, at the earliest and the latest."""
        duration = samples.get(SCRAPE_DURATION)
        took = duration[0].value if duration else target.interval_s or DEFAULT_INTERVAL_S
        start = stamp - self.clock.offset_s - self.origin
        return start - self.clock.uncertainty_s, start + took + self.clock.uncertainty_s

    def _fail(self, span: tuple[float, float], error: str) -> None:
        self.num_failures += 1
        if len(self.failure_spans) < MAX_FAILURE_SPANS:
            self.failure_spans.append(span)
        self._error(error)

    def _error(self, error: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(printable(error))

    def _mark_stale(self) -> None:
        now = self._prom_now()
        for target in self.targets.values():
            stale = now - target.seen_until > _gap_s(target) + self._hold_s()
            if stale and not target.is_stale and target.last_t is not None:
                self._error(
                    f"{target.instance}: nothing stored since {target.last_t:.3f} s: its "
                    f"series went stale (its pod gone, or no longer scraped); no reading after"
                )
            target.is_stale = stale

    # ---- targets and engines ---------------------------------------------------------------

    def _new_target(self, key: tuple[str, str]) -> PromTarget | None:
        """The target `key` of this selector's series, or None when a named selector's
        engine is already read from another live target (said once)."""
        interval = self._configured_interval(key)
        if self.selector.name is None:
            scraper = self._new_scraper(key)
        else:
            scraper = self._named_scraper(key)
            if scraper is None:
                return None
        target = PromTarget(key, scraper, interval, interval is not None)
        self.targets[key] = target
        return target

    def _configured_interval(self, key: tuple[str, str]) -> float | None:
        job, instance = key
        return next(
            (
                seconds
                for labels, seconds in self.configured
                if labels.get("job") == job and labels.get("instance") == instance
            ),
            None,
        )

    def _new_scraper(self, key: tuple[str, str]) -> Scraper:
        """An unnamed selector's target: its engines named by instance (and engine label),
        as a URL's are (scrape.py engine_name)."""
        source = MetricsSource(f"http://{key[1]}/metrics", None)
        if len(self.targets) or self._num_matching_targets() > 1:  # several: always named
            source = MetricsSource(source.url, key[1])
        return Scraper(source, self.origin, timeout_s=self.timeout_s, model=self.model)

    def _num_matching_targets(self) -> int:
        return sum(1 for labels, _ in self.configured if self.selector.matches_target(labels))

    def _named_scraper(self, key: tuple[str, str]) -> Scraper | None:
        live = [t for t in self.targets.values() if not t.is_stale]
        if live:
            self.refused_targets.append(key[1])
            self._error(
                f"selector {self.selector} matches {key[1]} while {live[0].instance} is read: "
                f"a named selector is one engine; give each target its own NAME=SELECTOR"
            )
            return None
        if not self.targets:
            return Scraper(self.source, self.origin, timeout_s=self.timeout_s, model=self.model)
        last = max(self.targets.values(), key=lambda t: t.last_stamp or -math.inf)
        self._moved(last, key)
        return last.scraper

    def _moved(self, last: PromTarget, key: tuple[str, str]) -> None:
        """The engine is now read from another target: another process, a restart."""
        since = last.last_t if last.last_t is not None else self.now_t
        watch = last.scraper.restart_watch
        watch.record(
            [
                Restart(
                    since=since,
                    t=self.now_t,
                    engine=name,
                    evidence=printable(f"instance {last.instance} -> {key[1]}"),
                )
                for name in last.scraper.engines.values()
            ]
        )

    def _sync_restarts(self) -> None:
        """Every target's new restarts, into this reader's watch (its faults)."""
        for scraper in self._scrapers():
            done = self._num_restarts.get(id(scraper), 0)
            new = scraper.restart_watch.restarts[done:]
            self._num_restarts[id(scraper)] = done + len(new)
            self.restart_watch.record(list(new))


def _gap_s(target: PromTarget) -> float:
    return max(GAP_SCRAPES * (target.interval_s or DEFAULT_INTERVAL_S), GAP_MIN_S)


def series_exist(reader: PromReader) -> bool:
    """Whether the selector's KV series were found (a target whose scrapes carry one)."""
    return bool(reader.targets)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrometheusOptions:
    """--prometheus URL and its --metrics selectors."""

    url: str  # http://HOST:9090
    selectors: tuple[PromSelector, ...]
    series_wait_s: float = 30.0  # how long the checks wait for the series to exist

    def readers(self, timeout_s: float) -> list[PromReader]:
        return [PromReader(self.url, s, timeout_s=timeout_s) for s in self.selectors]


async def wait_for_series(
    session: aiohttp.ClientSession, reader: PromReader, wait_s: float
) -> str | None:
    """Poll until the selector's KV series exist and their scrape interval is known
    (bounded by wait_s): None, or why not."""
    deadline = time.monotonic() + wait_s
    while True:
        polled = await reader.scrape(session)
        if polled and series_exist(reader) and reader.interval_s is not None:
            return None
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(0.25, max(deadline - time.monotonic(), 0.0)))
    if reader.errors:
        return f"no KV reading in {wait_s:g} s ({reader.errors[-1]})"
    if not reader.targets:
        return (
            f"no series of {', '.join(KV_METRICS[:2])} under {reader.selector.text} in "
            f"{wait_s:g} s: check the selector against Prometheus's targets"
        )
    return f"the scrape interval is not known after {wait_s:g} s"


def configured_interval(reader: PromReader) -> tuple[float, str] | None:
    """The longest interval Prometheus's configuration gives a target the selector may
    read, and that target's instance (None: none known)."""
    found = [
        (seconds, labels.get("instance", "?"))
        for labels, seconds in reader.configured
        if seconds is not None and reader.selector.matches_target(labels)
    ]
    return max(found) if found else None


def interval_refusal(interval_s: float, where: str, drain_deadline_s: float) -> str | None:
    """Why a replay judged with this drain deadline cannot use readings this far apart
    (more than half the deadline), naming the interval it needs; None when it can."""
    need = drain_deadline_s / 2
    if interval_s <= need + 1e-9:
        return None
    return (
        f"Prometheus scrapes {where} every {interval_s:g} s; a replay with --drain-deadline "
        f"{drain_deadline_s:g} s needs a scrape interval of at most {need:g} s (half the "
        f"deadline, {need * 1000:g}ms): set scrape_interval for that job, or judge with "
        f"--drain-deadline {2 * interval_s:g}"
    )


def provable_deadline(interval_s: float, drain_deadline_s: float) -> float:
    """The shortest drain deadline readings this far apart can prove (top's)."""
    return max(drain_deadline_s, 2 * interval_s)
