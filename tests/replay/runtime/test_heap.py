"""replay/runtime/heap.py: the collector's passes during a replay, and the state it is left in after."""

import gc

import pytest

from replay.runtime.heap import NO_FULL_COLLECTION, frozen_heap, no_full_collections


def test_no_full_collections_restores_the_thresholds_even_on_an_error():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with no_full_collections():
            assert gc.get_threshold() == (*before[:2], NO_FULL_COLLECTION)
            raise RuntimeError("stop")
    assert gc.get_threshold() == before


def test_frozen_heap_freezes_what_lives_and_unfreezes_after():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_frozen_heap_leaves_a_heap_someone_else_froze_frozen():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == count
        assert gc.get_freeze_count() == count
    finally:
        gc.unfreeze()


def test_frozen_heap_freezes_nothing_with_the_collector_off():
    gc.disable()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
