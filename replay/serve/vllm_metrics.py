"""Prometheus metrics of kvdrain's HTTP front, with vLLM 0.32's names and meanings. Runs in: frontend process.

A prometheus_client Collector over two sources, read at scrape time:
- the latest StatsSnapshot of each engine (gauges and engine-side counters). An engine
  publishes a snapshot only when it runs, so a parked engine's gauges keep their last
  values, exactly as vLLM's do (vLLM's gauges are set from SchedulerStats, which only a
  step produces): under `--liveness legacy` P reports its held blocks through the idle
  period.
- what the front observes per request (FrontStats): time to first token, end-to-end
  latency, finished requests by reason. Like vLLM's, these are measured where the
  requests enter and leave (vLLM's output processor); they are labelled with the
  engine that answered (D in a P/D topology). P's prefill-only completions, which the
  front never sees, come from the router's count of P's final outputs (`prefill`): a
  vLLM P server counts each in vllm:request_success_total{finished_reason="length"}.

Names, types, label names and buckets follow vllm/v1/metrics/loggers.py and buckets.py
(0.32.0): every vLLM series carries `model_name` and `engine` (vLLM's engine label is
an index, "0"; here it is the engine id, "P" or "D"); vllm:num_requests_waiting counts
waiting + skipped (remote-KV) requests; vllm:kv_cache_usage_perc is a fraction (1 = full)
of the usable blocks (the null block excluded); the prefix-cache counters count tokens,
queried and hit, once per request at its first admission (vLLM skips preempted retries
too); vllm:request_success_total has one series per FinishReason. kvdrain's own metrics
(kvdrain:*) add what vLLM does not export: block counts, delayed frees, the loop state,
the snapshot's age and the connector's counters.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.core.liveness import LOOP_STATE_NAMES
from engine.proc.messages import StatsSnapshot

# vllm/v1/metrics/buckets.py (0.32.0): TIME_TO_FIRST_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# vllm.v1.engine.FinishReason, in order; kvdrain's "ignored" is vLLM's FINISHED_IGNORED,
# which vLLM reports as "length".
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ("model_name", "engine")

# Exposed family names -> label names, pinned by tests/replay/serve/test_vllm_metrics.py.
# (Counter families expose `<name>_total`; histograms `_bucket`, `_sum`, `_count`.)
FAMILIES: dict[str, tuple[str, ...]] = {
    "vllm:num_requests_running": LABELS,
    "vllm:num_requests_waiting": LABELS,
    "vllm:kv_cache_usage_perc": LABELS,
    "vllm:num_preemptions": LABELS,
    "vllm:prefix_cache_queries": LABELS,
    "vllm:prefix_cache_hits": LABELS,
    "vllm:request_success": LABELS + ("finished_reason",),
    "vllm:time_to_first_token_seconds": LABELS,
    "vllm:e2e_request_latency_seconds": LABELS,
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks", "engine"),
    "kvdrain:kv_blocks_used": LABELS,
    "kvdrain:kv_blocks_cached": LABELS,
    "kvdrain:kv_blocks_free": LABELS,
    "kvdrain:kv_blocks_usable": LABELS,
    "kvdrain:delayed_free_requests": LABELS,
    "kvdrain:requests_waiting_for_remote_kvs": LABELS,
    "kvdrain:loop_state": LABELS + ("state",),
    "kvdrain:engine_steps": LABELS,
    "kvdrain:engine_wakeups": LABELS,
    "kvdrain:engine_probe_wakeups": LABELS,
    "kvdrain:engine_bad_messages": LABELS,
    "kvdrain:kv_load_failures": LABELS,
    "kvdrain:stats_age_seconds": LABELS,
    "kvdrain:connector_events": LABELS + ("event",),
    "kvdrain:connector_in_flight": LABELS + ("kind",),
}

# StatsSnapshot.counts keys that are not the connector's.
_ENGINE_KEYS = frozenset(
    (
        "num_waiting",
        "num_skipped_waiting",
        "num_waiting_for_remote_kvs",
        "num_running",
        "num_finished_awaiting_free",
        "num_usable_blocks",
        "num_used_blocks",
        "num_cached_blocks",
        "num_free_blocks",
        "num_preemptions",
        "num_prefix_hit_tokens",
        "num_prefix_query_tokens",
        "connector_worker_pid",
        "num_probe_wakeups",
        "num_bad_messages",
        "num_kv_load_failures",
    )
)


@dataclass(slots=True)
class Histogram:
    """Cumulative-free bucket counts of one series (made cumulative at exposition)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return out


@dataclass(slots=True)
class FrontStats:
    """What the HTTP front observed for one engine's answers."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def on_finished(self, reason: str, e2e_s: float) -> None:
        reason = "length" if reason == "ignored" else reason
        self.finished[reason if reason in self.finished else "error"] += 1
        self.e2e.observe(e2e_s)


class EngineCollector(Collector):
    """Collects every family above from the snapshots and the front's stats."""

    def __init__(
        self,
        model_name: str,
        engines: list[str],
        block_size: int,
        latest: dict[str, StatsSnapshot],
        front: dict[str, FrontStats],
        prefill: tuple[str, dict[str, int]] | None = None,
    ) -> None:
        """prefill: the prefill engine and its finished requests by reason (kept current)."""
        self.model_name = model_name
        self.prefill = prefill
        self.engines = list(engines)
        self.block_size = block_size
        self.latest = latest  # shared with the server, which keeps it current
        self.front = front

    def collect(self):
        families = _new_families()
        now = time.monotonic()
        for engine in self.engines:
            labels = [self.model_name, engine]
            snap = self.latest.get(engine)
            if snap is not None:
                _add_snapshot(families, labels, snap, now, self.block_size)
            prefill = (
                self.prefill[1] if self.prefill is not None and self.prefill[0] == engine else {}
            )
            _add_front(families, labels, self.front.get(engine) or FrontStats(), prefill)
        yield from families.values()


