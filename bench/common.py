"""What benchmarks share: other processes' load, the HTTP serve. Runs in: a bench process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent
# One `kvdrain serve --http 0` of this checkout: mock runner, P/D, event (the defaults).
SERVE = [
    "--runner",
    "mock",
    "--num-blocks",
    "8192",
    "--max-num-seqs",
    "256",
    "--max-num-batched-tokens",
    "8192",
    "--no-live",
    "--http",
    "0",
]


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
        return f"other processes used ~{other:.1f} CPU s during this run" + (
            ": on 2 cores that disturbs these numbers, rerun on an idle machine"
            if other > 1.0
            else ""
        )


def start_serve() -> tuple[subprocess.Popen, str, str]:
    """The serve child, its zmq address and its HTTP URL (it prints both once listening)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", *SERVE],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    zmq_address = http_url = None
    deadline = time.monotonic() + 120
    while (zmq_address is None or http_url is None) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if m := re.search(r"listening on (\S+)", line):
            zmq_address = m.group(1)
        if m := re.search(r"HTTP on (http://\S+)", line):
            http_url = m.group(1)
    if zmq_address is None or http_url is None:
        proc.kill()
        raise RuntimeError("kvdrain serve --http did not start")
    return proc, zmq_address, http_url
