"""Engines read through a Prometheus: the same series as /metrics, each reading judged by
when Prometheus took it; engines named by selector, or split by instance and engine label;
a counter reset is a restart, a pod that disappears is never drained, and a scrape
interval over half the drain deadline is refused before anything is sent."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from replay.metrics.prometheus import PrometheusOptions, interval_refusal, provable_deadline
from replay.metrics.promql import PromSelector, canonical, matrix_series, spellings
from replay.target.client import HttpReplay, HttpTargetOptions
from replay.target.preflight import PreflightError, _preflight
from replay.trace.records import TraceRequest
from replay.verify.outcome import http_verdict
from replay.verify.rules import VerifyOptions, verify
from replay.verify.timeline import Timeline
from tests.http_utils import serving
from tests.replay.metrics.fake_prometheus import FakePrometheus, prometheus_scraping
from tests.replay.target.test_hostile_server import LeakyPD
from tests.replay.target.test_restarted_server import RestartingPD

pytestmark = pytest.mark.timeout(60)
TRACE = [TraceRequest(0.0, "a", 2, 1), TraceRequest(2.0, "b", 2, 1)]
OPTIONS = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.3)


def test_a_selector_is_named_or_not_and_never_names_the_metric():
    named = PromSelector.parse('P0={pod="prefill-0", job=~"vllm-.*"}')
    assert named.name == "P0" and [m.label for m in named.matchers] == ["pod", "job"]
    assert named.matches_target({"job": "vllm-prefill", "pod": "prefill-0"})
    assert not named.matches_target({"job": "gateway"})
    assert PromSelector.parse('{job="vllm"}').name is None
    query = named.promql(("vllm:kv_cache_usage_perc",), 1500)
    assert query.startswith('{__name__=~"vllm:kv_cache_usage_perc|vllm_kv_cache_usage_perc",')
    assert query.endswith(',pod="prefill-0",job=~"vllm-.*"}[1500ms]')
    for bad in ('job="vllm"', "{}", '{__name__="up"}', '{a="b" c="d"}', '{a=~"("}'):
        with pytest.raises(ValueError):
            PromSelector.parse(bad)


def test_an_underscored_vllm_name_is_read_as_vllms():
    """prometheus_client's OpenMetrics exposition writes `vllm:x`'s samples as `vllm_x`."""
    assert spellings("vllm:kv_cache_usage_perc") == (
        "vllm:kv_cache_usage_perc",
        "vllm_kv_cache_usage_perc",
    )
    assert canonical("vllm_kv_cache_usage_perc") == "vllm:kv_cache_usage_perc"
    assert canonical("up") == "up"
    answer = {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [{"metric": {"__name__": "kvdrain_kv_blocks_used"}, "values": [[1.5, "3"]]}],
        },
    }
    assert matrix_series(answer)[0].name == "kvdrain:kv_blocks_used"


def test_a_coarse_interval_is_refused_naming_the_one_needed_and_top_proves_twice_it():
    assert interval_refusal(0.25, "pod", 0.5) is None
    why = interval_refusal(30.0, "10.0.0.5:8000", 0.5)
    assert "every 30 s" in why and "at most 0.25 s" in why and "--drain-deadline 60" in why
    assert provable_deadline(30.0, 0.5) == 60.0 and provable_deadline(0.1, 0.5) == 0.5


def replay_through(
    apps: dict[str, web.Application], selectors: tuple[str, ...], trace, **setup
) -> tuple[Timeline, FakePrometheus, float]:
    """HttpReplay of `trace` against the first app, each app scraped by a fake Prometheus
    as a target of job "pd" (labels pod=NAME); `setup(prometheus, targets)` may run
    during the replay (a coroutine: what happens to the pods meanwhile)."""
    during = setup.pop("during", None)

    async def go() -> tuple[Timeline, FakePrometheus, float]:
        prometheus = FakePrometheus(underscore=setup.pop("underscore", False))
        async with contextlib_nested([serving(app) for app in apps.values()]) as urls:
            targets = [
                prometheus.add("pd", url + "/metrics", pod=name) for name, url in zip(apps, urls)
            ]
            async with prometheus_scraping(prometheus):
                options = HttpTargetOptions(
                    urls[0],
                    vocab_size=512,
                    tail_s=setup.pop("tail_s", 2.0),
                    scrape_interval_s=0.05,
                    prometheus=PrometheusOptions(
                        url=prometheus.url,
                        selectors=tuple(PromSelector.parse(s) for s in selectors),
                    ),
                )
                replay = HttpReplay(options)
                side = asyncio.create_task(during(targets)) if during else None
                try:
                    return await replay.run_async(trace), prometheus, replay.origin
                finally:
                    if side is not None:
                        side.cancel()

    return asyncio.run(asyncio.wait_for(go(), 45))


def contextlib_nested(managers):
    import contextlib

    @contextlib.asynccontextmanager
    async def nested():
        async with contextlib.AsyncExitStack() as stack:
            yield [await stack.enter_async_context(m) for m in managers]

    return nested()


@pytest.mark.parametrize("underscore", [False, True])
def test_a_leak_and_a_drain_are_judged_from_prometheus_alone(underscore: bool):
    timeline, _, _ = replay_through(
        {"pd-0": LeakyPD(delay_s=0.0, busy_s=0.3).app()},
        ('{job="pd"}',),
        TRACE,
        underscore=underscore,
    )
    verdict = verify(timeline, [], OPTIONS)
    by_engine = {e: {w.verdict for w in verdict.windows if w.engine == e} for e in "PD"}
    assert by_engine == {"P": {"leak"}, "D": {"drained"}}, verdict.windows
    status = timeline.meta["http"]["metrics"][0]
    assert status["metric"] == "vllm:kv_cache_usage_perc" and status["num_failures"] == 0
    assert timeline.meta["http"]["settings"]["engines"]["P"]["num_gpu_blocks"] == 101


def test_each_reading_is_judged_by_when_prometheus_took_it():
    """Every sample's [send_t, t] holds the moment the fake Prometheus began its scrape."""
    timeline, prometheus, origin = replay_through(
        {"pd-0": LeakyPD(delay_s=0.0, busy_s=0.3).app()}, ('{job="pd"}',), TRACE[:1], tail_s=1.0
    )
    began = [s - origin for s in prometheus.targets[0].starts]
    samples = timeline.samples_for("P")
    assert len(samples) > 10
    for sample in samples:
        assert sample.t - sample.send_t < 0.1
        assert any(sample.send_t <= b <= sample.t for b in began), sample


