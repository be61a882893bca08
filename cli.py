"""The kvdrain command line: thin click commands that parse, build configs and delegate. Runs in: frontend process."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from replay.deploy.balance import ROUTER_POLICIES
from replay.deploy.routing import TOPOLOGIES, engine_roles
from engine.config import (DEVICES, KV_LOAD_FAILURE_POLICIES, LIVENESS_POLICIES, MODEL_PRESETS,
                           RUNNERS, TRANSPORTS, EngineConfig, KVTransferConfig)
from click.core import ParameterSource

from engine.profiles import DEFAULT_VIRTUAL_PROFILE, PROFILES
from replay.trace.reader import FORMATS

EXAMPLE = Path(__file__).resolve().parent / "examples" / "pd_idle.jsonl"
MAX_WINDOW_LINES = 10  # idle windows listed at the end without --all-windows
# replay/pipeline.py's CLOCKS (tests/e2e/test_startup.py checks they agree), named here so that
# importing cli imports no replay machinery: every engine and connector-worker process
# re-runs the `kvdrain` script (multiprocessing's spawn imports the parent's main file).
CLOCKS = ("wall", "virtual")
CPU_NUM_BLOCKS = 512  # --num-blocks unless the pool is sized from GPU memory
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, for all of a topology's engines together


def _build_configs(o: dict) -> tuple[EngineConfig, KVTransferConfig]:
    """EngineConfig and KVTransferConfig from the shared options; bad values -> usage error."""
    try:
        engine = EngineConfig(
            num_blocks=o["num_blocks"] or CPU_NUM_BLOCKS, gpu_memory_utilization=_gpu_memory_utilization(o),
            block_size=o["block_size"], max_num_seqs=o["max_num_seqs"],
            max_num_batched_tokens=o["max_num_batched_tokens"], max_model_len=o["max_model_len"],
            liveness=o["liveness"], kv_load_failure_policy=o["kv_load_failure_policy"],
            runner=o["runner"], device=o["device"], model=_model_preset(o["model"]))
        kv = KVTransferConfig(transport=o["transport"], kv_lease_s=o["kv_lease_s"],
                              pull_delay_ms=o["pull_delay_ms"], drop_read_done=o["drop_read_done"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return engine, kv


def _gpu_memory_utilization(o: dict) -> float | None:
    """None with --num-blocks (vLLM's num_gpu_blocks_override); else each engine's share:
    kvdrain puts all of a topology's engines on one GPU, as `vllm serve` twice would need."""
    if o["num_blocks"] is not None:
        return None
    return o["gpu_memory_utilization"] or GPU_MEMORY_UTILIZATION / len(engine_roles(o["topology"]))


def _model_preset(name: str):
    if name not in MODEL_PRESETS:
        raise click.UsageError(f"--model: {name!r} is not a preset ({', '.join(sorted(MODEL_PRESETS))});"
                               f" a served model's name goes with --target http:// only")
    return MODEL_PRESETS[name]


ENGINE_OPTIONS = [
    click.option("--topology", type=click.Choice(TOPOLOGIES), default="pd", show_default=True,
                 help="pd: a prefill and a decode engine with connectors; single: one engine."),
    click.option("--liveness", type=click.Choice(LIVENESS_POLICIES), default="event", show_default=True,
                 help="Engine loop: legacy (the pre-#43433 leak), poll (vLLM's 1 ms fix), event."),
    click.option("--runner", type=click.Choice(RUNNERS), default="torch", show_default=True,
                 help="torch: the real model; mock: deterministic tokens, no torch work."),
    click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True),
    click.option("--model", default="tiny", show_default=True,
                 help=f"Model preset ({', '.join(sorted(MODEL_PRESETS))}); with --target http:// "
                      f"the served model's name (default: the first /v1/models lists)."),
    click.option("--num-blocks", type=click.IntRange(2), default=None,
                 help=f"KV blocks per engine, the null block included [default: {CPU_NUM_BLOCKS}; "
                      f"the torch runner on CUDA sizes the pool from GPU memory as vLLM does]."),
    click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
                 help=f"The torch runner on CUDA without --num-blocks: the share of the GPU's "
                      f"memory each engine may use, KV cache included (vLLM's flag) [default: "
                      f"{GPU_MEMORY_UTILIZATION} shared by the engines, so {GPU_MEMORY_UTILIZATION / 2} "
                      f"each for pd]."),
    click.option("--block-size", type=click.IntRange(1), default=16, show_default=True),
    click.option("--max-num-seqs", type=click.IntRange(1), default=64, show_default=True),
    click.option("--max-num-batched-tokens", type=click.IntRange(1), default=2048, show_default=True),
    click.option("--max-model-len", type=click.IntRange(2), default=4096, show_default=True),
    click.option("--transport", type=click.Choice(TRANSPORTS), default="shm", show_default=True,
                 help="How the decode side pulls blocks: shared memory or bytes over ZMQ."),
    click.option("--kv-lease-s", type=click.FloatRange(min=0, min_open=True), default=30.0,
                 show_default=True, help="P's lease on an unread request's blocks (vLLM 0.32 "
                 "NIXL's kv_lease_duration): D's heartbeats extend it while D waits; P reaps "
                 "it only when it steps."),
    click.option("--pull-delay-ms", type=click.FloatRange(min=0), default=0.0, show_default=True,
                 help="D waits this long before reading (a fault knob)."),
    click.option("--drop-read-done", is_flag=True, help="P never hears 'read done'; only the lease frees."),
    click.option("--kv-load-failure-policy", type=click.Choice(KV_LOAD_FAILURE_POLICIES),
                 default=EngineConfig().kv_load_failure_policy, show_default=True,
                 help="A failed remote load: fail the request (vLLM 0.32's default) or recompute it."),
]


