"""Choosing an upstream among several of one role, sans IO. Runs in: frontend process.

The proxy (replay/deploy/proxy.py) asks it which P and which D serve the next request; an
xPyD router can ask the same. Pure: the caller keeps the turn and hands it in.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def round_robin(candidates: Sequence[T], turn: int) -> T:
    """The candidate whose turn it is: turn 0 the first, then each in order, then again."""
    if not candidates:
        raise ValueError("round_robin: no candidates")
    return candidates[turn % len(candidates)]
