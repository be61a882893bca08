"""Scraping Prometheus metrics URLs into per-engine KV-usage samples. Runs in: frontend process.

Each --metrics URL is fetched (aiohttp) and parsed with prometheus_client's parser.
The KV-usage metric is the first of KV_METRICS the server exposes:
- `vllm:kv_cache_usage_perc` (vLLM >= 0.10), `vllm:gpu_cache_usage_perc` (older vLLM):
  a fraction of the usable blocks. When `vllm:cache_config_info` says num_gpu_blocks
  (vLLM and kvdrain do), usage becomes blocks (num_gpu_blocks - 1 usable: the null
  block); otherwise parts per million of the pool.
- `sglang:token_usage`: a fraction of the token pool, as tokens when
  `sglang:max_total_num_tokens` is there, otherwise parts per million.
- `kvdrain:kv_blocks_used` with `kvdrain:kv_blocks_free`: blocks.
A nonzero fraction never rounds to 0 (a one-block leak in a big pool stays a leak).
Series are told apart by their `engine` label; a URL given as NAME=URL names its
engine NAME (NAME:<engine> when the URL exposes several). With the model under test known
(Scraper.model), a series whose `model_name` names another model is another engine's and
is dropped (of_model); every model_name seen is in the status. Queue gauges, delayed
frees, loop state and step counts are read where the server has them (kvdrain), else 0.
Each reading also goes to a RestartWatch (replay/metrics/restarts.py): a restart is a
fault, never a drain.
Each sample is stamped with its scrape's sending (EngineSample.send_t) and its answer
(t): the server took the reading somewhere between (replay/verify/rules.py judges by both).
A scrape that fails in any way (no answer, not 200, not parseable, a value read that is
+Inf, -Inf or NaN, anything unexpected) is a counted failure with its error; the scrape
loop goes on.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from replay.metrics.restarts import (
    PROCESS_START,
    RESTART_COUNTERS,
    RestartWatch,
    restart_faults,
)
from replay.verify.text import printable
from replay.verify.timeline import EngineSample

KV_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "kvdrain:kv_blocks_used",
)
PPM = 1_000_000
MAX_METRICS_BYTES = 8 << 20  # a larger /metrics answer is a failed scrape
INLINE_PARSE_BYTES = 64 << 10  # a later scrape's answer up to this is read on the event loop
MAX_FAILURE_SPANS = 1000  # failed scrapes placed in time; past it, every failure is taken to matter
PREFIXES = ("vllm:", "sglang:", "kvdrain:")
_SAFE_LABEL = re.compile(r"[^\w.:@/-]", re.ASCII)
_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_OURS = tuple(
    f"{head}{prefix}"
    for prefix in (*PREFIXES, PROCESS_START)
    for head in ("", "# HELP ", "# TYPE ")
)
MAX_MODELS_NAMED = 20  # model_name labels kept for the report; past it, only counted


@dataclass(frozen=True, slots=True)
class MetricsSource:
    """One --metrics argument: NAME=URL or URL; a URL with no path is the server's
    /metrics (where vLLM, SGLang and kvdrain serve --http expose them)."""

    url: str
    name: str | None = None

    @staticmethod
    def parse(arg: str) -> MetricsSource:
        name, sep, url = arg.partition("=")
        if not sep or "://" in name:
            name, url = None, arg
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--metrics: expected [NAME=]http://HOST:PORT/metrics, got {arg!r}")
        if parts.path in ("", "/") and not parts.query:
            url = f"{parts.scheme}://{parts.netloc}/metrics"
        return MetricsSource(url, name or None)


def sample_lines(text: str, names: frozenset[str]) -> str:
    """The sample lines of `names` only, no comments (their samples untyped: the same
    names, labels and values as parsed from the whole text)."""
    return "".join(
        f"{line}\n"
        for line in text.splitlines()
        if (m := _SAMPLE_NAME.match(line)) is not None and m[0] in names
    )


async def _parse_off_the_sends(raw: bytes, whole: bool) -> dict[str, list]:
    """_parse(raw, whole) where it holds back the replay's sends least: on the event loop
    when it is a plain read of a small answer (a kvdrain or vLLM scrape: well under a
    millisecond, and a parse thread would hold the GIL against the sends as long),
    otherwise in a thread (a big answer's filter, prometheus_client's parser)."""
    if not whole and len(raw) <= INLINE_PARSE_BYTES:
        samples = parse_plain_samples(sample_lines(raw.decode("utf-8", "replace"), READ_NAMES))
        if samples is not None:
            return samples
    return await asyncio.to_thread(_parse, raw, whole)


def _parse(raw: bytes, whole: bool) -> dict[str, list]:
    """The first scrape reads every family's name; the later ones only READ_NAMES."""
    text = raw.decode("utf-8", "replace")
    if whole:
        return parse_metrics(text)
    lines = sample_lines(text, READ_NAMES)
    samples = parse_plain_samples(lines)
    return samples if samples is not None else parse_metrics(lines)


