"""The P/D connector's factory, named in the engine config. Runs in: engine core, simulator.

KVTransferConfig.kv_connector names it ("connector.factory:make_pd_connector"); the engine core
imports it by name, so engine/ never imports connector/. The simulator builds only its scheduler
role.
"""

from __future__ import annotations

from connector.pd import PDConnector
from engine.config import EngineConfig
from engine.core.kv_connector import KVConnectorAgentBase, KVConnectorBase, KVConnectorRole


def make_pd_connector(
    config: EngineConfig, role: KVConnectorRole, kv_cache_handle: dict | None = None
) -> KVConnectorBase | KVConnectorAgentBase:
    """The scheduler side (PDConnector) or the agent (PDConnectorAgent) of one engine."""
    if role is KVConnectorRole.SCHEDULER:
        return PDConnector(config)
    # zmq, torch and a process: imported only where the worker role is built
    from connector.agent import PDConnectorAgent

    if kv_cache_handle is None:
        raise ValueError("kv_cache_handle: the worker role needs the engine's KV cache handle")
    return PDConnectorAgent(config, kv_cache_handle)