def engine_options(func):
    for option in reversed(ENGINE_OPTIONS):
        func = option(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdrain")
def cli() -> None:
    """kvdrain: replay traces against a miniature vLLM v1 engine and find KV-block leaks.

    \b
    kvdrain replay examples/pd_idle.jsonl            # live view, real processes
    kvdrain replay TRACE --clock virtual --liveness legacy
    kvdrain serve --record traffic.jsonl             # then: kvdrain top --connect ADDR
    kvdrain inspect traces/AzureLLMInferenceTrace_code.csv
    """


@cli.command(name="inspect")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Trace format (default: detected).")
@click.option("--idle-threshold", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="List gaps between arrivals at least this long (seconds).")
def inspect_cmd(trace: Path, fmt: str | None, idle_threshold: float) -> None:
    """What TRACE holds: format, requests, duration, rate, tokens, idle gaps, prefix reuse.

    \b
    Example: kvdrain inspect examples/pd_idle.jsonl --idle-threshold 2
    """
    from replay.trace.inspect import format_inspection, inspect_trace
    from replay.trace.reader import TraceError
    try:
        for line in format_inspection(inspect_trace(trace, fmt, idle_threshold)):
            click.echo(line)
    except TraceError as e:
        raise click.UsageError(str(e)) from None


SHAPING_OPTIONS = [
    click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
                 help="Trace format (default: detected from the content)."),
    click.option("--skip-bad-lines", is_flag=True, help="Count bad lines instead of stopping."),
    click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True),
    click.option("--start", type=float, default=None, help="Trace window start (trace seconds)."),
    click.option("--end", type=float, default=None, help="Trace window end (trace seconds)."),
    click.option("--max-requests", type=click.IntRange(1), default=None),
    click.option("--max-gap", type=click.FloatRange(min=0), default=None,
                 help="Cap idle gaps between arrivals to this many seconds."),
    click.option("--insert-idle", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Insert this many seconds of idle (with --insert-idle-every or --insert-idle-at)."),
    click.option("--insert-idle-every", type=click.IntRange(1), default=None, help="... every N requests."),
    click.option("--insert-idle-at", type=float, multiple=True, help="... at these trace times."),
    click.option("--scale-tokens", type=click.FloatRange(min=0, min_open=True), default=1.0,
                 show_default=True, help="Multiply prompt and output lengths (shrink for a CPU)."),
]


AUTH_OPTIONS = [
    click.option("--curve-keys", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="CURVE keys made by `kvdrain keys DIR`: required to serve beyond loopback; "
                      "a client needs client.key_secret and server.key from it."),
    click.option("--token", envvar="KVDRAIN_TOKEN", default=None,
                 help="A shared token every client must give (loopback; KVDRAIN_TOKEN keeps it "
                      "out of `ps`)."),
]


def auth_options(func):
    for option in reversed(AUTH_OPTIONS):
        func = option(func)
    return func