# A sample line as servers write it: name, labels quoted without escapes, one value, no
# timestamp. Anything else (escapes, a timestamp, odd spacing) is prometheus_client's.
_PLAIN_LINE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*")*)?)\})? ([0-9a-zA-Z.+-]+)'
)
_PLAIN_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')


def parse_plain_samples(lines: str) -> dict[str, list] | None:
    """parse_metrics of untyped sample lines (sample_lines'), or None where a line is not
    plain (_PLAIN_LINE): the same samples at a fraction of the cost (prometheus_client's
    parser takes ~100 us a line, all of it holding the GIL against the replay's sends)."""
    out: dict[str, list] = {}
    for line in lines.splitlines():
        m = _PLAIN_LINE.fullmatch(line)
        if m is None:
            return None
        name, labels, value = m.groups()
        pairs = _PLAIN_LABEL.findall(labels) if labels else ()
        labels = dict(pairs)
        if len(labels) != len(pairs) or any(k.startswith("__") for k, _ in pairs):
            return None  # a repeated or reserved label: prometheus_client's to refuse
        try:
            number = int(value)
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                return None
        out.setdefault(name, []).append(Sample(name, labels, number))
    return out


def parse_metrics(text: str) -> dict[str, list]:
    """Sample name -> its samples (prometheus_client Sample: name, labels, value), of the
    vllm:, sglang: and kvdrain: families and the process start time only: the others' lines
    are dropped unparsed (prometheus_client's parser takes seconds per megabyte)."""
    ours = "\n".join(line for line in text.splitlines() if line.startswith(_OURS))
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(ours + "\n"):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or a ValueError once it is past `limit` bytes (never all of it)."""
    chunks, size = [], 0
    while chunk := await response.content.read(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ValueError(f"the answer is larger than {limit >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def family_names(samples: dict[str, list]) -> list[str]:
    """The vllm:, sglang: and kvdrain: metric families among `samples`."""
    names = set()
    for name in samples:
        for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
            name = name.removesuffix(suffix)
        if name.startswith(PREFIXES):
            names.add(name)
    return sorted(names)


def of_model(samples: dict[str, list], model: str | None) -> dict[str, list]:
    """`samples` without the series of another model than `model` (a `model_name` label
    that is not it); a series without the label is kept, and so is every one when model is
    None (not known)."""
    if model is None:
        return samples
    out = {}
    for name, series in samples.items():
        kept = [s for s in series if s.labels.get("model_name", model) == model]
        if kept:
            out[name] = kept
    return out


def model_names(samples: dict[str, list]) -> set[str]:
    """Every `model_name` label among `samples`."""
    return {
        s.labels["model_name"]
        for series in samples.values()
        for s in series
        if "model_name" in s.labels
    }


def choose_metric(samples: dict[str, list]) -> str | None:
    return next((name for name in KV_METRICS if name in samples), None)


@dataclass(slots=True)
class Scraped:
    """One engine's reading from one scrape."""

    engine_label: str
    used: int
    free: int
    cached: int
    unit: str  # "blocks" | "tokens" | "ppm"
    labels: dict[str, float] = field(default_factory=dict)  # other gauges by sample name


def read_engines(samples: dict[str, list], metric: str) -> list[Scraped]:
    """Every engine's KV usage in `samples` per `metric` (see the module docstring)."""
    out = []
    for sample in samples.get(metric, []):
        engine = sample.labels.get("engine", "")  # the label as the server spells it
        used, total, unit = _usage(samples, metric, sample.value, engine)
        cached = int(_gauge(samples, "kvdrain:kv_blocks_cached", engine)) if unit == "blocks" else 0
        extra = {name: _gauge(samples, name, engine) for name in _EXTRA}
        out.append(Scraped(engine, used, max(total - used, 0), cached, unit, extra))
    return out


_EXTRA = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "kvdrain:requests_waiting_for_remote_kvs",
    "kvdrain:delayed_free_requests",
    "kvdrain:engine_steps_total",
    "kvdrain:engine_wakeups_total",
)
# Every sample a scrape reads once its metric is chosen. The rest (histograms above all,
# half of kvdrain's /metrics) is dropped before prometheus_client's parser, which costs
# tens of microseconds a line and holds the GIL against the replay's sends meanwhile.
READ_NAMES = frozenset(
    (
        *KV_METRICS,
        *_EXTRA,
        "kvdrain:kv_blocks_free",
        "kvdrain:kv_blocks_cached",
        "kvdrain:loop_state",
        "vllm:cache_config_info",
        "sglang:max_total_num_tokens",
        *RESTART_COUNTERS,
        PROCESS_START,
    )
)


