"""The replay target over HTTP: a trace sent to any OpenAI-compatible server, its /metrics scraped. Runs in: frontend process.

`replay --target http://HOST:PORT` (vLLM, SGLang, a P/D proxy, kvdrain's `serve --http`):
- every request is sent at origin + t/speedup (the shaping's times) from one monotonic
  origin, as a streaming POST /v1/completions with max_tokens, ignore_eos and
  stream_options.include_usage; prompts are the synthesised token ids (as vLLM accepts
  them) or, with --prompt-format text, those ids as the word tokenizer's text;
- a request ends at its [DONE]; its body is then read to the end (replay/target/stream.py)
  so that its connection goes back to the pool: one connection per request in flight at
  the busiest moment, not one per request;
- per request: send lateness, TTFT, inter-token latencies, end-to-end latency, tokens
  (the final usage chunk, else what streamed), errors (HTTP status and message, a
  malformed stream, a request given up after request_timeout_s); every record is
  closed, whatever happened to its task (an abort before it was even sent included);
  a stream is kept as counts and running digests, never its text, and more outputs or
  tokens than max_tokens is that request's error (memory is bounded by the trace);
- a request the server finished with "length" and no token although max_tokens >= 1
  was ignored by it (vLLM's FINISHED_IGNORED: a prompt that can never fit); its error
  is the cause kvdrain's front sends (the choice's `kvdrain_ignored_reason`), else
  IGNORED_BY_SERVER, so replay/verify/coverage.py counts it;
- the vocabulary is the server's: --vocab-size when given, else what kvdrain's /v1/models
  card says, else what vLLM's /tokenize shows (replay/target/server_facts.py); none of
  these is a VocabularyUnknown (the CLI's exit 2: give --vocab-size), never a guess;
- the trace's largest prompt token id is checked against that vocabulary before t = 0
  (a TraceError, the CLI's exit 2, never a failure mid-run);
- without --metrics, a `kvdrain proxy` target's upstreams are scraped (its /health names
  them; meta["http"]["metrics_from"] says so), when on the target's own host (or loopback,
  the target's being too: server_facts.is_followable); one elsewhere is refused;
- --api-key goes to the target's origin only (key_for_target), never to a --metrics URL
  elsewhere nor to an upstream the target names; no request leaves the origins given or
  followed (same_origin_only);
- the way `kvdrain proxy` says it sent each request (its X-Kvdrain-Route header: P, then
  D, by the names /health gives them) goes into the request record's stages, so each
  engine behind it is judged in its own idle windows (replay/verify/windows.py); an answer
  without it (any other server) leaves the stages empty and its engines judged by role;
- every --metrics URL is scraped on a fixed grid into the same EngineSample records the
  other drivers produce, so replay/verify/rules.py judges the idle windows from the
  server's own metrics; the i-th of n URLs at origin + (k + i/n) * interval: spread over
  the interval, a send waits behind one scrape's work on the event loop, never n at once;
- before t = 0 and after the tail, every metrics URL's counters and cache config are read
  once more (replay/target/server_facts.py): the differences are each engine's steps,
  wake-ups, lease expiries and prefix-cache hits over the replay (the timeline's
  counters; None where the server does not count it), and a request whose usage has no
  `cached_tokens` (vLLM without --enable-prompt-tokens-details) has unknown hits (None).
The result is a Timeline; `meta["http"]` holds the server's identity, each URL's scrape
status, the latency summary (replay/verify/latency.py) and `settings`, the server as it
described itself (version, block size, pool, max_model_len, connector, per engine);
`meta["sampling"]` is
SAMPLING_SCRAPED, so replay/verify/rules.py judges a window only from scrapes inside it.
With --prometheus, the --metrics selectors' series are read through that Prometheus
(replay/metrics/prometheus.py PromReader) on the same grid, each reading stamped with when
Prometheus took it; the counters and cache config come from its first and last readings.
Only the model under test's series are read (replay/metrics/scrape.py of_model); an
engine that restarted (replay/metrics/restarts.py) is in `meta["faults"]`, the run's fault.
replay/verify/outcome.py adds what the HTTP observation lacked to the Verdict's status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from replay.metrics.prometheus import PrometheusOptions, PromReader
from replay.metrics.scrape import MetricsSource, Scraper, of_model
from replay.openai import pool
from replay.openai.protocol import DuplicateKeyError, loads_strict
from replay.openai.route_header import ROUTE_HEADER, parse_route
from replay.openai.tokenizer import WordTokenizer
from replay.runtime.heap import frozen_heap
from replay.runtime.interrupt import Interrupted
from replay.target.server_facts import (
    EngineFacts,
    counter_deltas,
    discover_metrics,
    engine_facts,
    fetch_version,
    probe_vocab_size,
    read_facts,
    root_of,
)
from replay.target.stream import Stream, drain, error_message, read_stream
from replay.trace.reader import TraceAbort, TraceError, TraceRecord, TraceRequest
from replay.trace.synth import synth_prompt
from replay.verify.latency import latency_summary
from replay.verify.text import printable
from replay.verify.timeline import SAMPLING_SCRAPED, AbortRecord, RequestRecord, Timeline
from replay.verify.windows import QUEUE_GAUGE, QUEUE_GAUGES

LEAD_IN_S = 0.2  # between the probes and the trace's t = 0
PROMPT_FORMATS = ("ids", "text")
IGNORED_BY_SERVER = "ignored by the server"  # "length" with no token, and no cause given


@dataclass(frozen=True, slots=True)
class HttpTargetOptions:
    """`replay --target http://`: the server replayed against, its metrics, how to send."""

    base_url: str  # http://HOST:PORT (a trailing /v1 is fine)
    metrics: tuple[MetricsSource, ...] = ()
    model: str | None = None  # None: the first model /v1/models lists
    prompt_format: str = "ids"
    scrape_interval_s: float = 0.1
    api_key: str | None = None
    vocab_size: int | None = None  # --vocab-size; None: the server's (see the module docstring)
    vocab_source: str = (
        "--vocab-size"  # where vocab_size came from (a launcher: the model's config)
    )
    connector: str | None = None  # the KV connector the servers were launched with, if known
    tail_s: float = 3.0
    request_timeout_s: float = 120.0
    max_token_id: int | None = None  # the trace's largest prompt token id (None: none given)
    metrics_from: str | None = (
        None  # who named `metrics` (replay/target/preflight.py); None: --metrics
    )
    scrape_timeout_s: float = 2.0  # a /metrics answer later than this is a failed scrape
    # --prometheus: `metrics` unused, the selectors' series read through Prometheus
    prometheus: PrometheusOptions | None = None

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format: must be one of {PROMPT_FORMATS}")
        for name in ("scrape_interval_s", "scrape_timeout_s", "tail_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError("--vocab-size: must be >= 1")


class VocabularyUnknown(ValueError):
    """The server does not say its vocabulary size and none was given (usage: exit 2)."""


@dataclass(slots=True)
class ServerIdentity:
    """Who answered: what /v1/models and the Server header say."""

    base_url: str
    model: str
    server_header: str | None
    owned_by: str | None
    max_model_len: int | None
    vocab_size: int | None
    models: list[str] = field(default_factory=list)
    kvdrain: dict | None = None  # kvdrain's own facts (engines, topology, liveness)
    vocab_source: str | None = None  # "--vocab-size", "/v1/models" or "/tokenize"
    version: str | None = None  # GET /version's

    def to_dict(self) -> dict:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "server": self.server_header,
            "owned_by": self.owned_by,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "vocab_source": self.vocab_source,
            "version": self.version,
            "models": self.models,
            "kvdrain": self.kvdrain,
        }

    @property
    def kind(self) -> str:
        """Who serves: kvdrain, vLLM, or what the Server header says."""
        if self.kvdrain is not None or self.owned_by == "kvdrain":
            return "kvdrain"
        if self.owned_by == "vllm" or self.version is not None:
            return "vLLM"
        return self.server_header or "unknown server"


def same_origin_only(allowed: set[URL]):
    """A client middleware that refuses every request (redirects included) to an origin
    (scheme, host, port) not in `allowed` (URL(u).origin() of the URLs kvdrain was given or
    found; the caller may add to it): a redirect to another host is an error, never
    followed silently (aiohttp would follow it, dropping the API key)."""

    async def middleware(request: aiohttp.ClientRequest, handler):
        if request.url.origin() not in allowed:
            raise aiohttp.ClientError(
                f"a redirect to another host ({request.url.origin()}) was not followed"
            )
        return await handler(request)

    return middleware


def key_for_target(api_key: str | None, target: URL):
    """A client middleware that sends `Authorization: Bearer <api_key>` to the target's
    origin (scheme, host, port: URL(...).origin()) and to no other: a credential given for
    one origin goes to that origin alone, so a --metrics URL elsewhere, or an upstream the
    target names, is read without it."""

    async def middleware(request: aiohttp.ClientRequest, handler):
        if api_key and request.url.origin() == target:
            request.headers["Authorization"] = f"Bearer {api_key}"
        else:
            request.headers.popall("Authorization", None)
        return await handler(request)

    return middleware


def target_session(
    options: HttpTargetOptions,
    allowed: set[URL],
    connector: aiohttp.BaseConnector | None = None,
) -> aiohttp.ClientSession:
    """The session every request of a replay over HTTP goes through: to the origins in
    `allowed` only (same_origin_only), the API key to the target's alone (key_for_target)."""
    target = URL(api_root(options.base_url)).origin()
    return aiohttp.ClientSession(
        connector=connector,
        middlewares=(same_origin_only(allowed), key_for_target(options.api_key, target)),
    )


