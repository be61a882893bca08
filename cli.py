"""The kvdrain command line: thin click commands that parse, build configs and delegate. Runs in: frontend process.

Options come in groups (replay/trace, engine, shaping, verification, target, outputs,
security): each is one OptionGroup, whose options' values build one dataclass that the
verb takes as a single parameter, and whose title heads its section of --help. A new
group is a dataclass (its fields named as its options' parameters) plus one
`OptionGroup(...)` applied as a decorator to the verbs that take it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from engine.config import (
    DEVICES,
    KV_LOAD_FAILURE_POLICIES,
    LIVENESS_POLICIES,
    MODEL_PRESETS,
    RUNNERS,
    TRANSPORTS,
    EngineConfig,
    KVTransferConfig,
)
from engine.profiles import DEFAULT_VIRTUAL_PROFILE, PROFILES
from replay.deploy.pd_flow import TOPOLOGY_FORMS, engine_roles, parse_topology
from replay.deploy.placement import ROUTER_POLICIES
from replay.runtime.startup import START_LIMIT_S
from replay.trace.reader import FORMATS
from replay.vllm.options import DEFAULT_VENV, ENGINES, VllmOptions
from replay.vllm.proxy_options import MAX_BODY_BYTES, MAX_IN_FLIGHT, MIB, UpstreamTimeouts

EXAMPLE = Path(__file__).resolve().parent / "examples" / "pd_idle.jsonl"
MAX_WINDOW_LINES = 10  # idle windows listed at the end without --all-windows
# replay/pipeline.py's CLOCKS (tests/e2e/test_process_startup.py checks they agree), named here so that
# importing cli imports no replay machinery: every engine and connector-worker process
# re-runs the `kvdrain` script (multiprocessing's spawn imports the parent's main file).
CLOCKS = ("wall", "virtual")
CPU_NUM_BLOCKS = 512  # --num-blocks unless the pool is sized from GPU memory
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, for all of a topology's engines together
DEFAULT_MODEL = "tiny"
OUTPUT_FILES = (
    "report",
    "requests",
    "plot",
    "series",
)  # replay/commands/replay.py OutputFiles' fields
IDLE_THRESHOLD = click.FloatRange(
    min=0, min_open=True
)  # replay's and inspect's: a gap of 0 s is no gap


# ---- option groups ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OptionGroup:
    """Options under one --help heading; `build` makes the verb's parameter `name` out of
    their values (a ValueError from it is a usage error). As a decorator, adds them."""

    title: str
    name: str
    options: tuple[Callable, ...]
    build: Callable[..., object]

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in _params(self.options)]

    def __call__(self, func: Callable) -> Callable:
        names, inner = self.param_names, func

        @functools.wraps(inner)
        def func(*args, **kwargs):
            values = {n: kwargs.pop(n) for n in names}
            try:
                kwargs[self.name] = self.build(**values)
            except ValueError as e:
                raise click.UsageError(str(e)) from None
            return inner(*args, **kwargs)

        for option in reversed(self.options):
            func = option(func)
        for param in func.__click_params__[-len(self.options) :]:
            param.group_title = self.title  # read by GroupedCommand.format_options
        return func


def _params(options: tuple[Callable, ...]) -> list[click.Parameter]:
    def probe() -> None:
        return None

    for option in options:
        option(probe)
    return probe.__click_params__


def titled(title: str, *options: Callable) -> Callable:
    """Options that stay separate parameters of the verb, shown under `title` in --help."""

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        for param in func.__click_params__[-len(options) :]:
            param.group_title = title
        return func

    return decorate


class GroupedCommand(click.Command):
    """--help with one section per option group, in the order the verb declares them."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        untitled: list[tuple[str, str]] = []  # a verb's own options, and -h
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                title = getattr(param, "group_title", None)
                (untitled if title is None else sections.setdefault(title, [])).append(record)
        for title, records in [("Options", untitled), *sections.items()]:
            with formatter.section(title):
                formatter.write_dl(records)


class KvdrainGroup(click.Group):
    command_class = GroupedCommand  # every verb's --help in sections

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Ctrl-C before the verb took over its signals: 128 + 2, not 1
            from replay.verify.verdict import EXIT_INTERRUPTED

            click.echo("stopping (SIGINT): nothing had started", err=True)
            ctx.exit(EXIT_INTERRUPTED)


def _fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


@dataclass(frozen=True, slots=True, kw_only=True)
class Engines:
    """The engines to run: their topology, one EngineConfig before each engine's role,
    the KV transfer between P and D, and --model as given."""

    topology: str
    router: str  # which P and D take each request (replay/deploy/placement.py)
    config: EngineConfig
    kv: KVTransferConfig
    model: str  # a preset; with replay --target http:// a served model's name

    @classmethod
    def of(
        cls,
        *,
        topology: str,
        router: str,
        model: str,
        num_blocks: int | None,
        gpu_memory_utilization: float | None,
        **values,
    ) -> Engines:
        if topology == "single" and _given("router"):
            raise click.UsageError(
                "--router: not with --topology single (one engine takes every "
                "request); routing picks among P and D engines (pd, NpMd)"
            )
        kv_fields = _fields(KVTransferConfig)
        kv = KVTransferConfig(**{k: v for k, v in values.items() if k in kv_fields})
        config = EngineConfig(
            num_blocks=num_blocks or CPU_NUM_BLOCKS,
            gpu_memory_utilization=gpu_share(num_blocks, gpu_memory_utilization, topology),
            model=MODEL_PRESETS.get(model, MODEL_PRESETS[DEFAULT_MODEL]),
            **{k: v for k, v in values.items() if k not in kv_fields},
        )
        return cls(topology=topology, router=router, config=config, kv=kv, model=model)

    def check_preset(self, served_name_note: str = "") -> None:
        if self.model not in MODEL_PRESETS:
            raise click.UsageError(
                f"--model: {self.model!r} is not a preset "
                f"({', '.join(sorted(MODEL_PRESETS))}){served_name_note}"
            )


def gpu_share(
    num_blocks: int | None, gpu_memory_utilization: float | None, topology: str
) -> float | None:
    """None with --num-blocks (vLLM's num_gpu_blocks_override); else each engine's share:
    kvdrain puts all of a topology's engines on one GPU, as `vllm serve` twice would need."""
    if num_blocks is not None:
        return None
    return gpu_memory_utilization or GPU_MEMORY_UTILIZATION / len(engine_roles(topology))


