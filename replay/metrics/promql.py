"""Label selectors, metric names and answers of Prometheus's HTTP API (pure). Runs in: frontend process.

A --metrics value read through a Prometheus is `{label OP "value", ...}` (OP one of
= != =~ !~, as PromQL has them), optionally named: `P0={pod="prefill-0"}`. kvdrain adds
the metric names itself (`__name__` is refused in a selector) and asks for a range
vector of raw samples, each with its own scrape timestamp (never query_range's
step-aligned evaluations). A name is asked for in both spellings, `vllm:x` and
`vllm_x`: prometheus_client's OpenMetrics exposition writes a sample line's `:` as `_`
(its HELP and TYPE lines keep it), so a Prometheus server that negotiates OpenMetrics stores
vLLM's series under the underscored name. Answers are read back under the `vllm:` name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.samples import Sample

from replay.metrics.restarts import PROCESS_START
from replay.metrics.scrape import PREFIXES, READ_NAMES

UP, SCRAPE_DURATION = "up", "scrape_duration_seconds"  # Prometheus's own, per scrape
# Read once before and once after the run (the report's counters and connector): the
# names replay/target/server_facts.py COUNTERS and CONNECTOR_FAMILIES read.
FACT_NAMES = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:nixl_num_kv_expired_reqs",
    "kvdrain:connector_events_total",
)
QUERY_NAMES = tuple(sorted({*READ_NAMES, *FACT_NAMES, PROCESS_START}))
OPS = ("=~", "!~", "!=", "=")
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
_MATCHER = re.compile(rf'\s*({_LABEL})\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:@-]{0,63}")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


@dataclass(frozen=True, slots=True)
class Matcher:
    label: str
    op: str  # one of OPS
    value: str  # unescaped

    def matches(self, labels: dict[str, str]) -> bool:
        """PromQL's rule: a missing label is the empty string; regexes are anchored."""
        have = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (have == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, have) is not None) == (self.op == "=~")

    def promql(self) -> str:
        escaped = self.value.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.label}{self.op}"{escaped}"'


@dataclass(frozen=True, slots=True)
class PromSelector:
    """One --metrics value with --prometheus: [NAME=]{matchers}."""

    text: str  # the selector as given, without the name
    matchers: tuple[Matcher, ...]
    name: str | None = None

    @staticmethod
    def parse(arg: str) -> PromSelector:
        name, sep, rest = arg.partition("=")
        if sep and rest.startswith("{") and _NAME.fullmatch(name):
            text = rest
        else:
            name, text = None, arg
        return PromSelector(text.strip(), _matchers(text.strip()), name)

    def promql(self, names: tuple[str, ...], window_ms: int) -> str:
        """The range vector of `names` (both spellings) under this selector."""
        inner = ",".join(m.promql() for m in self.matchers)
        return f'{{__name__=~"{names_regex(names)}",{inner}}}[{window_ms}ms]'

    def matches_target(self, labels: dict[str, str]) -> bool:
        """Whether a target with these labels may be one this selector reads: every
        matcher on a label the target has holds (the others are the metrics' own)."""
        return all(m.matches(labels) for m in self.matchers if m.label in labels)

    def __str__(self) -> str:
        return self.text if self.name is None else f"{self.name}={self.text}"


def _matchers(text: str) -> tuple[Matcher, ...]:
    usage = f'--metrics with --prometheus: expected [NAME=]{{label="value", ...}}, got {text!r}'
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(usage)
    body, out, at = text[1:-1], [], 0
    while at < len(body):
        m = _MATCHER.match(body, at)
        if m is None:
            raise ValueError(usage)
        out.append(Matcher(m[1], m[2], re.sub(r"\\(.)", r"\1", m[3])))
        at = m.end()
        if at < len(body) and body[at] != ",":
            raise ValueError(usage)
        at += 1
    if not out or any(m.label == "__name__" for m in out):
        raise ValueError(f"{usage}: name at least one label, never __name__ (kvdrain names them)")
    for m in out:
        if m.op in ("=~", "!~"):
            _compile(m.value)
    return tuple(out)


