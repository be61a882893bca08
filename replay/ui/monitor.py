"""Feeds the live dashboard from a running replay, a serve, or a serve's stats (top). Runs in: frontend process.

The one place where engine data becomes DashboardState: the drivers know nothing of the
screen and replay/ui/tui.py knows nothing of engines. A new panel is its state in
replay/ui/dashboard.py, its view in replay/ui/tui.py and its feed here.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.proc.messages import StatsSnapshot
from replay.deploy.pd_flow import engine_roles
from replay.metrics.restarts import restart_sentence
from replay.pipeline import FORECASTING, RUNNING, ReplayConfig, ReplayHooks, ReplayResult
from replay.runtime.interrupt import QUIT_KEY, Interrupted, stopping_line
from replay.serve.server import Server
from replay.ui.dashboard import DashboardState, ReplayProgress, StartupState, WindowVerdict
from replay.ui.tui import LiveView
from replay.verify.rules import EngineSeries, VerifyOptions, check_window, idle_windows
from replay.verify.text import printable
from replay.verify.timeline import SAMPLING_SCRAPED, EngineSample, Timeline
from replay.wall.driver import WallClockReplay, sample_from_snapshot

if TYPE_CHECKING:
    from replay.metrics.scrape import Scraper
    from replay.target.client import HttpReplay

WINDOW_CHECK_INTERVAL_S = 1.0
MAX_WINDOWS = 1000  # closed windows a serve's dashboard keeps
MAX_SAMPLES = 4096  # samples a serve's dashboard holds before it drops what no window needs
QUEUE_COUNTS = ("num_waiting", "num_skipped_waiting", "num_waiting_for_remote_kvs", "num_running")
# The counts every scrape gives, and the ones a family of the server's metrics adds.
ALWAYS_OBSERVED = frozenset({"num_used_blocks", "num_free_blocks", "num_usable_blocks"})
OBSERVED_BY_FAMILY = {
    "vllm:num_requests_waiting": ("num_waiting",),
    "vllm:num_requests_running": ("num_running",),
    "kvdrain:kv_blocks_cached": ("num_cached_blocks",),
    "kvdrain:requests_waiting_for_remote_kvs": ("num_waiting_for_remote_kvs",),
    "kvdrain:delayed_free_requests": ("num_finished_awaiting_free",),
    "kvdrain:engine_steps": ("num_steps",),
    "kvdrain:engine_wakeups": ("num_wakeups",),
}


def replay_state(config: ReplayConfig, num_requests: int, duration: float) -> DashboardState:
    """The dashboard of a replay of `num_requests` over `duration` trace seconds, before it starts."""
    state = DashboardState(title=f"kvdrain replay {config.trace.name}")
    total = min(num_requests, config.shaping.max_requests or num_requests)
    remote = config.target is not None or config.http is not None
    # A server's liveness is its own: unknown until it says (a serve's ServeInfo, kvdrain's card).
    state.progress = ReplayProgress(
        trace_name=config.trace.name,
        num_total=total,
        duration_s=duration / config.shaping.speedup,
        clock=config.clock,
        liveness="" if remote else config.engine.liveness,
        speedup=config.shaping.speedup,
    )
    if config.clock == "wall" and config.http is None:
        local = config.target is None
        state.startup = StartupState(
            engines=[e for e, _ in engine_roles(config.topology)] if local else []
        )
    return state


def apply_newest(state: DashboardState, snapshots: Iterable[StatsSnapshot]) -> None:
    """Each engine's newest snapshot, unless the view already shows it."""
    for snapshot in snapshots:
        if state.view(snapshot.engine_id).monotonic != snapshot.monotonic:
            state.apply_snapshot(snapshot)


