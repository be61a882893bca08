"""Checking a decoded StatsSnapshot before anything uses it. Runs in: frontend process.

The codec checks field types; this checks what readers index: a known engine id and loop state,
every SchedulerStats count a non-negative int, block counts that add up. Whoever received a
snapshot that fails drops and counts it (num_bad_messages): MPClient, or ServeClient for a serve.
"""

from __future__ import annotations

from dataclasses import fields

from engine.core.liveness import LOOP_STATE_NAMES
from engine.core.outputs import SchedulerStats
from engine.proc.messages import StatsSnapshot

REQUIRED_COUNTS = tuple(f.name for f in fields(SchedulerStats))
KNOWN_LOOP_STATES = frozenset(LOOP_STATE_NAMES)


def snapshot_problem(snap: StatsSnapshot, engines: list[str] | tuple[str, ...]) -> str | None:
    """Why snap must not be used (one line), or None if it is sound."""
    if snap.engine_id not in engines:
        return f"stats from unknown engine {snap.engine_id!r}"
    if snap.loop_state not in KNOWN_LOOP_STATES:
        return f"engine {snap.engine_id}: unknown loop state {snap.loop_state!r}"
    counts = snap.counts
    for name in REQUIRED_COUNTS:
        value = counts.get(name)
        if type(value) is not int or value < 0:
            return f"engine {snap.engine_id}: count {name} is {value!r}"
    if counts["num_used_blocks"] + counts["num_free_blocks"] != counts["num_usable_blocks"]:
        return f"engine {snap.engine_id}: used + free blocks != num_usable_blocks"
    return None
