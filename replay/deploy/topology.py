"""Launching a topology: one engine core per role, each with its connector config. Runs in: frontend process.

engine_roles (replay/deploy/pd_flow.py) names the engines and their kv roles; here each gets
an EngineConfig with its addresses in one private run directory, the engines start in
parallel, and the P/D router is handed their clients. A launch spawns them and returns
at once, so the frontend can prepare (import, forecast) while they start; waiting for them
hands their clients to the router. A failed start leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import replace

from engine.config import EngineConfig, KVTransferConfig
from engine.proc.client import (
    EngineClient,
    EngineDeadError,
    InprocClient,
    MPClient,
    make_run_dir,
    wait_for_output,
)
from replay.deploy.pd_flow import engine_roles
from replay.deploy.pd_router import PDRouter
from replay.deploy.placement import RouterPolicy
from replay.runtime.startup import StartupStarved, StartWatch


def engine_configs(
    base: EngineConfig, kv: KVTransferConfig, topology: str, run_dir: str
) -> list[EngineConfig]:
    """One config per engine, with addresses in the private run directory."""
    return [
        replace(
            base,
            engine_id=name,
            kv_transfer=None
            if role is None
            else replace(
                kv,
                kv_role=role,
                kv_addr=f"ipc://{run_dir}/{name}-kv",
                agent_addr=f"ipc://{run_dir}/{name}-agent",
            ),
        )
        for name, role in engine_roles(topology)
    ]


@contextlib.contextmanager
def spawning_without_main() -> Iterator[None]:
    """Children spawned meanwhile do not re-run this process's main file.

    multiprocessing's spawn imports the parent's __main__ (here the `kvdrain` script, so
    cli, click and rich: ~80 ms of CPU) in every child, for targets defined there. An
    engine core's target and config come from engine/ (and its connector worker's from
    connector/), never from __main__, so each child starts from a bare __main__ instead;
    its own children (the connector workers) then inherit that. Only the process start
    reads sys.modules["__main__"]; it is restored at once."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that land meanwhile are raised again at the end, to the handlers
    there were: a child's start (fork-exec, then its start data down a pipe) is never cut
    in half, which would leave the child printing "EOFError: Ran out of input"."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals go to the main thread only
        return
    caught: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: caught.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)
        for s in caught:
            signal.raise_signal(s)


class TopologyLaunch:
    """A topology's engines, spawned and starting; wait_ready hands them to a PDRouter,
    close shuts down whatever was not handed over (idempotent)."""

    def __init__(
        self,
        base: EngineConfig,
        kv: KVTransferConfig,
        topology: str = "pd",
        inproc: bool = False,
        router: RouterPolicy = "round-robin",
    ) -> None:
        self.base, self.kv, self.topology, self.router = base, kv, topology, router
        self.launched_at = time.monotonic()
        self.run_dir: str | None = make_run_dir()
        self.clients: list[EngineClient] = []
        try:
            for config in engine_configs(base, kv, topology, self.run_dir):
                with signals_deferred():  # a signal lands once the client is ours to close
                    self.clients.append(InprocClient(config) if inproc else self._spawn(config))
        except BaseException:
            self.close()
            raise

    def _spawn(self, config: EngineConfig) -> MPClient:
        with spawning_without_main():
            return MPClient(config, self.run_dir, wait=False)

    def ready_engines(self) -> list[str]:
        """The engines ready so far, without waiting; EngineDeadError if one failed."""
        try:
            return [c.engine_id for c in self.clients if c.poll_ready(0) is not None]
        except BaseException:
            self.close()
            raise

    def wait_ready(
        self,
        on_wait: Callable[[list[str]], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> PDRouter:
        """Every engine's Ready, then a router that owns them (and the run dir). An engine
        slow to start is judged (replay/runtime/startup.py): EngineDeadError for a fault,
        StartupStarved at the start limit; on_note hears an engine found starved."""
        if self.run_dir is None:
            raise RuntimeError("this launch was closed or already handed to a router")
        watch = StartWatch(self.base.start_limit_s, note=on_note)
        for client in self.clients:
            if getattr(client, "pid", None) is not None:
                watch.watch(f"engine {client.engine_id}", client.pid, self.launched_at)
        try:
            wait_all_ready(self.clients, on_wait, watch)
        except BaseException:
            self.close()
            raise
        router, self.clients, self.run_dir = (
            PDRouter(self.clients, self.run_dir, self.topology, self.router),
            [],
            None,
        )
        return router

    def close(self) -> None:
        """Shut down the engines not handed to a router, and remove their run dir."""
        clients, self.clients = self.clients, []
        run_dir, self.run_dir = self.run_dir, None
        with contextlib.ExitStack() as stack:  # every shutdown runs, even if one raises
            if run_dir is not None:
                stack.callback(shutil.rmtree, run_dir, ignore_errors=True)
            for client in clients:
                stack.callback(client.shutdown)

    def __enter__(self) -> TopologyLaunch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_topology(
    base: EngineConfig,
    kv: KVTransferConfig,
    topology: str = "pd",
    inproc: bool = False,
    on_wait: Callable[[list[str]], None] | None = None,
    router: RouterPolicy = "round-robin",
) -> PDRouter:
    """Start every engine (and, through their connectors, the connector workers) and
    wait for them; on_wait (a live view's clock) hears which engines are ready meanwhile."""
    return TopologyLaunch(base, kv, topology, inproc, router).wait_ready(on_wait)


def wait_all_ready(
    clients: list[EngineClient],
    on_wait: Callable[[list[str]], None] | None = None,
    watch: StartWatch | None = None,
) -> None:
    """Every engine's Ready (they start in parallel; each client bounds its own wait);
    while any is starting, on_wait(the engines ready so far) about ten times a second,
    the last time once all are, and the watch judges those still starting."""
    pending = [c for c in clients if c.poll_ready(0) is None]
    while pending:
        wait_for_output(pending, 0.1)
        pending = [c for c in pending if c.poll_ready(0) is None]
        if on_wait is not None:
            on_wait([c.engine_id for c in clients if c not in pending])
        for client in pending if watch is not None else ():
            judge_start(client, watch)


def judge_start(client: EngineClient, watch: StartWatch) -> None:
    """Raise for an engine whose start-up the watch judged: a fault, or starved."""
    judgement = watch.check(f"engine {client.engine_id}")
    if judgement is None:
        return
    if judgement.is_fault:
        raise EngineDeadError(client.engine_id, judgement.cause)
    raise StartupStarved(client.engine_id, judgement.cause)