class ReplayMonitor:
    """A wall-clock replay's ticks and a replay's final result -> the dashboard."""

    def __init__(
        self,
        state: DashboardState,
        view: LiveView,
        verify_options: VerifyOptions,
        start: float | None = None,
    ) -> None:
        """start: the monotonic time the dashboard's clock counts from (the engines'
        launch, when they started before the view did); None: now."""
        self.state = state
        self.view = view
        self.verify_options = verify_options
        self.start = time.monotonic() if start is None else start
        self._last_window_check = 0.0
        self._num_messages = 0
        self._feed: ScrapeFeed | None = None

    def hooks(self) -> ReplayHooks:
        return ReplayHooks(
            self.on_tick, self.on_phase, self.on_progress, self.on_http_tick, self.on_note
        )

    def on_note(self, note: str) -> None:
        """A line the run says as it goes (an engine starting starved of CPU)."""
        self.view.console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)

    def on_phase(self, phase: str, ready: list[str]) -> None:
        """Start-up: the phase, the engines ready so far; RUNNING ends it."""
        state = self.state
        state.elapsed_s = time.monotonic() - self.start
        startup = state.startup if state.startup is not None else StartupState()
        state.startup = startup
        for engine in ready:
            startup.engine_ready(engine, state.elapsed_s)
        if phase == RUNNING:
            startup.finish(state.elapsed_s)
        else:
            startup.enter(phase, state.elapsed_s)
        self._show()

    def on_progress(self, num_done: int, t: float) -> None:
        """The virtual clock's progress: the replay itself, or the wall clock's forecast."""
        state, progress = self.state, self.state.progress
        state.elapsed_s = time.monotonic() - self.start
        if state.startup is not None and state.startup.phase == FORECASTING:
            total = progress.num_total if progress is not None else num_done
            state.startup.detail = f"{num_done:,}/{total:,} requests"
        elif progress is not None:
            progress.num_sent, progress.trace_t = num_done, t
            progress.update_rate(num_done, state.elapsed_s)
        self._show()

    def _show(self) -> None:
        """Redraw if due; `q` on the terminal stops the run as Ctrl-C does."""
        self.view.tick()
        if self.view.quit_requested:
            self.view.console.print(stopping_line(QUIT_KEY), highlight=False, markup=False)
            raise Interrupted(signal.SIGINT, key=QUIT_KEY)

    def on_tick(self, replay: WallClockReplay) -> None:
        state = self.state
        state.elapsed_s = time.monotonic() - self.start
        apply_newest(state, replay.latest.values())
        if state.progress is not None:
            self._update_progress(state.progress, replay)
        faults = replay.faults.faults  # named: died, stopped answering, stalled a transfer
        for fault in faults[self._num_messages :]:
            who = f"{fault.engine}: " if fault.engine else ""
            state.messages.append(f"fault: {who}{fault.cause}")
        self._num_messages = len(faults)
        if state.elapsed_s - self._last_window_check >= WINDOW_CHECK_INTERVAL_S:
            self._last_window_check = state.elapsed_s
            state.windows = closed_windows(replay, self.verify_options)
        self._show()

    def on_http_tick(self, replay: HttpReplay) -> None:
        """--target http://: the server answered (its identity heads the view), then each
        scrape: the engines as scraped, the requests sent and in flight, closed windows."""
        state = self.state
        state.elapsed_s = time.monotonic() - self.start
        if state.startup is not None and state.startup.ready_s is None:
            state.startup.finish(state.elapsed_s)
        if replay.identity is not None and not state.server:
            state.server = server_line(replay.identity.to_dict())
            if state.progress is not None:
                state.progress.liveness = (replay.identity.kvdrain or {}).get("liveness") or ""
        if self._feed is None:
            self._feed = ScrapeFeed(replay.scrapers, state)
        self._feed.take()
        if state.progress is not None:
            _update_http_progress(state.progress, list(replay.requests.values()), replay.now())
        if state.elapsed_s - self._last_window_check >= WINDOW_CHECK_INTERVAL_S:
            self._last_window_check = state.elapsed_s
            samples = sorted((s for sc in replay.scrapers for s in sc.samples), key=lambda s: s.t)
            state.windows = windows_closed_by(
                samples,
                list(replay.requests.values()),
                list(replay.arrivals),
                replay.now(),
                self.verify_options,
                scraped=True,
            )
        self._show()

    @staticmethod
    def _update_progress(progress: ReplayProgress, replay: WallClockReplay) -> None:
        records = list(replay.requests.values())
        for record in records[progress.num_sent :]:
            progress.record_send(record.send_lateness_s)
        progress.trace_t = max(replay.now(), 0.0)
        _update_flight(progress, records)

    def show_final(self, result: ReplayResult) -> None:
        """The final picture: every engine's last sample and every window's verdict."""
        state = self.state
        last = {s.engine: s for s in result.timeline.samples}
        for sample in last.values():
            state.apply_sample(sample)
        state.windows = [WindowVerdict.of(w) for w in result.verdict.windows]
        if state.progress is not None:
            progress = state.progress
            progress.num_sent, progress.trace_t = (
                len(result.timeline.requests),
                result.timeline.end_t,
            )
            progress.num_in_flight = None
            progress.rate_per_s = progress.eta_s = None  # done: no rate to finish at
            if "interrupted" not in result.timeline.meta:  # all the shaped trace had
                progress.num_total = progress.num_sent


