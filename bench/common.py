"""What the benchmarks share: a measure of other processes' load. Runs in: a benchmark."""
from __future__ import annotations

import os

CLK_TCK = os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU seconds that processes outside this process tree used meanwhile (from /proc/stat)."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        own = os.times()
        return busy / CLK_TCK, own.user + own.system + own.children_user + own.children_system

    def report(self) -> str:
        (busy0, own0), (busy1, own1) = self.start, self._now()
        other = max(0.0, (busy1 - busy0) - (own1 - own0))
        return (f"other processes used ~{other:.1f} CPU s during this run"
                + (": on 2 cores that disturbs these numbers, rerun on an idle machine" if other > 1.0 else ""))
