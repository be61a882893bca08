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

Faults (replay/trace/records.py): a request's way has phases the client can tell apart,
`prefill` (P has it and has not answered), `transfer` (P answered, D has streamed no
token) and `decode` (D streams); a request not routed through P goes from prefill (no
token yet) to decode. An abort with a phase waits for it and is carried out at its first
moment, or is skipped if the phase has passed. `drop_decode` ends the request at P's
answer and never sends the D leg; `reject_decode` sends it with max_tokens 0, which D's
engine refuses before admission (engine/core/request_check.py), as vLLM's front refuses
a request that fails validation. A killed engine is gone: its requests end, and no
request is given to it again. What the client's records need of all this comes as
RouteEvents (take_events).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.core.block_hash import hash_request_blocks
from engine.core.outputs import RequestOutput
from replay.deploy.placement import Balancer, RouterPolicy

TOPOLOGIES = ("pd", "single")
TOPOLOGY_FORMS = "single, pd (= 1p1d) or NpMd (N prefill and M decode engines: 2p2d, 1p3d, ...)"
NPMD = re.compile(r"([1-9][0-9]?)p([1-9][0-9]?)d")
PREFILL_MAX_TOKENS = 1  # P computes the prompt's KV; its one sampled token is dropped
# reject_decode's D leg: a max_tokens that D's validation refuses before admission.
REJECTED_MAX_TOKENS = 0
DROPPED_ERROR = "drop_decode: the D leg was never sent"
_PHASE_ORDER = {"prefill": 0, "transfer": 1, "decode": 2}


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


DECODE, RELEASE, LOCAL, END, DROP = "decode", "release", "local", "end", "drop"


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

RouteEventKind = Literal["prefill_done", "aborted", "abort_skipped", "lost"]
PREFILL_DONE, ABORTED, ABORT_SKIPPED, LOST = "prefill_done", "aborted", "abort_skipped", "lost"


@dataclass(frozen=True, slots=True)
class RouteEvent:
    """What became of a request on its way, for the client's record: P answered holding
    blocks for D (PREFILL_DONE; `fault`: the request fault carried out there), the
    client's abort carried out (ABORTED, in `phase`) or skipped (ABORT_SKIPPED: `when`
    had passed; `phase` where the request was, None: it had ended), or the request lost
    with its engine (LOST, `error`: what the client is told)."""

    kind: RouteEventKind
    req_id: str
    phase: str | None = None
    when: str | None = None
    fault: str | None = None
    error: str | None = None