def _new_families() -> dict[str, object]:
    def gauge(name, doc):
        return GaugeMetricFamily(name, doc, labels=FAMILIES[name])

    def counter(name, doc):
        return CounterMetricFamily(name, doc, labels=FAMILIES[name])

    def histogram(name, doc):
        return HistogramMetricFamily(name, doc, labels=FAMILIES[name])

    return {
        f.name: f
        for f in (
            gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
            gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            counter(
                "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
            ),
            counter("vllm:request_success", "Count of successfully processed requests."),
            histogram(
                "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."
            ),
            histogram(
                "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
            ),
            gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig"),
            gauge("kvdrain:kv_blocks_used", "KV blocks held by requests (ref count > 0)."),
            gauge("kvdrain:kv_blocks_cached", "Free KV blocks that still hold a prefix hash."),
            gauge("kvdrain:kv_blocks_free", "Free KV blocks, cached ones included."),
            gauge("kvdrain:kv_blocks_usable", "Usable KV blocks (the null block excluded)."),
            gauge(
                "kvdrain:delayed_free_requests",
                "Finished requests whose blocks the KV connector still holds (delayed frees).",
            ),
            gauge(
                "kvdrain:requests_waiting_for_remote_kvs",
                "Requests parked in WAITING_FOR_REMOTE_KVS.",
            ),
            gauge(
                "kvdrain:loop_state", "The engine loop's state at its last snapshot (1 = current)."
            ),
            counter("kvdrain:engine_steps", "Engine steps so far."),
            counter(
                "kvdrain:engine_wakeups", "Engine loop wake-ups (out of blocked, poll sleeps)."
            ),
            counter(
                "kvdrain:engine_probe_wakeups",
                "Wake-ups of a parked engine whose only input was a stats probe.",
            ),
            counter(
                "kvdrain:engine_bad_messages",
                "Messages the engine core dropped (undecodable or not its own).",
            ),
            counter(
                "kvdrain:kv_load_failures", "Requests whose KV load failed (the scheduler's count)."
            ),
            gauge(
                "kvdrain:stats_age_seconds",
                "Seconds since the engine last published stats (a parked engine's grow).",
            ),
            counter("kvdrain:connector_events", "KV connector counters, by event."),
            gauge("kvdrain:connector_in_flight", "KV connector operations in flight, by kind."),
        )
    }


def _add_snapshot(
    families: dict, labels: list[str], snap: StatsSnapshot, now: float, block_size: int
) -> None:
    c = snap.counts
    num_usable = c.get("num_usable_blocks", 0)
    values = {
        "vllm:num_requests_running": c.get("num_running", 0),
        "vllm:num_requests_waiting": c.get("num_waiting", 0) + c.get("num_skipped_waiting", 0),
        "vllm:kv_cache_usage_perc": c.get("num_used_blocks", 0) / num_usable if num_usable else 0.0,
        "vllm:num_preemptions": c.get("num_preemptions", 0),
        "vllm:prefix_cache_queries": c.get("num_prefix_query_tokens", 0),
        "vllm:prefix_cache_hits": c.get("num_prefix_hit_tokens", 0),
        "kvdrain:kv_blocks_used": c.get("num_used_blocks", 0),
        "kvdrain:kv_blocks_cached": c.get("num_cached_blocks", 0),
        "kvdrain:kv_blocks_free": c.get("num_free_blocks", 0),
        "kvdrain:kv_blocks_usable": num_usable,
        "kvdrain:delayed_free_requests": c.get("num_finished_awaiting_free", 0),
        "kvdrain:requests_waiting_for_remote_kvs": c.get("num_waiting_for_remote_kvs", 0),
        "kvdrain:engine_steps": snap.num_steps,
        "kvdrain:engine_wakeups": snap.num_wakeups,
        "kvdrain:engine_probe_wakeups": c.get("num_probe_wakeups", 0),
        "kvdrain:engine_bad_messages": c.get("num_bad_messages", 0),
        "kvdrain:kv_load_failures": c.get("num_kv_load_failures", 0),
        "kvdrain:stats_age_seconds": max(0.0, now - snap.monotonic),
    }
    for name, value in values.items():
        families[name].add_metric(labels, value)
    # vLLM's num_gpu_blocks counts the null block too.
    families["vllm:cache_config_info"].add_metric(
        [str(block_size), str(num_usable + 1), labels[1]], 1
    )
    for state in LOOP_STATE_NAMES:
        families["kvdrain:loop_state"].add_metric(labels + [state], float(snap.loop_state == state))
    for key, value in sorted(c.items()):
        if key in _ENGINE_KEYS or not key.startswith("num_"):
            continue
        name = key[len("num_") :]
        if name.endswith("_in_flight"):
            families["kvdrain:connector_in_flight"].add_metric(
                labels + [name[: -len("_in_flight")]], value
            )
        else:
            families["kvdrain:connector_events"].add_metric(labels + [name], value)


def _add_front(
    families: dict, labels: list[str], front: FrontStats, prefill_finished: dict[str, int]
) -> None:
    finished = dict(front.finished)
    for reason, count in prefill_finished.items():
        reason = "length" if reason == "ignored" else reason if reason in finished else "error"
        finished[reason] += count
    for reason, count in finished.items():
        families["vllm:request_success"].add_metric(labels + [reason], count)
    families["vllm:time_to_first_token_seconds"].add_metric(
        labels, front.ttft.buckets(), front.ttft.total
    )
    families["vllm:e2e_request_latency_seconds"].add_metric(
        labels, front.e2e.buckets(), front.e2e.total
    )
