"""The KV registration handshake's error paths (connector/agent.py, connector/worker_proc.py)."""

from __future__ import annotations

import time

import pytest

import connector.agent as agent_mod
from engine.config import EngineConfig, KVTransferConfig, ModelConfig
from engine.runner.kv_cache import KVCache


def test_a_kv_cache_the_worker_cannot_map_fails_the_start_at_once(tmp_path, monkeypatch) -> None:
    """A RegisterKVCache whose memory the worker cannot map (here: the segment is gone)
    ends the worker, so the agent says so at once; it used to count a bad message and
    stay silent, and the engine start hung its whole start limit for KVCacheRegistered."""
    config = EngineConfig(
        engine_id="P",
        num_blocks=8,
        start_limit_s=5.0,
        kv_transfer=KVTransferConfig(
            kv_role="kv_producer",
            agent_addr=f"ipc://{tmp_path}/agent",
            kv_addr=f"ipc://{tmp_path}/kv",
        ),
    )
    cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=16)
    handle = cache.handle.to_dict()
    cache.close()  # the owner unlinks the segment: the handle names nothing now
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code .* before KVCacheRegistered"):
        agent_mod.PDConnectorAgent(config, handle)
    assert time.monotonic() - start < 15.0
