"""P/D routing decisions: a topology's engines and a request's way from P to D. Runs in: frontend process.

vLLM's disaggregated proxy, as the decisions that the live router (connector/router.py)
and the virtual-clock simulator (replay/sim/simulation.py) share, so that both route alike.
Pure: no zmq, no clock, no I/O, so the simulator imports it without the live stack.

`pd`: engines P (kv_producer) and D (kv_consumer). A request goes to P with
max_tokens=1 and do_remote_decode; P's final output carries the params its connector
returned. When P finished by length with params, the request goes to D with them and the
real max_tokens, and D's tokens are the answer (P's token is dropped: D samples the first
token itself). Any other end at P ends the request.
`single`: one engine E, no connector.
"""
from __future__ import annotations

from engine.outputs import RequestOutput

TOPOLOGIES = ("pd", "single")
PREFILL_MAX_TOKENS = 1  # P computes the prompt's KV; its one sampled token is dropped


def engine_roles(topology: str) -> list[tuple[str, str | None]]:
    """(engine name, kv_role) of each engine, the prefill engine first; None: no connector."""
    if topology == "single":
        return [("E", None)]
    if topology != "pd":
        raise ValueError(f"topology: must be one of {TOPOLOGIES}, got {topology!r}")
    return [("P", "kv_producer"), ("D", "kv_consumer")]


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
    if not prefill_output.finished or prefill_output.finish_reason != "length":
        return END, None
    params = prefill_output.kv_transfer_params or None
    if aborted:
        return (RELEASE, params) if params else (END, None)
    return (DECODE, params) if params else (LOCAL, None)
