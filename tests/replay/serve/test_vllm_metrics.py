"""/metrics of the HTTP front: vLLM's names, label sets and buckets, parsed by prometheus_client."""

from __future__ import annotations

import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from engine.proc.messages import StatsSnapshot
from replay.serve.vllm_metrics import (
    E2E_BUCKETS,
    FAMILIES,
    TTFT_BUCKETS,
    EngineCollector,
    FrontStats,
)

COUNTS = {
    "num_waiting": 2,
    "num_skipped_waiting": 1,
    "num_waiting_for_remote_kvs": 1,
    "num_running": 3,
    "num_finished_awaiting_free": 4,
    "num_usable_blocks": 100,
    "num_used_blocks": 25,
    "num_cached_blocks": 10,
    "num_free_blocks": 75,
    "num_preemptions": 5,
    "num_stale_kv_reports": 0,
    "num_prefix_hit_tokens": 32,
    "num_prefix_query_tokens": 96,
    "num_kv_load_failures": 0,
    "num_sent": 7,
    "num_expired": 1,
    "num_recvs_in_flight": 2,
    "connector_worker_pid": 1234,
    "num_bad_messages": 0,
}

# Pinned: what a dashboard built for vLLM 0.32 (or for kvdrain) reads.
EXPECTED_LABELS = {
    "vllm:num_requests_running": {"model_name", "engine"},
    "vllm:num_requests_waiting": {"model_name", "engine"},
    "vllm:kv_cache_usage_perc": {"model_name", "engine"},
    "vllm:num_preemptions_total": {"model_name", "engine"},
    "vllm:prefix_cache_queries_total": {"model_name", "engine"},
    "vllm:prefix_cache_hits_total": {"model_name", "engine"},
    "vllm:request_success_total": {"model_name", "engine", "finished_reason"},
    "vllm:time_to_first_token_seconds_bucket": {"model_name", "engine", "le"},
    "vllm:time_to_first_token_seconds_sum": {"model_name", "engine"},
    "vllm:time_to_first_token_seconds_count": {"model_name", "engine"},
    "vllm:e2e_request_latency_seconds_bucket": {"model_name", "engine", "le"},
    "vllm:e2e_request_latency_seconds_sum": {"model_name", "engine"},
    "vllm:e2e_request_latency_seconds_count": {"model_name", "engine"},
    "vllm:cache_config_info": {"block_size", "num_gpu_blocks", "engine"},
    "kvdrain:kv_blocks_used": {"model_name", "engine"},
    "kvdrain:kv_blocks_cached": {"model_name", "engine"},
    "kvdrain:kv_blocks_free": {"model_name", "engine"},
    "kvdrain:kv_blocks_usable": {"model_name", "engine"},
    "kvdrain:delayed_free_requests": {"model_name", "engine"},
    "kvdrain:requests_waiting_for_remote_kvs": {"model_name", "engine"},
    "kvdrain:loop_state": {"model_name", "engine", "state"},
    "kvdrain:engine_steps_total": {"model_name", "engine"},
    "kvdrain:engine_wakeups_total": {"model_name", "engine"},
    "kvdrain:engine_probe_wakeups_total": {"model_name", "engine"},
    "kvdrain:engine_bad_messages_total": {"model_name", "engine"},
    "kvdrain:kv_load_failures_total": {"model_name", "engine"},
    "kvdrain:stats_age_seconds": {"model_name", "engine"},
    "kvdrain:connector_events_total": {"model_name", "engine", "event"},
    "kvdrain:connector_in_flight": {"model_name", "engine", "kind"},
}


def _scrape(latest: dict, front: dict) -> dict[str, list]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector("m", ["P", "D"], 16, latest, front))
    text = generate_latest(registry).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples, name, **labels) -> float:
    hits = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_names_and_label_sets_are_pinned():
    latest = {"P": StatsSnapshot("P", 1, time.monotonic(), "blocked", 10, 3, dict(COUNTS))}
    samples = _scrape(latest, {})
    assert {
        name: set().union(*(s.labels for s in group)) for name, group in samples.items()
    } == EXPECTED_LABELS
    base = {
        name.removesuffix("_total")
        .removesuffix("_bucket")
        .removesuffix("_sum")
        .removesuffix("_count")
        for name in EXPECTED_LABELS
    }
    assert base == set(FAMILIES)


