"""What an HTTP server says about itself: version, vocabulary, cache config and counters. Runs in: frontend process.

Read once before a replay and once after it, so that the report describes the server
that answered (never kvdrain's own engine options) and counts what happened between:
- the metrics URLs, when none were given: a `kvdrain proxy`'s GET /health names its
  upstreams (`{"upstreams": {NAME: {"url": ...}}}`), each one's /metrics is scraped as NAME;
- the version: GET /version (vLLM's `{"version": ...}`), from the target and from the
  root of every metrics URL (a P/D proxy has none of its own); release_of reads the vLLM
  release in it, which the verdict's contract follows (replay/verify/contract.py);
- the vocabulary: vLLM's POST /tokenize, for a model whose tokenizer is kvdrain's word
  tokenizer (`w<id>` words, as the model kvdrain launches): the vocabulary covers id k
  when "w<k>" tokenizes to [k] (and to the token string "w<k>", not an unknown token's);
  the size is found by doubling, then bisecting. Any other tokenizer: unknown;
- per engine of a metrics URL: `vllm:cache_config_info`'s labels (block_size,
  num_gpu_blocks, ...), the families it exposes (a NIXL server's `vllm:nixl_*` names its
  connector), and the counters in COUNTERS, whose differences between the two readings
  are the replay's prefix-cache hits, steps, wake-ups, lease expiries and reads after
  expiry (replay/verify/safety.py). A counter
  the server does not expose is unknown (None), never 0.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from engine.core.release import VllmRelease
from replay.metrics.scrape import MetricsSource, family_names, of_model, parse_metrics
from replay.openai.bearer import is_loopback_host
from replay.verify.text import printable
from replay.verify.timeline import engine_role

TIMEOUT_S = 5.0
_RELEASE = re.compile(r"\d+\.\d+(\.\d+)?")
MAX_VOCAB_SIZE = 1 << 24  # the doubling stops here
# What the report counts -> the counter samples that say it (the first one exposed wins).
COUNTERS: dict[str, tuple[tuple[str, dict[str, str]], ...]] = {
    "num_prefix_hit_tokens": (("vllm:prefix_cache_hits_total", {}),),
    "num_prefix_query_tokens": (("vllm:prefix_cache_queries_total", {}),),
    "num_steps": (("kvdrain:engine_steps_total", {}),),
    "num_wakeups": (("kvdrain:engine_wakeups_total", {}),),
    "num_expired": (
        ("vllm:nixl_num_kv_expired_reqs_total", {}),
        ("vllm:nixl_num_kv_expired_reqs", {}),
        ("kvdrain:connector_events_total", {"event": "expired"}),
    ),
    # D read blocks P had freed when their lease ran out (NIXL from vLLM 0.32; kvdrain's)
    "num_notifications_after_expiry": (
        ("vllm:nixl_num_notifications_after_expiry_total", {}),
        ("vllm:nixl_num_notifications_after_expiry", {}),
        ("kvdrain:connector_events_total", {"event": "reads_after_expiry"}),
    ),
}
CONNECTOR_FAMILIES = (
    ("vllm:nixl_", "NixlConnector"),
    ("kvdrain:connector_", "kvdrain PDConnector"),
)


@dataclass(slots=True, kw_only=True)
class EngineFacts:
    """One engine of one metrics URL at one reading."""

    label: str  # its `engine` label ("" when it has none)
    cache_config: dict[str, str] = field(default_factory=dict)
    counters: dict[str, float | None] = field(default_factory=dict)
    families: list[str] = field(default_factory=list)

    @property
    def connector(self) -> str | None:
        """The KV connector its metrics name (None: none seen)."""
        for prefix, name in CONNECTOR_FAMILIES:
            if any(f.startswith(prefix) for f in self.families):
                return name
        return None


def root_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class UpstreamRefused(ConnectionError):
    """An upstream the target names on another host than its own: never fetched."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"{url}: {why}")
        self.url = url
        self.why = why


def is_followable(url: str, root: str) -> bool:
    """Whether the replay fetches a URL the target at `root` named: only on the target's own
    host (any port), or on loopback when the target is on loopback too. A target cannot
    make the replay fetch anything else; the user gives such a URL with --metrics."""
    host, target = urlsplit(url).hostname, urlsplit(root).hostname
    if host is None or target is None:
        return False
    return host == target or (is_loopback_host(host) and is_loopback_host(target))


def refuse_foreign(sources: tuple[MetricsSource, ...], root: str) -> None:
    """UpstreamRefused for the first of `sources` that is not is_followable from `root`."""
    for source in sources:
        if not is_followable(source.url, root):
            raise UpstreamRefused(
                printable(source.url),
                f"upstream {printable(repr(source.name))} is on another host than the "
                f"target's ({printable(urlsplit(root).hostname)}), so it was not fetched; "
                f"to scrape it, give it: --metrics {printable(source.name)}="
                f"{printable(source.url)}",
            )


