"""How times read in the text output: seconds, always to the millisecond. Runs in: frontend process.

Every time a verdict, reason, fault or summary line states is written by seconds(), so
"1.971 s" and "4.349 s" sit side by side, never "1.971210 s" beside "4.3 s". Option
values echoed as the user gave them ("--idle-threshold 0.5 s") keep their own form.
"""

from __future__ import annotations

SECONDS_DECIMALS = 3  # the millisecond: what a wall-clock replay's stamps resolve


def seconds(t: float) -> str:
    """'1.971 s'."""
    return f"{t:.{SECONDS_DECIMALS}f} s"