def test_values_mean_what_vllm_means():
    latest = {"P": StatsSnapshot("P", 1, time.monotonic() - 2.0, "blocked", 10, 3, dict(COUNTS))}
    front = {"D": FrontStats()}
    front["D"].ttft.observe(0.03)
    front["D"].on_finished("length", 0.9)
    front["D"].on_finished("ignored", 0.2)  # vLLM's FINISHED_IGNORED is "length"
    s = _scrape(latest, front)
    assert _value(s, "vllm:kv_cache_usage_perc", engine="P") == 0.25
    assert _value(s, "vllm:num_requests_waiting", engine="P") == 3  # waiting + skipped
    assert _value(s, "vllm:num_requests_running", engine="P") == 3
    assert _value(s, "vllm:num_preemptions_total", engine="P") == 5
    assert _value(s, "vllm:prefix_cache_queries_total", engine="P") == 96
    assert _value(s, "vllm:prefix_cache_hits_total", engine="P") == 32
    assert _value(s, "vllm:cache_config_info", engine="P", num_gpu_blocks="101") == 1
    assert _value(s, "kvdrain:delayed_free_requests", engine="P") == 4
    assert _value(s, "kvdrain:loop_state", engine="P", state="blocked") == 1
    assert _value(s, "kvdrain:loop_state", engine="P", state="stepping") == 0
    assert _value(s, "kvdrain:stats_age_seconds", engine="P") >= 2.0
    assert _value(s, "kvdrain:connector_events_total", engine="P", event="sent") == 7
    assert _value(s, "kvdrain:connector_in_flight", engine="P", kind="recvs") == 2
    assert _value(s, "vllm:request_success_total", engine="D", finished_reason="length") == 2
    assert _value(s, "vllm:request_success_total", engine="P", finished_reason="stop") == 0
    assert _value(s, "vllm:time_to_first_token_seconds_count", engine="D") == 1
    assert _value(s, "vllm:time_to_first_token_seconds_bucket", engine="D", le="0.04") == 1
    assert _value(s, "vllm:time_to_first_token_seconds_bucket", engine="D", le="0.02") == 0
    assert _value(s, "vllm:e2e_request_latency_seconds_bucket", engine="D", le="+Inf") == 2
    les = [
        x.labels["le"]
        for x in s["vllm:e2e_request_latency_seconds_bucket"]
        if x.labels["engine"] == "D"
    ]
    assert [float(le) for le in les[:-1]] == list(E2E_BUCKETS)
    les = [
        x.labels["le"]
        for x in s["vllm:time_to_first_token_seconds_bucket"]
        if x.labels["engine"] == "D"
    ]
    assert [float(le) for le in les[:-1]] == list(TTFT_BUCKETS)
    # An engine with no snapshot yet exports no gauges (nothing is known).
    assert not [x for x in s["vllm:kv_cache_usage_perc"] if x.labels["engine"] == "D"]


def test_prefix_cache_queries_count_each_request_once_like_vllm():
    from tests.engine.core.test_scheduler import run_to_completion
    from tests.utils import make_request, make_scheduler

    sched = make_scheduler()
    sched.add_request(make_request("a", num_tokens=13, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", num_tokens=13, max_tokens=1))
    run_to_completion(sched)
    stats = sched.make_stats()
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (26, 12)


def test_an_engine_without_a_connector_exposes_no_connector_counter():
    """The engine core's own counters (bad messages, probe wake-ups, the scheduler's KV load
    failures) are the engine's: as connector events, a single engine read as having a
    kvdrain PDConnector."""
    from replay.target.server_facts import engine_facts

    counts = {
        k: v
        for k, v in COUNTS.items()
        if k
        in ("num_waiting", "num_running", "num_usable_blocks", "num_used_blocks", "num_free_blocks")
    }
    latest = {
        "E": StatsSnapshot(
            "E",
            1,
            time.monotonic(),
            "blocked",
            10,
            3,
            {**counts, "num_bad_messages": 2, "num_probe_wakeups": 5, "num_kv_load_failures": 0},
        )
    }
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector("m", ["E"], 16, latest, {}))
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    assert engine_facts(samples, "E").connector is None
    assert _value(samples, "kvdrain:engine_probe_wakeups_total", engine="E") == 5
    assert _value(samples, "kvdrain:engine_bad_messages_total", engine="E") == 2
    assert _value(samples, "kvdrain:kv_load_failures_total", engine="E") == 0
