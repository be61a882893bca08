"""P/D routing: the sans-IO stage machine shared by the live router and the simulator, and the live router over clients."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, KVTransferConfig
from engine.core.outputs import RequestOutput
from engine.proc.messages import Ready
from replay.deploy.pd_flow import (
    DECODE,
    END,
    LOCAL,
    PREFILL_MAX_TOKENS,
    RELEASE,
    AbortAt,
    AddTo,
    Routed,
    Routing,
    after_prefill,
    engine_names,
    engine_roles,
    parse_topology,
    prefill_params,
)
from replay.deploy.pd_router import PDRouter
from replay.deploy.topology import start_topology
from tests.mp_utils import mock_tokens

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1]}
PROMPT = [1, 2, 3]


@pytest.mark.parametrize(
    "reason,params,aborted,expected",
    [
        ("length", PARAMS, False, (DECODE, PARAMS)),
        ("length", PARAMS, True, (RELEASE, PARAMS)),  # P finished anyway: D releases its blocks
        ("length", None, False, (LOCAL, None)),  # P offered no KV: D prefills itself
        ("length", None, True, (END, None)),
        ("stop", PARAMS, False, (DECODE, PARAMS)),  # EOS at P: P holds its blocks all the same
        ("stop", PARAMS, True, (RELEASE, PARAMS)),
        ("stop", None, False, (END, None)),
        ("abort", None, True, (END, None)),
        ("error", None, False, (END, None)),
    ],
)
def test_after_prefill(reason, params, aborted, expected):
    assert after_prefill(RequestOutput("r", [9], reason, params), aborted) == expected


def pd_routing() -> Routing:
    return Routing.for_topology("pd")


def test_request_goes_to_p_for_one_token_then_to_d_with_p_params():
    routing = pd_routing()
    assert routing.add("r", PROMPT, 8) == [
        AddTo("P", "r", PROMPT, PREFILL_MAX_TOKENS, prefill_params())
    ]
    finished_at_p = RequestOutput("r", [9], "length", PARAMS)
    routed = routing.on_output("P", finished_at_p)
    assert routed.commands == (AddTo("D", "r", PROMPT, 8, PARAMS),)
    assert routed.output is None and routed.action == DECODE  # P's token is dropped
    tokens = RequestOutput("r", [4])
    assert routing.on_output("D", tokens).output is tokens and "r" in routing.routes
    last = RequestOutput("r", [5], "length")
    assert routing.on_output("D", last).output is last and not routing.routes


def test_prefill_without_params_lets_d_prefill_itself():
    routing = pd_routing()
    routing.add("r", PROMPT, 8)
    routed = routing.on_output("P", RequestOutput("r", [9], "length", None))
    assert routed.commands == (AddTo("D", "r", PROMPT, 8, None),) and routed.action == LOCAL


def test_other_end_at_p_is_the_client_answer():
    routing = pd_routing()
    routing.add("r", PROMPT, 8)
    failed = RequestOutput("r", [], "error", error="bad token")
    routed = routing.on_output("P", failed)
    assert routed.commands == () and routed.output is failed and routed.action == END
    assert not routing.routes


def test_unfinished_prefill_output_waits():
    routing = pd_routing()
    routing.add("r", PROMPT, 8)
    assert routing.on_output("P", RequestOutput("r", [9])) == Routed()
    assert routing.routes["r"].engine == "P"


@pytest.mark.parametrize(
    "topology,pd,engine", [("pd", False, "D"), ("single", None, "E"), ("single", True, "E")]
)
def test_direct_requests_skip_prefill(topology, pd, engine):
    routing = Routing.for_topology(topology)
    assert routing.add("r", PROMPT, 8, pd) == [AddTo(engine, "r", PROMPT, 8, None)]
    out = RequestOutput("r", [4], "length")
    assert routing.on_output(engine, out).output is out and not routing.routes


def test_abort_goes_where_the_request_is_once():
    routing = pd_routing()
    routing.add("r", PROMPT, 8)
    routing.on_output("P", RequestOutput("r", [9], "length", PARAMS))
    assert routing.abort("r") == [AbortAt("D", "r")]
    assert routing.abort("r") == [] and routing.abort("unknown") == []
    ended = RequestOutput("r", [], "abort")
    assert routing.on_output("D", ended).output is ended and not routing.routes


def test_abort_while_prefilling_then_p_finishes_releases_through_d():
    routing = pd_routing()
    routing.add("r", PROMPT, 8)
    assert routing.abort("r") == [AbortAt("P", "r")]
    routed = routing.on_output("P", RequestOutput("r", [9], "length", PARAMS))
    assert routed.commands == (AddTo("D", "r", PROMPT, 8, PARAMS), AbortAt("D", "r"))
    assert routed.action == RELEASE and routed.output is None and routing.routes["r"].engine == "D"


def test_outputs_from_where_the_request_is_not_are_dropped():
    routing = pd_routing()
    routing.add("r", PROMPT, 8)
    assert routing.on_output("D", RequestOutput("r", [4], "length")).output is None
    assert routing.on_output("P", RequestOutput("unknown", [4], "length")).output is None
    assert routing.routes["r"].engine == "P"


def test_a_router_refuses_clients_that_are_not_its_topologys():
    with pytest.raises(ValueError, match="not topology pd's"):
        PDRouter([FakeClient("D"), FakeClient("P")])


def finish_prefill(routing: Routing, engine: str, req_id: str) -> Routed:
    params = {"do_remote_prefill": True, "remote_engine_id": engine, "remote_request_id": req_id}
    return routing.on_output(
        engine, RequestOutput(req_id, [7], "length", kv_transfer_params=params)
    )


def test_xpyd_requests_go_round_robin_and_each_d_gets_its_own_ps_params():
    routing = Routing.for_topology("2p2d")
    firsts = [routing.add(f"r{i}", [1, 2, 3], 4)[0] for i in range(4)]
    assert [c.engine for c in firsts] == ["P0", "P1", "P0", "P1"]
    moved = [finish_prefill(routing, c.engine, c.req_id).commands[0] for c in reversed(firsts)]
    assert [(c.req_id, c.engine) for c in moved] == [
        ("r3", "D0"),
        ("r2", "D1"),
        ("r1", "D0"),
        ("r0", "D1"),
    ]
    assert [c.kv_transfer_params["remote_engine_id"] for c in moved] == ["P1", "P0", "P1", "P0"]
    assert routing.balancer.num_in_flight == {"P0": 0, "P1": 0, "D0": 2, "D1": 2}
    for c in moved:
        assert (
            routing.on_output(c.engine, RequestOutput(c.req_id, [5], "length")).output is not None
        )
    assert not routing.routes and set(routing.balancer.num_in_flight.values()) == {0}
    assert routing.balancer.num_requests == {"P0": 2, "P1": 2, "D0": 2, "D1": 2}


def test_least_loaded_sends_the_next_request_to_the_idle_prefill_engine():
    routing = Routing.for_topology("2p1d", policy="least-loaded")
    assert routing.add("a", [1], 4)[0].engine == "P0"
    assert routing.add("b", [1], 4)[0].engine == "P1"
    finish_prefill(routing, "P1", "b")  # P1 is free again, P0 still prefills a
    assert routing.add("c", [1], 4)[0].engine == "P1"


def test_prefix_sends_a_shared_prompt_to_the_prefill_engine_that_cached_it():
    routing = Routing.for_topology("2p1d", policy="prefix", block_size=2)
    shared = [1, 2, 3, 4]
    first = routing.add("a", shared + [5, 6], 4)[0].engine
    assert routing.add("b", [9, 9, 9, 9], 4)[0].engine != first  # nothing cached: the idle one
    assert routing.add("c", shared + [7, 8], 4)[0].engine == first


class FakeClient:
    """An EngineClient that records what it is told and returns the outputs a test queues."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id, self.calls, self.outputs = engine_id, [], []
        self.errors: list[str] = []
        self.num_stats_requests = 0

    def wait_ready(self) -> Ready:
        return Ready(self.engine_id, 0, 64, 4, 128, 77, "cpu")

    def add_request(self, req_id, prompt, max_tokens, params=None):
        self.calls.append(("add", req_id, max_tokens, params))

    def abort(self, req_ids):
        self.calls.append(("abort", *req_ids))

    def get_outputs(self, timeout_s):
        outputs, self.outputs = self.outputs, []
        return outputs

    def wait_handles(self):
        return []

    def request_stats(self):
        self.num_stats_requests += 1

    def take_stats(self):
        return []

    def shutdown(self):
        pass


