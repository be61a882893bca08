"""Launching a topology: one engine core per role, each with its connector config. Runs in: frontend process.

engine_roles (connector/routing.py) names the engines and their kv roles; here each gets
an EngineConfig with its addresses in one private run directory, the engines start in
parallel, and the P/D router is handed their clients. A failed start leaves nothing behind.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace

from connector.router import PDRouter
from connector.routing import engine_roles
from engine.client import EngineClient, InprocClient, MPClient, make_run_dir, wait_for_output
from engine.config import EngineConfig, KVTransferConfig


def engine_configs(base: EngineConfig, kv: KVTransferConfig, topology: str,
                   run_dir: str) -> list[EngineConfig]:
    """One config per engine, with addresses in the private run directory."""
    return [replace(base, engine_id=name, kv_transfer=None if role is None else replace(
        kv, kv_role=role, kv_addr=f"ipc://{run_dir}/{name}-kv", agent_addr=f"ipc://{run_dir}/{name}-agent"))
        for name, role in engine_roles(topology)]


def start_topology(base: EngineConfig, kv: KVTransferConfig, topology: str = "pd",
                   inproc: bool = False, on_wait: Callable[[list[str]], None] | None = None) -> PDRouter:
    """Start every engine (and, through their connectors, the connector workers);
    on_wait (a live view's clock) hears which engines are ready while they start."""
    run_dir = make_run_dir()
    clients: list[EngineClient] = []
    try:
        for config in engine_configs(base, kv, topology, run_dir):
            clients.append(InprocClient(config) if inproc else MPClient(config, run_dir, wait=False))
        wait_all_ready(clients, on_wait)
    except BaseException:
        for client in clients:
            client.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return PDRouter(clients, run_dir)


def wait_all_ready(clients: list[EngineClient],
                   on_wait: Callable[[list[str]], None] | None = None) -> None:
    """Every engine's Ready (they start in parallel; each client bounds its own wait);
    on_wait(the engines ready so far) about ten times a second, and once all are."""
    pending = list(clients)
    while pending:
        wait_for_output(pending, 0.1)
        pending = [c for c in pending if c.poll_ready(0) is None]
        if on_wait is not None:
            on_wait([c.engine_id for c in clients if c not in pending])
