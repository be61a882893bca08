"""Choosing an upstream among several of one role: round-robin, sans IO."""
from __future__ import annotations

import pytest

from replay.deploy.balance import round_robin


def test_round_robin_takes_each_candidate_in_order_then_starts_again():
    assert [round_robin(["P0", "P1", "P2"], turn) for turn in range(7)] == \
        ["P0", "P1", "P2", "P0", "P1", "P2", "P0"]
    assert round_robin(["P"], 41) == "P"


def test_round_robin_over_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        round_robin([], 0)