def _topology(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_topology(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: must be {TOPOLOGY_FORMS}") from None
    return value


def engine_group(model_help: str) -> OptionGroup:
    return OptionGroup(
        "Engine",
        "engines",
        (
            click.option(
                "--topology",
                default="pd",
                show_default=True,
                callback=_topology,
                metavar="TOPOLOGY",
                help="pd (= 1p1d): a prefill and a decode engine with connectors; NpMd: N "
                "prefill and M decode engines (2p2d, 1p3d, ...; named P0.., D0..); "
                "single: one engine.",
            ),
            click.option(
                "--router",
                type=click.Choice(ROUTER_POLICIES),
                default="round-robin",
                show_default=True,
                help="Which P and which D take each request: in turn "
                "(vLLM's toy proxy), the fewest in flight, or the P holding the longest "
                "cached prefix of its blocks (ties by load).",
            ),
            click.option(
                "--liveness",
                type=click.Choice(LIVENESS_POLICIES),
                default="event",
                show_default=True,
                help="Engine loop: legacy (the pre-#43433 leak), poll (vLLM's 1 ms fix), event.",
            ),
            click.option(
                "--runner",
                type=click.Choice(RUNNERS),
                default="torch",
                show_default=True,
                help="torch: the real model; mock: deterministic tokens, no torch work.",
            ),
            click.option(
                "--device",
                type=click.Choice(DEVICES),
                default="auto",
                show_default=True,
                help="Where the torch runner runs: auto is CUDA when torch sees it, else CPU.",
            ),
            click.option("--model", default=DEFAULT_MODEL, show_default=True, help=model_help),
            click.option(
                "--num-blocks",
                type=click.IntRange(2),
                default=None,
                help=f"KV blocks per engine, the null block included [default: {CPU_NUM_BLOCKS}; "
                f"the torch runner on CUDA sizes the pool from GPU memory as vLLM does].",
            ),
            click.option(
                "--gpu-memory-utilization",
                type=click.FloatRange(0, 1, min_open=True),
                default=None,
                help=f"The torch runner on CUDA without --num-blocks: the share of the GPU's "
                f"memory each engine may use, KV cache included (vLLM's flag) [default: "
                f"{GPU_MEMORY_UTILIZATION} shared by the engines, so "
                f"{GPU_MEMORY_UTILIZATION / 2} each for pd].",
            ),
            click.option(
                "--block-size",
                type=click.IntRange(1),
                default=16,
                show_default=True,
                help="Tokens per KV block (vLLM's --block-size).",
            ),
            click.option(
                "--max-num-seqs",
                type=click.IntRange(1),
                default=64,
                show_default=True,
                help="Requests running at once per engine (vLLM's --max-num-seqs).",
            ),
            click.option(
                "--max-num-batched-tokens",
                type=click.IntRange(1),
                default=2048,
                show_default=True,
                help="Tokens scheduled per step per engine; longer "
                "prompts prefill in chunks (vLLM's --max-num-batched-tokens).",
            ),
            click.option(
                "--max-model-len",
                type=click.IntRange(2),
                default=4096,
                show_default=True,
                help="Prompt plus output tokens per request; a longer prompt is refused, "
                "a longer output stopped there (vLLM's --max-model-len).",
            ),
            click.option(
                "--async-scheduling",
                is_flag=True,
                help="vLLM's AsyncScheduler and the engine core's batch queue: step N+1 is "
                "scheduled before step N's output is processed (off: kvdrain's runners "
                "never overlap a step, and parity holds either way).",
            ),
            click.option(
                "--kv-load-failure-policy",
                type=click.Choice(KV_LOAD_FAILURE_POLICIES),
                default=EngineConfig().kv_load_failure_policy,
                show_default=True,
                help="A failed remote load: fail the request (vLLM 0.32's default) or "
                "recompute it.",
            ),
            click.option(
                "--transport",
                type=click.Choice(TRANSPORTS),
                default="shm",
                show_default=True,
                help="How the decode side pulls blocks: shared memory or bytes over ZMQ.",
            ),
            click.option(
                "--kv-lease-s",
                type=click.FloatRange(min=0, min_open=True),
                default=30.0,
                show_default=True,
                help="P's lease on an unread request's blocks (vLLM 0.32 "
                "NIXL's kv_lease_duration): D's heartbeats extend it while D waits; P reaps "
                "it only when it steps.",
            ),
            click.option(
                "--pull-delay-ms",
                type=click.FloatRange(min=0),
                default=0.0,
                show_default=True,
                help="D waits this long before reading (a fault knob).",
            ),
            click.option(
                "--drop-read-done",
                is_flag=True,
                help="P never hears 'read done'; only the lease frees (a fault knob).",
            ),
            click.option(
                "--start-limit",
                "start_limit_s",
                type=click.FloatRange(min=0, min_open=True),
                default=START_LIMIT_S,
                show_default=True,
                help="Seconds any engine (kvdrain's, or a vLLM instance with --engine vllm) "
                "may take to start: one starved of CPU past it makes the run inconclusive; "
                "one stopped, dead, or with no progress for 120 s is a fault at once.",
            ),
        ),
        build=Engines.of,
    )


PRESETS = ", ".join(sorted(MODEL_PRESETS))
REPLAY_ENGINE = engine_group(
    f"Model preset ({PRESETS}); with --target http:// the served "
    f"model's name (default: the first /v1/models lists)."
)
SERVE_ENGINE = engine_group(f"Model preset ({PRESETS}).")


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceInput:
    """How the trace file is read."""

    fmt: str | None
    skip_bad_lines: bool


TRACE = OptionGroup(
    "Trace",
    "trace_input",
    (
        click.option(
            "--format",
            "fmt",
            type=click.Choice(FORMATS),
            default=None,
            help="Trace format [default: detected from the content].",
        ),
        click.option("--skip-bad-lines", is_flag=True, help="Count bad lines instead of stopping."),
    ),
    build=TraceInput,
)


def _shaping(**values):
    from replay.trace.shaping import ShapingOptions

    return ShapingOptions(**values)


SHAPING = OptionGroup(
    "Shaping",
    "shaping",
    (
        click.option(
            "--speedup",
            type=click.FloatRange(min=0, min_open=True),
            default=1.0,
            show_default=True,
            help="Divide every arrival time (and gap) by this.",
        ),
        click.option(
            "--start", type=float, default=None, help="Trace window start (trace seconds)."
        ),
        click.option("--end", type=float, default=None, help="Trace window end (trace seconds)."),
        click.option(
            "--max-requests",
            type=click.IntRange(1),
            default=None,
            help="Send only the first N requests of the window [default: all].",
        ),
        click.option(
            "--max-gap",
            type=click.FloatRange(min=0),
            default=None,
            help="Cap idle gaps between arrivals to this many seconds.",
        ),
        click.option(
            "--insert-idle",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Insert this many seconds of idle (with --insert-idle-every or --insert-idle-at).",
        ),
        click.option(
            "--insert-idle-every",
            type=click.IntRange(1),
            default=None,
            help="... every N requests.",
        ),
        click.option(
            "--insert-idle-at", type=float, multiple=True, help="... at these trace times."
        ),
        click.option(
            "--scale-tokens",
            type=click.FloatRange(min=0, min_open=True),
            default=1.0,
            show_default=True,
            help="Multiply prompt and output lengths (shrink for a CPU).",
        ),
    ),
    build=_shaping,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verification:
    """How the run is judged; the tolerance and the tail default by clock."""

    idle_threshold_s: float
    drain_deadline_s: float
    # None: 0 on the virtual clock and for a recording by kvdrain serve (settled snapshots:
    # replay/serve/recorder.py), 2 on the wall clock otherwise
    snapshot_tolerance_blocks: int | None
    tail_s: float | None
    allow_ignored: bool
    check_outputs: bool | None
    min_coverage: float | None

    def options(self, clock: str, is_serve_recording: bool = False):
        from replay.verify.rules import VerifyOptions

        tolerance = self.snapshot_tolerance_blocks
        exact = clock == "virtual" or is_serve_recording
        return VerifyOptions(
            self.idle_threshold_s,
            self.drain_deadline_s,
            tolerance if tolerance is not None else (0 if exact else 2),
            allow_ignored=self.allow_ignored,
            min_coverage=self.min_coverage,
        )


VERIFICATION = OptionGroup(
    "Verification",
    "verification",
    (
        click.option(
            "--min-coverage",
            type=click.FloatRange(0, 1),
            default=None,
            help="Accept a run that observed at least this share of its expected idle windows "
            "(0-1), every observed one drained and the rest lost to the engines' lag: "
            "exit 0, said as partial coverage [default: every expected window is needed].",
        ),
        click.option(
            "--idle-threshold",
            "idle_threshold_s",
            type=IDLE_THRESHOLD,
            default=1.0,
            show_default=True,
            help="A gap with nothing in flight at least this long is an idle window (s).",
        ),
        click.option(
            "--drain-deadline",
            "drain_deadline_s",
            type=click.FloatRange(min=0),
            default=0.5,
            show_default=True,
            help="Every engine must hold no blocks this long into an idle window (s).",
        ),
        click.option(
            "--snapshot-tolerance",
            "snapshot_tolerance_blocks",
            type=click.IntRange(0),
            default=None,
            help="Blocks of slack when matching recorded snapshots "
            "[default: 0 virtual and for a `serve --record` recording, 2 wall].",
        ),
        click.option(
            "--tail",
            "tail_s",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Seconds observed after the last request [default: covers the drain deadline].",
        ),
        click.option(
            "--allow-ignored",
            is_flag=True,
            help="Do not call the run inconclusive when over 1% of requests were ignored "
            "(prompt over max_model_len, or never fits the pool); they are still counted.",
        ),
        click.option(
            "--check-outputs/--no-check-outputs",
            default=None,
            help="Hold every request's output against what a single engine generates for "
            "its prompt; a difference (corrupt KV) is a violation [default: on for a "
            "local wall replay with the mock runner, where it is cheap].",
        ),
    ),
    build=Verification,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """--target and what an HTTP target takes."""

    address: str | None
    metrics: tuple[str, ...]
    prometheus: str | None
    prompt_format: str
    scrape_interval_s: float
    api_key: str | None
    vocab_size: int | None

    @property
    def is_http(self) -> bool:
        return self.address is not None and self.address.startswith(("http://", "https://"))

    def http_options(self, served_model: str | None):
        """HttpTargetOptions for --target http://...; None for other targets (HTTP options refused)."""
        if not self.is_http:
            given = [
                n
                for n, v in (
                    ("--metrics", self.metrics),
                    ("--prometheus", self.prometheus),
                    ("--api-key", self.api_key),
                    ("--vocab-size", self.vocab_size),
                )
                if v
            ]
            if given:
                raise click.UsageError(f"{given[0]}: only with --target http://")
            return None
        from replay.metrics.scrape import MetricsSource
        from replay.target.client import HttpTargetOptions

        try:
            prometheus = prometheus_options(self.prometheus, self.metrics)
            return HttpTargetOptions(
                self.address,
                () if prometheus else tuple(MetricsSource.parse(m) for m in self.metrics),
                served_model,
                self.prompt_format,
                self.scrape_interval_s,
                self.api_key,
                vocab_size=self.vocab_size,
                prometheus=prometheus,
            )
        except ValueError as e:
            raise click.UsageError(str(e)) from None


def prometheus_options(url: str | None, selectors: tuple[str, ...]):
    """--prometheus URL with its --metrics selectors (None without --prometheus)."""
    if url is None:
        return None
    from urllib.parse import urlsplit

    from replay.metrics.prometheus import PrometheusOptions
    from replay.metrics.promql import PromSelector

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--prometheus: expected http://HOST:PORT, got {url!r}")
    if not selectors:
        raise ValueError(
            "--prometheus: say whose series to read with --metrics SELECTOR "
            "(e.g. --metrics '{job=\"vllm\"}' or --metrics 'P0={pod=\"prefill-0\"}')"
        )
    return PrometheusOptions(url=url, selectors=tuple(PromSelector.parse(m) for m in selectors))


def _target(address: str | None, **values) -> Target:
    return Target(address=normalize_target(address), **values)


TARGET = OptionGroup(
    "Target (a running server instead of local engines)",
    "target",
    (
        click.option(
            "--target",
            "address",
            default=None,
            help="Replay against a running `kvdrain serve` at ADDRESS (tcp://HOST:PORT, "
            "HOST:PORT or ipc://PATH), or any OpenAI-compatible server at "
            "http://HOST:PORT (vLLM, SGLang, a P/D proxy).",
        ),
        click.option(
            "--metrics",
            multiple=True,
            metavar="[NAME=]URL",
            help="With --target http://: a Prometheus URL to scrape for KV usage (repeat for "
            "P's and D's; NAME names the engine; no path: its /metrics); each is scraped once before the first "
            "request (a failure: exit 2). Default: a proxy's upstreams on the target's host, "
            "else the target's own /metrics when it has a KV-usage metric. With --prometheus: "
            'a label selector, [NAME=]{label="value",...}.',
        ),
        click.option(
            "--prometheus",
            default=None,
            metavar="URL",
            help="With --target http://: read the engines' series through this Prometheus "
            "server (http://HOST:9090), each --metrics a selector of them; its scrape "
            "interval must be at most half the drain deadline.",
        ),
        click.option(
            "--prompt-format",
            type=click.Choice(["ids", "text"]),
            default="ids",
            show_default=True,
            help="With --target http://: prompts as token ids, or as "
            "kvdrain's word-tokenizer text.",
        ),
        click.option(
            "--scrape-interval",
            "scrape_interval_s",
            type=click.FloatRange(min=0, min_open=True),
            default=0.1,
            show_default=True,
            help="With --target http://: seconds between scrapes.",
        ),
        click.option(
            "--api-key",
            default=None,
            help="With --target http://: sent as a Bearer token to the target's origin only.",
        ),
        click.option(
            "--vocab-size",
            type=click.IntRange(1),
            default=None,
            help="With --target http://: the model's vocabulary size, when the server does not "
            "say it (kvdrain's /v1/models and vLLM's /tokenize over kvdrain's words do).",
        ),
    ),
    build=_target,
)


def normalize_target(target: str | None) -> str | None:
    """tcp://, ipc:// or http(s):// as given; a plain HOST:PORT means tcp://."""
    if target is None:
        return None
    if "://" not in target:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise click.UsageError(
                f"--target: {target!r} is not tcp://HOST:PORT, HOST:PORT, "
                f"ipc://PATH or http://HOST:PORT"
            )
        return f"tcp://{target}"
    if not target.startswith(("tcp://", "ipc://", "http://", "https://")):
        raise click.UsageError(f"--target: {target!r}: the scheme must be tcp, ipc, http or https")
    return target


def _output_files(**values):
    from replay.commands.replay import OutputFiles

    return OutputFiles(**values)


def _path_option(flag: str, help: str) -> Callable:
    return click.option(
        flag, type=click.Path(dir_okay=False, path_type=Path), default=None, help=help
    )


OUTPUTS = OptionGroup(
    "Outputs",
    "outputs",
    (
        _path_option("--report", "Write the machine-readable report (JSON)."),
        _path_option("--requests", "Write one JSON line per request."),
        _path_option("--plot", "Write a PNG of blocks used over time, idle windows shaded (.png)."),
        _path_option("--series", "Write the plot's time series (every engine sample) as CSV."),
    ),
    build=_output_files,
)


def _display(live: bool, all_windows: bool, latency_block: bool, metric_percentiles: str):
    from replay.commands.replay import Display
    from replay.verify.latency import parse_percentiles

    try:
        percentiles = parse_percentiles(metric_percentiles)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return Display(
        live=live,
        max_window_lines=None if all_windows else MAX_WINDOW_LINES,
        latency_block=latency_block,
        percentiles=percentiles,
    )


DISPLAY = OptionGroup(
    "Replay",
    "display",
    (
        click.option(
            "--live/--no-live",
            default=True,
            show_default=True,
            help="Show the live dashboard (else only the final summary).",
        ),
        click.option(
            "--all-windows",
            is_flag=True,
            help="List every idle window at the end [default: the first few and a count].",
        ),
        click.option(
            "--latency-block",
            is_flag=True,
            help="Print latency as vllm bench serve does "
            "(25 lines) instead of five lines after the verdict.",
        ),
        click.option(
            "--metric-percentiles",
            default="90,95,99",
            show_default=True,
            help="Latency percentiles to print and report, as vllm bench's option (p50 always).",
        ),
    ),
    build=_display,
)


def _auth_options(**values):
    """AuthOptions from --curve-keys / --token (/ --insecure); None if none is given."""
    if not any(values.values()):
        return None
    from replay.serve.auth import AuthError, AuthOptions

    try:
        return AuthOptions(**values)
    except AuthError as e:
        raise click.UsageError(str(e)) from None


def security_group(curve_keys_help: str, token_help: str, *serve_only: Callable) -> OptionGroup:
    return OptionGroup(
        "Security",
        "auth",
        (
            click.option(
                "--curve-keys",
                type=click.Path(file_okay=False, path_type=Path),
                default=None,
                help=curve_keys_help,
            ),
            click.option("--token", envvar="KVDRAIN_TOKEN", default=None, help=token_help),
            *serve_only,
        ),
        build=_auth_options,
    )


SERVE_SECURITY = security_group(
    "CURVE keys made by `kvdrain keys DIR`: required to serve beyond loopback (clients need "
    "client.key_secret and server.key from it).",
    "A shared token every client must give (loopback only; KVDRAIN_TOKEN keeps it out of `ps`).",
    click.option(
        "--insecure",
        is_flag=True,
        help="Serve beyond loopback without --curve-keys (zmq) "
        "or --api-key (--http): anyone who reaches it may submit work.",
    ),
)


def client_security(flag: str) -> OptionGroup:
    return security_group(
        f"The serve's CURVE keys directory (`kvdrain keys DIR`), for {flag} "
        f"beyond loopback: this side needs client.key_secret and server.key.",
        "The serve's shared token (KVDRAIN_TOKEN keeps it out of `ps`).",
    )


def _explain(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        explain_cmd.callback()
        ctx.exit(0)


# ---- verbs ---------------------------------------------------------------------------


@click.group(cls=KvdrainGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdrain")
def cli() -> None:
    """kvdrain: replay traces against a miniature vLLM v1 engine and find KV-block leaks.

    \b
    kvdrain replay examples/pd_idle.jsonl            # live view, real processes
    kvdrain replay TRACE --clock virtual --liveness legacy
    kvdrain serve --record traffic.jsonl             # then: kvdrain top --connect ADDR
    kvdrain inspect traces/AzureLLMInferenceTrace_code.csv
    kvdrain explain                                  # what verdicts, columns and units mean
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class DryRun:
    """What inspect checks the trace against: replay's own settings."""

    idle_threshold_s: float
    max_model_len: int | None
    tail_s: float


DRY_RUN = OptionGroup(
    "Dry run (replay's settings)",
    "dry_run",
    (
        click.option(
            "--idle-threshold",
            "idle_threshold_s",
            type=IDLE_THRESHOLD,
            default=1.0,
            show_default=True,
            help="Count gaps between arrivals at least this "
            "long (seconds), as replay's --idle-threshold.",
        ),
        click.option(
            "--max-model-len",
            type=click.IntRange(1),
            default=None,
            help="Check prompts against this [default: a wall and a virtual replay's own].",
        ),
        click.option(
            "--tail",
            "tail_s",
            type=click.FloatRange(min=0, min_open=True),
            default=2.0,
            show_default=True,
            help="The replay's tail, for how long a wall replay takes.",
        ),
    ),
    build=DryRun,
)


@cli.command(name="inspect")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@TRACE
@SHAPING
@DRY_RUN
def inspect_cmd(trace: Path, trace_input: TraceInput, shaping, dry_run: DryRun) -> None:
    """What TRACE holds and what `replay` would do with it (a dry run): requests sent and
    dropped by shaping, idle gaps, prompts over max_model_len, how long a wall replay takes.

    \b
    Example: kvdrain inspect examples/pd_idle.jsonl
             kvdrain inspect traces/AzureLLMInferenceTrace_code.csv --speedup 8 --max-gap 20
    """
    from replay.trace.inspect import bad_line_lines, format_inspection, inspect_trace
    from replay.trace.reader import TraceError

    try:
        insp = inspect_trace(
            trace,
            trace_input.fmt,
            dry_run.idle_threshold_s,
            shaping,
            dry_run.max_model_len,
            dry_run.tail_s,
        )
    except (TraceError, ValueError) as e:  # a data error: one line, as replay prints it
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    for line in format_inspection(insp):
        click.echo(line)
    for line in bad_line_lines(insp):
        click.echo(line, err=not trace_input.skip_bad_lines)
    if insp.num_bad_lines and not trace_input.skip_bad_lines:
        click.echo(
            f"error: {insp.num_bad_lines:,} bad lines: replay stops at the first "
            f"(--skip-bad-lines skips and counts them)",
            err=True,
        )
        sys.exit(2)


@cli.command(name="explain")
def explain_cmd() -> None:
    """Print what the verdicts, exit statuses, columns and units of a replay mean."""
    from replay.verify.report import LEGEND

    click.echo(LEGEND)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """--profile and --cost-profile: engine sizes like a real deployment's, step costs measured."""

    profile_name: str | None
    cost_profile_path: Path | None


SIZING = OptionGroup(
    "Engine",
    "sizing",
    (
        click.option(
            "--profile",
            "profile_name",
            type=click.Choice(sorted(PROFILES)),
            default=None,
            help=f"Size the engines like a real deployment (KV blocks from GPU memory as "
            f"vLLM does, max_model_len, batch limits); explicit size options win "
            f"[default: {DEFAULT_VIRTUAL_PROFILE} with --clock virtual, none with the "
            f"wall clock].",
        ),
        click.option(
            "--cost-profile",
            "cost_profile_path",
            default=None,
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Step costs measured by `kvdrain calibrate`: the virtual clock's, and the "
            "wall clock's model of its expected idle windows.",
        ),
    ),
    build=lambda **values: Sizing(**values),
)


# ---- --engine vllm ---------------------------------------------------------------------

VLLM_TARGET = "http://127.0.0.1:0"  # --engine vllm: the launched deployment's address replaces it


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineChoice:
    """--engine and what --engine vllm launches."""

    engine: str
    vllm_venv: Path
    vllm_model: str | None
    vllm_args: tuple[str, ...]
    vllm_env: tuple[str, ...]
    vllm_start_timeout: float | None  # deprecated: --start-limit

    def options(self, topology: str, start_limit_s: float = START_LIMIT_S) -> VllmOptions | None:
        """VllmOptions for --engine vllm; None for --engine kvdrain (vLLM options refused)."""
        names = ("vllm_venv", "vllm_model", "vllm_args", "vllm_env", "vllm_start_timeout")
        if self.engine == "kvdrain":
            extra = next((n for n in names if _given(n)), None)
            if extra is not None:
                raise click.UsageError(
                    f"--{extra.replace('_', '-').removesuffix('s')}: only with --engine vllm"
                )
            return None
        pairs = []
        for item in self.vllm_env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise click.UsageError(f"--vllm-env: expected KEY=VALUE, got {item!r}")
            pairs.append((key, value))
        try:
            return VllmOptions(
                venv=self.vllm_venv,
                topology=topology,
                model=self.vllm_model,
                args=tuple(self.vllm_args),
                env=tuple(pairs),
                start_limit_s=self._start_limit(start_limit_s),
            )
        except ValueError as e:
            raise click.UsageError(str(e)) from None

    def _start_limit(self, start_limit_s: float) -> float:
        if self.vllm_start_timeout is None:
            return start_limit_s
        click.echo("--vllm-start-timeout is deprecated: use --start-limit", err=True)
        return start_limit_s if _given("start_limit_s") else self.vllm_start_timeout


VLLM = OptionGroup(
    "vLLM (--engine vllm: real vllm serve instances)",
    "engine_choice",
    (
        click.option(
            "--engine",
            type=click.Choice(ENGINES),
            default="kvdrain",
            show_default=True,
            help="kvdrain: its own engines; vllm: real `vllm serve` instances (--topology pd: "
            "P and D with the NixlConnector, behind `kvdrain proxy`) that kvdrain "
            "launches, replays over HTTP and tears down.",
        ),
        click.option(
            "--vllm-venv",
            type=click.Path(file_okay=False, path_type=Path),
            default=DEFAULT_VENV,
            show_default=True,
            help="With --engine vllm: a virtualenv holding vLLM (`make vllm` makes .venv-vllm).",
        ),
        click.option(
            "--vllm-model",
            default=None,
            metavar="DIR_OR_NAME",
            help="With --engine vllm: the model `vllm serve` loads [default: a tiny "
            "dummy-weight Llama written into the run dir, its words kvdrain's prompts].",
        ),
        click.option(
            "--vllm-arg",
            "vllm_args",
            multiple=True,
            metavar="ARG",
            help="With --engine vllm: an argument for every `vllm serve` (repeat; "
            "--vllm-arg=--max-num-seqs --vllm-arg=8).",
        ),
        click.option(
            "--vllm-env",
            "vllm_env",
            multiple=True,
            metavar="KEY=VALUE",
            help="With --engine vllm: set in every instance's environment (repeat).",
        ),
        click.option(
            "--vllm-start-timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Deprecated: --start-limit.",
        ),
    ),
    build=lambda **values: EngineChoice(**values),
)


def _require_torch(runner: str) -> None:
    """--runner torch without torch installed: a usage error saying how to get it."""
    import importlib.util

    if runner != "torch":
        return
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise click.UsageError(
            "--runner torch: needs torch, which is not installed; pip install "
            "'kvdrain[model]' (or --runner mock; --target http://, --engine vllm "
            "and `kvdrain proxy` need no torch)"
        )


@cli.command(name="replay")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@titled(
    "Replay",
    click.option(
        "--clock",
        type=click.Choice(CLOCKS),
        default="wall",
        show_default=True,
        help="wall: real processes in real time; virtual: in-process, deterministic, "
        "fast (always the mock runner, with a step-cost and transfer-latency model).",
    ),
    click.option(
        "--explain",
        is_flag=True,
        is_eager=True,
        expose_value=False,
        callback=_explain,
        help="Print what the verdicts, columns and units mean, and exit.",
    ),
)
@DISPLAY
@TRACE
@REPLAY_ENGINE
@SIZING
@SHAPING
@VERIFICATION
@TARGET
@OUTPUTS
@client_security("--target")
@VLLM
def replay_cmd(
    trace: Path,
    clock: str,
    display,
    trace_input: TraceInput,
    engines: Engines,
    sizing: Sizing,
    shaping,
    verification: Verification,
    target: Target,
    outputs,
    auth,
    engine_choice: EngineChoice,
) -> None:
    """Replay TRACE and verify every engine's KV blocks drain in idle periods.

    \b
    Exit status: 0 verified, 1 a violation, 2 bad usage, input or an unreachable
    target, 3 inconclusive (an expected idle window not observed, over 1% of requests
    ignored, KV usage not observable), 4 an engine or connector-worker fault,
    130 Ctrl-C, 143 SIGTERM (`kvdrain explain` says more).
    Example: kvdrain replay examples/pd_idle.jsonl --liveness legacy --report out.json
             kvdrain replay TRACE --target http://HOST:8000 --metrics P=http://P:8100/metrics
    """
    from replay.commands.replay import replay_main
    from replay.pipeline import ReplayConfig

    vllm = engine_choice.options(engines.topology, engines.config.start_limit_s)
    if vllm is not None:
        _check_vllm(target, clock)
        target = replace(target, address=VLLM_TARGET)
    else:
        _check_target(target, clock, engines)
    if clock == "wall" and target.address is None:
        _require_torch(engines.config.runner)  # only a local wall replay runs the model
    http = target.http_options(engines.model if _given("model") and target.is_http else None)
    if not target.is_http:
        engines.check_preset("; a served model's name goes with --target http:// only")
    recorded: set[str] = set()
    is_serve_recording = False
    if target.address is None:
        engines, recorded, is_serve_recording = _adopt_recording(trace, trace_input.fmt, engines)
    engine = _apply_profile(
        engines.config,
        sizing.profile_name or (DEFAULT_VIRTUAL_PROFILE if clock == "virtual" else None),
        recorded,
    )
    if auth is not None and (target.address is None or target.is_http):
        raise click.UsageError(
            "--curve-keys/--token: only with --target of a kvdrain serve "
            "(an HTTP server takes --api-key)"
        )
    try:
        config = ReplayConfig(
            trace=trace,
            fmt=trace_input.fmt,
            skip_bad_lines=trace_input.skip_bad_lines,
            clock=clock,
            topology=engines.topology,
            router=engines.router,
            engine=engine,
            kv=engines.kv,
            tail_s=verification.tail_s,
            target=target.address,
            http=http,
            shaping=shaping,
            verify=verification.options(clock, is_serve_recording),
            cost_profile=_cost_profile(sizing.cost_profile_path),
            target_auth=auth,
            check_outputs=verification.check_outputs,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if vllm is not None:
        from replay.commands.replay_vllm import vllm_replay_main

        sys.exit(
            vllm_replay_main(
                vllm,
                config,
                outputs,
                display,
                Console(),
                deadline_given=_given("drain_deadline_s"),
                threshold_given=_given("idle_threshold_s"),
            )
        )
    sys.exit(replay_main(config, outputs, display, Console()))


def _check_vllm(target: Target, clock: str) -> None:
    """--engine vllm launches the servers and scrapes them: nothing may name others, and
    the engine options are vLLM's own (--vllm-arg), not kvdrain's."""
    refused = [
        flag
        for flag, on in (
            ("--target", target.address is not None),
            ("--metrics", bool(target.metrics)),
            ("--prometheus", target.prometheus is not None),
            ("--clock virtual", clock == "virtual"),
        )
        if on
    ]
    refused += [
        "--" + n.replace("_", "-")
        for n in [*REPLAY_ENGINE.param_names, "profile_name"]
        if n != "topology" and _given(n)
    ]
    if refused:
        raise click.UsageError(
            f"{refused[0].replace('--profile-name', '--profile')}: not with "
            f"--engine vllm (kvdrain launches the vLLM servers and scrapes them)"
        )


def _given(name: str) -> bool:
    """Whether the option with parameter `name` was set on the command line (or its variable)."""
    ctx = click.get_current_context(silent=True)
    source = None if ctx is None else ctx.get_parameter_source(name)
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _check_target(target: Target, clock: str, engines: Engines) -> None:
    """--target runs in real time on the server's own engines: engine options set on the
    command line, which only those engines could honour, are refused."""
    if target.address is None:
        return
    if clock == "virtual":
        raise click.UsageError(
            "--target: replays against a running server in real time; not with --clock virtual"
        )
    server_side = [*REPLAY_ENGINE.param_names, "profile_name"]
    explicit = [n for n in server_side if _given(n) and not (n == "model" and target.is_http)]
    if explicit:
        flag = (
            "--profile" if explicit[0] == "profile_name" else "--" + explicit[0].replace("_", "-")
        )
        raise click.UsageError(
            f"{flag}: does not apply with --target: the server runs its own "
            f"engines (set it on `kvdrain serve`); the report records the "
            f"server's own configuration"
        )


def _adopt_recording(
    trace: Path, fmt: str | None, engines: Engines
) -> tuple[Engines, set[str], bool]:
    """A recording's engine config (its header: replay/serve/recorder.py) where none was
    given on the command line; the names adopted; whether `serve --record` wrote it. A
    conflicting explicit option: usage error."""
    from replay.serve.recorder import SETTLED_KEY, adopt_recorded
    from replay.trace.reader import TraceError, read_trace
    from replay.trace.records import TraceHeader

    try:  # a pipe is copied at this first open; the replay reads the copy (replay/trace/source.py)
        first = next(iter(read_trace(trace, fmt)), None)
    except (TraceError, OSError, ValueError):
        return engines, set(), False  # the replay reports it
    if not isinstance(first, TraceHeader):
        return engines, set(), False
    config = engines.config
    current = {
        "num_blocks": config.num_blocks,
        "block_size": config.block_size,
        "liveness": config.liveness,
        "topology": engines.topology,
        "max_model_len": config.max_model_len,
    }
    try:
        adopted = adopt_recorded(first.metadata, current, {k for k in current if _given(k)})
        sizes = {k: v for k, v in adopted.items() if k != "topology"}
        if "num_blocks" in sizes:  # the recorded pool, not one sized from GPU memory
            sizes["gpu_memory_utilization"] = None
        engines = replace(
            engines,
            topology=adopted.get("topology", engines.topology),
            config=replace(config, **sizes),
        )
    except (ValueError, TypeError) as e:
        raise click.UsageError(str(e)) from None
    return engines, set(adopted), SETTLED_KEY in first.metadata


def _apply_profile(
    engine: EngineConfig, name: str | None, recorded: set[str] = frozenset()
) -> EngineConfig:
    """The profile's sizes, except where a size option was given on the command line (or
    taken from the recording replayed)."""
    if name is None:
        return engine
    ctx = click.get_current_context()
    keep = frozenset(
        k
        for k in PROFILES[name].sizes()
        if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT or k in recorded
    )
    try:
        return PROFILES[name].apply(engine, keep)
    except ValueError as e:
        raise click.UsageError(f"--profile {name}: {e}") from None


@cli.command(name="serve")
@titled(
    "Serve",
    click.option(
        "--address",
        default="tcp://127.0.0.1:0",
        show_default=True,
        help="Where clients connect (port 0: any free port, printed at start-up).",
    ),
    click.option(
        "--http",
        "http_address",
        default=None,
        metavar="[HOST:]PORT",
        help="Also serve OpenAI-compatible HTTP here (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /version); "
        "host 127.0.0.1 by default, port 0 picks a free one.",
    ),
    click.option(
        "--api-key", default=None, help="With --http: require 'Authorization: Bearer KEY' on /v1."
    ),
    click.option(
        "--record",
        "record_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Record the requests received and idle-time block counts as a kvdrain trace.",
    ),
    click.option(
        "--live/--no-live", default=True, show_default=True, help="Show the live dashboard."
    ),
)
@SERVE_ENGINE
@SERVE_SECURITY
def serve_cmd(
    address: str,
    http_address: str | None,
    api_key: str | None,
    record_path: Path | None,
    live: bool,
    engines: Engines,
    auth,
) -> None:
    """Start the engines and accept requests from clients until Ctrl-C.

    \b
    Example: kvdrain serve --liveness legacy --record traffic.jsonl
             kvdrain replay examples/pd_idle.jsonl --target tcp://127.0.0.1:PORT
             kvdrain top --connect tcp://127.0.0.1:PORT
             kvdrain serve --http 8000   (then --target http://127.0.0.1:8000)
    """
    from replay.commands.replay import serve_main

    engines.check_preset()
    _require_torch(engines.config.runner)
    http = None
    if http_address is not None:
        from replay.serve.fronts import HttpServe, parse_http_address
        from replay.serve.http_front import HttpOptions

        try:
            host, port = parse_http_address(http_address)
            http = HttpServe(
                HttpOptions(host, port, api_key),
                f"kvdrain/{engines.model}",
                bool(auth is not None and auth.insecure),
            )
        except ValueError as e:  # a bad address, or CredentialError
            raise click.UsageError(str(e)) from None
    elif api_key is not None:
        raise click.UsageError("--api-key: only with --http")
    sys.exit(
        serve_main(
            engines.config,
            engines.kv,
            engines.topology,
            address,
            record_path,
            live,
            Console(),
            http,
            auth,
            policy=engines.router,
        )
    )


@cli.command(name="keys")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def keys_cmd(directory: Path) -> None:
    """Make a CURVE key pair for a serve and one for its clients in DIRECTORY (0700).

    \b
    Example: kvdrain keys ~/.kvdrain-keys
             kvdrain serve --address tcp://0.0.0.0:5555 --curve-keys ~/.kvdrain-keys
             kvdrain top --connect tcp://HOST:5555 --curve-keys ~/.kvdrain-keys
    A client machine needs only client.key_secret and server.key.
    """
    from replay.serve.auth import AuthError, generate_keys

    try:
        for path in generate_keys(directory):
            click.echo(str(path))
    except (AuthError, OSError) as e:
        raise click.UsageError(str(e)) from None


def _cost_profile(path: Path | None):
    if path is None:
        return None
    from replay.sim.cost import CostProfile

    try:
        return CostProfile.load(path)
    except ValueError as e:
        raise click.UsageError(f"--cost-profile: {e}") from None


@cli.command(name="calibrate")
@click.option(
    "--runner",
    type=click.Choice(RUNNERS),
    default="torch",
    show_default=True,
    help="torch: the real model runner; mock: the engine core's own step cost.",
)
@click.option(
    "--model",
    type=click.Choice(sorted(MODEL_PRESETS)),
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model preset to time.",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Where to time it: auto is CUDA when torch sees it, else CPU.",
)
@click.option(
    "--reps",
    type=click.IntRange(1, 100),
    default=5,
    show_default=True,
    help="Timed steps per grid point (the median counts).",
)
@click.option(
    "--loop-overhead/--no-loop-overhead",
    default=True,
    show_default=True,
    help="Also time one real engine-core process and add its per-step loop cost.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("cost-profile.json"),
    show_default=True,
    help="The cost profile (JSON).",
)
def calibrate_cmd(
    runner: str, model: str, device: str, reps: int, loop_overhead: bool, output: Path
) -> None:
    """Time the runner's steps on this device and write a cost profile for replay --cost-profile.

    \b
    Example: kvdrain calibrate --runner torch --model tiny -o tiny-cpu.json
             kvdrain replay examples/pd_idle.jsonl --clock virtual --cost-profile tiny-cpu.json
             kvdrain replay examples/pd_idle.jsonl --cost-profile tiny-cpu.json  # the wall clock's model
    """
    _require_torch(runner)
    from replay.commands.calibrate import CalibrateOptions, calibrate_main

    _require_torch(runner)
    try:
        options = CalibrateOptions(
            runner=runner, model=model, device=device, num_reps=reps, loop_overhead=loop_overhead
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(calibrate_main(options, output, click.echo))


@cli.command(name="top")
@click.option(
    "--connect",
    "address",
    default=None,
    help="A `kvdrain serve`'s ZMQ address, as it printed (tcp://HOST:PORT or ipc://PATH).",
)
@click.option(
    "--metrics",
    "metrics",
    multiple=True,
    metavar="[NAME=]URL",
    help="A Prometheus metrics URL of any vLLM, SGLang or `kvdrain serve --http` "
    "engine (repeat for each, e.g. P=http://h:8100/metrics D=...; no path: its /metrics). "
    'With --prometheus: a label selector, [NAME=]{label="value",...}.',
)
@click.option(
    "--prometheus",
    default=None,
    metavar="URL",
    help="Read the --metrics selectors' series through this Prometheus server "
    "(http://HOST:9090); a scrape interval over half the drain deadline is judged with "
    "twice the interval, and said.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between scrapes of the --metrics URLs.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop after this long [default: until Ctrl-C or q].",
)
@client_security("--connect")
def top_cmd(
    address: str | None,
    metrics: tuple[str, ...],
    prometheus: str | None,
    interval: float,
    seconds: float | None,
    auth,
) -> None:
    """Watch engines live: a `kvdrain serve` (--connect) or any server's metrics (--metrics).

    \b
    Examples:
      kvdrain top --connect tcp://127.0.0.1:5555
      kvdrain top --metrics P=http://127.0.0.1:8100/metrics --metrics D=http://127.0.0.1:8200/metrics
      kvdrain top --prometheus http://127.0.0.1:9090 --metrics '{job="vllm"}'
    """
    from replay.ui.metrics_top import connect_problem, metrics_top_main

    problem = connect_problem(address, metrics)
    if problem is not None:
        raise click.UsageError(problem)
    if prometheus is not None:
        from replay.ui.prometheus_top import prometheus_top_main

        try:
            options = prometheus_options(prometheus, metrics)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        sys.exit(prometheus_top_main(options, seconds, interval, Console()))
    if metrics:
        sys.exit(metrics_top_main(list(metrics), seconds, interval, Console()))
    from replay.commands.replay import top_main

    sys.exit(top_main(address, seconds, Console(), auth))


def _proxy_limits(
    connect_timeout: float,
    first_byte_timeout: float,
    idle_timeout: float,
    total_timeout: float,
    max_in_flight: int,
    max_body_mib: float,
) -> dict:
    """ProxyOptions' bounds from the Limits group's flags."""
    timeouts = UpstreamTimeouts(
        connect_s=connect_timeout,
        first_byte_s=first_byte_timeout,
        idle_s=idle_timeout,
        total_s=total_timeout,
    )
    body = int(max_body_mib * MIB)
    return {"timeouts": timeouts, "max_in_flight": max_in_flight, "max_body_bytes": body}


def _limit(flag: str, default: float, help: str, metavar: str = "S") -> Callable:
    kind = click.IntRange(min=1) if metavar == "N" else click.FloatRange(min=0, min_open=True)
    return click.option(
        flag, type=kind, default=default, show_default=True, metavar=metavar, help=help
    )


_TIMEOUTS = UpstreamTimeouts()
PROXY_LIMITS = OptionGroup(
    "Limits",
    "limits",
    (
        _limit("--connect-timeout", _TIMEOUTS.connect_s, "Connecting to a server."),
        _limit(
            "--first-byte-timeout",
            _TIMEOUTS.first_byte_s,
            "From sending to a server's first byte (a non-streamed answer's: its end).",
        ),
        _limit("--idle-timeout", _TIMEOUTS.idle_s, "Between two reads of an answer."),
        _limit("--total-timeout", _TIMEOUTS.total_s, "One whole exchange with a server."),
        _limit("--max-in-flight", MAX_IN_FLIGHT, "Requests at one server; beyond: 503.", "N"),
        _limit("--max-body-mib", MAX_BODY_BYTES / MIB, "A request body; beyond: 413.", "MIB"),
    ),
    build=_proxy_limits,
)


@cli.command(name="sweep")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the table here [default: SPEC with the suffix .csv].",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a PNG: blocks held, windows leaked and expiries per cell.",
)
@click.option(
    "--workers",
    type=click.IntRange(1),
    default=None,
    help="Replays at once on this machine [default: its cores].",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Run the cells on the Ray cluster at ADDRESS (HOST:PORT, or auto), one task each "
    "(pip install 'kvdrain[ray]'; every node needs kvdrain and the traces at the same paths).",
)
def sweep_cmd(
    spec: Path, csv_path: Path | None, plot: Path | None, workers: int | None, ray_address
) -> None:
    """Run a grid of virtual replays and write one table (CSV, and a plot with --plot).

    \b
    SPEC is a TOML file of `kvdrain replay` options; a list is an axis of the grid:
      trace = ["examples/pd_idle.jsonl", "traces/conversation_trace.jsonl"]
      liveness = ["legacy", "poll", "event"]
      kv-lease-s = [5.0, 30.0]
      max-requests = 100
    Exit status: 0 every cell gave a report, 2 a bad spec or a cell that could not run.
    Example: kvdrain sweep examples/sweep.toml --plot sweep.png
             kvdrain sweep examples/sweep.toml --ray 10.0.0.1:6379
    """
    from replay.commands.sweep import SweepOptions, sweep_main

    options = SweepOptions(
        spec=spec,
        csv=csv_path or spec.with_suffix(".csv"),
        plot=plot,
        workers=workers,
        ray_address=ray_address,
    )
    sys.exit(sweep_main(options, _replay_option_names(), _check_replay_argv, Console()))


def _replay_option_names() -> frozenset[str]:
    return frozenset(
        opt.removeprefix("--")
        for param in replay_cmd.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
        if opt.startswith("--")
    )


def _check_replay_argv(argv: list[str]) -> None:
    """A ValueError saying what `kvdrain replay` would refuse in these arguments."""
    try:
        replay_cmd.make_context("replay", [*argv, "--clock", "virtual", "--no-live"])
    except click.ClickException as e:
        raise ValueError(f"kvdrain replay {' '.join(argv)}: {e.format_message()}") from None


@cli.command(name="proxy")
@click.option(
    "--prefill",
    "prefill_urls",
    multiple=True,
    required=True,
    metavar="URL",
    help="A vLLM prefill server (kv_producer), e.g. http://127.0.0.1:8100; repeat for several.",
)
@click.option(
    "--decode",
    "decode_urls",
    multiple=True,
    required=True,
    metavar="URL",
    help="A vLLM decode server (kv_consumer); repeat for several.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Where clients connect.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="0: any free port (printed in the 'proxy ready' line).",
)
@click.option(
    "--api-key",
    envvar="KVDRAIN_PROXY_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1 (env KVDRAIN_PROXY_API_KEY).",
)
@click.option(
    "--upstream-api-key",
    envvar="KVDRAIN_UPSTREAM_API_KEY",
    default=None,
    help="Sent to every server as 'Authorization: Bearer KEY' (env KVDRAIN_UPSTREAM_API_KEY).",
)
@click.option("--insecure", is_flag=True, help="Listen beyond loopback without --api-key.")
@click.option(
    "--router",
    type=click.Choice(ROUTER_POLICIES),
    default="round-robin",
    show_default=True,
    help="Which P and D take each request: in turn, the fewest in flight, or the P "
    "the proxy sent the longest prefix of the prompt to (its own table).",
)
@PROXY_LIMITS
def proxy_cmd(
    prefill_urls: tuple[str, ...],
    decode_urls: tuple[str, ...],
    host: str,
    port: int,
    api_key: str | None,
    upstream_api_key: str | None,
    insecure: bool,
    router: str,
    limits: dict,
) -> None:
    """A P/D proxy in front of vLLM servers: prefill on a P, decode on a D (vLLM's protocol).

    \b
    Example: kvdrain proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
             kvdrain replay examples/pd_idle.jsonl --target http://127.0.0.1:8000 \\
                 --metrics P=http://127.0.0.1:8100/metrics --metrics D=http://127.0.0.1:8200/metrics
    """
    from replay.openai.bearer import CredentialError
    from replay.vllm.proxy import check_listen, proxy_main
    from replay.vllm.proxy_options import ProxyError, ProxyOptions

    try:
        options = ProxyOptions(
            prefill=prefill_urls,
            decode=decode_urls,
            host=host,
            port=port,
            api_key=api_key,
            upstream_api_key=upstream_api_key,
            insecure=insecure,
            router=router,
            **limits,
        )
        check_listen(options)
    except (ProxyError, CredentialError) as e:
        raise click.UsageError(str(e)) from None
    sys.exit(proxy_main(options))


if __name__ == "__main__":
    cli(prog_name="kvdrain")  # `python -m cli` is kvdrain: its usage lines say so, not cli.py
