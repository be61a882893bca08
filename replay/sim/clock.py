"""The virtual clock: a deterministic discrete-event loop. Runs in: frontend process.

No sleeping and no wall clock: time is integer nanoseconds; events sit in a heap keyed
(time, class, engine rank, seq), seq a counter, so ties resolve the same way every run.
At one instant: deliveries (trace records, transfers, reports), then step ends (P before
D), then step starts, then samples (the event classes below, in that order). An event
for now pushed by the one being handled (a message sent with no latency) comes after
that one, whatever its class: it inherits its place (EventLoop.order, has_passed).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

NS = 1_000_000_000
DELIVER, STEP_END, STEP_START, TICK = range(4)  # event classes, in tie order
_RANKS = 1 << 16  # engine ranks below it: an event's place at an instant is cls * _RANKS + rank


def to_ns(seconds: float) -> int:
    """Seconds as integer nanoseconds of virtual time."""
    return round(seconds * NS)


class EventLoop:
    """The event heap and the virtual time `now` (of the event being handled)."""

    def __init__(self) -> None:
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0
        self.num_pending = 0  # events other than sample ticks
        self.order = DELIVER  # the event being handled's place at `now` (cls * _RANKS + rank)

    def push(self, t: int, cls: int, rank: int, fn: Callable, arg: object = None) -> None:
        self.seq += 1
        self.num_pending += cls != TICK
        # An event for now, pushed by the one being handled, comes after that one
        # (a message sent at once): it inherits its place (has_passed).
        after = self.order if t == self.now else -1
        heapq.heappush(self.heap, (t, cls, rank, self.seq, fn, arg, after))

    def pop(self) -> tuple[Callable, object]:
        t, cls, rank, _, fn, arg, after = heapq.heappop(self.heap)
        self.now = t
        self.order = max(cls * _RANKS + rank, after)
        self.num_pending -= cls != TICK
        return fn, arg

    def cancel(self) -> None:
        """An event pushed earlier will do nothing when it comes (its handler checks a
        ticket): it is no longer pending, so pop() of it must not count it again."""
        self.num_pending -= 1

    def on_cancelled(self) -> None:
        """The handler of a cancelled event, called: undo pop()'s count of it."""
        self.num_pending += 1


def has_passed(loop: EventLoop, rank: int, cls: int = STEP_START) -> bool:
    """Whether the event being handled comes after engine `rank`'s step start (or event of
    class `cls`) at `now` (a message sent at once by a later engine's step start, say): a
    step starting now has started already, and cannot see what this event brings."""
    return loop.order > cls * _RANKS + rank
