"""A run of plain decode steps on the virtual clock: when each starts, and its outputs. Runs in: frontend process.

engine/core/decode_run.py says how many plain decode steps follow a plain one and makes
them at once; replay/sim/engine.py skips them as one run. Each skipped step starts
when the one before it ends (the loop steps again at once after a model step) and
costs what the step cost says of its shape (one token per running request,
every request's context one token longer than in the step before). The run ends
before the connector's next timed action (a heartbeat due, a lease to reap), which
a step starting at or after it would take.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.outputs import StepOutputs

# step_cost(num_decodes, num_context_tokens): one decode step's virtual ns.
StepCost = Callable[[int, int], int]


@dataclass(slots=True)
class DecodeRun:
    """Skipped steps: the i-th starts at starts[i] and ends when the next starts; the last ends at `end`."""

    starts: list[int]
    end: int

    @classmethod
    def plan(
        cls,
        now: int,
        num_steps: int,
        num_decodes: int,
        num_context_tokens: int,
        step_cost: StepCost,
        deadline: int | None,
    ) -> DecodeRun | None:
        """`num_steps` steps from `now`, less those that would start at or after `deadline`; None if none is left."""
        starts, t = [], now
        for _ in range(num_steps):
            if deadline is not None and t >= deadline:
                break
            starts.append(t)
            t += step_cost(num_decodes, num_context_tokens)
            num_context_tokens += num_decodes
        return cls(starts, t) if starts else None

    def num_started_by(self, t: int) -> int:
        """Steps started at or before t (a sample at t comes after a step start at t)."""
        return bisect_right(self.starts, t)

    def num_started_before(self, t: int) -> int:
        """Steps started before t (an input at t is drained by a step starting at t)."""
        return bisect_left(self.starts, t)

    def end_of(self, step: int) -> int:
        return self.starts[step + 1] if step + 1 < len(self.starts) else self.end


def step_outputs(
    req_ids: list[str], tokens: list[list[int]], num_cached_tokens: list[int], step: int
) -> StepOutputs:
    """The outputs of one step of a run: every request's token of that step (plain outputs)."""
    outputs = StepOutputs()
    outputs.req_ids = list(req_ids)
    outputs.new_token_ids = [sampled[step] for sampled in tokens]
    outputs.num_cached_tokens = list(num_cached_tokens)
    return outputs