class ServeMonitor:
    """A serve's engines -> the dashboard: the serve's own (on_tick) or top's (on_snapshots),
    with the idle windows judged as replay judges them (SnapshotWindows)."""

    def __init__(
        self,
        state: DashboardState,
        view: LiveView,
        verify_options: VerifyOptions = VerifyOptions(),
        http_url: Callable[[], str | None] | None = None,
    ) -> None:
        """http_url: where `serve --http` listens, once it does (for the header)."""
        self.state = state
        self.view = view
        self.http_url = http_url
        self.start = time.monotonic()
        self.windows = SnapshotWindows(verify_options)
        self._last_window_check = -WINDOW_CHECK_INTERVAL_S
        self._num_restarts = 0

    def on_tick(self, server: Server) -> None:
        """The panels show each engine's newest snapshot; the windows need every one
        (a request can come and go between two ticks)."""
        for snapshot in server.take_stats():
            self.windows.add(snapshot)
        apply_newest(self.state, server.latest.values())
        url = self.http_url() if self.http_url is not None else None
        if url and url not in self.state.server:
            self.state.server = f"{self.state.server}  {url}".strip()
        self._refresh()

    def on_snapshots(self, snapshots: list[StatsSnapshot]) -> None:
        """Every snapshot a serve sent, in order (rates come from each pair)."""
        for snapshot in snapshots:
            self.state.apply_snapshot(snapshot)
            self.windows.add(snapshot)
        self._refresh()

    def on_restarts(self, restarts: list[str]) -> None:
        """The serve's restarts so far (ServeClient.restarts): each said once, and the idle
        windows start again (the new engines' counts are not the old ones')."""
        for notice in restarts[self._num_restarts :]:
            self.state.messages.append(notice)
            self.windows = SnapshotWindows(self.windows.options)
        if len(restarts) > self._num_restarts and "(restarted)" not in self.state.title:
            self.state.title += " (restarted)"
        self._num_restarts = len(restarts)

    def _refresh(self) -> None:
        self.state.elapsed_s = time.monotonic() - self.start
        if self.state.elapsed_s - self._last_window_check >= WINDOW_CHECK_INTERVAL_S / 4:
            self._last_window_check = self.state.elapsed_s
            self.state.windows = self.windows.verdicts(time.monotonic())
        self.view.tick()