def _auth(options: dict, insecure: bool = False):
    """AuthOptions from --curve-keys / --token (popped from options); None if neither."""
    from replay.live.auth import AuthError, AuthOptions
    curve_keys, token = options.pop("curve_keys"), options.pop("token")
    if curve_keys is None and token is None and not insecure:
        return None
    try:
        return AuthOptions(curve_keys, token, insecure)
    except AuthError as e:
        raise click.UsageError(str(e)) from None


def shaping_options(func):
    for option in reversed(SHAPING_OPTIONS):
        func = option(func)
    return func


@cli.command(name="replay")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--clock", type=click.Choice(CLOCKS), default="wall", show_default=True,
              help="wall: real processes in real time; virtual: in-process, deterministic, fast "
                   "(always the mock runner, with a step-cost and transfer-latency model).")
@engine_options
@shaping_options
@click.option("--idle-threshold", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="A gap with nothing in flight at least this long is an idle window (s).")
@click.option("--drain-deadline", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Every engine must hold no blocks this long into an idle window (s).")
@click.option("--snapshot-tolerance", type=click.IntRange(0), default=None,
              help="Blocks of slack when matching recorded snapshots (default: 0 virtual, 2 wall).")
@click.option("--tail", "tail_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds observed after the last request (default: covers the drain deadline).")
@click.option("--target", default=None,
              help="Replay against a running `kvdrain serve` at ADDRESS (tcp://...), or any "
                   "OpenAI-compatible server at http://HOST:PORT (vLLM, SGLang, a P/D proxy).")
@click.option("--metrics", "metrics_urls", multiple=True, metavar="[NAME=]URL",
              help="With --target http://: a Prometheus URL to scrape for KV usage (repeat for "
                   "P's and D's; NAME names the engine).")
@click.option("--prompt-format", type=click.Choice(["ids", "text"]), default="ids", show_default=True,
              help="With --target http://: prompts as token ids, or as kvdrain's word-tokenizer text.")
@click.option("--scrape-interval", type=click.FloatRange(min=0, min_open=True), default=0.1,
              show_default=True, help="With --target http://: seconds between scrapes.")
@click.option("--api-key", default=None, help="With --target http://: sent as a Bearer token.")
@click.option("--vocab-size", type=click.IntRange(1), default=None,
              help="With --target http://: the model's vocabulary size, when the server does not "
                   "say it (kvdrain's /v1/models and vLLM's /tokenize over kvdrain's words do).")
@click.option("--cost-profile", "cost_profile_path", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --clock virtual: step costs measured by `kvdrain calibrate`.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the machine-readable report (JSON).")
@click.option("--requests", "requests_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write one JSON line per request.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG of blocks used over time, idle windows shaded.")
@click.option("--series", "series_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the plot's time series (every engine sample) as CSV.")
@click.option("--profile", "profile_name", type=click.Choice(sorted(PROFILES)), default=None,
              help=f"Size the engines like a real deployment (KV blocks from GPU memory as vLLM "
                   f"does, max_model_len, batch limits); explicit size options win. Default: "
                   f"{DEFAULT_VIRTUAL_PROFILE} with --clock virtual, none with the wall clock.")
@click.option("--min-coverage", type=click.FloatRange(0, 1), default=None,
              help="Accept a run that observed at least this share of its expected idle windows "
                   "(0-1), every observed one drained and the rest lost to the engines' lag: "
                   "exit 0, said as partial coverage. Default: every expected window is needed.")
@click.option("--allow-ignored", is_flag=True,
              help="Do not call the run inconclusive when over 1% of requests were ignored "
                   "(prompt over max_model_len, or never fits the pool); they are still counted.")
@click.option("--check-outputs/--no-check-outputs", default=None,
              help="Hold every request's output against what a single engine generates for "
                   "its prompt; a difference (corrupt KV) is a violation. Default: on for a "
                   "local wall replay with the mock runner, where it is cheap.")
@click.option("--all-windows", is_flag=True, help="List every idle window at the end (default: "
              "the first few and a count).")
@click.option("--explain", is_flag=True, help="Print what the verdicts, columns and units mean.")
@click.option("--live/--no-live", default=True, show_default=True, help="Show the live dashboard.")
@auth_options
def replay_cmd(trace: Path, clock: str, idle_threshold: float, drain_deadline: float,
               snapshot_tolerance: int | None, tail_s: float | None, target: str | None,
               report_path: Path | None, requests_path: Path | None, plot_path: Path | None,
               series_path: Path | None, profile_name: str | None, allow_ignored: bool,
               check_outputs: bool | None, all_windows: bool, explain: bool, live: bool, metrics_urls: tuple[str, ...], prompt_format: str,
               scrape_interval: float, api_key: str | None, cost_profile_path: Path | None,
               **options) -> None:
    """Replay TRACE and verify every engine's KV blocks drain in idle periods.

    \b
    Exit status: 0 verified, 1 a violation, 2 bad usage, input or an unreachable
    target, 3 inconclusive (an expected idle window not observed, over 1% of requests
    ignored, KV usage not observable), 4 an engine or connector-worker fault,
    130 Ctrl-C, 143 SIGTERM (--explain says more).
    Example: kvdrain replay examples/pd_idle.jsonl --liveness legacy --report out.json
             kvdrain replay TRACE --target http://HOST:8000 --metrics P=http://P:8100/metrics
    """
    from replay.commands import ReportPaths, replay_main
    from replay.pipeline import ReplayConfig
    from replay.trace.shaping import ShapingOptions
    from replay.verify.rules import VerifyOptions
    target = _normalize_target(target, clock)
    http = _http_target(target, metrics_urls, prompt_format, scrape_interval, api_key, options)
    recorded = _adopt_recording(trace, options) if target is None else set()
    engine, kv = _build_configs(options)
    engine = _apply_profile(engine, profile_name or (DEFAULT_VIRTUAL_PROFILE if clock == "virtual"
                                                     else None), recorded)
    try:
        config = ReplayConfig(
            trace=trace, fmt=options["fmt"], skip_bad_lines=options["skip_bad_lines"], clock=clock,
            topology=options["topology"], engine=engine, kv=kv, tail_s=tail_s, target=target, http=http,
            shaping=ShapingOptions(
                speedup=options["speedup"], start=options["start"], end=options["end"],
                max_requests=options["max_requests"], max_gap=options["max_gap"],
                insert_idle=options["insert_idle"], insert_idle_every=options["insert_idle_every"],
                insert_idle_at=tuple(options["insert_idle_at"]), scale_tokens=options["scale_tokens"]),
            verify=VerifyOptions(idle_threshold, drain_deadline,
                                 snapshot_tolerance if snapshot_tolerance is not None
                                 else (0 if clock == "virtual" else 2), allow_ignored=allow_ignored,
                                 min_coverage=options.pop("min_coverage")),
            cost_profile=_cost_profile(cost_profile_path), target_auth=_target_auth(options, target),
            check_outputs=check_outputs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    paths = ReportPaths(report_path, requests_path, plot_path, series_path, explain,
                        None if all_windows else MAX_WINDOW_LINES)
    sys.exit(replay_main(config, paths, live, Console()))


# Explicit engine options that a running server ignores: refused with --target.
SERVER_SIDE = ("topology", "liveness", "runner", "device", "model", "num_blocks",
               "gpu_memory_utilization", "block_size",
               "max_num_seqs", "max_num_batched_tokens", "max_model_len", "transport", "kv_lease_s",
               "kv_expiry_s", "pull_delay_ms", "drop_read_done", "kv_load_failure_policy",
               "profile_name")


def _normalize_target(target: str | None, clock: str) -> str | None:
    """tcp://, ipc:// or http(s):// as given; a plain HOST:PORT means tcp://. Options set on
    the command line that only the server's engines could honour are refused."""
    if target is None:
        return None
    if clock == "virtual":
        raise click.UsageError("--target: replays against a running server in real time; "
                               "not with --clock virtual")
    if "://" not in target:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise click.UsageError(f"--target: {target!r} is not tcp://HOST:PORT, HOST:PORT, "
                                   f"ipc://PATH or http://HOST:PORT")
        target = f"tcp://{target}"
    elif not target.startswith(("tcp://", "ipc://", "http://", "https://")):
        raise click.UsageError(f"--target: {target!r}: the scheme must be tcp, ipc, http or https")
    ctx = click.get_current_context()
    explicit = [name for name in SERVER_SIDE if name in ctx.params
                and ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                                       ParameterSource.ENVIRONMENT)
                and not (name == "model" and target.startswith("http"))]
    if explicit:
        flag = "--profile" if explicit[0] == "profile_name" else "--" + explicit[0].replace("_", "-")
        raise click.UsageError(f"{flag}: does not apply with --target: the server runs its own "
                               f"engines (set it on `kvdrain serve`); the report records the "
                               f"server's own configuration")
    return target


def _adopt_recording(trace: Path, options: dict) -> set[str]:
    """A recording's engine config (its header: replay/live/recorder.py) into `options`
    where none was given; the names adopted. A conflicting explicit option: usage error."""
    from replay.live.recorder import adopt_recorded
    from replay.trace.reader import TraceError, read_trace
    from replay.trace.records import TraceHeader
    try:
        first = next(iter(read_trace(trace, options["fmt"])), None)
    except (TraceError, OSError, ValueError):
        return set()  # the replay reports it
    if not isinstance(first, TraceHeader):
        return set()
    ctx = click.get_current_context()
    explicit = {k for k in options if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
    try:
        adopted = adopt_recorded(first.metadata, options, explicit)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    options.update(adopted)
    return set(adopted)


def _apply_profile(engine: EngineConfig, name: str | None,
                   recorded: set[str] = frozenset()) -> EngineConfig:
    """The profile's sizes, except where a size option was given on the command line (or
    taken from the recording replayed)."""
    if name is None:
        return engine
    ctx = click.get_current_context()
    keep = frozenset(k for k in PROFILES[name].sizes()
                     if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT or k in recorded)
    try:
        return PROFILES[name].apply(engine, keep)
    except ValueError as e:
        raise click.UsageError(f"--profile {name}: {e}") from None


def _http_target(target: str | None, metrics_urls: tuple[str, ...], prompt_format: str,
                 scrape_interval: float, api_key: str | None, options: dict):
    """HttpTargetOptions for --target http://...; None for other targets (HTTP options refused)."""
    vocab_size = options.pop("vocab_size")
    if target is None or not target.startswith(("http://", "https://")):
        given = [n for n, v in (("--metrics", metrics_urls), ("--api-key", api_key),
                                ("--vocab-size", vocab_size)) if v]
        if given:
            raise click.UsageError(f"{given[0]}: only with --target http://")
        return None
    from replay.http.client import HttpTargetOptions
    from replay.http.scrape import MetricsSource
    source = click.get_current_context().get_parameter_source("model")
    served = options["model"] if source is not click.core.ParameterSource.DEFAULT else None
    options["model"] = "tiny"  # the engine options do not apply to someone else's server
    try:
        return HttpTargetOptions(target, tuple(MetricsSource.parse(m) for m in metrics_urls),
                                 served, prompt_format, scrape_interval, api_key, vocab_size=vocab_size)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@cli.command(name="serve")
@engine_options
@click.option("--address", default="tcp://127.0.0.1:0", show_default=True,
              help="Where clients connect (port 0: any free port, printed at start-up).")
@click.option("--record", "record_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Record the requests received and idle-time block counts as a kvdrain trace.")
@click.option("--live/--no-live", default=True, show_default=True, help="Show the live dashboard.")
@click.option("--http", "http_address", default=None, metavar="[HOST:]PORT",
              help="Also serve OpenAI-compatible HTTP (/v1/completions, /v1/models, /health, "
                   "/metrics) here; host 127.0.0.1 by default, port 0 picks a free one.")
@click.option("--api-key", default=None, help="With --http: require 'Authorization: Bearer KEY' on /v1.")
@auth_options
@click.option("--insecure", is_flag=True,
              help="Serve beyond loopback without --curve-keys (anyone who reaches it may submit work).")
def serve_cmd(address: str, record_path: Path | None, live: bool, http_address: str | None,
              api_key: str | None, **options) -> None:
    """Start the engines and accept requests from clients until Ctrl-C.

    \b
    Example: kvdrain serve --liveness legacy --record traffic.jsonl
             kvdrain replay examples/pd_idle.jsonl --target tcp://127.0.0.1:PORT
             kvdrain top --connect tcp://127.0.0.1:PORT
             kvdrain serve --http 8000   (then --target http://127.0.0.1:8000)
    """
    from replay.commands import serve_main
    engine, kv = _build_configs(options)
    http = None
    if http_address is not None:
        from replay.http.shared_serve import HttpServe, parse_http_address
        from replay.http.server import HttpOptions
        try:
            host, port = parse_http_address(http_address)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        http = HttpServe(HttpOptions(host, port, api_key), f"kvdrain/{options['model']}")
    elif api_key is not None:
        raise click.UsageError("--api-key: only with --http")
    auth = _auth(options, options.pop("insecure"))
    sys.exit(serve_main(engine, kv, options["topology"], address, record_path, live, Console(), http,
                        auth))


def _target_auth(options: dict, target: str | None):
    """--curve-keys / --token for --target of a kvdrain serve (refused anywhere else)."""
    auth = _auth(options)
    if auth is not None and (target is None or target.startswith(("http://", "https://"))):
        raise click.UsageError("--curve-keys/--token: only with --target of a kvdrain serve "
                               "(an HTTP server takes --api-key)")
    return auth


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
    from replay.live.auth import AuthError, generate_keys
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
@click.option("--runner", type=click.Choice(RUNNERS), default="torch", show_default=True,
              help="torch: the real model runner; mock: the engine core's own step cost.")
@click.option("--model", type=click.Choice(sorted(MODEL_PRESETS)), default="tiny", show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--reps", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Timed steps per grid point (the median counts).")
@click.option("--loop-overhead/--no-loop-overhead", default=True, show_default=True,
              help="Also time one real engine-core process and add its per-step loop cost.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("cost-profile.json"), show_default=True)
def calibrate_cmd(runner: str, model: str, device: str, reps: int, loop_overhead: bool,
                  output: Path) -> None:
    """Time the runner's steps on this device and write a cost profile for --clock virtual.

    \b
    Example: kvdrain calibrate --runner torch --model tiny -o tiny-cpu.json
             kvdrain replay examples/pd_idle.jsonl --clock virtual --cost-profile tiny-cpu.json
    """
    from replay.live.calibrate import CalibrateOptions, calibrate_main
    try:
        options = CalibrateOptions(runner=runner, model=model, device=device, num_reps=reps,
                                   loop_overhead=loop_overhead)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(calibrate_main(options, output, click.echo))


@cli.command(name="top")
@click.option("--connect", "address", required=True, help="The address a `kvdrain serve` printed.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this long (default: until Ctrl-C).")
@auth_options
def top_cmd(address: str, seconds: float | None, **options) -> None:
    """Attach the live dashboard to a running `kvdrain serve`.

    \b
    Example: kvdrain top --connect tcp://127.0.0.1:5555
    """
    from replay.commands import top_main
    sys.exit(top_main(address, seconds, Console(), _auth(options)))


@cli.command(name="proxy")
@click.option("--prefill", "prefill_urls", multiple=True, required=True, metavar="URL",
              help="A vLLM prefill server (kv_producer), e.g. http://127.0.0.1:8100; repeat for several.")
@click.option("--decode", "decode_urls", multiple=True, required=True, metavar="URL",
              help="A vLLM decode server (kv_consumer); repeat for several.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Where clients connect.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="0: any free port (printed in the 'proxy ready' line).")
@click.option("--api-key", envvar="KVDRAIN_PROXY_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 (env KVDRAIN_PROXY_API_KEY).")
@click.option("--upstream-api-key", envvar="KVDRAIN_UPSTREAM_API_KEY", default=None,
              help="Sent to every server as 'Authorization: Bearer KEY' (env KVDRAIN_UPSTREAM_API_KEY).")
@click.option("--insecure", is_flag=True, help="Listen beyond loopback without --api-key.")
@click.option("--router", type=click.Choice(ROUTER_POLICIES), default="round-robin", show_default=True,
              help="Which P and D take each request: in turn, the fewest in flight, or the P "
                   "the proxy sent the longest prefix of the prompt to (its own table).")
def proxy_cmd(prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], host: str, port: int,
              api_key: str | None, upstream_api_key: str | None, insecure: bool, router: str) -> None:
    """A P/D proxy in front of vLLM servers: prefill on a P, decode on a D (vLLM's protocol).

    \b
    Example: kvdrain proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
             kvdrain replay examples/pd_idle.jsonl --target http://127.0.0.1:8000 \\
                 --metrics P=http://127.0.0.1:8100/metrics --metrics D=http://127.0.0.1:8200/metrics
    """
    from replay.deploy.proxy import ProxyError, ProxyOptions, check_listen, proxy_main
    try:
        options = ProxyOptions(prefill=prefill_urls, decode=decode_urls, host=host, port=port,
                               api_key=api_key, upstream_api_key=upstream_api_key, insecure=insecure,
                               router=router)
        check_listen(options)
    except ProxyError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(proxy_main(options))


if __name__ == "__main__":
    cli()
