"""KV block pull throughput of the connector transports, against a plain in-process copy. Runs in: a bench process.

Usage: .venv/bin/python bench/transfer.py
A real connector worker process (connector.worker_proc.run_connector_worker) plays the
prefill side: this process registers a KV cache with it (RegisterKVCache) and a held
send of every block (StepMeta.reqs_to_send), as P's engine core would. This process
then pulls NUM_BLOCKS scattered blocks into scattered blocks of its own cache with
connector.transfer.Puller, again and again:
- shm: the Puller maps the worker's registered memory once, then copies block by block
  (KVCache.copy_blocks_from);
- zmq: the worker reads the blocks into bytes (KVCache.read_blocks) and sends them as
  one zero-copy frame; the Puller writes them in (KVCache.write_blocks).
References, in this process, on the same byte count: a plain contiguous tensor copy_
(the ratio's denominator: what memory bandwidth allows) and an index_select +
index_copy_ of the same scattered blocks between two local caches. Prints GB/s (1e9
payload bytes/s of the median call) per row, the ratio to the plain copy and the ratio
to the in-process block copy, for two KV layouts. Every transport is checked once for bit-exact contents.

OMP_WAIT_POLICY=PASSIVE (inherited by the worker) shows the zmq pull without OpenMP's
spin-waiting: after each torch op, idle OpenMP threads spin for a while, and on two
cores they keep the peer process, which the pull is waiting for, off the CPU.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import OtherLoad  # noqa: E402  (bench/common.py)
from connector.messages import (CONNECTOR_CODEC, BlockData, ReadBlocks, RecvSpec,  # noqa: E402
                                RegisterKVCache, StepMeta, WorkerReady)
from connector.transfer import PeerLink, Puller  # noqa: E402
from connector.worker_proc import ConnectorWorkerConfig, run_connector_worker  # noqa: E402
from engine.config import ModelConfig, get_model_config  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402

NUM_BLOCKS = 64  # per pull
CACHE_BLOCKS = 256  # per cache, block 0 is the null block
BLOCK_SIZE = 16
MIN_TIME_S = 1.0  # per row: repeat until this much time has passed ...
MAX_ITERS = 500  # ... or this many pulls
TIMEOUT_S = 30.0
LAYOUTS = (
    ("small preset, fp32", get_model_config("small"), torch.float32),
    ("8 layers x 8 KV heads x 64, bf16", ModelConfig(num_layers=8, num_heads=8, num_kv_heads=8,
                                                     head_dim=64), torch.bfloat16),
)



class PrefillWorker:
    """A spawned connector worker holding every block of `cache` for request "bench"."""

    def __init__(self, cache: KVCache, run_dir: str) -> None:
        self.kv_addr = f"ipc://{run_dir}/P-kv"
        config = ConnectorWorkerConfig("P", f"ipc://{run_dir}/P-agent", self.kv_addr)
        self.ctx = zmq.Context.instance()
        self.agent = self.ctx.socket(zmq.PAIR)
        self.agent.setsockopt(zmq.LINGER, 0)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_connector_worker, args=(config,), name="kvdrain-bench-worker")
        self.process.start()
        try:
            self.agent.connect(config.agent_addr)
            self._start_serving(cache)
        except BaseException:
            self.close()
            raise

    def _start_serving(self, cache: KVCache) -> None:
        if not self.agent.poll(int(TIMEOUT_S * 1000), zmq.POLLIN):
            raise TimeoutError(f"connector worker not ready in {TIMEOUT_S} s "
                               f"(exit code {self.process.exitcode})")
        if not isinstance(CONNECTOR_CODEC.decode(self.agent.recv()), WorkerReady):
            raise RuntimeError("connector worker did not say WorkerReady first")
        held = list(range(1, cache.num_blocks))
        for msg in (RegisterKVCache("P", cache.handle.to_dict()), StepMeta({"bench": held}, [])):
            self.agent.send(CONNECTOR_CODEC.encode(msg))
        self._wait_serving()

    def _wait_serving(self) -> None:
        """Until the worker serves a read (it handles our two messages in order)."""
        link, deadline = PeerLink(self.ctx, self.kv_addr, TIMEOUT_S), time.monotonic() + TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                reply, _ = link.request(ReadBlocks("bench", [1]))
                if isinstance(reply, BlockData) and reply.ok:
                    return
            raise TimeoutError("connector worker does not serve reads")
        finally:
            link.close()

    def close(self) -> None:
        self.process.terminate()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.agent.close(linger=0)


def gbps(fn: Callable[[], None], num_bytes: int) -> float:
    """Payload GB/s of fn's median call, after warm-up, over MIN_TIME_S or MAX_ITERS calls.

    The median, not the mean: on a 2-core machine a call that loses its core to another
    process would otherwise count against the transport.
    """
    for _ in range(3):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + MIN_TIME_S
    while len(times) < MAX_ITERS and (len(times) < 5 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def blocks_equal(a: KVCache, a_ids: list[int], b: KVCache, b_ids: list[int]) -> bool:
    pick = lambda cache, ids: cache.tensor.index_select(2, torch.tensor(ids))  # noqa: E731
    return torch.equal(pick(a, a_ids).view(torch.uint8), pick(b, b_ids).view(torch.uint8))


def measure_layout(model: ModelConfig, dtype: torch.dtype, run_dir: str) -> tuple[int, list]:
    """(bytes per block, [(row name, GB/s)]) for one KV layout."""
    src = KVCache.allocate(model, CACHE_BLOCKS, BLOCK_SIZE, "cpu", dtype)
    dst = KVCache.allocate(model, CACHE_BLOCKS, BLOCK_SIZE, "cpu", dtype)
    src.tensor.copy_(torch.randn(src.tensor.shape, dtype=torch.float32))
    rng = random.Random(0)
    src_ids = rng.sample(range(1, CACHE_BLOCKS), NUM_BLOCKS)
    dst_ids = rng.sample(range(1, CACHE_BLOCKS), NUM_BLOCKS)
    num_bytes = NUM_BLOCKS * src.num_bytes_per_block
    flat_src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    flat_dst = torch.empty_like(flat_src)
    rows = [("plain copy_ of the bytes (reference)", gbps(lambda: flat_dst.copy_(flat_src), num_bytes)),
            ("in-process index_select+index_copy_",
             gbps(lambda: dst.copy_blocks_from(src, src_ids, dst_ids), num_bytes))]
    worker = PrefillWorker(src, run_dir)
    try:
        spec = RecvSpec("bench", dst_ids, src_ids, "P", "bench", worker.kv_addr)
        for transport in ("shm", "zmq"):
            puller = Puller(zmq.Context.instance(), transport, timeout_s=TIMEOUT_S)
            try:
                dst.tensor.zero_()
                puller.pull(dst, spec)
                if not blocks_equal(src, src_ids, dst, dst_ids):
                    raise AssertionError(f"{transport} pull is not bit-exact")
                rows.append((f"Puller, {transport} (worker process)",
                             gbps(lambda: puller.pull(dst, spec), num_bytes)))
            finally:
                puller.close()
    finally:
        worker.close()
        src.close()
        dst.close()
    return num_bytes // NUM_BLOCKS, rows


def main() -> None:
    load = OtherLoad()
    print(f"{NUM_BLOCKS} scattered blocks per pull, block_size {BLOCK_SIZE}, CPU; torch threads "
          f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; "
          "GB/s = 1e9 payload bytes/s (median call); ratio = row / plain copy")
    print("the plain copy of 2-16 MiB may run from the CPU cache; a block copy allocates a "
          "temporary the size of the pull")
    run_dir = tempfile.mkdtemp(prefix="kvdrain-bench-", dir="/tmp")
    try:
        for name, model, dtype in LAYOUTS:
            block_bytes, rows = measure_layout(model, dtype, run_dir)
            print(f"\n{name}: {block_bytes // 1024} KiB per block, "
                  f"{NUM_BLOCKS * block_bytes / 2**20:g} MiB per pull")
            print(f"{'path':<38} {'GB/s':>8} {'ratio':>6} {'vs in-process blocks':>21}")
            for row, value in rows:
                print(f"{row:<38} {value:>8.2f} {value / rows[0][1]:>6.2f} {value / rows[1][1]:>21.2f}")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(load.report())


if __name__ == "__main__":
    main()