class SnapshotWindows:
    """A serve's idle windows from its engines' stats alone, so serve and top agree: the
    engines are busy while any holds a request in a queue, and new work starts where one
    holds more blocks than before (replay knows the requests; a serve's screen, and top,
    only these counts); a quiet spell of at least
    idle_threshold_s between busy ones is an idle window, judged by
    replay/verify/rules.py's check_window as a replay's are. The open window (the engines
    quiet now) is shown as it drains; closed ones are judged once and kept."""

    def __init__(self, options: VerifyOptions, scraped: bool = False) -> None:
        self.options = options
        self.scraped = scraped  # samples are scrapes of /metrics: judged as replay judges scrapes
        self.origin: float | None = None  # the first snapshot's time: window times count from it
        self.samples: list[EngineSample] = []  # since the last closed window (and one before)
        self.busy: dict[str, bool] = {}
        self.used: dict[str, int] = {}  # each engine's used blocks in its last snapshot
        self.spells: list[tuple[float, float | None]] = []  # busy (start, end), the last two
        self.closed: list[WindowVerdict] = []  # the last MAX_WINDOWS judged
        self.num_judged = 0  # verdicts of closed windows so far, those no longer kept too
        self._max_samples = MAX_SAMPLES

    def add(self, snapshot: StatsSnapshot) -> None:
        """A serve's engine stats; times count from the first snapshot's."""
        if self.origin is None:
            self.origin = snapshot.monotonic
        self.add_sample(sample_from_snapshot(snapshot.monotonic - self.origin, snapshot))

    def add_sample(self, sample: EngineSample) -> None:
        """One engine's reading at sample.t (seconds from this watch's origin): a serve's
        stats, or a scrape of a server's metrics (replay/metrics/scrape.py)."""
        if self.origin is None:
            self.origin = 0.0
        t = sample.t
        # Used blocks only rise for new work: a prefill engine may take a request and
        # finish it within one step, so no snapshot of it shows the request queued.
        rose = sample.num_used_blocks > self.used.get(sample.engine, 0)
        self.samples.append(sample)
        self.used[sample.engine] = sample.num_used_blocks
        was_busy = any(self.busy.values())
        self.busy[sample.engine] = any(getattr(sample, k) for k in QUEUE_COUNTS)
        is_busy = any(self.busy.values())
        if (is_busy or rose) and not was_busy:
            self._busy_from(t)
        if not is_busy and self.spells and self.spells[-1][1] is None:
            self.spells[-1] = (self.spells[-1][0], t)
        if len(self.samples) > self._max_samples:
            self._bound_samples(t)

    def _busy_from(self, t: float) -> None:
        """A busy spell starts: the quiet one before it, if long enough, is judged for good."""
        if self.spells:
            start = self.spells[-1][1]
            if start is not None and t - start >= self.options.idle_threshold_s:
                judged = self._judge((start, t, False))
                self.closed = [*self.closed, *judged][-MAX_WINDOWS:]
                self.num_judged += len(judged)
                self._prune(t)
        self.spells = [*self.spells[-1:], (t, None)]

    def _bound_samples(self, t: float) -> None:
        """Keep what a window still to be judged needs: outside a quiet spell each engine's
        last sample; inside one, its samples with each run of equal readings cut to its
        first and last (a verdict looks at where used blocks change, and at the readings
        either side of the drain deadline)."""
        quiet_from = self.spells[-1][1] if self.spells else None
        if quiet_from is None:
            self._prune(t)
        else:
            self._prune(quiet_from)
            self.samples = _thinned(self.samples, quiet_from)
        self._max_samples = max(MAX_SAMPLES, 2 * len(self.samples))

    def _prune(self, before: float) -> None:
        """Drop samples before `before`, keeping each engine's last one before it."""
        keep = {s.engine: s for s in self.samples if s.t <= before}
        self.samples = sorted(
            [*keep.values(), *(s for s in self.samples if s.t > before)], key=lambda s: s.t
        )

    def _judge(self, window: tuple[float, float, bool]) -> list[WindowVerdict]:
        timeline = Timeline(
            engines=sorted(self.busy),
            num_usable_blocks={},
            samples=self.samples,
            requests=[],
            arrivals=[],
            aborts=[],
            end_t=window[1],
        )
        return [
            WindowVerdict.of(
                check_window(
                    EngineSeries.of(timeline, engine),
                    window,
                    self.options.drain_deadline_s,
                    self.scraped,
                )
            )
            for engine in timeline.engines
        ]

    def verdicts(self, now: float) -> list[WindowVerdict]:
        """The closed windows, then the open one once it is idle_threshold_s long (now:
        in the snapshots' clock; for add_sample's, the samples' own)."""
        if self.origin is None or not self.spells or self.spells[-1][1] is None:
            return list(self.closed)
        start, t = self.spells[-1][1], now - self.origin
        if t - start < self.options.idle_threshold_s:
            return list(self.closed)
        return [*self.closed, *self._judge((start, t, True))]


def _thinned(samples: list[EngineSample], start: float) -> list[EngineSample]:
    """Samples after `start` with each engine's runs of equal readings (used blocks and
    queues; a scrape sent before `start` or after it) cut to their first and last; those
    up to `start` kept."""
    kept, runs = [s for s in samples if s.t <= start], {}
    for s in samples:
        if s.t > start:
            runs.setdefault(s.engine, []).append(s)
    for series in runs.values():
        reading = [
            (
                (s.t if s.send_t is None else s.send_t) >= start,
                s.num_used_blocks,
                *(getattr(s, k) for k in QUEUE_COUNTS),
            )
            for s in series
        ]
        kept += [
            s
            for i, s in enumerate(series)
            if i in (0, len(series) - 1)
            or reading[i] != reading[i - 1]
            or reading[i] != reading[i + 1]
        ]
    return sorted(kept, key=lambda s: s.t)


def closed_windows(replay: WallClockReplay, options: VerifyOptions) -> list[WindowVerdict]:
    """Verdicts of the idle windows that have ended so far (the tail is judged at the end)."""
    return windows_closed_by(
        sorted(replay.samples, key=lambda s: s.t),
        list(replay.requests.values()),
        list(replay.arrivals),
        replay.now(),
        options,
        aborts=list(replay.aborts),
    )


