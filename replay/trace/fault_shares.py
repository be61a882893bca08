"""Seeded shares of faults put into any trace: `--fault NAME=SHARE`, `--fault-seed N`. Runs in: frontend process.

Each request of the shaped trace draws one number in [0, 1) from the seed and its id
alone, so a request gets the same fault whatever the window, the speedup or the other
shares' order; the shares, laid end to end in FAULT_NAMES order, split [0, 1), and a
request whose number falls in one gets that fault. A request fault (drop_decode,
reject_decode) goes on the request, and only on one routed from P to D (not `"pd":
false`); an `abort_<phase>` is an abort record right after the request, at its arrival,
in that phase. A request that has a fault of its own keeps it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from replay.trace.faults import FAULT_NAMES, abort_phase
from replay.trace.records import TraceAbort, TraceRecord, TraceRequest

_DRAW_SCALE = float(1 << 64)


def draw(seed: int, req_id: str) -> float:
    """The request's number in [0, 1): the same for the same seed and id, on any machine."""
    digest = hashlib.blake2b(f"{seed}\0{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _DRAW_SCALE


@dataclass(frozen=True, slots=True)
class FaultShares:
    """The share of requests that gets each fault, and the seed of the draw."""

    shares: tuple[tuple[str, float], ...] = ()  # (fault name, share), in FAULT_NAMES order
    seed: int = 0

    def __post_init__(self) -> None:
        names = [name for name, _ in self.shares]
        for name, share in self.shares:
            if name not in FAULT_NAMES:
                raise ValueError(f"--fault {name}: unknown fault, expected one of {_names()}")
            if not 0 < share <= 1:
                raise ValueError(f"--fault {name}: the share must be in (0, 1], got {share:g}")
            if names.count(name) > 1:
                raise ValueError(f"--fault {name}: given more than once")
        if sum(share for _, share in self.shares) > 1 + 1e-9:
            raise ValueError("--fault: the shares add up to more than 1 (one fault a request)")
        order = sorted(self.shares, key=lambda s: FAULT_NAMES.index(s[0]))
        object.__setattr__(self, "shares", tuple(order))

    @classmethod
    def parse(cls, specs: Sequence[str], seed: int = 0) -> FaultShares:
        """From `--fault NAME=SHARE` options (a ValueError names a bad one)."""
        shares = []
        for spec in specs:
            name, sep, share = spec.partition("=")
            try:
                value = float(share)
            except ValueError:
                value = None
            if not sep or value is None:
                raise ValueError(f"--fault {spec}: expected NAME=SHARE, as drop_decode=0.05")
            shares.append((name.strip(), value))
        return cls(tuple(shares), seed)

    def __bool__(self) -> bool:
        return bool(self.shares)

    def pick(self, req_id: str) -> str | None:
        """The fault request `req_id` draws; None: none."""
        number, end = draw(self.seed, req_id), 0.0
        for name, share in self.shares:
            end += share
            if number < end:
                return name
        return None

    def put_into(self, req: TraceRequest) -> tuple[TraceRecord, ...]:
        """The request as the replay sends it, and its abort if it drew one."""
        name = self.pick(req.req_id) if req.fault is None else None
        if name is None:
            return (req,)
        phase = abort_phase(name)
        if phase is not None:
            return req, TraceAbort(req.t, req.req_id, req.line, phase)
        if req.pd is False:
            return (req,)
        return (dataclasses.replace(req, fault=name),)


def _names() -> str:
    return ", ".join(FAULT_NAMES)