def api_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


async def probe(session: aiohttp.ClientSession, options: HttpTargetOptions) -> ServerIdentity:
    """GET /v1/models: who answers and what it serves.

    A proxy without /v1/models (vLLM's toy P/D proxy: 404) is fine when --model names the
    model; a server that does not answer, refuses the request (401, 403) or fails it
    (a 5xx: a proxy whose upstream is down answers 502), or lists models without the
    one asked for, is a ConnectionError saying which.
    """
    url = api_root(options.base_url) + "/v1/models"
    body, status = None, None
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            server, status = response.headers.get("Server"), response.status
            server = printable(server) if server is not None else None
            raw = await response.read()
        body = loads_strict(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ConnectionError(f"{url}: {type(e).__name__}: {printable(e)}") from None
    except DuplicateKeyError as e:
        raise ConnectionError(f"{url}: {printable(e)}") from None
    except ValueError:  # not JSON: as if there were no list
        pass
    if status not in (200, 404, 405):
        raise ConnectionError(f"{url}: {_refusal(status, body, options)}")
    cards = body.get("data") if isinstance(body, dict) else None
    if not isinstance(cards, list) or not cards or not all(isinstance(c, dict) for c in cards):
        if options.model is None:
            said = "lists no models" if status == 200 else f"HTTP {status} (no model list here)"
            raise ConnectionError(f"{url}: {said}; name the model with --model")
        return ServerIdentity(
            options.base_url,
            options.model,
            server,
            None,
            None,
            options.vocab_size,
            vocab_source=_given(options),
        )
    return _identity(options, url, server, cards)


def _refusal(status: int, body: object, options: HttpTargetOptions) -> str:
    """What a /v1/models answer other than 200, 404 or 405 says: the status, the server's own
    error message, and what to do about it."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    said = f"HTTP {status}" + (f": {printable(message)}" if isinstance(message, str) else "")
    if status in (401, 403):
        return said + (
            "; the server refused --api-key"
            if options.api_key
            else "; the server needs an API key: give --api-key"
        )
    if status >= 500:
        return said + (
            "; the server failed to list its models (a proxy answers 502 when its "
            "decode server cannot be reached): check that it and its upstreams are up"
        )
    return said + "; the server refused to list its models"


def _identity(
    options: HttpTargetOptions, url: str, server: str | None, cards: list[dict]
) -> ServerIdentity:
    names = [_card_field(url, c, "id", str, i, required=True) for i, c in enumerate(cards)]
    model = options.model or names[0]
    if model not in names:
        raise ConnectionError(f"{url}: --model {model!r} is not served here; it lists {names}")
    i = names.index(model)
    card = cards[i]
    extra = _card_field(url, card, "kvdrain", dict, i)
    said = _card_field(url, extra, "vocab_size", int, i, "kvdrain.") if extra else None
    vocab, source = _vocabulary(options, said)
    return ServerIdentity(
        options.base_url,
        model,
        server,
        _card_field(url, card, "owned_by", str, i),
        _card_field(url, card, "max_model_len", int, i),
        vocab,
        names,
        extra,
        vocab_source=source,
    )


def _given(options: HttpTargetOptions) -> str | None:
    return options.vocab_source if options.vocab_size is not None else None


def _vocabulary(options: HttpTargetOptions, said: object) -> tuple[int | None, str | None]:
    """(size, where it came from): the one given, else what /v1/models said, else unknown."""
    if options.vocab_size is not None:
        return options.vocab_size, _given(options)
    if type(said) is int and said >= 1:
        return said, "/v1/models"
    return None, None


async def learn_vocabulary(session: aiohttp.ClientSession, identity: ServerIdentity) -> None:
    """identity.vocab_size from /tokenize when nothing said it; VocabularyUnknown if that fails too."""
    if identity.vocab_size is not None:
        return
    size = await probe_vocab_size(session, api_root(identity.base_url), identity.model)
    if size is None:
        raise VocabularyUnknown(
            f"{identity.base_url}: the server does not say its vocabulary size (its /v1/models "
            f"does not, and its /tokenize does not take kvdrain's w<id> words): give "
            f"--vocab-size N (the model's config.json vocab_size)"
        )
    identity.vocab_size, identity.vocab_source = size, "/tokenize"


def _card_field(
    url: str, card: dict, name: str, kind: type, i: int, prefix: str = "", required: bool = False
) -> object:
    """card[name] if absent (None) or of `kind` (a positive int for int; no bool); a
    ConnectionError naming the field otherwise: the CLI's exit 2, before anything is sent."""
    value = card.get(name)
    if value is None and not required:
        return None
    ok = isinstance(value, kind) and not isinstance(value, bool) and (kind is not int or value > 0)
    if not ok:
        want = "a positive integer" if kind is int else f"a {kind.__name__}"
        got = value if kind is int and type(value) is int else type(value).__name__
        raise ConnectionError(f"{url}: data[{i}].{prefix}{name}: expected {want}, got {got}")
    return value


class HttpReplay:
    def __init__(
        self,
        options: HttpTargetOptions,
        identity: ServerIdentity | None = None,
        on_tick: Callable[[HttpReplay], None] | None = None,
    ) -> None:
        """identity: the target's /v1/models answer when already asked (replay/target/preflight.py);
        on_tick: called on the replay's thread once the server answered, then after every
        scrape (the live view reads the requests and the scrapers)."""
        self.options = options
        self.on_tick = on_tick
        self.origin = 0.0
        self.identity = identity
        self.scrapers = [
            Scraper(m, 0.0, timeout_s=options.scrape_timeout_s) for m in options.metrics
        ]
        self.metrics_from = (options.metrics_from or "--metrics") if options.metrics else None
        if options.prometheus is not None:
            self.scrapers = options.prometheus.readers(options.scrape_timeout_s)
            self.metrics_from = "--prometheus"
        self.requests: dict[str, RequestRecord] = {}
        self.arrivals: list[float] = []
        self.aborts: list[AbortRecord] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.aborted: set[str] = set()  # aborted by the trace (not given up on)
        self.end_t = 0.0
        self.facts_before: dict[str, EngineFacts] = {}  # engine (timeline name) -> facts
        self.facts_after: dict[str, EngineFacts] = {}
        self.versions: dict[str, str | None] = {}  # engine -> its server's GET /version

    def now(self) -> float:
        return time.monotonic() - self.origin

    def run(self, records: Iterable[TraceRecord]) -> Timeline:
        """Send the trace and observe; on Ctrl-C or SIGTERM, stop there (the requests in
        flight cancelled) and return what was seen (meta "interrupted" names the signal)."""
        try:
            return asyncio.run(self.run_async(records))
        except Interrupted as e:
            self.end_t = max(self.now(), 0.0) if self.origin else 0.0
            timeline = self._timeline()
            timeline.meta["interrupted"] = e.name
            return timeline

    async def run_async(self, records: Iterable[TraceRecord]) -> Timeline:
        connector = pool.connector()
        origins = {
            URL(u).origin() for u in (self.options.base_url, *(m.url for m in self.options.metrics))
        }
        if self.options.prometheus is not None:
            origins.add(URL(self.options.prometheus.url).origin())
        async with target_session(self.options, origins, connector) as session:
            if self.identity is None:
                self.identity = await probe(session, self.options)
            await learn_vocabulary(session, self.identity)
            check_vocab(self.options.max_token_id, self.identity)
            self.identity.version = await fetch_version(session, api_root(self.options.base_url))
            if not self.scrapers:
                found = await discover_metrics(session, api_root(self.options.base_url))
                origins.update(URL(m.url).origin() for m in found)  # named by the proxy itself
                self.scrapers = [
                    Scraper(m, 0.0, timeout_s=self.options.scrape_timeout_s) for m in found
                ]
                self.metrics_from = "the proxy's /health" if found else None
            for scraper in self.scrapers:  # picks the metric and names the engines
                scraper.model = self.identity.model
                scraper.origin = time.monotonic()
                await scraper.scrape(session)
            self.facts_before = await self._read_facts(session)
            await self._read_versions(session)
            self.origin = (
                time.monotonic() + LEAD_IN_S
            )  # a slow probe or first scrape delays no send
            for scraper in self.scrapers:
                scraper.rebase(self.origin)
            self._tick()
            with frozen_heap():
                await self._send_while_scraping(session, records)
            for scraper in self.scrapers:  # a last reading, after the tail
                await scraper.scrape(session)
            self.end_t = self.now()
            self.facts_after = await self._read_facts(session)
        return self._timeline()

    async def _read_facts(self, session: aiohttp.ClientSession) -> dict[str, EngineFacts]:
        out: dict[str, EngineFacts] = {}
        for scraper in self.scrapers:
            if isinstance(scraper, PromReader):  # its latest reading: the pods are not reached
                out.update(_facts_of(scraper))
                continue
            facts = await read_facts(
                session, scraper.source.url, list(scraper.engines), scraper.model
            )
            out.update({scraper.engines[label]: f for label, f in facts.items()})
        return out

    async def _read_versions(self, session: aiohttp.ClientSession) -> None:
        """Each engine's server version: its metrics URL's server's, else the target's."""
        for scraper in self.scrapers:
            reachable = not isinstance(scraper, PromReader)  # a pod behind Prometheus is not
            root = root_of(scraper.source.url)
            version = await fetch_version(session, root) if reachable else None
            for name in scraper.engines.values():
                self.versions[name] = version or self.identity.version

    async def _send_all(
        self, session: aiohttp.ClientSession, records: Iterable[TraceRecord]
    ) -> None:
        for record in records:
            if isinstance(record, (TraceRequest, TraceAbort)):
                # Yields even when late: a burst behind schedule holds back no scrape,
                # no request's I/O and no timeout until it is all started.
                await asyncio.sleep(max(0.0, record.t - self.now()))
            if isinstance(record, TraceRequest):
                self._start(session, record)
            elif isinstance(record, TraceAbort):
                task = self.tasks.get(record.req_id)
                if task is not None and not task.done():
                    self.aborted.add(record.req_id)
                    task.cancel()  # the connection closes: the server aborts it
                self.aborts.append(AbortRecord(self.now(), record.req_id))

    def _start(self, session: aiohttp.ClientSession, req: TraceRequest) -> None:
        prompt = synth_prompt(req, self.identity.vocab_size)
        # Sent at its arrival until _request (or _close_unsent) stamps when it was.
        record = RequestRecord.sent(req.req_id, req.t, req.t, len(prompt))
        self.requests[req.req_id] = record
        self.arrivals.append(req.t)
        task = asyncio.create_task(self._request(session, req, prompt, record))
        task.add_done_callback(lambda _task: self._close_unsent(record))
        self.tasks[req.req_id] = task

    def _close_unsent(self, record: RequestRecord) -> None:
        """A task cancelled before its first step never ran _request (an abort at the
        instant of its request, or a client running late): close its record here."""
        if record.end_t is not None:
            return
        stream = Stream(num_cached_tokens=0)  # never computed: no hits
        if record.req_id in self.aborted:
            stream.finish_reason = "abort"
        else:
            stream.error = "cancelled before it was sent"
        record.send_t = self.now()
        record.send_lateness_s = record.send_t - record.arrival_t
        self._close(record, stream)

    async def _send_while_scraping(
        self, session: aiohttp.ClientSession, records: Iterable[TraceRecord]
    ) -> None:
        """Send the trace and wait for its tail while scraping; whatever stops the scrape
        loop (the live view's `q` raises Interrupted from on_tick) stops the sending too."""
        scraping = asyncio.create_task(self._scrape_loop(session))
        sending = asyncio.create_task(self._send_and_finish(session, records))
        try:
            done, _ = await asyncio.wait({scraping, sending}, return_when=asyncio.FIRST_COMPLETED)
            if scraping in done:
                scraping.result()  # it never returns: this raises what stopped it
            await sending
        finally:
            for task in (scraping, sending):
                task.cancel()
            await asyncio.gather(scraping, sending, return_exceptions=True)

    async def _send_and_finish(
        self, session: aiohttp.ClientSession, records: Iterable[TraceRecord]
    ) -> None:
        await self._send_all(session, records)
        await self._finish()

    async def _scrape_loop(self, session: aiohttp.ClientSession) -> None:
        interval, k = self.options.scrape_interval_s, 0
        while True:
            k += 1
            delay = k * interval - self.now()
            if delay <= 0:  # fell behind (a slow server, a slow on_tick): skip the missed slots
                k = int(self.now() / interval)
            # Yields even when behind: with nothing to scrape the gather below does not,
            # and a loop that never yields starves every send (and every timeout).
            await asyncio.sleep(max(0.0, delay))
            await asyncio.gather(
                *(
                    self._scrape_at(session, s, (k + i / len(self.scrapers)) * interval)
                    for i, s in enumerate(self.scrapers)
                )
            )
            self._tick()

    async def _scrape_at(self, session: aiohttp.ClientSession, scraper: Scraper, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        await scraper.scrape(session)

    def _tick(self) -> None:
        if self.on_tick is not None:
            self.on_tick(self)

    async def _finish(self) -> None:
        """Wait for open requests (bounded), then observe the tail."""
        open_tasks = [t for t in self.tasks.values() if not t.done()]
        if open_tasks:
            await asyncio.wait(open_tasks, timeout=self.options.request_timeout_s)
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await asyncio.sleep(self.options.tail_s)

    # ---- one request -------------------------------------------------------------------

    def _payload(self, req: TraceRequest, prompt: list[int]) -> dict:
        identity = self.identity
        text = self.options.prompt_format == "text"
        payload = {
            "model": identity.model,
            "prompt": WordTokenizer(max(identity.vocab_size, 256)).decode(prompt)
            if text
            else prompt,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if identity.owned_by in ("vllm", "kvdrain"):
            payload["return_token_ids"] = True  # vLLM's extension: token ids for the digest
        return payload

    async def _request(
        self,
        session: aiohttp.ClientSession,
        req: TraceRequest,
        prompt: list[int],
        record: RequestRecord,
    ) -> None:
        url = api_root(self.options.base_url) + "/v1/completions"
        stream = Stream(max_outputs=req.max_tokens)
        record.send_t = self.now()
        record.send_lateness_s = record.send_t - req.t
        try:
            async with session.post(url, json=self._payload(req, prompt)) as response:
                for upstream in parse_route(response.headers.get(ROUTE_HEADER)):
                    record.enter(upstream, record.send_t)  # when it reached each: not seen here
                if response.status != 200:
                    body = await response.read()
                    stream.error = f"HTTP {response.status}: {error_message(_json_or_text(body))}"
                else:
                    await read_stream(response, stream, self.now)
                    if stream.done_t is not None:
                        await drain(response.content)
        except asyncio.CancelledError:  # aborted by the trace, or given up on by _finish
            if stream.done_t is not None:
                pass  # cancelled while draining a finished stream: its outcome stands
            elif record.req_id in self.aborted:
                stream.finish_reason = "abort"
            else:
                stream.error = f"gave up after {self.options.request_timeout_s:g} s without an end"
        except Exception as e:  # a lost connection, a malformed answer: this request's error
            stream.error = printable(f"{type(e).__name__}: {e}")
        finally:
            self._close(record, stream, req.max_tokens)

    def _close(self, record: RequestRecord, stream: Stream, max_tokens: int = 0) -> None:
        record.end_t = stream.done_t if stream.done_t is not None else self.now()
        times = stream.chunk_times
        record.first_token_t = times[0] if times else None
        record.itls = [b - a for a, b in zip(times, times[1:])]
        record.last_token_t = times[-1] if times else None
        record.num_output_tokens = (
            stream.usage_completion_tokens
            if stream.usage_completion_tokens is not None
            else stream.num_tokens or len(times)
        )
        record.num_prefix_hit_tokens = stream.num_cached_tokens
        record.finish_reason = "error" if stream.error else (stream.finish_reason or "error")
        record.error = stream.error or (
            None if stream.finish_reason else "stream ended without a finish_reason"
        )
        if (
            record.error is None
            and record.finish_reason == "length"
            and record.num_output_tokens == 0
            and max_tokens >= 1
        ):
            record.error = stream.ignored_reason or IGNORED_BY_SERVER
        record.output_digest = stream.digest()

    # ---- the result ------------------------------------------------------------------

    def _timeline(self) -> Timeline:
        samples = sorted(
            (s for scraper in self.scrapers for s in scraper.samples), key=lambda s: s.t
        )
        engines = list(dict.fromkeys(s.engine for s in samples))
        num_usable_blocks = {s.engine: s.num_usable_blocks for s in samples}
        topology = (self.identity.kvdrain or {}).get("topology") if self.identity else None
        meta = {
            "driver": "http",
            "target": self.options.base_url,
            "sampling": SAMPLING_SCRAPED,
            "topology": topology,  # None: the server does not say (settings.topology)
            # engines whose /metrics say how many requests they run and queue: their own
            # idle windows are read from those (replay/verify/windows.py)
            QUEUE_GAUGES: sorted(
                {
                    e
                    for s in self.scrapers
                    if QUEUE_GAUGE in s.names_found
                    for e in s.engines.values()
                }
            ),
            "http": {
                "server": self.identity.to_dict() if self.identity else None,
                "metrics": [s.status() for s in self.scrapers],
                "metrics_from": self.metrics_from,
                "prompt_format": self.options.prompt_format,
                "scrape_interval_s": self.options.scrape_interval_s,
                "scrape_timeout_s": self.options.scrape_timeout_s,
                "latency": latency_summary(self.requests.values()),
                "settings": self.settings(engines),
            },
        }
        counters = {
            e: counter_deltas(self.facts_before.get(e), self.facts_after.get(e)) for e in engines
        }
        faults = sorted((f for s in self.scrapers for f in s.faults()), key=lambda f: f["t"])
        if faults:  # restarts (replay/metrics/restarts.py): the run's faults
            meta["faults"] = faults
        return Timeline(
            engines=engines,
            num_usable_blocks=num_usable_blocks,
            samples=samples,
            requests=list(self.requests.values()),
            arrivals=self.arrivals,
            aborts=self.aborts,
            end_t=self.end_t,
            counters=counters,
            meta=meta,
        )

    def settings(self, engines: list[str]) -> dict:
        """The server as it described itself (the report's settings.engine over HTTP)."""
        identity = self.identity
        if identity is None:
            return {}
        said = {
            "server": identity.kind,
            "version": identity.version,
            "model": identity.model,
            "max_model_len": identity.max_model_len,
            "vocab_size": identity.vocab_size,
            "vocab_source": identity.vocab_source,
            "engines": {e: self._engine_settings(e) for e in engines},
        }
        if identity.kvdrain is not None:  # kvdrain's own server says its liveness policy
            said["liveness"] = identity.kvdrain.get("liveness")
        return said

    def _engine_settings(self, engine: str) -> dict:
        facts = self.facts_after.get(engine) or self.facts_before.get(engine)
        config = facts.cache_config if facts is not None else {}
        return {
            "version": self.versions.get(engine, self.identity.version),
            "block_size": _int_or_none(config.get("block_size")),
            "num_gpu_blocks": _int_or_none(config.get("num_gpu_blocks")),
            "connector": self.options.connector or (facts.connector if facts else None),
            "cache_config": config,
        }


def _facts_of(reader: PromReader) -> dict[str, EngineFacts]:
    """Each engine's facts from its latest reading through Prometheus."""
    return {
        name: engine_facts(of_model(samples, reader.model), label)
        for name, (samples, label) in reader.latest_samples().items()
    }


def check_vocab(max_token_id: int | None, identity: ServerIdentity) -> None:
    """A TraceError before t = 0 if the trace's prompts hold a token the server cannot take."""
    if max_token_id is None or max_token_id < identity.vocab_size:
        return
    raise TraceError(
        f"trace: prompt token id {max_token_id:,} is outside the server's "
        f"vocabulary [0, {identity.vocab_size:,}) (from {identity.vocab_source}); "
        f"nothing was sent"
    )


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:  # vLLM says "None" before its profile run
        return None


def _json_or_text(body: bytes) -> object:
    try:
        return loads_strict(body)
    except ValueError:
        return body.decode("utf-8", "replace")
