"""`kvdrain top --metrics`'s watch: a vLLM-like server's metrics on the live dashboard, its
idle windows judged as replay judges them, what vLLM does not expose shown as unknown."""

from __future__ import annotations

import asyncio
import io
import re

import pytest
from aiohttp import web
from rich.console import Console

from replay.metrics.scrape import MetricsSource
from replay.ui.dashboard import DashboardState
from replay.ui.metrics_top import MetricsWatch, watch_metrics
from replay.ui.tui import render
from replay.verify.rules import VerifyOptions

pytestmark = pytest.mark.timeout(60)
OPTIONS = VerifyOptions(idle_threshold_s=0.2, drain_deadline_s=0.1)
INTERVAL_S = 0.05


def vllm_exposition(usage: float, running: int) -> str:
    """What vLLM >= 0.10 serves, trimmed: 101 GPU blocks (100 usable), one engine."""
    return f"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="101"}} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 0
"""


def script(k: int) -> tuple[float, int]:
    """The k-th scrape's (usage, running): busy, then 10 scrapes idle holding 15 blocks
    (a leak), busy again, then idle and empty."""
    if k < 4 or 14 <= k < 18:
        return 0.2, 1
    return (0.15, 0) if k < 14 else (0.0, 0)


async def _serve_and_watch(watch: MetricsWatch, num_scrapes: int) -> None:
    count = {"k": 0}

    async def metrics(_request):
        usage, running = script(count["k"])
        count["k"] += 1
        return web.Response(text=vllm_exposition(usage, running))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    watch.scrapers[0].source = MetricsSource.parse(f"P=http://127.0.0.1:{port}/metrics")

    class View:
        quit_requested = False

        def tick(self) -> None:
            self.quit_requested = count["k"] >= num_scrapes

    try:
        await watch_metrics(watch, View(), seconds=30, interval_s=INTERVAL_S)
    finally:
        await runner.cleanup()


def test_a_vllm_servers_leak_is_seen_live_from_its_metrics():
    state = DashboardState(title="kvdrain top")
    watch = MetricsWatch([MetricsSource.parse("P=http://127.0.0.1:1/metrics")], state, OPTIONS)
    asyncio.run(_serve_and_watch(watch, num_scrapes=24))
    view = state.engines["P"]
    assert view.counts["num_usable_blocks"] == 100 and view.counts["num_used_blocks"] == 0
    assert not view.is_observed("num_steps") and view.is_observed("num_running")
    leaks = [w for w in state.windows if w.verdict == "leak"]
    assert len(leaks) == 1 and leaks[0].engine == "P" and leaks[0].num_blocks_held == 15
    assert [m for m in state.messages if "held 15 blocks through" in m] == [leaks[0].sentence()]
    console = Console(record=True, width=80, height=24, file=io.StringIO())
    console.print(render(state))
    text = console.export_text()
    # the last, open idle spell may have grown past the idle threshold (a drained window)
    assert (
        "steps unknown" in text and "0/100" in text and re.search(r"P: (1 drained )?1 leak", text)
    ), text
    assert not re.search(r"fin-await-free +(\d|unknown)", text)  # a row vLLM lacks is left out


def _reading(t: float, used: int, running: int) -> EngineSample:  # noqa: F821
    from replay.verify.timeline import EngineSample

    return EngineSample(
        t=t,
        engine="P",
        num_used_blocks=used,
        num_cached_blocks=0,
        num_free_blocks=100 - used,
        num_usable_blocks=100,
        num_waiting=0,
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=0,
        num_running=running,
        num_finished_awaiting_free=0,
        loop_state="unknown",
        num_steps=0,
        num_wakeups=0,
        send_t=t - 0.01,
    )


def _watch_readings(readings) -> MetricsWatch:
    """A watch fed scrape readings of (t, used blocks, running) as its scraper took them."""
    watch = MetricsWatch(
        [MetricsSource.parse("P=http://127.0.0.1:1/metrics")],
        DashboardState(title="kvdrain top"),
        OPTIONS,
    )
    scraper = watch.scrapers[0]
    scraper.metric, scraper.unit = "vllm:kv_cache_usage_perc", "blocks"
    for t, used, running in readings:
        scraper.samples.append(_reading(t, used, running))
        watch.take(t)
    return watch


def test_top_metrics_says_every_leak_past_a_thousand_windows_and_forgets_what_it_took():
    """Past MAX_WINDOWS kept verdicts no new leak was said, and the scraper kept every sample."""

    def windows(num):  # each: one busy reading, then 0.3 s idle holding 10 blocks
        for k in range(num):
            yield k, 10, 1
            for i in range(1, 7):
                yield k + 0.05 * i, 10, 0

    watch = _watch_readings(windows(1200))
    said = [m for m in watch.state.messages if "held 10 blocks through" in m]
    assert len(said) == 1199  # every window closed by the next busy spell: the last is open
    assert watch.scrapers[0].samples == [] and watch.num_readings() == 1200 * 7
    assert len(watch.windows.samples) < 20 and watch.failures() == []


def test_top_metrics_holds_bounded_samples_over_a_long_quiet_or_busy_spell():
    from replay.ui.monitor import MAX_SAMPLES

    n = 3 * MAX_SAMPLES
    busy = _watch_readings((0.05 * i, 5 + i % 2, 1) for i in range(n))
    assert len(busy.windows.samples) <= MAX_SAMPLES
    held = [(0.0, 10, 1), *((0.05 * i, 10, 0) for i in range(1, n))]
    quiet = _watch_readings(held)
    assert len(quiet.windows.samples) <= MAX_SAMPLES
    (window,) = quiet.windows.verdicts(0.05 * n)
    assert (window.verdict, window.num_blocks_held, window.num_used_at_start) == ("leak", 10, 10)
    drained = _watch_readings([*held[:100], *((0.05 * i, 0, 0) for i in range(100, n))])
    (window,) = drained.windows.verdicts(0.05 * n)
    assert window.verdict == "leak"  # held past the 0.1 s deadline
    late = _watch_readings([(0.0, 10, 1), (0.05, 10, 0), *((0.05 * i, 0, 0) for i in range(2, n))])
    (window,) = late.windows.verdicts(0.05 * n)
    assert window.verdict == "drained" and abs(window.time_to_drain - 0.05) < 1e-9


def test_a_metrics_url_without_a_path_is_the_servers_metrics():
    """top --metrics http://HOST:PORT scraped the server's root: 'ValueError: HTTP 404'."""
    assert MetricsSource.parse("D=http://127.0.0.1:8200").url == "http://127.0.0.1:8200/metrics"
    assert MetricsSource.parse("http://127.0.0.1:8200/").url == "http://127.0.0.1:8200/metrics"
    assert MetricsSource.parse("http://h:1/custom/path").url == "http://h:1/custom/path"
    assert MetricsSource.parse("http://h:1/?x=1").url == "http://h:1/?x=1"


def test_top_metrics_says_a_restart_of_the_server_once():
    """A new process_start_time_seconds (the server restarted) between two scrapes: top says
    so once, naming the engine, however long the restarted server keeps answering."""
    from replay.metrics.scrape import parse_plain_samples

    watch = MetricsWatch(
        [MetricsSource.parse("P=http://127.0.0.1:1/metrics")], DashboardState(title="t"), OPTIONS
    )
    scraper = watch.scrapers[0]
    scraper.metric = "vllm:kv_cache_usage_perc"
    for k, start in enumerate((100.0, 100.0, 160.0, 160.0)):
        exposition = vllm_exposition(0.0, 0) + f"process_start_time_seconds {start}\n"
        samples = parse_plain_samples(
            "".join(line + "\n" for line in exposition.splitlines() if not line.startswith("#"))
        )
        assert scraper._read(samples, 0.1 * k, 0.1 * k + 0.01)
        watch.take(0.1 * k + 0.02)
    said = [m for m in watch.state.messages if "restarted" in m]
    assert said == [
        "P at http://127.0.0.1:1/metrics restarted between 0.100 s and 0.210 s "
        "(process_start_time_seconds 100 -> 160): blocks freed by a restart are not a drain"
    ]
