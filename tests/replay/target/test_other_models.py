"""Series of another model are not the engine's: a /metrics that also carries another
model's series (a leak among them) is read for the model under test only, says so, and
one that carries only another model's is refused before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from replay.trace.records import TraceRequest
from replay.verify.outcome import http_outcome, http_verdict, outcome_lines
from replay.verify.rules import VerifyOptions, verify
from tests.http_utils import serving_in_thread
from tests.replay.target.test_hostile_server import LeakyPD, invoke_replay, replay_against

pytestmark = pytest.mark.timeout(90)


class TwoModels(LeakyPD):
    """One engine ("0") serving model "m", which holds 4 blocks while a request runs and
    none otherwise, beside the series of model "other", which holds 8 blocks throughout
    and counts 1,000 prefix-cache hits a scrape. `served` is what its series say the
    model under test is called."""

    def __init__(self, served: str = "m") -> None:
        super().__init__(delay_s=0.0, busy_s=0.3)
        self.served = served
        self.num_other_hits = 0

    async def metrics(self, request: web.Request) -> web.Response:
        self.num_other_hits += 1000
        used = 4 if self.num_running else 0
        return web.Response(
            text=f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.served}"}} '
            f"{used / 100}\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="other"} 0.08\n'
            'vllm:cache_config_info{engine="0",num_gpu_blocks="101"} 1\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="{self.served}"}} 0\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="other"}} '
            f"{self.num_other_hits}\n"
        )


TRACE = [TraceRequest(0.0, "a", 2, 1), TraceRequest(2.5, "b", 2, 1)]
OPTIONS = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=0.5)


def test_another_models_leak_is_not_blamed_on_the_engine_and_the_note_says_why():
    timeline = replay_against(TwoModels().app(), TRACE, tail_s=1.5, scrape_interval_s=0.05)
    verdict = verify(timeline, [], OPTIONS)
    assert verdict.status == "verified", verdict.violations
    assert len(timeline.engines) == 1
    assert max(s.num_used_blocks for s in timeline.samples) == 4
    assert http_verdict(timeline, verdict)[0] == "verified"
    assert timeline.counters[timeline.engines[0]]["num_prefix_hit_tokens"] == 0
    lines = outcome_lines(http_outcome(timeline, verdict))
    assert "  series of 2 models at this URL ('m', 'other'): only model 'm''s were read" in lines


def test_a_metrics_url_with_only_another_models_series_is_refused_naming_them(tmp_path: Path):
    with serving_in_thread(TwoModels(served="elsewhere").app()) as url:
        result = invoke_replay(url, tmp_path, "--metrics", url + "/metrics")
    assert result.exit_code == 2, result.output
    assert (
        "vllm:kv_cache_usage_perc: no series of model 'm' (the server's are of 'elsewhere', "
        "'other'); --model names the model under test" in result.output
    )
