"""KV block pull throughput of the transports vs an in-process copy. Runs in: a bench process.

Usage: .venv/bin/python bench/transfer.py [--rounds N]
A real connector worker process plays P (a KV cache and a held send of every block, registered as
P's engine core would); this process pulls NUM_BLOCKS scattered blocks with Puller over shm and
zmq, in interleaved rounds. Method and columns: bench/README.md. No torch, here or in the worker:
numpy copies run on one thread, and no idle OpenMP thread spins on a core the peer needs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import CLK_TCK, OtherLoad  # noqa: E402  (bench/common.py)

from connector.messages import (
    CONNECTOR_CODEC,
    BlockData,
    KVCacheRegistered,
    ReadBlocks,
    RecvSpec,  # noqa: E402
    RegisterKVCache,
    StepMeta,
    WorkerReady,
)
from connector.transfer import PeerLink, Puller, keep_freed_buffers  # noqa: E402
from connector.worker_proc import ConnectorWorkerConfig, run_connector_worker  # noqa: E402
from engine.config import ModelConfig, get_model_config  # noqa: E402
from engine.runner.kv_cache import KVCache  # noqa: E402

NUM_BLOCKS = 64  # per pull
CACHE_BLOCKS = 256  # per cache, block 0 is the null block
BLOCK_SIZE = 16
ROUNDS = 9
ROUND_S = 0.1  # per path and round: repeat for this long ...
MIN_CALLS, MAX_CALLS = 5, 200  # ... within these bounds
TIMEOUT_S = 30.0
LAYOUTS = (
    ("small preset, fp32", get_model_config("small"), "float32"),
    (
        "8 layers x 8 KV heads x 64, bf16",
        ModelConfig(num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64),
        "bfloat16",
    ),
)
PLAIN, BLOCKS = "plain copy of the bytes", "in-process block copy"
GOALS = {"shm": 0.8, "zmq": 0.4}  # of the in-process block copy's GB/s, on 16 MiB pulls


class PrefillWorker:
    """A spawned connector worker holding every block of `cache` for request "bench"."""

    def __init__(self, cache: KVCache, run_dir: str) -> None:
        self.kv_addr = f"ipc://{run_dir}/P-kv"
        config = ConnectorWorkerConfig(
            engine_id="P", agent_addr=f"ipc://{run_dir}/P-agent", kv_addr=self.kv_addr
        )
        self.ctx = zmq.Context.instance()
        self.agent = self.ctx.socket(zmq.PAIR)
        self.agent.setsockopt(zmq.LINGER, 0)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_connector_worker, args=(config,), name="kvdrain-bench-worker"
        )
        self.process.start()
        try:
            self.agent.connect(config.agent_addr)
            self._start_serving(cache)
        except BaseException:
            self.close()
            raise

    def _start_serving(self, cache: KVCache) -> None:
        if not self.agent.poll(int(TIMEOUT_S * 1000), zmq.POLLIN):
            raise TimeoutError(
                f"connector worker not ready in {TIMEOUT_S} s (exit code {self.process.exitcode})"
            )
        if not isinstance(CONNECTOR_CODEC.decode(self.agent.recv()), WorkerReady):
            raise RuntimeError("connector worker did not say WorkerReady first")
        held = list(range(1, cache.num_blocks))
        self.agent.send(CONNECTOR_CODEC.encode(RegisterKVCache("P", cache.handle.to_dict())))
        if not isinstance(CONNECTOR_CODEC.decode(self.agent.recv()), KVCacheRegistered):
            raise RuntimeError("connector worker did not answer RegisterKVCache")
        self.agent.send(CONNECTOR_CODEC.encode(StepMeta({"bench": held}, [])))
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

    def cpu_s(self) -> float:
        """The worker's CPU seconds so far (user + system, all its threads)."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def close(self) -> None:
        self.process.terminate()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.agent.close(linger=0)


@dataclass(slots=True)
class Path:
    """One measured way of moving the pull's bytes, and what the rounds saw of it."""

    name: str
    fn: Callable[[], None]
    worker: PrefillWorker | None = None  # its CPU counts too
    times: list[float] = field(default_factory=list)  # per round: median seconds per call
    cpu_s: float = 0.0
    num_calls: int = 0

    def run_round(self) -> None:
        durations: list[float] = []
        cpu0, worker0 = time.process_time(), self.worker.cpu_s() if self.worker else 0.0
        end = time.perf_counter() + ROUND_S
        while len(durations) < MAX_CALLS and (
            len(durations) < MIN_CALLS or time.perf_counter() < end
        ):
            start = time.perf_counter()
            self.fn()
            durations.append(time.perf_counter() - start)
        self.cpu_s += (
            time.process_time() - cpu0 + (self.worker.cpu_s() - worker0 if self.worker else 0.0)
        )
        self.num_calls += len(durations)
        self.times.append(statistics.median(durations))


