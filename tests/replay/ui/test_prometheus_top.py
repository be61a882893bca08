"""`kvdrain top --prometheus`: the series waited for, then watched; a scrape interval too
coarse for the drain deadline is not refused but judged with twice the interval, said."""

from __future__ import annotations

import asyncio
import time

import pytest

from replay.metrics.prometheus import PrometheusOptions
from replay.metrics.promql import PromSelector
from replay.ui.prometheus_top import judged_options, ready_readers
from replay.verify.rules import VerifyOptions
from tests.http_utils import serving
from tests.replay.metrics.fake_prometheus import FakePrometheus, prometheus_scraping
from tests.replay.target.test_hostile_server import LeakyPD

pytestmark = pytest.mark.timeout(60)


def test_top_judges_a_coarse_interval_with_the_deadline_it_can_prove_and_says_so():
    options = VerifyOptions(drain_deadline_s=0.5)
    assert judged_options(options, 0.25) == (options, None)
    judged, note = judged_options(options, 1.0)
    assert judged.drain_deadline_s == 2.0
    assert "drain deadline of 2 s" in note and "1 s scrape interval" in note


def test_top_waits_for_the_series_and_reads_the_interval_prometheus_is_configured_with():
    async def go():
        prometheus = FakePrometheus(configured_interval="1s")
        async with serving(LeakyPD(0.0, 0.1).app()) as url:
            prometheus.add("vllm", url + "/metrics", pod="p")
            async with prometheus_scraping(prometheus):
                selectors = (PromSelector.parse('{job="vllm"}'), PromSelector.parse('{job="x"}'))
                options = PrometheusOptions(
                    url=prometheus.url, selectors=selectors, series_wait_s=1.0
                )
                return await ready_readers(options, time.monotonic(), 2.0)

    readers, problems = asyncio.run(asyncio.wait_for(go(), 30))
    assert readers[0].interval_s == 1.0 and len(readers[0].targets) == 1
    assert len(problems) == 1 and '{job="x"}' in problems[0] and "no series" in problems[0]
