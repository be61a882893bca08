"""The garbage collector while a replay runs: what its passes leave out. Runs in: frontend process.

Python's collector walks every tracked object it keeps in a generation. A replay's
frontend holds a large heap that lives as long as the replay (the trace, imports, the
engines and their samples): walking it finds nothing and delays whatever runs then.
The virtual clock keeps full collections out of a simulation; the HTTP replay freezes the
heap that exists when its sending starts. Each is undone after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# A full collection's threshold that a run never reaches (gc.set_threshold's third).
NO_FULL_COLLECTION = (1 << 31) - 1


@contextmanager
def no_full_collections() -> Iterator[None]:
    """Only young garbage collected meanwhile. What a simulation makes (its samples,
    requests, engines) lives until it ends, so each full collection walks all of it for
    nothing: 2-3 of them took 6-8% of a whole Mooncake replay. Thresholds restored after."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, NO_FULL_COLLECTION)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Every object alive now out of the collector's sight (gc.freeze) meanwhile: a full
    collection walks the whole heap (imports, the trace, aiohttp) and holds every send
    back while it runs (34 ms on an idle 2-core machine, over 100 ms on a loaded one,
    about once a 10 s run at 100 req/s). No collection first: gc.collect() would run
    every pending finalizer of the process (another library's, a test's) synchronously on
    the caller's loop, where no timeout can interrupt one that blocks; what is garbage now
    is collected after the unfreeze instead. Nothing frozen (nor unfrozen after) where the
    heap was already frozen by someone else, or the collector is off."""
    frozen = gc.isenabled() and not gc.get_freeze_count()
    if frozen:
        gc.freeze()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()
