"""The P/D router's decisions, shared by the live router and the simulator."""
from __future__ import annotations

import pytest

from connector.router import PDRouter
from connector.routing import DECODE, END, LOCAL, RELEASE, after_prefill
from engine.outputs import RequestOutput

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1]}


@pytest.mark.parametrize("reason,params,aborted,expected", [
    ("length", PARAMS, False, (DECODE, PARAMS)),
    ("length", PARAMS, True, (RELEASE, PARAMS)),  # P finished anyway: D releases its blocks
    ("length", None, False, (LOCAL, None)),  # P offered no KV: D prefills itself
    ("length", None, True, (END, None)),
    ("abort", None, True, (END, None)),
    ("error", None, False, (END, None)),
])
def test_after_prefill(reason, params, aborted, expected):
    assert after_prefill(RequestOutput("r", [9], reason, params), aborted) == expected


class FakeClient:
    def __init__(self, engine_id: str) -> None:
        self.engine_id, self.calls, self.outputs = engine_id, [], []

    def add_request(self, req_id, prompt, max_tokens, params=None):
        self.calls.append(("add", req_id, max_tokens, params))

    def abort(self, req_ids):
        self.calls.append(("abort", *req_ids))

    def get_outputs(self, timeout_s):
        outputs, self.outputs = self.outputs, []
        return outputs

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
    assert [o.finish_reason for o in router.poll(0)] == ["abort"] and not router.pending


def test_aborted_request_ends_as_an_abort_whatever_p_said():
    outputs, _, d, router = routed(RequestOutput("r", [9], "length", None), abort_first=True)
    assert [(o.finish_reason, o.new_token_ids) for o in outputs] == [("abort", [])]
    assert d.calls == [] and not router.pending


def test_duplicate_in_flight_id_is_refused():
    router = PDRouter([FakeClient("P"), FakeClient("D")])
    router.add_request("r", [1], 2)
    with pytest.raises(ValueError, match="already in flight"):
        router.add_request("r", [1], 2)
