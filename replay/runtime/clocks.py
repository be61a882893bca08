"""The clocks a replay runs on. Runs in: frontend process.

wall: real engine processes in real time (replay/wall/); virtual: the simulator in this
process, deterministic (replay/sim/). Light to import: cli.py names them in --help.
"""

from __future__ import annotations

from typing import Literal, get_args

Clock = Literal["wall", "virtual"]
CLOCKS: tuple[Clock, ...] = get_args(Clock)
