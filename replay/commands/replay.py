"""`kvdrain replay`: what its options mean together, then the run. Runs in: frontend process.

A --target or --engine vllm runs engines kvdrain does not size, so engine options set on
the command line are refused there; a recording by `kvdrain serve` gives the engine
config its header holds where no option set it (the run's checking pass reads the header,
replay/pipeline.py); a deployment preset sizes the rest.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import click

from engine.config import EngineConfig
from engine.profiles import DEFAULT_VIRTUAL_DEPLOYMENT, DEPLOYMENT_PRESETS
from replay.commands.groups import REPLAY_ENGINE, Engines, require_torch
from replay.commands.replay_options import SIZING, VLLM_TARGET, ReplayOptions, Target
from replay.commands.replay_run import replay_and_report
from replay.pipeline import ReplayConfig
from replay.trace.records import TraceHeader
from replay.vllm.options import VllmOptions

# Engine options that --engine vllm honours too: the topology it launches, and how long
# each instance may take to start.
VLLM_ENGINE_OPTIONS = ("topology", "start_limit_s")
# Engine options that say what a --target's deployment runs, for the verdict's contract
# (replay/verify/contract.py): taken with --target, not sent to the server.
CONTRACT_OPTIONS = {"vllm_release": "--vllm-release", "kv_lease_s": "--kv-lease-s"}


def replay_main(options: ReplayOptions, console) -> int:
    """`kvdrain replay`: the exit status (replay/verify/verdict.py's table)."""
    config, vllm = replay_config(options)
    if vllm is None:
        adopt = None if config.target is not None else partial(_recorded_config, options)
        return replay_and_report(config, options.outputs, options.display, console, adopt)
    from replay.commands.replay_vllm import vllm_replay_main

    return vllm_replay_main(
        vllm,
        config,
        options.outputs,
        options.display,
        console,
        deadline_given="drain_deadline_s" in options.given,
        threshold_given="idle_threshold_s" in options.given,
    )


def _recorded_config(options: ReplayOptions, header: TraceHeader) -> ReplayConfig:
    return replay_config(options, header)[0]


def replay_config(
    options: ReplayOptions, header: TraceHeader | None = None
) -> tuple[ReplayConfig, VllmOptions | None]:
    """The replay the options ask for, and what --engine vllm launches (None: kvdrain's
    own engines); a click.UsageError for options that do not go together. A local
    replay's trace header (the run's checking pass reads it) may hold a recording's
    engine config."""
    o, given = options, options.given
    target, engines = o.target, o.engines
    vllm = o.engine_choice.options(engines.topology, engines.config.start_limit_s)
    if vllm is not None:
        check_vllm(target, o.clock, given)
        target = replace(target, address=VLLM_TARGET)
    else:
        check_target(target, o.clock, given)
    if o.clock == "wall" and target.address is None:
        require_torch(engines.config.runner)  # only a local wall replay runs the model
    http = target.http_options(engines.model if "model" in given and target.is_http else None)
    if not target.is_http:
        engines.check_preset("; a served model's name goes with --target http:// only")
    recorded: set[str] = set()
    is_serve_recording = False
    if target.address is None and header is not None:
        engines, recorded, is_serve_recording = adopt_recording(header, engines, given)
    engine = apply_deployment(
        engines.config,
        o.sizing.deployment or (DEFAULT_VIRTUAL_DEPLOYMENT if o.clock == "virtual" else None),
        given | recorded,
    )
    if o.auth is not None and (target.address is None or target.is_http):
        raise click.UsageError(
            "--curve-keys/--token: only with --target of a kvdrain serve "
            "(an HTTP server takes --api-key)"
        )
    try:
        config = ReplayConfig(
            trace=o.trace,
            fmt=o.trace_input.fmt,
            skip_bad_lines=o.trace_input.skip_bad_lines,
            clock=o.clock,
            topology=engines.topology,
            router=engines.router,
            engine=engine,
            kv=engines.kv,
            tail_s=o.verification.tail_s,
            target=target.address,
            http=http,
            shaping=o.shaping,
            verify=o.verification.options(o.clock, is_serve_recording),
            calibration=load_calibration(o.sizing.calibration_path),
            target_auth=o.auth,
            check_outputs=o.verification.check_outputs,
            **(served_contract(engines, given) if target.address is not None else {}),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return config, vllm


def check_vllm(target: Target, clock: str, given: frozenset[str]) -> None:
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
        _flag(n)
        for n in [*REPLAY_ENGINE.param_names, "deployment"]
        if n not in VLLM_ENGINE_OPTIONS and n in given
    ]
    if refused:
        raise click.UsageError(
            f"{refused[0]}: not with --engine vllm (kvdrain launches the vLLM servers and "
            f"scrapes them)"
        )


def check_target(target: Target, clock: str, given: frozenset[str]) -> None:
    """--target runs in real time on the server's own engines: engine options set on the
    command line, which only those engines could honour, are refused."""
    if target.address is None:
        return
    if clock == "virtual":
        raise click.UsageError(
            "--target: replays against a running server in real time; not with --clock virtual"
        )
    server_side = [
        n for n in (*REPLAY_ENGINE.param_names, "deployment") if n not in CONTRACT_OPTIONS
    ]
    explicit = [n for n in server_side if n in given and not (n == "model" and target.is_http)]
    if explicit:
        raise click.UsageError(
            f"{_flag(explicit[0])}: does not apply with --target: the server runs its own "
            f"engines (set it on `kvdrain serve`); the report records the "
            f"server's own configuration"
        )


def served_contract(engines: Engines, given: frozenset[str]) -> dict:
    """What --vllm-release and --kv-lease-s say a --target's deployment runs (ReplayConfig's
    served_release, served_lease_s): the verdict's contract, where the server cannot say."""
    out = {}
    if "vllm_release" in given:
        out["served_release"] = (engines.config.vllm_release, CONTRACT_OPTIONS["vllm_release"])
    if "kv_lease_s" in given:
        out["served_lease_s"] = (engines.kv.kv_lease_s, CONTRACT_OPTIONS["kv_lease_s"])
    return out


def _flag(param: str) -> str:
    return {**REPLAY_ENGINE.flags, **SIZING.flags}[param]


def adopt_recording(
    header: TraceHeader, engines: Engines, given: frozenset[str]
) -> tuple[Engines, set[str], bool]:
    """A recording's engine config (its header: replay/serve/recorder.py) where none was
    given on the command line; the names adopted; whether `serve --record` wrote it. A
    conflicting explicit option: usage error."""
    from replay.serve.recorder import SETTLED_KEY, adopt_recorded

    config = engines.config
    current = {
        "num_blocks": config.num_blocks,
        "block_size": config.block_size,
        "liveness": config.liveness,
        "topology": engines.topology,
        "max_model_len": config.max_model_len,
    }
    try:
        adopted = adopt_recorded(header.metadata, current, {k for k in current if k in given})
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
    return engines, set(adopted), SETTLED_KEY in header.metadata


def apply_deployment(engine: EngineConfig, name: str | None, keep: set[str]) -> EngineConfig:
    """The deployment preset's sizes, except those named in `keep` (set on the command
    line, or taken from the recording replayed)."""
    if name is None:
        return engine
    preset = DEPLOYMENT_PRESETS[name]
    kept = frozenset(k for k in preset.sizes() if k in keep)
    try:
        return preset.apply(engine, kept)
    except ValueError as e:
        raise click.UsageError(f"--deployment {name}: {e}") from None


def load_calibration(path: Path | None):
    if path is None:
        return None
    from replay.sim.cost import Calibration

    try:
        return Calibration.load(path)
    except ValueError as e:
        raise click.UsageError(f"--calibration: {e}") from None