def _finite(name: str, value: float) -> float:
    """value, or a ValueError if it is +Inf, -Inf, NaN or negative (no count or fraction
    is), or a fraction above 1."""
    if not math.isfinite(value):
        raise ValueError(f"{name}: not a finite value: {value}")
    if value < 0:
        raise ValueError(f"{name}: negative: {value}")
    if value > 1 and name in _FRACTIONS:
        raise ValueError(f"{name}: a fraction above 1: {value}")
    return value


_FRACTIONS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def _usage(
    samples: dict[str, list], metric: str, value: float, engine: str
) -> tuple[int, int, str]:
    value = _finite(metric, value)
    if metric == "kvdrain:kv_blocks_used":
        used = int(value)
        return used, used + int(_gauge(samples, "kvdrain:kv_blocks_free", engine)), "blocks"
    if metric == "sglang:token_usage":
        total, unit = int(_gauge(samples, "sglang:max_total_num_tokens", engine)), "tokens"
    else:
        total = _num_gpu_blocks(samples, engine) - 1
        unit = "blocks"
    if total <= 0:
        total, unit = PPM, "ppm"
    used = min(total, round(value * total))
    if value > 0 and used == 0:
        used = 1
    return used, total, unit


def _num_gpu_blocks(samples: dict[str, list], engine: str) -> int:
    for sample in samples.get("vllm:cache_config_info", []):
        if sample.labels.get("engine", "") in (engine, ""):
            try:
                return int(sample.labels.get("num_gpu_blocks", "0"))
            except ValueError:  # "None" before the profile run
                return 0
    return 0


def _gauge(samples: dict[str, list], name: str, engine: str) -> float:
    return _finite(
        name,
        next((s.value for s in samples.get(name, []) if s.labels.get("engine", "") == engine), 0.0),
    )


def engine_name(source: MetricsSource, label: str, num_labels: int) -> str:
    """The name one series gets in the timeline (a label's or a source name's characters
    other than letters, digits and . : @ / - become _: a target names its upstreams, and
    the name is printed everywhere, the live view's markup included); a URL's credentials
    are never part of it."""
    label = _SAFE_LABEL.sub("_", label)[:64]
    if source.name is not None:
        name = _SAFE_LABEL.sub("_", source.name)[:64]
        return name if num_labels == 1 else f"{name}:{label}"
    if num_labels > 1 or (label and not label.isdigit()):
        return label
    where = urlsplit(source.url).netloc.rpartition("@")[2]
    return where + (f":{label}" if label and label != "0" else "")


def to_sample(t: float, engine: str, scraped: Scraped, loop_state: str) -> EngineSample:
    g = scraped.labels
    return EngineSample(
        t=t,
        engine=engine,
        num_used_blocks=scraped.used,
        num_cached_blocks=scraped.cached,
        num_free_blocks=scraped.free,
        num_usable_blocks=scraped.used + scraped.free,
        num_waiting=int(g.get("vllm:num_requests_waiting", 0)),
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=int(g.get("kvdrain:requests_waiting_for_remote_kvs", 0)),
        num_running=int(g.get("vllm:num_requests_running", 0)),
        num_finished_awaiting_free=int(g.get("kvdrain:delayed_free_requests", 0)),
        loop_state=loop_state,
        num_steps=int(g.get("kvdrain:engine_steps_total", 0)),
        num_wakeups=int(g.get("kvdrain:engine_wakeups_total", 0)),
    )


def loop_state(samples: dict[str, list], engine: str) -> str:
    """kvdrain's loop state, or "unknown" for servers that do not say."""
    for sample in samples.get("kvdrain:loop_state", []):
        if sample.labels.get("engine") == engine and sample.value == 1:
            return sample.labels.get("state", "unknown")
    return "unknown"


