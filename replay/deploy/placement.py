"""Which prefill and which decode engine takes each request: round-robin, least-loaded or by cached prefix, sans IO. Runs in: frontend process.

One decision table for every router: the live router over engine clients, the virtual-clock
simulator and the HTTP proxy. Callers say when a request starts and ends on an engine; the
table never sees a socket or a clock, so every router picks alike.

- `round-robin`: vLLM's toy proxy's order: one cycle over the prefill engines and one over
  the decode engines, each advanced once per request it serves.
- `least-loaded`: the engine with the fewest requests in flight; ties go to the engine
  listed first (P0 before P1).
- `prefix`: the prefill engine holding the longest cached prefix of the request's block
  hashes, as llm-d's prefix-cache scorer and Dynamo's KV router score it; ties by load,
  then by place in the list. The decode engine by load. The table is what was sent where,
  not what an engine really holds (a router cannot see a server's cache): each engine
  remembers the last `max_blocks` hashes it was sent, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from itertools import count
from typing import Literal, get_args

RouterPolicy = Literal["round-robin", "least-loaded", "prefix"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
MAX_BLOCKS_PER_ENGINE = 1 << 16  # the prefix table's memory per engine, in block hashes


class PrefixTable:
    """The block hashes one engine was sent, most recent last, at most `max_blocks`."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.hashes: OrderedDict[Hashable, None] = OrderedDict()

    def match(self, block_hashes: Sequence[Hashable]) -> int:
        """How many of the request's blocks, from the first, this engine was sent."""
        for num_matched, block_hash in enumerate(block_hashes):
            if block_hash not in self.hashes:
                return num_matched
        return len(block_hashes)

    def insert(self, block_hashes: Sequence[Hashable]) -> None:
        for block_hash in block_hashes:
            self.hashes[block_hash] = None
            self.hashes.move_to_end(block_hash)
        while len(self.hashes) > self.max_blocks:
            self.hashes.popitem(last=False)


class Balancer:
    """Picks the engines of each request under one policy, and counts what each engine got."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        policy: RouterPolicy = "round-robin",
        max_blocks: int = MAX_BLOCKS_PER_ENGINE,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy: must be one of {ROUTER_POLICIES}, got {policy!r}")
        if not decode:
            raise ValueError("a balancer needs at least one decode engine")
        self.prefill, self.decode, self.policy = list(prefill), list(decode), policy
        engines = self.prefill + self.decode
        self.num_in_flight = dict.fromkeys(engines, 0)
        self.num_requests = dict.fromkeys(engines, 0)  # every request each engine was given
        self.tables = {name: PrefixTable(max_blocks) for name in self.prefill}
        self._place = {
            name: place for names in (self.prefill, self.decode) for place, name in enumerate(names)
        }
        self._cycles = {"prefill": count(), "decode": count()}

    def pick_prefill(self, block_hashes: Sequence[Hashable] = ()) -> str:
        """The prefill engine of a new request (block_hashes: its full blocks', for `prefix`)."""
        if not self.prefill:
            raise ValueError("this topology has no prefill engine")
        if self.policy == "prefix":
            engine = min(
                self.prefill, key=lambda e: (-self.tables[e].match(block_hashes), self._rank(e))
            )
            self.tables[engine].insert(block_hashes)
        else:
            engine = self._pick(self.prefill, "prefill")
        self.num_requests[engine] += 1
        return engine

    def pick_decode(self) -> str:
        """The decode engine of a request (after its prefill, or alone)."""
        engine = self._pick(self.decode, "decode")
        self.num_requests[engine] += 1
        return engine

    def remove(self, engine: str) -> None:
        """`engine` is gone (killed): it is never picked again."""
        for names in (self.prefill, self.decode):
            if engine in names:
                names.remove(engine)

    def started(self, engine: str) -> None:
        """A request is in flight on `engine` now."""
        self.num_in_flight[engine] += 1

    def ended(self, engine: str) -> None:
        """A request left `engine` (finished, aborted or moved on)."""
        if self.num_in_flight[engine] <= 0:
            raise ValueError(f"engine {engine!r} has no request in flight to end")
        self.num_in_flight[engine] -= 1

    def _pick(self, engines: list[str], role: str) -> str:
        if self.policy == "round-robin":
            return engines[next(self._cycles[role]) % len(engines)]
        return min(engines, key=self._rank)  # least-loaded, and prefix's decode engines

    def _rank(self, engine: str) -> tuple[int, int]:
        """Load first, then the engine's place in its list."""
        return self.num_in_flight[engine], self._place[engine]
