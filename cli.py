"""The kvdrain command line: each verb's options and its one entry. Runs in: frontend process.

A verb's body is its module in replay/commands/ (what its options mean together, and what
it does); option groups that several verbs take are replay/commands/groups.py's, replay's
own replay/commands/replay_options.py's. Importing this module loads no replay machinery:
every engine and connector-worker process re-runs the `kvdrain` script (multiprocessing's
spawn imports the parent's main file).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from engine.config import DEVICES, MODEL_PRESETS, RUNNERS
from replay.commands.groups import (
    DEFAULT_MODEL,
    REPLAY_ENGINE,
    SERVE_ENGINE,
    SERVE_SECURITY,
    SHAPING,
    TRACE,
    client_security,
)
from replay.commands.inspect import DRY_RUN
from replay.commands.options import KvdrainGroup, given_options, titled
from replay.commands.proxy import PROXY_LIMITS
from replay.commands.replay_options import (
    DISPLAY,
    OUTPUTS,
    SIZING,
    TARGET,
    VERIFICATION,
    VLLM,
    ReplayOptions,
)
from replay.deploy.placement import ROUTER_POLICIES
from replay.runtime.clocks import CLOCKS

EXAMPLE = Path(__file__).resolve().parent / "examples" / "pd_idle.jsonl"
TRACE_ARGUMENT = click.argument(
    "trace", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)


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


def _explain(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from replay.commands.explain import explain_main

        ctx.exit(explain_main())


@cli.command(name="replay")
@TRACE_ARGUMENT
@titled(
    "Replay",
    click.option(
        "--clock",
        type=click.Choice(CLOCKS),
        default="wall",
        show_default=True,
        help="wall: real processes in real time; virtual: in-process, deterministic, "
        "fast (always the mock runner, its step costs and transfer latencies simulated).",
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
def replay_cmd(**groups) -> None:
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

    sys.exit(replay_main(ReplayOptions(**groups, given=given_options()), Console()))


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
def serve_cmd(**options) -> None:
    """Start the engines and accept requests from clients until Ctrl-C.

    \b
    Example: kvdrain serve --liveness legacy --record traffic.jsonl
             kvdrain replay examples/pd_idle.jsonl --target tcp://127.0.0.1:PORT
             kvdrain top --connect tcp://127.0.0.1:PORT
             kvdrain serve --http 8000   (then --target http://127.0.0.1:8000)
    """
    from replay.commands.serve import serve_main

    sys.exit(serve_main(**options, console=Console()))


@cli.command(name="inspect")
@TRACE_ARGUMENT
@TRACE
@SHAPING
@DRY_RUN
def inspect_cmd(**options) -> None:
    """What TRACE holds and what `replay` would do with it (a dry run): requests sent and
    dropped by shaping, idle gaps, prompts over max_model_len, how long a wall replay takes.

    \b
    Example: kvdrain inspect examples/pd_idle.jsonl
             kvdrain inspect traces/AzureLLMInferenceTrace_code.csv --speedup 8 --max-gap 20
    """
    from replay.commands.inspect import inspect_main

    sys.exit(inspect_main(**options))


@cli.command(name="explain")
def explain_cmd() -> None:
    """Print what the verdicts, exit statuses, columns and units of a replay mean."""
    from replay.commands.explain import explain_main

    sys.exit(explain_main())


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
    from replay.commands.keys import keys_main

    sys.exit(keys_main(directory))


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
    help="The calibration (JSON).",
)
def calibrate_cmd(**options) -> None:
    """Time the runner's steps on this device and write a calibration for replay --calibration.

    \b
    Example: kvdrain calibrate --runner torch --model tiny -o tiny-cpu.json
             kvdrain replay examples/pd_idle.jsonl --clock virtual --calibration tiny-cpu.json
             kvdrain replay examples/pd_idle.jsonl --calibration tiny-cpu.json  # wall: the forecast
    """
    from replay.commands.calibrate import calibrate_main

    sys.exit(calibrate_main(**options))


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
def top_cmd(**options) -> None:
    """Watch engines live: a `kvdrain serve` (--connect) or any server's metrics (--metrics).

    \b
    Examples:
      kvdrain top --connect tcp://127.0.0.1:5555
      kvdrain top --metrics P=http://127.0.0.1:8100/metrics --metrics D=http://127.0.0.1:8200/metrics
      kvdrain top --prometheus http://127.0.0.1:9090 --metrics '{job="vllm"}'
    """
    from replay.commands.top import top_main

    sys.exit(top_main(**options, console=Console()))


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
def sweep_cmd(**options) -> None:
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
    from replay.commands.sweep import sweep_cli_main

    sys.exit(sweep_cli_main(replay_cmd, console=Console(), **options))


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
def proxy_cmd(**options) -> None:
    """A P/D proxy in front of vLLM servers: prefill on a P, decode on a D (vLLM's protocol).

    \b
    Example: kvdrain proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
             kvdrain replay examples/pd_idle.jsonl --target http://127.0.0.1:8000 \\
                 --metrics P=http://127.0.0.1:8100/metrics --metrics D=http://127.0.0.1:8200/metrics
    """
    from replay.commands.proxy import proxy_main

    sys.exit(proxy_main(**options))


if __name__ == "__main__":
    cli(prog_name="kvdrain")  # `python -m cli` is kvdrain: its usage lines say so, not cli.py