@dataclass(slots=True)
class Scraper:
    """One metrics URL over a replay: its samples on the replay's clock, and what went wrong."""

    source: MetricsSource
    origin: float  # time.monotonic() of the replay's t = 0
    timeout_s: float = 2.0
    model: str | None = None  # the model under test; None: every series is read
    metric: str | None = None
    unit: str | None = None
    names_found: list[str] = field(default_factory=list)  # vllm:/sglang:/kvdrain: families
    engines: dict[str, str] = field(default_factory=dict)  # engine label -> timeline name
    samples: list[EngineSample] = field(default_factory=list)
    num_scrapes: int = 0
    num_failures: int = 0
    max_answer_s: float = 0.0  # the longest wait for an answer (the server's cost)
    max_parse_s: float = 0.0  # the longest parse of one (the client's cost)
    errors: list[str] = field(default_factory=list)  # the first few failures, in order
    # (sent, failed) of each failed scrape, the first MAX_FAILURE_SPANS: where a reading is
    # missing (replay/verify/outcome.py: a failure matters only inside a judged window)
    failure_spans: list[tuple[float, float]] = field(default_factory=list)
    models_found: list[str] = field(default_factory=list)  # model_name labels, first seen first
    restart_watch: RestartWatch = field(default_factory=RestartWatch)

    async def scrape(self, session: aiohttp.ClientSession) -> bool:
        """One scrape; False (and a counted failure) if it gave no usable KV reading. A scrape
        cancelled unanswered (the run ended) is not counted."""
        send_t = time.monotonic() - self.origin
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with session.get(self.source.url, timeout=timeout) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                raw = await _read_capped(response, MAX_METRICS_BYTES)
            t = time.monotonic() - self.origin
            self.max_answer_s = max(self.max_answer_s, t - send_t)
            samples = await _parse_off_the_sends(raw, self.metric is None)
            self.max_parse_s = max(self.max_parse_s, time.monotonic() - self.origin - t)
            usable = self._read(samples, send_t, t)
        except Exception as e:  # any failure is this scrape's, counted; the loop goes on
            usable = self._fail(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        self.num_scrapes += 1
        if not usable and len(self.failure_spans) < MAX_FAILURE_SPANS:
            self.failure_spans.append((send_t, time.monotonic() - self.origin))
        return usable

    def _fail(self, error: str) -> bool:
        self.num_failures += 1
        if len(self.errors) < 5:
            self.errors.append(printable(error))
        return False

    def rebase(self, origin: float) -> None:
        """Move the replay's t = 0 to `origin` (a time.monotonic()), samples taken so far too."""
        shift = self.origin - origin
        for sample in self.samples:
            sample.t += shift
            sample.send_t += shift
        self.failure_spans = [(sent + shift, failed + shift) for sent, failed in self.failure_spans]
        self.restart_watch.rebase(shift)
        self.origin = origin

    def read(self, samples: dict[str, list], send_t: float, t: float) -> bool:
        """One reading taken in [send_t, t], parsed (a /metrics answer, or one scrape of
        it as a Prometheus stored it: replay/metrics/prometheus.py); False if unusable."""
        return self._read(samples, send_t, t)

    def _read(self, samples: dict[str, list], send_t: float, t: float) -> bool:
        if self.metric is None:  # chosen by the first scrape that has one
            self.metric = choose_metric(samples)
            self.names_found = family_names(samples)
            if self.metric is None:
                return self._fail(f"none of {', '.join(KV_METRICS)} is exposed")
        self._note_models(samples)
        mine = of_model(samples, self.model)
        readings = read_engines(mine, self.metric)
        if not readings:
            return self._fail(self._no_reading(samples))
        for scraped in readings:
            name = self.engines.get(scraped.engine_label)
            if name is None:
                name = engine_name(self.source, scraped.engine_label, len(readings))
                self.engines[scraped.engine_label] = name
            self.unit = scraped.unit
            sample = to_sample(t, name, scraped, loop_state(mine, scraped.engine_label))
            sample.send_t = send_t
            self.samples.append(sample)
        read = {r.engine_label: self.engines[r.engine_label] for r in readings}
        self.restart_watch.observe(mine, send_t, t, read)
        return True

    def _note_models(self, samples: dict[str, list]) -> None:
        if len(self.models_found) < MAX_MODELS_NAMED:
            new = sorted(model_names(samples) - set(self.models_found))
            self.models_found += new[: MAX_MODELS_NAMED - len(self.models_found)]

    def _no_reading(self, samples: dict[str, list]) -> str:
        """Why a scrape gave no reading once the metric was chosen."""
        others = sorted(model_names({self.metric: samples.get(self.metric, [])}))
        if not others:
            return f"{self.metric} is gone"
        named = ", ".join(repr(m) for m in others[:MAX_MODELS_NAMED])
        return (
            f"{self.metric}: no series of model {self.model!r} (the server's are of {named}); "
            f"--model names the model under test"
        )

    def faults(self) -> list[dict]:
        """Each restarted engine as a fault (replay/metrics/restarts.py restart_faults)."""
        return restart_faults(self.source.url, self.restart_watch)

    def status(self) -> dict:
        """For the report: which metric, in what unit, what was found, what failed."""
        return {
            "url": self.source.url,
            "metric": self.metric,
            "unit": self.unit,
            "engines": dict(self.engines),
            "metric_names_found": self.names_found,
            "num_scrapes": self.num_scrapes,
            "num_failures": self.num_failures,
            "max_answer_s": self.max_answer_s,
            "max_parse_s": self.max_parse_s,
            "errors": list(self.errors),
            "failure_spans": [list(s) for s in self.failure_spans],
            "model": self.model,
            "models_found": list(self.models_found),
            "num_restarts": self.restart_watch.num_restarts,
        }