def _compile(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--metrics: the regex {pattern!r} does not compile: {e}") from None


def spellings(name: str) -> tuple[str, ...]:
    """`vllm:x` and `vllm_x` (see the module docstring); other names as they are."""
    prefix = next((p for p in PREFIXES if name.startswith(p)), None)
    return (name,) if prefix is None else (name, prefix[:-1] + "_" + name[len(prefix) :])


def canonical(name: str) -> str:
    """The `vllm:` name of either spelling."""
    for prefix in PREFIXES:
        under = prefix[:-1] + "_"
        if name.startswith(under):
            return prefix + name[len(under) :]
    return name


def names_regex(names: tuple[str, ...]) -> str:
    return "|".join(re.escape(s) for n in names for s in spellings(n)).replace("\\", "\\\\")


def parse_duration(text: str) -> float:
    """Prometheus's duration ("250ms", "1m30s") in seconds; ValueError if it is not one."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


@dataclass(frozen=True, slots=True)
class Series:
    """One series of a range-vector answer: its name (the vllm: spelling), its labels
    but __name__, and its raw samples (Prometheus time, value)."""

    name: str
    labels: dict[str, str]
    values: tuple[tuple[float, float], ...]

    @property
    def target(self) -> tuple[str, str]:
        """(job, instance): the scrape target it came from."""
        return self.labels.get("job", ""), self.labels.get("instance", "")


def matrix_series(answer: object) -> list[Series]:
    """The series of an /api/v1/query answer whose result is a matrix; ValueError when
    the answer is anything else (an error, another result type, a malformed value)."""
    data = _data(answer)
    if data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise ValueError(f"expected a matrix, got {data.get('resultType')!r}")
    out = []
    for item in data["result"]:
        labels = dict(item["metric"])
        name = canonical(labels.pop("__name__", ""))
        values = tuple((float(ts), float(v)) for ts, v in item["values"])
        out.append(Series(name, labels, values))
    return out


def scalar_time(answer: object) -> float:
    """The value of a `time()` query: the server's clock, in Unix seconds."""
    data = _data(answer)
    if data.get("resultType") != "scalar":
        raise ValueError(f"expected a scalar, got {data.get('resultType')!r}")
    value = float(data["result"][1])
    if not math.isfinite(value):
        raise ValueError(f"time() is {value}")
    return value


def active_targets(answer: object) -> list[tuple[dict[str, str], float | None]]:
    """/api/v1/targets' active targets: (labels, scrape interval in seconds or None)."""
    out = []
    for target in _data(answer).get("activeTargets", []):
        labels = target.get("labels")
        if not isinstance(labels, dict):
            continue
        interval = target.get("scrapeInterval") or target.get("discoveredLabels", {}).get(
            "__scrape_interval__"
        )
        try:
            seconds = parse_duration(interval) if isinstance(interval, str) else None
        except ValueError:
            seconds = None
        out.append(({str(k): str(v) for k, v in labels.items()}, seconds))
    return out


def _data(answer: object) -> dict:
    if not isinstance(answer, dict):
        raise ValueError("not a JSON object")
    if answer.get("status") != "success":
        raise ValueError(f"{answer.get('errorType', 'error')}: {answer.get('error', answer)}")
    data = answer.get("data")
    if not isinstance(data, dict):
        raise ValueError("no data")
    return data


def group_scrapes(series: list[Series]) -> dict[tuple[str, str], dict[float, dict[str, list]]]:
    """Target (job, instance) -> Prometheus time -> the samples of that scrape, as
    scrape.py parses a /metrics answer: name -> prometheus_client Samples (job and
    instance dropped). Prometheus stamps every sample of one scrape with its start."""
    out: dict[tuple[str, str], dict[float, dict[str, list]]] = {}
    for s in series:
        labels = {k: v for k, v in s.labels.items() if k not in ("job", "instance")}
        scrapes = out.setdefault(s.target, {})
        for ts, value in s.values:
            scrapes.setdefault(ts, {}).setdefault(s.name, []).append(Sample(s.name, labels, value))
    return out