def measure(paths: list[Path], rounds: int) -> None:
    """Warm every path up, then `rounds` interleaved rounds (the order rotates)."""
    for path in paths:
        for _ in range(3):
            path.fn()
    for r in range(rounds):
        for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
            path.run_round()


def ratio(path: Path, ref: Path) -> tuple[float, float, float]:
    """(median, min, max) over rounds of ref's time / path's time in that round."""
    ratios = [t_ref / t for t, t_ref in zip(path.times, ref.times)]
    return statistics.median(ratios), min(ratios), max(ratios)


def blocks_equal(a: KVCache, a_ids: list[int], b: KVCache, b_ids: list[int]) -> bool:
    return np.array_equal(a.gather_blocks(a_ids), b.gather_blocks(b_ids))


def measure_layout(
    model: ModelConfig, dtype: str, run_dir: str, rounds: int
) -> tuple[int, list[Path]]:
    """(bytes per block, the measured paths) for one KV layout."""
    src = KVCache.allocate(model, CACHE_BLOCKS, BLOCK_SIZE, "cpu", dtype)
    dst = KVCache.allocate(model, CACHE_BLOCKS, BLOCK_SIZE, "cpu", dtype)
    src.pages[...] = np.random.default_rng(0).integers(0, 256, src.pages.shape, dtype=np.uint8)
    rng = random.Random(0)
    src_ids = rng.sample(range(1, CACHE_BLOCKS), NUM_BLOCKS)
    dst_ids = rng.sample(range(1, CACHE_BLOCKS), NUM_BLOCKS)
    flat_src = src.gather_blocks(src_ids)
    flat_dst = np.empty_like(flat_src)
    paths = [
        Path(PLAIN, lambda: np.copyto(flat_dst, flat_src)),
        Path(BLOCKS, lambda: dst.copy_blocks_from(src, src_ids, dst_ids)),
    ]
    worker = PrefillWorker(src, run_dir)
    pullers = []
    try:
        spec = RecvSpec("bench", dst_ids, src_ids, "P", "bench", worker.kv_addr)
        for transport in ("shm", "zmq"):
            puller = Puller(zmq.Context.instance(), transport, timeout_s=TIMEOUT_S)
            pullers.append(puller)
            dst.pages[...] = 0
            puller.pull(dst, spec)
            if not blocks_equal(src, src_ids, dst, dst_ids):
                raise AssertionError(f"{transport} pull is not bit-exact")
            paths.append(Path(f"Puller, {transport}", lambda p=puller: p.pull(dst, spec), worker))
        measure(paths, rounds)
    finally:
        for puller in pullers:
            puller.close()
        worker.close()
        src.close()
        dst.close()
    return len(flat_src) // NUM_BLOCKS, paths


def print_layout(name: str, block_bytes: int, paths: list[Path]) -> None:
    num_bytes = NUM_BLOCKS * block_bytes
    print(f"\n{name}: {block_bytes // 1024} KiB per block, {num_bytes / 2**20:g} MiB per pull")
    print(
        f"{'path':<26} {'GB/s':>6} {'vs plain':>9} {'vs in-process blocks (range)':>29} "
        f"{'CPU ms/pull':>12}"
    )
    plain, blocks = paths[0], paths[1]
    for path in paths:
        gbps = num_bytes / statistics.median(path.times) / 1e9
        (r_plain, _, _), (r_blocks, lo, hi) = ratio(path, plain), ratio(path, blocks)
        cpu_ms = 1e3 * path.cpu_s / path.num_calls
        print(
            f"{path.name:<26} {gbps:>6.2f} {r_plain:>9.2f} {r_blocks:>12.2f} ({lo:.2f}-{hi:.2f})"
            f"{'':>4} {cpu_ms:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds per layout")
    args = parser.parse_args()
    keep_freed_buffers()  # this process plays D's connector worker, which does this at start
    load = OtherLoad()
    print(
        f"{NUM_BLOCKS} scattered blocks per pull, block_size {BLOCK_SIZE}, CPU, "
        "numpy (one thread); "
        f"{args.rounds} interleaved rounds of {ROUND_S:g} s per path; GB/s = 1e9 payload bytes/s "
        "(median over rounds of each round's median call); ratio = median over rounds; "
        "CPU = this process + the worker"
    )
    run_dir = tempfile.mkdtemp(prefix="kvdrain-bench-", dir="/tmp")
    summary = []
    try:
        for name, model, dtype in LAYOUTS:
            block_bytes, paths = measure_layout(model, dtype, run_dir, args.rounds)
            print_layout(name, block_bytes, paths)
            summary = [(p.name.split()[-1], ratio(p, paths[1])[0]) for p in paths[2:]]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(
        f"\nkvdrain vs the in-process block copy, {NUM_BLOCKS * block_bytes / 2**20:g} MiB pulls: "
        + ", ".join(f"{t} {r:.2f} (goal >= {GOALS[t]})" for t, r in summary)
    )
    print(load.report())


if __name__ == "__main__":
    main()