def windows_closed_by(
    samples: list[EngineSample],
    requests: list,
    arrivals: list[float],
    now: float,
    options: VerifyOptions,
    aborts: list | None = None,
    scraped: bool = False,
) -> list[WindowVerdict]:
    """Verdicts of the idle windows of these samples and requests that ended before `now`
    (scraped: samples are readings at their instants, as replay/verify/rules.py takes them)."""
    engines = list(dict.fromkeys(s.engine for s in samples))
    timeline = Timeline(
        engines=engines,
        num_usable_blocks={},
        samples=samples,
        requests=requests,
        arrivals=arrivals,
        aborts=aborts or [],
        end_t=now,
        meta={"sampling": SAMPLING_SCRAPED} if scraped else {},
    )
    verdicts = []
    for window in idle_windows(timeline, options.idle_threshold_s):
        start, end, is_tail = window
        if is_tail or end > now:
            continue
        for engine in timeline.engines:
            checked = check_window(
                EngineSeries.of(timeline, engine), window, options.drain_deadline_s, scraped
            )
            verdicts.append(WindowVerdict.of(checked))
    return verdicts


def _update_http_progress(progress: ReplayProgress, records: list, now: float) -> None:
    """Sent (a request's send_t is set when it goes out), in flight, lateness so far."""
    sent = [r for r in records if r.send_t > 0 or r.end_t is not None]
    for record in sent[len(progress.lateness_s) :]:
        progress.lateness_s.append(record.send_lateness_s)
    progress.num_sent = len(sent)
    progress.trace_t = max(now, 0.0)
    _update_flight(progress, sent)


def _update_flight(progress: ReplayProgress, sent: list) -> None:
    """Requests in flight, and the first-token times of those that had one."""
    progress.num_in_flight = sum(1 for r in sent if r.end_t is None)
    progress.ttft_s = [r.first_token_t - r.send_t for r in sent if r.first_token_t is not None]


def server_line(server: dict) -> str:
    """'kvdrain (aiohttp) kvdrain/tiny pd' from an HTTP server's identity (client.py's)."""
    kvdrain = server.get("kvdrain") or {}
    parts = [server.get("server") or "no Server header", str(server.get("model"))]
    if kvdrain.get("topology"):
        parts.append(str(kvdrain["topology"]))
    parts = [printable(part) for part in parts]
    return " ".join(parts)


def observed_counts(family_names: list[str]) -> frozenset[str]:
    """The EngineSample counts a server with these metric families really reports."""
    names = set(ALWAYS_OBSERVED)
    for family in family_names:
        names.update(OBSERVED_BY_FAMILY.get(family, ()))
    return frozenset(names)


class ScrapeFeed:
    """Scrapers' new readings, errors and restarts -> the dashboard (each engine's panel
    says what the server does not expose as unknown); the samples also go to `on_sample`."""

    def __init__(
        self,
        scrapers: list[Scraper],
        state: DashboardState,
        on_sample=None,
        forget_taken: bool = False,
    ) -> None:
        self.scrapers, self.state, self.on_sample = scrapers, state, on_sample
        self.forget_taken = (
            forget_taken  # drop each scraper's samples once taken (top runs for days)
        )
        self.num_taken = [0] * len(
            scrapers
        )  # each scraper's samples taken so far, forgotten or not
        self._num_kept = [0] * len(scrapers)  # of them, still in scraper.samples
        self._num_errors = [0] * len(scrapers)
        self._num_restarts = [0] * len(scrapers)

    def take(self) -> None:
        for i, scraper in enumerate(self.scrapers):
            observed = observed_counts(scraper.names_found)
            new = scraper.samples[self._num_kept[i] :]
            for sample in new:
                view = self.state.view(sample.engine)
                view.unit, view.observed = scraper.unit or "blocks", observed
                self.state.apply_sample(sample)
                if self.on_sample is not None:
                    self.on_sample(sample)
            self.num_taken[i] += len(new)
            if self.forget_taken:
                scraper.samples.clear()
            self._num_kept[i] = len(scraper.samples)
            for error in scraper.errors[self._num_errors[i] :]:
                self.state.messages.append(f"{scraper.source.url}: {error}")
            self._num_errors[i] = len(scraper.errors)
            restarts = scraper.restart_watch.restarts  # a restart is no drain: each said once
            for restart in restarts[self._num_restarts[i] :]:
                self.state.messages.append(restart_sentence(scraper.source.url, restart))
            self._num_restarts[i] = len(restarts)
