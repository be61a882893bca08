"""`kvdrain top --metrics`: any server's Prometheus metrics on the live dashboard. Runs in: frontend process.

Each URL is scraped (replay/metrics/scrape.py, as a replay against --target http:// scrapes
it) every `interval_s`; each engine's reading feeds its panel (KV usage, waiting,
running, and what else the server exposes) and SnapshotWindows, which judges the idle
windows as a serve's dashboard and `top --connect` do: quiet spells of at least the
idle threshold, each engine's used blocks checked against the drain deadline. What a
server does not expose (vLLM has no loop state, no step counts) is shown as unknown.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from replay.metrics.scrape import MetricsSource, Scraper
from replay.ui.dashboard import DashboardState
from replay.ui.monitor import WINDOW_CHECK_INTERVAL_S, ScrapeFeed, SnapshotWindows
from replay.verify.rules import VerifyOptions


@dataclass(slots=True)
class MetricsWatch:
    """Scrapers -> the dashboard state and the idle windows; pure of I/O but `scrape_once`."""

    sources: list[MetricsSource]
    state: DashboardState
    options: VerifyOptions = field(default_factory=VerifyOptions)
    origin: float = field(default_factory=time.monotonic)
    # what reads the engines: a Scraper per source, unless given (Prometheus's readers)
    scrapers: list[Scraper] | None = None
    windows: SnapshotWindows = field(init=False)
    feed: ScrapeFeed = field(init=False)
    _last_window_check: float = -WINDOW_CHECK_INTERVAL_S
    _num_closed: int = 0

    def __post_init__(self) -> None:
        if self.scrapers is None:
            self.scrapers = [Scraper(source, self.origin) for source in self.sources]
        self.windows = SnapshotWindows(self.options, scraped=True)
        self.feed = ScrapeFeed(
            self.scrapers, self.state, self.windows.add_sample, forget_taken=True
        )

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(scraper.scrape(session) for scraper in self.scrapers))
        self.take(time.monotonic() - self.origin)

    def take(self, now: float) -> None:
        """Feed every scraper's new samples and errors to the state; judge the windows."""
        self.feed.take()
        self._say_closed()
        self.state.elapsed_s = now
        if now - self._last_window_check >= WINDOW_CHECK_INTERVAL_S / 4:
            self._last_window_check = now
            self.state.windows = self.windows.verdicts(now)

    def _say_closed(self) -> None:
        """Each window that closed held (a leak, or undecided) becomes a message line."""
        num_new = self.windows.num_judged - self._num_closed
        for w in self.windows.closed[
            len(self.windows.closed) - min(num_new, len(self.windows.closed)) :
        ]:
            if w.verdict != "drained":
                self.state.messages.append(w.sentence())
        self._num_closed = self.windows.num_judged

    def num_readings(self) -> int:
        return sum(self.feed.num_taken)

    def failures(self) -> list[str]:
        """One line per URL that never gave a reading."""
        return [
            f"{s.source.url}: no KV reading in {s.num_scrapes} scrapes"
            + (f" ({s.errors[-1]})" if s.errors else "")
            for s, n in zip(self.scrapers, self.feed.num_taken)
            if not n
        ]


def top_title(sources: list[MetricsSource]) -> str:
    return "kvdrain top " + ", ".join(
        s.url if s.name is None else f"{s.name}={s.url}" for s in sources
    )


async def watch_metrics(
    watch: MetricsWatch, view, seconds: float | None, interval_s: float
) -> None:
    """Scrape every interval_s until `seconds` pass or `q` is typed (Ctrl-C: the caller's)."""
    async with aiohttp.ClientSession() as session:
        while seconds is None or time.monotonic() - watch.origin < seconds:
            started = time.monotonic()
            await watch.scrape_once(session)
            view.tick()
            if view.quit_requested:
                return
            await asyncio.sleep(max(interval_s - (time.monotonic() - started), 0.0))
