"""The routing carries out a trace's faults: phased aborts, a dropped or refused D leg, a
killed engine; the client's records hear of them as RouteEvents."""

from __future__ import annotations

from engine.core.outputs import RequestOutput
from replay.deploy.pd_flow import (
    ABORT_SKIPPED,
    ABORTED,
    DROP,
    DROPPED_ERROR,
    LOST,
    PREFILL_DONE,
    REJECTED_MAX_TOKENS,
    AbortAt,
    AddTo,
    RouteEvent,
    Routing,
)
from replay.deploy.pd_router import PDRouter
from tests.replay.deploy.test_pd_flow import PARAMS, PROMPT, FakeClient


def answered(routing: Routing, req_id: str = "r", engine: str = "P"):
    """P's final output for the request: it answers, holding blocks for D."""
    return routing.on_output(engine, RequestOutput(req_id, [9], "length", PARAMS))


def listening(topology: str = "pd") -> Routing:
    routing = Routing.for_topology(topology)
    routing.listen()
    return routing


def routing_with(req_id: str = "r", fault: str | None = None) -> Routing:
    routing = listening()
    routing.add(req_id, PROMPT, 8, fault=fault)
    return routing


def test_a_route_goes_through_prefill_transfer_and_decode():
    routing = routing_with()
    phases = [routing.routes["r"].phase]
    answered(routing)
    phases.append(routing.routes["r"].phase)
    routing.on_output("D", RequestOutput("r", [4]))
    phases.append(routing.routes["r"].phase)
    assert phases == ["prefill", "transfer", "decode"]
    assert routing.take_events() == [RouteEvent(PREFILL_DONE, "r")]


def test_an_abort_in_the_phase_the_request_is_in_goes_at_once():
    routing = routing_with()
    assert routing.abort("r", "prefill") == [AbortAt("P", "r")]
    assert routing.take_events() == [RouteEvent(ABORTED, "r", phase="prefill")]


def test_an_abort_in_transfer_waits_for_ps_answer_then_releases_through_d():
    routing = routing_with()
    assert routing.abort("r", "transfer") == [] and routing.pending_aborts == {"r": "transfer"}
    routed = answered(routing)
    assert routed.commands == (AddTo("D", "r", PROMPT, 8, PARAMS), AbortAt("D", "r"))
    assert routing.take_events() == [
        RouteEvent(PREFILL_DONE, "r"),
        RouteEvent(ABORTED, "r", phase="transfer"),
    ]


def test_an_abort_in_decode_comes_with_ds_first_token_which_ends_it_for_the_client():
    routing = routing_with()
    routing.abort("r", "decode")
    answered(routing)
    routed = routing.on_output("D", RequestOutput("r", [4], num_cached_tokens=3))
    assert routed.commands == (AbortAt("D", "r"),)
    assert routed.output == RequestOutput("r", [4], "abort", None, 3)
    assert routing.take_events()[-1] == RouteEvent(ABORTED, "r", phase="decode")
    assert routing.on_output("D", RequestOutput("r", [5])).commands == ()  # once


def test_an_abort_whose_phase_passed_is_skipped_saying_where_the_request_was():
    routing = routing_with()
    answered(routing)
    routing.take_events()
    assert routing.abort("r", "prefill") == [] and "r" in routing.routes
    assert routing.take_events() == [
        RouteEvent(ABORT_SKIPPED, "r", phase="transfer", when="prefill")
    ]
    assert routing.abort("gone", "decode") == []
    assert routing.take_events() == [RouteEvent(ABORT_SKIPPED, "gone", when="decode")]


def test_an_abort_waiting_for_a_phase_that_never_comes_is_skipped_when_the_request_ends():
    routing = routing_with()
    routing.abort("r", "decode")
    answered(routing)
    routing.on_output("D", RequestOutput("r", [4], "length"))  # its one token ended it
    assert routing.take_events()[-1] == RouteEvent(ABORT_SKIPPED, "r", when="decode")
    direct = listening()
    direct.add("d", PROMPT, 8, pd=False)  # no P: no transfer phase
    direct.abort("d", "transfer")
    direct.streamed("d")
    assert direct.take_events() == [RouteEvent(ABORT_SKIPPED, "d", phase="decode", when="transfer")]


def test_a_plain_abort_takes_the_place_of_one_that_waits():
    routing = routing_with()
    routing.abort("r", "decode")
    assert routing.abort("r") == [AbortAt("P", "r")]
    assert routing.take_events() == [
        RouteEvent(ABORT_SKIPPED, "r", phase="prefill", when="decode"),
        RouteEvent(ABORTED, "r", phase="prefill"),
    ]


def test_drop_decode_ends_the_request_at_ps_answer_and_never_sends_the_d_leg():
    routing = routing_with(fault="drop_decode")
    routed = answered(routing)
    assert routed.commands == () and routed.action == DROP and not routing.routes
    assert routed.output == RequestOutput("r", [], "error", error=DROPPED_ERROR)
    assert routing.take_events() == [RouteEvent(PREFILL_DONE, "r", fault="drop_decode")]
    assert routing.balancer.num_in_flight == {"P": 0, "D": 0}


def test_reject_decode_sends_the_d_leg_in_the_form_d_refuses():
    routing = routing_with(fault="reject_decode")
    routed = answered(routing)
    assert routed.commands == (AddTo("D", "r", PROMPT, REJECTED_MAX_TOKENS, PARAMS),)
    assert routing.take_events() == [RouteEvent(PREFILL_DONE, "r", fault="reject_decode")]
    refused = RequestOutput("r", [], "error", error="max_tokens: must be an integer >= 1")
    assert routing.on_output("D", refused).output is refused and not routing.routes


def test_a_router_nobody_listens_to_keeps_no_events():
    routing = Routing.for_topology("pd")  # a serve's: it never takes them
    routing.add("r", PROMPT, 8, fault="drop_decode")
    answered(routing)
    assert routing.events is None and routing.take_events() == []


def test_a_killed_engine_loses_its_requests_and_takes_no_more():
    routing = listening("2p1d")
    routing.add("a", PROMPT, 8)
    routing.add("b", PROMPT, 8)
    routing.engine_gone("P0")
    assert routing.take_events() == [RouteEvent(LOST, "a", error="engine P0 was killed")]
    assert [routing.add(f"n{i}", PROMPT, 8)[0].engine for i in range(2)] == ["P1", "P1"]
    routing.engine_gone("D0")
    answered(routing, "b", "P1")
    routing.add("late", PROMPT, 8, pd=False)
    assert [(e.kind, e.req_id, e.error) for e in routing.take_events()] == [
        (PREFILL_DONE, "b", None),  # P holds its blocks: no D will read them
        (LOST, "b", "no decode engine left: every one was killed"),
        (LOST, "late", "no decode engine left: every one was killed"),
    ]


def test_the_router_neither_polls_nor_asks_a_lost_engine():
    p, d = FakeClient("P"), FakeClient("D")
    router = PDRouter([p, d])
    router.routing.listen()
    router.add_request("r", [1, 2, 3], 8)
    router.lose_engine("P")
    calls = list(p.calls)
    router.request_stats()
    p.outputs.append(RequestOutput("r", [9], "length", PARAMS))
    assert router.poll(0) == [] and p.outputs  # never read
    router.add_request("s", [1, 2, 3], 8)
    router.abort("r")
    assert p.calls == calls and (p.num_stats_requests, d.num_stats_requests) == (0, 1)
    assert [e.kind for e in router.routing.take_events()] == [LOST, LOST]
