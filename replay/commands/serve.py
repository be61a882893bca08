"""`kvdrain serve`: the engines serving clients until stopped. Runs in: frontend process."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import click

from engine.config import MODEL_PRESETS, EngineConfig, KVTransferConfig
from engine.proc.client import EngineDeadError
from replay.commands.groups import Engines, require_torch
from replay.commands.terminal import NoView, print_error
from replay.deploy.topology import start_topology
from replay.runtime.startup import StartupStarved
from replay.serve.messages import ServeInfo
from replay.verify.verdict import (
    EXIT_FAULT,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
)

if TYPE_CHECKING:
    from replay.serve.auth import AuthOptions


def serve_main(
    engines: Engines,
    address: str,
    http_address: str | None,
    api_key: str | None,
    record_path: Path | None,
    live: bool,
    auth: AuthOptions | None,
    console,
) -> int:
    """`kvdrain serve`: the exit status (0 when stopped by Ctrl-C or `q`, 143 by SIGTERM)."""
    engines.check_preset()
    require_torch(engines.config.runner)
    http = None
    if http_address is not None:
        from replay.serve.fronts import HttpServe, parse_http_address
        from replay.serve.http_front import HttpFrontOptions

        try:
            host, port = parse_http_address(http_address)
            http = HttpServe(
                HttpFrontOptions(host, port, api_key),
                f"kvdrain/{engines.model}",
                bool(auth is not None and auth.insecure),
            )
        except ValueError as e:  # a bad address, or CredentialError
            raise click.UsageError(str(e)) from None
    elif api_key is not None:
        raise click.UsageError("--api-key: only with --http")
    return run_serve(
        engines.config,
        engines.kv,
        engines.topology,
        address,
        record_path,
        live,
        console,
        http,
        auth,
        policy=engines.router,
    )


class _StopFlag:
    """Set by SIGTERM (Ctrl-C raises KeyboardInterrupt as usual)."""

    def __init__(self) -> None:
        self.stop = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.stop = True

    def __call__(self) -> bool:
        return self.stop


def run_serve(
    engine: EngineConfig,
    kv: KVTransferConfig,
    topology: str,
    address: str,
    record: Path | None,
    live: bool,
    console,
    http=None,
    auth: AuthOptions | None = None,
    policy: str = "round-robin",
) -> int:
    """http: replay/serve/fronts.py HttpServe, to serve OpenAI-compatible HTTP beside zmq;
    auth: the credentials clients must give (replay/serve/auth.py)."""
    from replay.serve.auth import AuthOptions
    from replay.serve.server import ServeError, ServeOptions, Server, open_front, recording_metadata
    from replay.ui.dashboard import DashboardState
    from replay.ui.monitor import ServeMonitor
    from replay.ui.tui import LiveView

    stop = _StopFlag()
    options = ServeOptions(address, record, engine.max_model_len, auth or AuthOptions())
    try:  # the client socket and --record first: a bad one is an error before any engine starts
        front = open_front(
            options, recording_metadata(topology, engine.liveness, engine.block_size)
        )
    except ServeError as e:
        print_error(console, e)
        return EXIT_USAGE
    for warning in front.warnings:
        console.print(f"[bold red]{warning}[/]", highlight=False, soft_wrap=True)
    try:
        if http is not None:
            http.bind()
    except OSError as e:
        front.close()
        why = os.strerror(e.errno) if e.errno else str(e)
        print_error(console, f"--http {http.options.host}:{http.options.port}: {why}")
        return EXIT_USAGE
    try:
        router = start_topology(engine, kv, topology, router=policy)
    except (EngineDeadError, StartupStarved) as e:  # its start-up judged: one line
        front.close()
        http is None or http.close()
        starved = isinstance(e, StartupStarved)
        print_error(console, f"{'inconclusive' if starved else 'fault'}: {e}")
        return EXIT_INCONCLUSIVE if starved else EXIT_FAULT
    except BaseException:
        front.close()
        http is None or http.close()
        raise
    try:
        info = ServeInfo(
            router.engines,
            topology,
            engine.liveness,
            router.vocab_size,
            engine.block_size,
            engine.runner,
            engine.max_model_len,
            router.num_blocks,
            _preset_name(engine),
        )
        shared = router if http is None else http.share(router)
        server = Server(shared, options, info, front)
    except Exception:
        front.close()
        router.shutdown()
        raise
    print(
        f"kvdrain serve: {topology} topology, liveness {engine.liveness}, listening on "
        f"{server.address}",
        flush=True,
    )
    state = DashboardState(
        title=f"kvdrain serve {server.address}", server=f"{topology}  liveness {engine.liveness}"
    )
    view = LiveView(state, console) if live else NoView(console)
    monitor = ServeMonitor(state, view, http_url=lambda: getattr(http, "url", None))
    try:
        with view:
            if http is None:
                server.serve_forever(monitor.on_tick, lambda: stop() or view.quit_requested)
            else:
                http.run(
                    server, engine, topology, monitor.on_tick, lambda: stop() or view.quit_requested
                )
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        router.shutdown()
    over_http = "" if http is None else f" ({http.num_requests} over HTTP)"
    print(
        f"kvdrain serve: stopped after {server.num_requests + (http.num_requests if http else 0)} "
        f"requests{over_http}",
        flush=True,
    )
    return EXIT_TERMINATED if stop() else EXIT_OK  # SIGTERM: 128 + 15, as the verdict table says


def _preset_name(engine: EngineConfig) -> str:
    return next((name for name, m in MODEL_PRESETS.items() if m == engine.model), "custom")