def test_an_unnamed_selector_splits_engines_by_instance_and_a_named_one_is_its_name():
    def apps():
        return {"pd-0": LeakyPD(0.0, 0.3).app(), "pd-1": LeakyPD(0.0, 0.3).app()}

    timeline, prometheus, _ = replay_through(apps(), ('{job="pd"}',), TRACE[:1], tail_s=0.5)
    instances = [t.instance for t in prometheus.targets]
    assert sorted(timeline.engines) == sorted(f"{i}:{e}" for i in instances for e in "PD")
    selectors = ('A={pod="pd-0"}', 'B={pod="pd-1"}')
    named, _, _ = replay_through(apps(), selectors, TRACE[:1], tail_s=0.5)
    assert sorted(named.engines) == ["A:D", "A:P", "B:D", "B:P"]


def test_a_counter_reset_read_through_prometheus_is_a_restart_fault():
    timeline, _, _ = replay_through(
        {"pd-0": RestartingPD("counters").app()}, ('P0={pod="pd-0"}',), TRACE, tail_s=2.0
    )
    verdict = verify(timeline, [], OPTIONS)
    assert http_verdict(timeline, verdict)[0] == "fault"
    assert {f["kind"] for f in verdict.faults} == {"restarted"}
    assert "went back" in verdict.faults[0]["cause"]


def test_a_pod_that_disappears_is_never_judged_drained():
    """The pod's target leaves Prometheus while the first request runs: its series go
    stale, no window after is drained, and the run is not verified."""

    pod = StartedPD(0.0, 0.3)

    async def pod_gone(targets) -> None:
        await pod.started.wait()
        targets[0].is_scraped = False

    timeline, _, _ = replay_through({"pd-0": pod.app()}, ('{job="pd"}',), TRACE, during=pod_gone)
    verdict = verify(timeline, [], OPTIONS)
    assert "drained" not in {w.verdict for w in verdict.windows}, verdict.windows
    status, reasons = http_verdict(timeline, verdict)
    assert status == "inconclusive", reasons
    errors = timeline.meta["http"]["metrics"][0]["errors"]
    assert any("went stale" in e for e in errors), errors


class StartedPD(LeakyPD):
    """LeakyPD that says when its first request came."""

    def __init__(self, delay_s: float, busy_s: float) -> None:
        super().__init__(delay_s, busy_s)
        self.started = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.started.set()
        return await super().completions(request)


def preflight_through(
    prometheus: FakePrometheus, selector: str, deadline_s: float = 0.5, num_pods: int = 1
):
    async def go():
        apps = [LeakyPD(0.0, 0.1).app() for _ in range(num_pods)]
        async with contextlib_nested([serving(app) for app in apps]) as urls:
            for i, url in enumerate(urls):
                prometheus.add("pd", url + "/metrics", interval_s=0.05, pod=f"pd-{i}")
            async with prometheus_scraping(prometheus):
                options = HttpTargetOptions(
                    urls[0],
                    vocab_size=512,
                    prometheus=PrometheusOptions(
                        url=prometheus.url,
                        selectors=(PromSelector.parse(selector),),
                        series_wait_s=5.0,
                    ),
                )
                return await _preflight(options, deadline_s)

    return asyncio.run(asyncio.wait_for(go(), 30))


def test_a_scrape_interval_over_half_the_deadline_is_refused_before_anything_is_sent():
    slow = FakePrometheus(configured_interval="30s")
    with pytest.raises(PreflightError, match=r"every 30 s.*at most 0.25 s"):
        preflight_through(slow, '{job="pd"}')
    spaced = FakePrometheus(has_targets_api=False)  # the interval from the samples' spacing
    with pytest.raises(PreflightError, match=r"at most 0.025 s"):
        preflight_through(spaced, '{job="pd"}', deadline_s=0.05)
    assert preflight_through(FakePrometheus(), '{job="pd"}').options.prometheus is not None


def test_a_selector_that_matches_nothing_or_a_named_one_two_pods_is_refused():
    with pytest.raises(PreflightError, match=r'no series .* under \{job="nope"\}'):
        preflight_through(FakePrometheus(), '{job="nope"}')
    with pytest.raises(PreflightError, match=r"a named selector is one engine"):
        preflight_through(FakePrometheus(), 'P={job="pd"}', num_pods=2)