def routed(p_output: RequestOutput, abort_first: bool):
    p, d = FakeClient("P"), FakeClient("D")
    router = PDRouter([p, d])
    router.add_request("r", [1, 2, 3], 8)
    if abort_first:
        router.abort("r")
    p.outputs.append(p_output)
    return router.poll(0), p, d, router


def test_abort_that_loses_the_race_releases_p_through_d():
    outputs, p, d, router = routed(RequestOutput("r", [9], "length", PARAMS), abort_first=True)
    assert p.calls == [("add", "r", 1, {"do_remote_decode": True}), ("abort", "r")]
    assert d.calls == [("add", "r", 8, PARAMS), ("abort", "r")]
    assert outputs == []  # the client hears D's abort output
    d.outputs.append(RequestOutput("r", [], "abort"))
    assert [o.finish_reason for o in router.poll(0)] == ["abort"] and not router.has_pending


def test_aborted_request_ends_as_an_abort_whatever_p_said():
    outputs, _, d, router = routed(RequestOutput("r", [9], "length", None), abort_first=True)
    assert [(o.finish_reason, o.new_token_ids) for o in outputs] == [("abort", [])]
    assert d.calls == [] and not router.has_pending


def test_duplicate_in_flight_id_is_refused():
    router = PDRouter([FakeClient("P"), FakeClient("D")])
    router.add_request("r", [1], 2)
    with pytest.raises(ValueError, match="already in flight"):
        router.add_request("r", [1], 2)


