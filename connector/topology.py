"""Launching a topology: one engine core per role, each with its connector config. Runs in: frontend process.

engine_roles (connector/routing.py) names the engines and their kv roles; here each gets
an EngineConfig with its addresses in one private run directory, the engines start in
parallel, and the P/D router is handed their clients. A failed start leaves nothing behind.
"""
from __future__ import annotations

import shutil
from dataclasses import replace

from connector.router import PDRouter
from connector.routing import engine_roles
from engine.client import EngineClient, InprocClient, MPClient, make_run_dir
from engine.config import EngineConfig, KVTransferConfig


def engine_configs(base: EngineConfig, kv: KVTransferConfig, topology: str,
                   run_dir: str) -> list[EngineConfig]:
    """One config per engine, with addresses in the private run directory."""
    return [replace(base, engine_id=name, kv_transfer=None if role is None else replace(
        kv, kv_role=role, kv_addr=f"ipc://{run_dir}/{name}-kv", agent_addr=f"ipc://{run_dir}/{name}-agent"))
        for name, role in engine_roles(topology)]


def start_topology(base: EngineConfig, kv: KVTransferConfig, topology: str = "pd",
                   inproc: bool = False) -> PDRouter:
    """Start every engine (and, through their connectors, the connector workers)."""
    run_dir = make_run_dir()
    clients: list[EngineClient] = []
    try:
        for config in engine_configs(base, kv, topology, run_dir):
            clients.append(InprocClient(config) if inproc else MPClient(config, run_dir, wait=False))
        for client in clients:  # the engines start in parallel
            client.wait_ready()
    except BaseException:
        for client in clients:
            client.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return PDRouter(clients, run_dir)
