"""The option groups several verbs take. Runs in: frontend process.

Each group's options build one dataclass (replay/commands/options.py): the engines to run
(replay, serve), how a trace is read and shaped (replay, inspect), the credentials a serve
asks for or a client gives (serve; replay --target, top --connect).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import click

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
from engine.core.release import (
    DEFAULT_RELEASE,
    OLDEST_RELEASE,
    VllmRelease,
    has_kv_lease,
    is_modelled_release,
    liveness_of,
)
from replay.commands.options import OptionGroup, is_given
from replay.deploy.pd_flow import TOPOLOGY_FORMS, engine_roles, parse_topology
from replay.deploy.placement import ROUTER_POLICIES
from replay.runtime.startup import START_LIMIT_S
from replay.trace.reader import FORMATS

CPU_NUM_BLOCKS = 512  # --num-blocks unless the pool is sized from GPU memory
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, for all of a topology's engines together
DEFAULT_MODEL = "tiny"
PRESETS = ", ".join(sorted(MODEL_PRESETS))
# replay's and inspect's --idle-threshold: a gap of 0 s is no gap
IDLE_THRESHOLD = click.FloatRange(min=0, min_open=True)


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
        if topology == "single" and is_given("router"):
            raise click.UsageError(
                "--router: not with --topology single (one engine takes every "
                "request); routing picks among P and D engines (pd, NpMd)"
            )
        values["vllm_release"], values["liveness"] = release_and_loop(
            values["vllm_release"], values["liveness"], values["kv_lease_s"]
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


def release_and_loop(
    release: VllmRelease | None, liveness: str | None, kv_lease_s: float
) -> tuple[str, str]:
    """--vllm-release and --liveness as EngineConfig takes them: the release's loop
    unless --liveness is given; --kv-lease-s only for a release with a lease."""
    release = release or DEFAULT_RELEASE
    if is_given("kv_lease_s") and not has_kv_lease(release):
        raise click.UsageError(
            f"--kv-lease-s: vLLM {release} has no lease (the lease came in 0.22.0); its P "
            f"frees an unread request's blocks on a fixed fallback timer"
        )
    return str(release), liveness or liveness_of(release)


def _release(ctx: click.Context, param: click.Parameter, value: str | None) -> VllmRelease | None:
    if value is None:
        return None
    try:
        release = VllmRelease.parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if not is_modelled_release(release):
        raise click.BadParameter(
            f"{value!r}: the miniature models vLLM {OLDEST_RELEASE.major}.{OLDEST_RELEASE.minor}"
            f" to {DEFAULT_RELEASE.major}.{DEFAULT_RELEASE.minor}"
        )
    return release


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
                "--vllm-release",
                callback=_release,
                metavar="X.Y",
                default=None,
                help="The vLLM release whose KV lifecycle the engines follow "
                f"({OLDEST_RELEASE.major}.{OLDEST_RELEASE.minor}-{DEFAULT_RELEASE.major}."
                f"{DEFAULT_RELEASE.minor}): its loop, P's hold on an unread request's blocks "
                "(up to 0.21 a 480 s timer read only when P steps, from 0.22 the lease and D's "
                "heartbeats), aborts during a step, D's refusals told to P, the lease reaper "
                f"(docs/lifecycle.md) [default: {DEFAULT_RELEASE.major}.{DEFAULT_RELEASE.minor}].",
            ),
            click.option(
                "--liveness",
                type=click.Choice(LIVENESS_POLICIES),
                default=None,
                help="Engine loop: legacy (the pre-#43433 leak), poll (vLLM's 1 ms fix), event "
                "[default: the release's: legacy up to 0.21, event from 0.22].",
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
                help="P's lease on an unread request's blocks (vLLM 0.22+ "
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


def _shaping(fault: tuple[str, ...], fault_seed: int, **values):
    from replay.trace.fault_shares import FaultShares
    from replay.trace.shaping import ShapingOptions

    return ShapingOptions(**values, faults=FaultShares.parse(fault, fault_seed))


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
        click.option(
            "--fault",
            multiple=True,
            metavar="NAME=SHARE",
            help="Give this share of the requests a fault: drop_decode, reject_decode, "
            "abort_prefill, abort_transfer or abort_decode (repeatable) [default: none].",
        ),
        click.option(
            "--fault-seed",
            type=int,
            default=0,
            show_default=True,
            help="Seed of which requests get each --fault.",
        ),
    ),
    build=_shaping,
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


def require_torch(runner: str) -> None:
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
