"""Start-up: which processes import torch, and the KV memory's torch-free byte paths."""
from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

from engine.config import ModelConfig
from engine.kv_cache import KVCache, KVCacheHandle
from tests.mp_utils import mock_tokens, topology

HAS_PROC = os.path.exists("/proc/self/maps")


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc/<pid>/maps")
@pytest.mark.parametrize("runner", ["mock", "torch"])
def test_only_the_torch_runners_engine_cores_load_torch(runner):
    """A P/D topology after a request moved its blocks over shm: the connector workers
    never load torch (CPU memory moves as bytes), the engine cores only for the torch runner."""
    with topology(runner=runner, transport="shm") as h:
        prompt = list(range(1, 19))
        h.add_request("r", prompt, 3)
        result = h.collect({"r"})
        cores = {e: c.ready.pid for e, c in h.clients.items()}
        workers = {e: h.stats(e).counts["connector_worker_pid"] for e in cores}
        assert h.stats("D").counts["num_recved"] == 1  # a real pull ran in D's worker
        torch_in = {f"{e} core" for e, pid in cores.items() if _maps_torch(pid)}
        torch_in |= {f"{e} worker" for e, pid in workers.items() if _maps_torch(pid)}
    assert torch_in == ({"P core", "D core"} if runner == "torch" else set())
    if runner == "mock":
        assert result["tokens"]["r"] == mock_tokens(prompt, 3)


def _copy_without_torch(handle: dict, results) -> None:
    """A connector worker's imports and its copy paths, in a fresh process."""
    import connector.worker_proc  # noqa: F401  (what the worker process imports)
    peer = KVCache.open(KVCacheHandle.from_dict(handle))
    local = KVCache.allocate(ModelConfig(), 8, 4, dtype=peer.handle.dtype)
    try:
        local.copy_blocks_from(peer, [2, 3], [5, 4])  # shm pull
        local.write_blocks([6], peer.read_blocks([3]))  # zmq pull
        results.put(("torch" in sys.modules, local.read_blocks([5, 4, 6])))
    finally:
        local.close()


def test_worker_copy_paths_run_without_torch():
    """In a spawned process: pulls by copy and by bytes never import torch, and give
    the bytes the torch view of the owner's memory holds."""
    import torch
    owner = KVCache.allocate(ModelConfig(), 8, 4, dtype="bfloat16")
    try:
        owner.tensor.copy_(torch.randn(owner.tensor.shape).to(torch.bfloat16))
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_copy_without_torch, args=(owner.handle.to_dict(), results))
        child.start()
        try:
            imported_torch, data = results.get(timeout=60)
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
        assert not imported_torch and child.exitcode == 0
        want = owner.tensor.permute(2, 0, 1, 3, 4, 5)[[2, 3, 3]].contiguous()
        assert data == want.view(torch.uint8).numpy().tobytes()
    finally:
        owner.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_byte_paths_match_the_torch_view(dtype):
    """pages (numpy) and tensor (torch) are one memory: bytes read, written and copied
    through pages are exactly what the torch view holds, for every dtype."""
    import torch
    src = KVCache.allocate(ModelConfig(), 8, 4, dtype=dtype)
    dst = KVCache.allocate(ModelConfig(), 8, 4, dtype=dtype)
    try:
        src.tensor.copy_(torch.randn(src.tensor.shape, dtype=torch.float64).to(src.tensor.dtype))
        assert src.nbytes == src.tensor.nbytes
        blocks = src.tensor.permute(2, 0, 1, 3, 4, 5)
        assert src.read_blocks([1, 7]) == blocks[[1, 7]].contiguous().view(torch.uint8).numpy().tobytes()
        dst.copy_blocks_from(src, [1, 2], [3, 6])
        dst.write_blocks([7], src.read_blocks([5]))
        for d, s in ((3, 1), (6, 2), (7, 5)):
            assert torch.equal(dst.tensor[:, :, d].view(torch.uint8), src.tensor[:, :, s].view(torch.uint8))
        assert not dst.tensor[:, :, 1].view(torch.uint8).any()  # untouched blocks stay zero
    finally:
        src.close()
        dst.close()


def test_closed_cache_does_not_map_again():
    cache = KVCache.allocate(ModelConfig(), 8, 4)
    cache.close()
    assert cache.pages is None
    with pytest.raises(ValueError, match="closed"):
        cache.tensor


def test_start_topology_reports_engines_as_they_become_ready():
    """on_wait hears the engines ready so far while they start (never fewer than before),
    and all of them at the end."""
    from connector.topology import start_topology
    from engine.config import EngineConfig, KVTransferConfig
    heard: list[list[str]] = []
    router = start_topology(EngineConfig(num_blocks=32, block_size=4, runner="mock"),
                            KVTransferConfig(), "pd", on_wait=heard.append)
    try:
        assert sorted(heard[-1]) == ["D", "P"]
        assert all(set(a) <= set(b) for a, b in zip(heard, heard[1:]))
        assert all(c.ready is not None for c in router.clients.values())
    finally:
        router.shutdown()


HEAVY = ("torch", "numpy", "zmq", "rich.live", "matplotlib", "aiohttp", "replay.pipeline")


def test_help_and_the_cli_module_import_nothing_heavy():
    """`kvdrain --help` and `import cli` (which every spawned engine and connector worker
    repeats: multiprocessing re-runs the parent's main file) load none of HEAVY."""
    import subprocess
    from pathlib import Path
    probe = ("import sys; sys.argv = ['kvdrain', '--help']; import cli\n"
             "try:\n    cli.cli()\nexcept SystemExit:\n    pass\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    assert out.splitlines()[-1] == "[]", out


def test_cli_clocks_are_the_pipelines():
    import cli
    from replay.pipeline import CLOCKS
    assert cli.CLOCKS == CLOCKS