async def discover_metrics(session: aiohttp.ClientSession, root: str) -> tuple[MetricsSource, ...]:
    """NAME=URL/metrics of every upstream a proxy's /health names (none: not a kvdrain proxy);
    UpstreamRefused, before any is fetched, if one is not is_followable."""
    try:
        async with session.get(
            root + "/health", timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
        ) as r:
            body = await r.json(content_type=None) if r.content_type == "application/json" else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return ()
    upstreams = body.get("upstreams") if isinstance(body, dict) else None
    if not isinstance(upstreams, dict):
        return ()
    sources = []
    for name, upstream in upstreams.items():
        url = upstream.get("url") if isinstance(upstream, dict) else None
        if isinstance(url, str) and url.startswith(("http://", "https://")) and url.isprintable():
            sources.append(MetricsSource(url.rstrip("/") + "/metrics", printable(name, 64)))
    refuse_foreign(tuple(sources), root)
    return tuple(sources)


async def fetch_version(session: aiohttp.ClientSession, root: str) -> str | None:
    """GET ROOT/version's "version" (vLLM's); None when there is none."""
    try:
        async with session.get(
            root + "/version", timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
        ) as r:
            body = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return printable(version, 64) if isinstance(version, (str, int, float)) else None


def release_of(version: str | None) -> VllmRelease | None:
    """The vLLM release a /version names ("0.32.0", "0.11.2.dev5+g1234", "0.32.0+cpu":
    its leading X.Y or X.Y.Z); None: none there."""
    if version is None:
        return None
    m = _RELEASE.match(version.strip().removeprefix("v"))
    return VllmRelease.parse(m.group(0)) if m is not None else None


def served_release(meta: dict) -> tuple[VllmRelease, str] | None:
    """The release a server's /version names (a prefill engine's first: its blocks are
    judged), from the HTTP replay's meta; None: none said one."""
    http = meta.get("http") or {}
    settings = http.get("settings") or {}
    if settings.get("server") == "kvdrain":  # its /version is kvdrain's, not a vLLM release
        said = release_of(((http.get("server") or {}).get("kvdrain") or {}).get("vllm_release"))
        return None if said is None else (said, "the kvdrain server's settings")
    engines = sorted(
        (settings.get("engines") or {}).items(), key=lambda e: engine_role(e[0]) != "P"
    )
    for name, engine in engines:
        release = release_of(engine.get("version"))
        if release is not None:
            return release, f"{name}'s /version: {engine.get('version')}"
    release = release_of(settings.get("version"))
    return None if release is None else (release, f"the server's /version: {settings['version']}")


async def _tokenize(
    session: aiohttp.ClientSession, root: str, model: str, text: str
) -> dict | None:
    body = {"model": model, "prompt": text, "add_special_tokens": False, "return_token_strs": True}
    try:
        async with session.post(
            root + "/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
        ) as r:
            answer = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


async def _is_word(session: aiohttp.ClientSession, root: str, model: str, token_id: int) -> bool:
    answer = await _tokenize(session, root, model, f"w{token_id}")
    if answer is None or answer.get("tokens") != [token_id]:
        return False
    strs = answer.get("token_strs")
    return strs is None or strs == [f"w{token_id}"]


async def probe_vocab_size(session: aiohttp.ClientSession, root: str, model: str) -> int | None:
    """The size of a word-tokenizer vocabulary through /tokenize; None if it is not one."""
    if not await _is_word(session, root, model, 0):
        return None
    inside, outside = 0, 1
    while await _is_word(session, root, model, outside):
        inside, outside = outside, outside * 2
        if outside > MAX_VOCAB_SIZE:
            return None
    while outside - inside > 1:  # inside is a word, outside is not
        middle = (inside + outside) // 2
        inside, outside = (
            (middle, outside) if await _is_word(session, root, model, middle) else (inside, middle)
        )
    return outside


def _labels_match(sample, label: str, extra: dict[str, str]) -> bool:
    labels = sample.labels
    return labels.get("engine", "") in (label, "") and all(
        labels.get(k) == v for k, v in extra.items()
    )


def _counter(samples: dict[str, list], label: str, names) -> float | None:
    for name, extra in names:
        values = [s.value for s in samples.get(name, []) if _labels_match(s, label, extra)]
        if values:
            return sum(values)
    return None


def engine_facts(samples: dict[str, list], label: str) -> EngineFacts:
    """One engine's facts from one parsed exposition."""
    config = next(
        (
            dict(s.labels)
            for s in samples.get("vllm:cache_config_info", [])
            if s.labels.get("engine", "") in (label, "")
        ),
        {},
    )
    config.pop("engine", None)
    return EngineFacts(
        label=label,
        cache_config=config,
        families=family_names(samples),
        counters={k: _counter(samples, label, names) for k, names in COUNTERS.items()},
    )


async def read_facts(
    session: aiohttp.ClientSession, url: str, labels: list[str], model: str | None = None
) -> dict[str, EngineFacts]:
    """Engine label -> its facts, from one GET of a metrics URL (empty if it fails); with
    `model`, another model's series are not read (scrape.py of_model)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
            text = await r.text() if r.status == 200 else None
        samples = parse_metrics(text) if text is not None else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}
    if samples is None:
        return {}
    samples = of_model(samples, model)
    return {label: engine_facts(samples, label) for label in labels}


def counter_deltas(
    before: EngineFacts | None, after: EngineFacts | None
) -> dict[str, float | None]:
    """What each counter counted between two readings (None: not read both times)."""
    out: dict[str, float | None] = {}
    for name in COUNTERS:
        a = before.counters.get(name) if before else None
        b = after.counters.get(name) if after else None
        out[name] = None if a is None or b is None else max(b - a, 0.0)
    return out
