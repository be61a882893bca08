"""P/D routing, sans IO: a topology's engines and each request's way from P to D. Runs in: frontend process.

vLLM's disaggregated proxy as a state machine that the live router (replay/deploy/pd_router.py,
over engine clients) and the virtual-clock simulator (replay/sim/simulation.py, over
events) both drive, so that both route alike. Pure: no zmq, no clock, no I/O. Callers
hand it what happened (a request, an abort, an engine's output) and carry out the
commands it returns (AddTo, AbortAt) on their engines.

`pd` (= `1p1d`): engines P (kv_producer) and D (kv_consumer); `NpMd`: P0.. and D0...
A request goes to a P with max_tokens=1 and do_remote_decode; P's final output carries the
params its connector returned (naming P, so the D reads from the P that prefilled). When P
finished by length with params, the request goes to a D with them and the real max_tokens,
and D's tokens are the answer (P's token is dropped: D samples the first token itself). Any
other end at P ends the request. A request with pd=False goes to a D alone. `single`: one
engine E, no connector.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from engine.core.block_hash import hash_request_blocks
from engine.core.outputs import RequestOutput
from replay.deploy.placement import Balancer, RouterPolicy

TOPOLOGIES = ("pd", "single")
TOPOLOGY_FORMS = "single, pd (= 1p1d) or NpMd (N prefill and M decode engines: 2p2d, 1p3d, ...)"
NPMD = re.compile(r"([1-9][0-9]?)p([1-9][0-9]?)d")
PREFILL_MAX_TOKENS = 1  # P computes the prompt's KV; its one sampled token is dropped


def parse_topology(topology: str) -> tuple[int, int]:
    """(number of prefill engines, number of decode engines); single is (0, 1)."""
    if topology == "single":
        return 0, 1
    if topology == "pd":
        return 1, 1
    match = NPMD.fullmatch(topology)
    if match is None:
        raise ValueError(f"topology: must be {TOPOLOGY_FORMS}, got {topology!r}")
    return int(match[1]), int(match[2])


def engine_names(topology: str) -> tuple[list[str], list[str]]:
    """(prefill names, decode names): P and D for one of each, else P0.., D0..; E alone for single."""
    num_prefill, num_decode = parse_topology(topology)
    if num_prefill == 0:
        return [], ["E"]
    if (num_prefill, num_decode) == (1, 1):
        return ["P"], ["D"]
    return [f"P{i}" for i in range(num_prefill)], [f"D{i}" for i in range(num_decode)]


def engine_roles(topology: str) -> list[tuple[str, str | None]]:
    """(engine name, kv_role) of each engine, the prefill engines first; None: no connector."""
    prefill, decode = engine_names(topology)
    if not prefill:
        return [(name, None) for name in decode]
    return [(name, "kv_producer") for name in prefill] + [(name, "kv_consumer") for name in decode]


def prefill_params() -> dict[str, object]:
    """The kv_transfer_params a request goes to P with: hold its KV for D to read."""
    return {"do_remote_decode": True}


DECODE, RELEASE, LOCAL, END = "decode", "release", "local", "end"


def after_prefill(prefill_output: RequestOutput, aborted: bool) -> tuple[str, dict | None]:
    """What the router does once P finished a request: (action, params for D).

    DECODE: send it to D with P's params. RELEASE: the client aborted while P was
    prefilling and P finished anyway, holding blocks for D: send it to D with the params
    and abort it there at once, so D's connector tells P to free them (vLLM's
    abort_immediately) instead of P holding them until expiry. LOCAL: P finished but
    offered no KV (its connector could not): D prefills itself. END: P's output ends it.
    """
    if not prefill_output.finished or prefill_output.finish_reason not in ("length", "stop"):
        return END, None
    params = prefill_output.kv_transfer_params or None
    if prefill_output.finish_reason == "stop" and not params:
        return END, None  # its one token was EOS and P holds nothing for D
    if aborted:
        return (RELEASE, params) if params else (END, None)
    return (DECODE, params) if params else (LOCAL, None)


@dataclass(frozen=True, slots=True)
class AddTo:
    """Command: add the request to `engine`."""

    engine: str
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict | None


@dataclass(frozen=True, slots=True)
class AbortAt:
    """Command: abort the request at `engine`."""

    engine: str
    req_id: str


Command = AddTo | AbortAt


@dataclass(slots=True)
class Route:
    """One request in flight: where it is now and whether the client gave up on it."""

    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    engine: str
    via_prefill: bool
    aborted: bool = False  # over for the client; the engines may still be finishing it


@dataclass(frozen=True, slots=True)
class Routed:
    """What one engine output means: commands for the engines, and what the client sees."""

    commands: tuple[Command, ...] = ()
    output: RequestOutput | None = None  # for the client; None: nothing to show
    action: str | None = None  # after_prefill's, when this was P's final output


class Routing:
    """Every request in flight, each moved P -> D (or to D or E alone) by its engines' outputs.

    Which P and which D: replay/deploy/placement.py's Balancer under the router policy; the D
    is picked once P has finished, as vLLM's toy proxy picks it. A route lives until the
    engine it is at finished the request, aborted ones included: an abort while P prefills
    may lose the race to P's finish (after_prefill's RELEASE).
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        policy: RouterPolicy = "round-robin",
        block_size: int = 16,
    ) -> None:
        """prefill: no names for a topology without P (single); block_size: what `prefix` hashes by."""
        self.balancer = Balancer(prefill, decode, policy)
        self.prefill = frozenset(prefill)
        self.block_size = block_size
        self.routes: dict[str, Route] = {}

    @classmethod
    def for_topology(
        cls, topology: str, policy: RouterPolicy = "round-robin", block_size: int = 16
    ) -> Routing:
        return cls(*engine_names(topology), policy=policy, block_size=block_size)

    def add(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        pd: bool | None = None,
        block_hashes: Sequence[Hashable] | None = None,
    ) -> list[Command]:
        """A new request; pd=False sends a request of a P/D topology to a decode engine alone.

        block_hashes: the prompt's full blocks' (the prefix policy hashes them itself if not given)."""
        if req_id in self.routes:
            raise ValueError(f"request id {req_id!r} is already in flight")
        if not self.prefill or pd is False:
            engine = self._move_to(self.balancer.pick_decode())
            self.routes[req_id] = Route(req_id, prompt_token_ids, max_tokens, engine, False)
            return [AddTo(engine, req_id, prompt_token_ids, max_tokens, None)]
        if block_hashes is None and self.balancer.policy == "prefix":
            block_hashes = hash_request_blocks(prompt_token_ids, self.block_size, [])
        engine = self._move_to(self.balancer.pick_prefill(block_hashes or ()))
        self.routes[req_id] = Route(req_id, prompt_token_ids, max_tokens, engine, True)
        return [AddTo(engine, req_id, prompt_token_ids, PREFILL_MAX_TOKENS, prefill_params())]

    def abort(self, req_id: str) -> list[Command]:
        """The client gives up: abort where the request is now (once; unknown ids are ignored)."""
        route = self.routes.get(req_id)
        if route is None or route.aborted:
            return []
        route.aborted = True
        return [AbortAt(route.engine, req_id)]

    def on_output(self, engine: str, output: RequestOutput) -> Routed:
        """One output of `engine`; outputs of requests not (or no longer) there are dropped."""
        route = self.routes.get(output.req_id)
        if route is None or route.engine != engine:
            return Routed()
        if engine in self.prefill:
            return self._on_prefill_output(route, output)
        if output.finished:
            self._end(route)
        return Routed(output=output)

    def _on_prefill_output(self, route: Route, output: RequestOutput) -> Routed:
        if not output.finished:
            return Routed()
        action, params = after_prefill(output, route.aborted)
        if action == END:
            self._end(route)
            if route.aborted:  # the client asked: it ends as an abort, whatever P said
                return Routed(output=RequestOutput(route.req_id, [], "abort"), action=END)
            return Routed(output=output, action=END)
        self.balancer.ended(route.engine)
        route.engine = decode = self._move_to(self.balancer.pick_decode())
        commands: list[Command] = [
            AddTo(decode, route.req_id, route.prompt_token_ids, route.max_tokens, params)
        ]
        if action == RELEASE:
            commands.append(AbortAt(decode, route.req_id))
        return Routed(tuple(commands), action=action)

    def _move_to(self, engine: str) -> str:
        self.balancer.started(engine)
        return engine

    def _end(self, route: Route) -> None:
        del self.routes[route.req_id]
        self.balancer.ended(route.engine)
