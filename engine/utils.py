"""Pure arithmetic helpers shared by every package (vLLM's vllm.utils). Runs in: every process."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many size-b pieces hold a items."""
    return -(a // -b)