def test_router_asks_every_engine_and_collects_their_errors():
    p, d = FakeClient("P"), FakeClient("D")
    router = PDRouter([p, d])
    router.request_stats()
    d.errors.append("engine D died")
    router.poll(0)
    assert (p.num_stats_requests, d.num_stats_requests) == (1, 1)
    assert router.errors == [("D", "engine D died")] and d.errors == []
    assert router.vocab_size == 77 and router.engines == ["P", "D"]


def test_in_process_topology_routes_like_the_multiprocess_one():
    config = EngineConfig(num_blocks=64, block_size=4, runner="mock")
    router = start_topology(config, KVTransferConfig(), "single", inproc=True)
    try:
        assert router.vocab_size == config.model.vocab_size and router.engines == ["E"]
        router.add_request("r", [5, 6, 7], 3)
        tokens: list[int] = []
        for _ in range(20):  # the mock runner finishes in 3 steps; each poll steps once
            router.request_stats()
            outputs = router.poll(0.01)
            tokens += [t for o in outputs for t in o.new_token_ids]
            if not router.has_pending:
                break
        assert tokens == mock_tokens([5, 6, 7], 3) and router.take_stats() == []
    finally:
        router.shutdown()


@pytest.mark.parametrize(
    "topology, names",
    [
        ("single", ([], ["E"])),
        ("pd", (["P"], ["D"])),
        ("1p1d", (["P"], ["D"])),
        ("2p2d", (["P0", "P1"], ["D0", "D1"])),
        ("1p3d", (["P0"], ["D0", "D1", "D2"])),
    ],
)
def test_topologies_name_their_engines(topology, names):
    assert engine_names(topology) == names
    roles = engine_roles(topology)
    assert [n for n, _ in roles] == names[0] + names[1]
    assert {r for _, r in roles} == (
        {None} if topology == "single" else {"kv_producer", "kv_consumer"}
    )


@pytest.mark.parametrize("topology", ["", "0p1d", "2p", "p2d", "2p2", "pdd", "100p1d", "2P2D"])
def test_a_topology_that_is_no_form_is_refused_naming_the_forms(topology):
    with pytest.raises(ValueError, match="NpMd"):
        parse_topology(topology)