@dataclass(slots=True)
class Route:
    """One request in flight: where it is now and whether the client gave up on it."""

    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    engine: str
    via_prefill: bool
    aborted: bool = False  # over for the client; the engines may still be finishing it
    fault: str | None = None  # the trace's drop_decode or reject_decode
    prefill_done: bool = False  # P answered
    streaming: bool = False  # D (or the lone engine) sent a token

    @property
    def phase(self) -> str:
        """prefill, transfer or decode (module docstring)."""
        if self.streaming:
            return "decode"
        return "transfer" if self.prefill_done else "prefill"


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
        self.pending_aborts: dict[str, str] = {}  # req_id -> the phase its abort waits for
        self.gone: set[str] = set()  # killed engines
        # for the client's records, oldest first; None: nobody listens (a serve's router)
        self.events: list[RouteEvent] | None = None

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
        fault: str | None = None,
    ) -> list[Command]:
        """A new request; pd=False sends a request of a P/D topology to a decode engine alone;
        fault: the trace's drop_decode or reject_decode for its D leg.

        block_hashes: the prompt's full blocks' (the prefix policy hashes them itself if not given)."""
        if req_id in self.routes:
            raise ValueError(f"request id {req_id!r} is already in flight")
        if not self.prefill or pd is False:
            if not self.balancer.decode:
                return self._lose(req_id, "decode")
            engine = self._move_to(self.balancer.pick_decode())
            self.routes[req_id] = Route(req_id, prompt_token_ids, max_tokens, engine, False)
            return [AddTo(engine, req_id, prompt_token_ids, max_tokens, None)]
        if not self.balancer.prefill:
            return self._lose(req_id, "prefill")
        if block_hashes is None and self.balancer.policy == "prefix":
            block_hashes = hash_request_blocks(prompt_token_ids, self.block_size, [])
        engine = self._move_to(self.balancer.pick_prefill(block_hashes or ()))
        route = Route(req_id, prompt_token_ids, max_tokens, engine, True, fault=fault)
        self.routes[req_id] = route
        return [AddTo(engine, req_id, prompt_token_ids, PREFILL_MAX_TOKENS, prefill_params())]

    def abort(self, req_id: str, when: str | None = None) -> list[Command]:
        """The client gives up: abort where the request is now (once; unknown ids are
        ignored); with `when`, at the first moment it is in that phase (module docstring)."""
        route = self.routes.get(req_id)
        if route is None or route.aborted:
            if when is not None:
                self._skip(req_id, when, None)
            return []
        waiting = self.pending_aborts.get(req_id)
        if waiting is not None and when is not None:  # one abort waits already: it stands
            self._skip(req_id, when, route.phase)
            return []
        if when is None or route.phase == when:
            if waiting is not None:
                self._skip(req_id, self.pending_aborts.pop(req_id), route.phase)
            return self._abort_now(route)
        if _PHASE_ORDER[when] > _PHASE_ORDER[route.phase]:
            self.pending_aborts[req_id] = when
        else:
            self._skip(req_id, when, route.phase)
        return []

    def streamed(self, req_id: str) -> list[Command]:
        """The request's engine sent the client its first token (drivers that take plain
        outputs past on_output say so here): its decode phase began."""
        route = self.routes.get(req_id)
        if route is None or route.streaming:
            return []
        route.streaming = True
        when = self.pending_aborts.get(req_id)
        if when == "decode":
            return self._abort_now(route)
        if when is not None:
            self._skip(req_id, self.pending_aborts.pop(req_id), "decode")
        return []

    def engine_gone(self, engine: str) -> None:
        """`engine` was killed: the requests there are lost (LOST events), and no request
        is given to it again."""
        self.gone.add(engine)
        self.balancer.remove(engine)
        for route in [r for r in self.routes.values() if r.engine == engine]:
            self._end(route)
            if not route.aborted:
                self._note(RouteEvent(LOST, route.req_id, error=f"engine {engine} was killed"))

    def listen(self) -> None:
        """Keep RouteEvents from now on, for take_events (a replay's driver listens)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[RouteEvent]:
        """The events since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _note(self, event: RouteEvent) -> None:
        if self.events is not None:
            self.events.append(event)

    def on_output(self, engine: str, output: RequestOutput) -> Routed:
        """One output of `engine`; outputs of requests not (or no longer) there are dropped."""
        route = self.routes.get(output.req_id)
        if route is None or route.engine != engine:
            return Routed()
        if engine in self.prefill:
            return self._on_prefill_output(route, output)
        if output.finished:
            self._end(route)
        elif output.new_token_ids and not route.streaming:
            commands = tuple(self.streamed(route.req_id))
            if route.aborted:  # its abort waited for this token: the client stops here
                output = RequestOutput(
                    route.req_id, output.new_token_ids, "abort", None, output.num_cached_tokens
                )
            return Routed(commands, output=output)
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
        if route.fault == "drop_decode":
            return self._drop(route, params)
        self.balancer.ended(route.engine)
        if not self.balancer.decode:
            return self._lose_at_prefill(route, params)
        route.engine = decode = self._move_to(self.balancer.pick_decode())
        route.prefill_done = True
        self._note_prefill_done(route, params, route.fault)
        commands: list[Command] = [self._decode_leg(route, decode, params)]
        if action == RELEASE and route.fault != "reject_decode":
            commands.append(AbortAt(decode, route.req_id))
        elif self.pending_aborts.get(route.req_id) == "transfer":
            commands += self._abort_now(route)
        return Routed(tuple(commands), action=action)

    def _decode_leg(self, route: Route, decode: str, params: dict | None) -> AddTo:
        """The D leg: the request with P's params, or reject_decode's refused form."""
        max_tokens = REJECTED_MAX_TOKENS if route.fault == "reject_decode" else route.max_tokens
        return AddTo(decode, route.req_id, route.prompt_token_ids, max_tokens, params)

    def _drop(self, route: Route, params: dict | None) -> Routed:
        """drop_decode: the request ends at P's answer; P holds its blocks for a D leg that
        never comes."""
        self._end(route)
        self._note_prefill_done(route, params, "drop_decode")
        if route.aborted:
            return Routed(action=DROP)
        return Routed(
            output=RequestOutput(route.req_id, [], "error", error=DROPPED_ERROR), action=DROP
        )

    def _lose_at_prefill(self, route: Route, params: dict | None) -> Routed:
        """P answered, but every decode engine is gone: the request is lost there."""
        del self.routes[route.req_id]
        self._note_prefill_done(route, params, None)
        self._forget(route)
        if not route.aborted:
            self._note(RouteEvent(LOST, route.req_id, error=_no_engine_left("decode")))
        return Routed(action=DROP)

    def _note_prefill_done(self, route: Route, params: dict | None, fault: str | None) -> None:
        if params:  # P holds blocks for D from now
            self._note(RouteEvent(PREFILL_DONE, route.req_id, fault=fault))

    def _abort_now(self, route: Route) -> list[Command]:
        route.aborted = True
        self.pending_aborts.pop(route.req_id, None)
        self._note(RouteEvent(ABORTED, route.req_id, phase=route.phase))
        return [AbortAt(route.engine, route.req_id)]

    def _skip(self, req_id: str, when: str, phase: str | None) -> None:
        self._note(RouteEvent(ABORT_SKIPPED, req_id, phase=phase, when=when))

    def _lose(self, req_id: str, role: str) -> list[Command]:
        """No engine of `role` is left to take a new request: it is lost at once."""
        self._note(RouteEvent(LOST, req_id, error=_no_engine_left(role)))
        return []

    def _forget(self, route: Route) -> None:
        """A route that ended: its pending abort, if any, is skipped (its phase never came)."""
        when = self.pending_aborts.pop(route.req_id, None)
        if when is not None:
            self._skip(route.req_id, when, None)

    def _move_to(self, engine: str) -> str:
        self.balancer.started(engine)
        return engine

    def _end(self, route: Route) -> None:
        del self.routes[route.req_id]
        self.balancer.ended(route.engine)
        self._forget(route)


def _no_engine_left(role: str) -> str:
    return f"no {role} engine left: every one was killed"
