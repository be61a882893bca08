"""The option groups only `kvdrain replay` takes. Runs in: frontend process.

Display, trace outputs, verification, target, engine sizing and --engine vllm; what they
mean together is replay/commands/replay_config.py's. Light to import (cli.py declares the
verb with them): what a group's dataclass needs from the replay is imported when built.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import click

from engine.profiles import DEFAULT_VIRTUAL_DEPLOYMENT, DEPLOYMENT_PRESETS
from replay.commands.groups import IDLE_THRESHOLD, Engines, TraceInput
from replay.commands.options import OptionGroup, is_given, renamed_option, take_renamed
from replay.deploy.pd_flow import parse_topology
from replay.runtime.startup import START_LIMIT_S
from replay.vllm.options import DEFAULT_VENV, ENGINES, PRODUCERS, VllmOptions

MAX_WINDOW_LINES = 10  # idle windows listed at the end without --all-windows
CALIBRATION_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
DEPLOYMENT_CHOICE = click.Choice(sorted(DEPLOYMENT_PRESETS))

PLOT_SUFFIX = ".png"


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputFiles:
    """The files a replay writes once it has a verdict (None: not written)."""

    report: Path | None = None  # the machine-readable report (JSON)
    requests: Path | None = None  # one JSON line per request
    plot: Path | None = None  # a PNG of blocks used over time
    series: Path | None = None  # the plot's time series as CSV

    def given(self) -> list[tuple[str, Path]]:
        """(--flag, path) of each file asked for."""
        return [
            (f"--{f.name}", getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        ]

    def check(self) -> None:
        """A ValueError naming the first file that could not be written, before a run
        that may take hours; a write can still fail later (a full disk: /dev/full)."""
        for flag, path in self.given():
            why = unwritable(path)
            if why is not None:
                raise ValueError(f"{flag} {path}: {why}")
        if self.plot is not None and self.plot.suffix.lower() != PLOT_SUFFIX:
            raise ValueError(f"--plot {self.plot}: the plot is a PNG; name the file *{PLOT_SUFFIX}")
        paths = [path.resolve() for _, path in self.given()]
        if len(set(paths)) < len(paths):
            raise ValueError("--report/--requests/--plot/--series: two outputs name the same file")


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be opened for writing, or None."""
    if path.is_dir():
        return "is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else "not writable"
    parent = path.parent
    if not parent.is_dir():
        return f"no such directory: {parent}"
    return (
        None if os.access(parent, os.W_OK | os.X_OK) else f"the directory {parent} is not writable"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Display:
    """What the terminal shows while and after a replay runs."""

    live: bool = True  # the live dashboard (else only the final summary)
    max_window_lines: int | None = 10  # idle windows listed at the end (None: all)
    latency_block: bool = False  # vllm bench's 25-line latency block, not the compact lines
    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)  # --metric-percentiles


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
        """HttpTargetOptions for --target http://...; None for other targets (which refuse
        the HTTP options)."""
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
            "P's and D's; NAME names the engine; no path: its /metrics); each is scraped once "
            "before the first request (a failure: exit 2). Default: a proxy's upstreams on the "
            "target's host, else the target's own /metrics when it has a KV-usage metric. With "
            '--prometheus: a label selector, [NAME=]{label="value",...}.',
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
    build=lambda **values: OutputFiles(**values),
)


def _display(live: bool, all_windows: bool, latency_block: bool, metric_percentiles: str):
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """--deployment and --calibration: engine sizes like a real deployment's, step costs
    measured."""

    deployment: str | None  # a preset's name (engine/profiles.py)
    calibration_path: Path | None


def _sizing(
    deployment: str | None,
    profile: str | None,
    calibration_path: Path | None,
    cost_profile: Path | None,
) -> Sizing:
    return Sizing(
        deployment=take_renamed("--profile", "--deployment", profile, deployment),
        calibration_path=take_renamed(
            "--cost-profile", "--calibration", cost_profile, calibration_path
        ),
    )


SIZING = OptionGroup(
    "Engine",
    "sizing",
    (
        click.option(
            "--deployment",
            type=DEPLOYMENT_CHOICE,
            default=None,
            help=f"Size the engines like a real deployment (KV blocks from GPU memory as "
            f"vLLM does, max_model_len, batch limits); explicit size options win "
            f"[default: {DEFAULT_VIRTUAL_DEPLOYMENT} with --clock virtual, none with the "
            f"wall clock].",
        ),
        renamed_option("--profile", "--deployment", "deployment", type=DEPLOYMENT_CHOICE),
        click.option(
            "--calibration",
            "calibration_path",
            default=None,
            type=CALIBRATION_FILE,
            help="Step costs measured by `kvdrain calibrate`: the virtual clock's, and the "
            "wall clock's forecast of its idle windows.",
        ),
        renamed_option(
            "--cost-profile", "--calibration", "calibration_path", type=CALIBRATION_FILE
        ),
    ),
    build=_sizing,
)


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
    vllm_producer: str = "serve"

    def options(self, topology: str, start_limit_s: float = START_LIMIT_S) -> VllmOptions | None:
        """VllmOptions for --engine vllm; None for --engine kvdrain (vLLM options refused)."""
        names = (
            "vllm_venv",
            "vllm_model",
            "vllm_args",
            "vllm_env",
            "vllm_start_timeout",
            "vllm_producer",
        )
        if self.engine == "kvdrain":
            extra = next((n for n in names if is_given(n)), None)
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
        if self.vllm_producer == "inproc" and parse_topology(topology)[0] == 0:
            raise click.UsageError(
                f"--vllm-producer inproc: needs a P/D topology (pd, NpMd), not {topology}"
            )
        try:
            return VllmOptions(
                venv=self.vllm_venv,
                topology=topology,
                model=self.vllm_model,
                args=tuple(self.vllm_args),
                env=tuple(pairs),
                start_limit_s=self._start_limit(start_limit_s),
                producer=self.vllm_producer,
            )
        except ValueError as e:
            raise click.UsageError(str(e)) from None

    def _start_limit(self, start_limit_s: float) -> float:
        if self.vllm_start_timeout is None:
            return start_limit_s
        if is_given("start_limit_s"):  # as take_renamed refuses a renamed flag's pair
            raise click.UsageError(
                "--vllm-start-timeout: the old name of --start-limit; give --start-limit alone"
            )
        click.echo("kvdrain: --vllm-start-timeout is deprecated, use --start-limit", err=True)
        return self.vllm_start_timeout


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
        click.option(
            "--vllm-producer",
            type=click.Choice(PRODUCERS),
            default="serve",
            show_default=True,
            help="With --engine vllm and a P/D topology: what runs each P. serve: `vllm "
            "serve`; inproc: vLLM's LLM class (VLLM_ENABLE_V1_MULTIPROCESSING=0) in a "
            "driver kvdrain ships, serving the P leg and its scheduler's KV usage over HTTP.",
        ),
    ),
    build=lambda **values: EngineChoice(**values),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """Everything `kvdrain replay` was given: each group as its dataclass, and which
    options were set on the command line (defaults and explicit values mean different
    things next to a recording, a --target or --engine vllm)."""

    trace: Path
    clock: str
    display: Display
    trace_input: TraceInput
    engines: Engines
    sizing: Sizing
    shaping: object  # replay/trace/shaping.py ShapingOptions
    verification: Verification
    target: Target
    outputs: OutputFiles
    auth: object | None  # replay/serve/auth.py AuthOptions
    engine_choice: EngineChoice
    given: frozenset[str]
