"""Where a sweep's cells run: this machine's cores, or a Ray cluster. Runs in: frontend process.

Locally, `workers` cells at once, each a replay process of its own (replay/sweep/cell.py);
on Ray (`--ray ADDRESS`, the optional extra `kvdrain[ray]`), one task per cell, each
asking for one CPU, on any node with kvdrain installed and the traces at the same paths.
Either way the results come back in the grid's order, and each cell's report is the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from replay.sweep.cell import CellResult, run_cell
from replay.sweep.spec import Cell

OnDone = Callable[[Cell, CellResult], None]


def run_locally(cells: list[Cell], workers: int | None, on_done: OnDone) -> list[CellResult]:
    """Each cell's replay process, `workers` at once (default: this machine's cores)."""
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:  # each thread waits on a process
        futures = [pool.submit(run_cell, cell.argv()) for cell in cells]
        return [_done(cell, f.result(), on_done) for cell, f in zip(cells, futures)]


def run_on_ray(cells: list[Cell], address: str, on_done: OnDone) -> list[CellResult]:
    """One Ray task per cell on the cluster at `address`; RuntimeError without Ray."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install 'kvdrain[ray]' (or `make ray`)") from None
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(run_cell)
        refs = [task.remote(cell.argv()) for cell in cells]
        return [_done(cell, ray.get(ref), on_done) for cell, ref in zip(cells, refs)]
    finally:
        ray.shutdown()


def _done(cell: Cell, result: CellResult, on_done: OnDone) -> CellResult:
    on_done(cell, result)
    return result
