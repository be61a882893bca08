"""Every way a P/D request ends on D releases P's blocks.

One bad request used to pin P's KV blocks until the lease ran out: the router sent it to
P as a prefill, P held its blocks for D, and D refused it (max_tokens 0, an empty or
out-of-vocabulary prompt, a duplicate id) in a path that never told P. Now the front
refuses such a request before P sees it, and every path that ends a P/D request on D
tells P to free (the NIXL rule: an empty receive). The property test throws valid and
broken requests at D on the virtual clock and finds no block held once traffic stops.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.pd import PDConnector
from engine.config import EngineConfig, KVTransferConfig
from engine.core.outputs import RequestOutput
from engine.core.request import Request
from engine.core.request_check import RequestLimits, why_invalid
from engine.core.scheduler import Scheduler
from replay.deploy.pd_router import PDRouter
from replay.sim.clock import DELIVER, EventLoop, to_ns
from replay.sim.engine import AbortInput, AddInput, EngineSlot, SimEngine
from replay.sim.kv_worker import SimKVWorker
from replay.sim.options import SimOptions

VOCAB = 512


def remote_params(req_id: str = "p1", num_blocks: int = 3, addr: str = "ipc:///tmp/x/P-kv") -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P",
        "remote_request_id": req_id,
        "remote_block_ids": list(range(1, num_blocks + 1)),
        "remote_addr": addr,
    }


def d_scheduler(**overrides) -> Scheduler:
    config = EngineConfig(
        num_blocks=32,
        block_size=4,
        engine_id="D",
        kv_transfer=KVTransferConfig(kv_role="kv_consumer"),
        **overrides,
    )
    return Scheduler(config, PDConnector(config))


def releases(sched: Scheduler) -> list[tuple[str, str]]:
    """(D's id, P's send) of every empty receive the next step ships."""
    meta = sched.schedule().kv_connector_metadata
    specs = [*meta.reqs_to_recv.values(), *meta.reqs_to_release]
    return sorted((s.req_id, s.remote_request_id) for s in specs if not s.local_block_ids)


# ---- the checks at the front ---------------------------------------------------------


@pytest.mark.parametrize(
    "prompt,max_tokens,why",
    [
        ([1, 2], 0, "max_tokens: must be an integer >= 1"),
        ([1, 2], True, "max_tokens: must be an integer >= 1"),
        ([], 4, "non-empty"),
        ([1, VOCAB], 4, f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
        ([-1, 2], 4, "token id -1 is outside"),
        ([1, "2"], 4, "every token id must be an integer"),
        (list(range(64)), 4, "a prompt of 64 tokens does not fit max_model_len 64"),
    ],
)
def test_the_front_check_names_what_is_wrong(prompt, max_tokens, why):
    assert why in why_invalid(prompt, max_tokens, RequestLimits(64, VOCAB))


def test_a_valid_request_passes_the_front_check():
    assert why_invalid(list(range(63)), 1, RequestLimits(64, VOCAB)) is None


class _RecordingClient:
    """An engine client that records what it was sent (nothing must be)."""

    def __init__(self, engine_id: str) -> None:
        from engine.proc.messages import Ready

        self.engine_id, self.errors, self.sent = engine_id, [], []
        self.ready = Ready(engine_id, 1, 32, 4, 64, VOCAB, "cpu")

    def wait_ready(self):
        return self.ready

    def add_request(self, *args) -> None:
        self.sent.append(args)

    def get_outputs(self, timeout_s: float) -> list[RequestOutput]:
        return []

    def wait_handles(self) -> list:
        return []


def test_the_router_refuses_a_bad_request_before_p_sees_it():
    """The finding: max_tokens 0 went to P as a prefill (max_tokens 1) and pinned its blocks."""
    p, d = _RecordingClient("P"), _RecordingClient("D")
    router = PDRouter([p, d])
    router.add_request("bad", [1, 2, 3], 0)
    router.add_request("oov", [1, VOCAB + 7], 4)
    router.add_request("good", [1, 2, 3], 4)
    outputs = router.poll(0)
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("bad", "error"), ("oov", "error")]
    assert "max_tokens" in outputs[0].error and "vocabulary" in outputs[1].error
    assert [args[0] for args in p.sent] == ["good"] and d.sent == []
    assert router.num_rejected == 2 and list(router.routing.routes) == ["good"]


def test_the_router_ignores_a_prompt_over_max_model_len_as_the_scheduler_does():
    """It answered "error": a wall replay of prompts too long said VERIFIED with them failed,
    where the virtual clock (the scheduler's FINISHED_IGNORED) counted them ignored."""
    from replay.verify.coverage import ignored_cause
    from replay.verify.timeline import RequestRecord

    p, d = _RecordingClient("P"), _RecordingClient("D")
    router = PDRouter([p, d])
    router.add_request("long", list(range(64)), 4)
    (output,) = router.poll(0)
    assert (output.finish_reason, output.new_token_ids) == ("length", [])
    assert p.sent == d.sent == [] and router.num_rejected == 1
    record = RequestRecord(
        req_id="long",
        arrival_t=0.0,
        send_t=0.0,
        send_lateness_s=0.0,
        first_token_t=None,
        end_t=0.0,
        num_prompt_tokens=64,
        num_output_tokens=0,
        num_prefix_hit_tokens=None,
        finish_reason=output.finish_reason,
        error=output.error,
    )
    assert ignored_cause(record) == "prompt longer than max_model_len"


# ---- D's scheduler side: every end releases P ------------------------------------------


def test_a_malformed_request_on_d_releases_p():
    """EngineCore.add_request's error path used to return without telling the connector."""
    from engine.core.engine_core import EngineCore
    from engine.runner.mock_runner import MockModelRunner

    config = EngineConfig(
        num_blocks=32,
        block_size=4,
        engine_id="D",
        kv_transfer=KVTransferConfig(kv_role="kv_consumer"),
    )
    core = EngineCore(config, MockModelRunner(config), PDConnector(config))
    for req_id, prompt, max_tokens in (
        ("zero", [1] * 12, 0),
        ("empty", [], 4),
        ("oov", [VOCAB] * 12, 4),
    ):
        (out,) = core.add_request(req_id, prompt, max_tokens, remote_params(f"p-{req_id}"))
        assert out.finish_reason == "error"
    assert core.has_work()  # the release must reach the connector's agent in a step
    assert releases(core.scheduler) == [("empty", "p-empty"), ("oov", "p-oov"), ("zero", "p-zero")]


def test_a_duplicate_releases_its_own_send_but_never_the_originals():
    sched = d_scheduler()
    sched.add_request(Request("d", [1] * 12, 4, 4, kv_transfer_params=remote_params("p-first")))
    dup = sched.add_request(
        Request("d", [2] * 12, 4, 4, kv_transfer_params=remote_params("p-second"))
    )
    resent = sched.add_request(
        Request("d", [1] * 12, 4, 4, kv_transfer_params=remote_params("p-first"))
    )
    assert dup.finish_reason == resent.finish_reason == "error"
    meta = sched.schedule().kv_connector_metadata
    assert [s.remote_request_id for s in meta.reqs_to_recv.values()] == ["p-first"]  # the load
    assert [(s.req_id, s.remote_request_id, s.local_block_ids) for s in meta.reqs_to_release] == [
        ("d", "p-second", [])
    ]
    assert "d" not in meta.reqs_to_send and "d" not in sched.finished_req_ids


def test_params_that_do_not_fit_are_computed_locally_and_release_p():
    """vLLM NIXL: a request with remote blocks but nothing to load sends an empty receive."""
    sched = d_scheduler()
    sched.add_request(
        Request("d", [1] * 12, 4, 4, kv_transfer_params=remote_params("p1", num_blocks=7))
    )
    assert releases(sched) == [("d", "p1")]
    assert sched.connector.num_bad_params == 1


def test_ignored_with_params_that_do_not_fit_still_releases_p():
    sched = d_scheduler(max_model_len=8)
    out = sched.add_request(Request("d", [1] * 12, 4, 4, kv_transfer_params=remote_params("p1")))
    assert out.finish_reason == "length" and releases(sched) == [("d", "p1")]


# ---- end to end, real processes -----------------------------------------------------------


@pytest.mark.slow
def test_d_refusing_a_request_frees_p_long_before_the_lease():
    """The finding end to end: P prefilled a request whose D refuses it (max_tokens 0, sent
    to D directly, past the front); P's blocks come back in well under the 30 s lease."""
    from replay.deploy.topology import start_topology

    base = EngineConfig(num_blocks=64, block_size=4, runner="mock", liveness="event")
    router = start_topology(base, KVTransferConfig(kv_lease_s=30.0))
    p, d = router.clients["P"], router.clients["D"]
    try:
        p.add_request("r", list(range(1, 41)), 1, {"do_remote_decode": True})
        (prefill,) = _wait_outputs(p, 1)
        assert prefill.kv_transfer_params["do_remote_prefill"]
        assert _used_blocks(p) == 10  # held for D
        d.add_request("r", list(range(1, 41)), 0, prefill.kv_transfer_params)
        (refused,) = _wait_outputs(d, 1)
        assert refused.finish_reason == "error"
        deadline = time.monotonic() + 5.0
        while _used_blocks(p) and time.monotonic() < deadline:
            p.get_outputs(0.05)
        assert _used_blocks(p) == 0, "P still holds the refused request's blocks"
        assert p.latest_stats.counts["num_released_unread"] == 1
        assert p.latest_stats.counts["num_expired"] == 0
    finally:
        router.shutdown()


def _wait_outputs(client, n: int, timeout_s: float = 30.0) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout_s
    while len([o for o in outputs if o.finished]) < n:
        assert time.monotonic() < deadline, f"{client.engine_id}: no output in {timeout_s} s"
        outputs += client.get_outputs(0.05)
    return [o for o in outputs if o.finished]


def _used_blocks(client) -> int:
    asked = time.monotonic()
    client.request_stats()
    deadline = asked + 10.0
    while client.latest_stats is None or client.latest_stats.monotonic < asked:
        assert time.monotonic() < deadline, "no stats"
        client.get_outputs(0.02)
    return client.latest_stats.counts["num_used_blocks"]


# ---- the property: valid and broken requests, no block held at quiescence ----------------

FAULTS = (
    "valid",
    "max_tokens_0",
    "empty_prompt",
    "oov",
    "too_long",
    "bad_params",
    "duplicate",
    "resend",
    "abort_at_once",
    "abort_later",
    "abort_on_p",
)


class _HostileProxy:
    """A P/D proxy on the virtual clock that sends each request to P, then to D the way
    its fault says: as it should, or broken past any front."""

    def __init__(self, options: SimOptions) -> None:
        self.loop, self.workers = EventLoop(), {}
        self.options = options
        self.engines = {
            name: self._engine(name, rank, role)
            for rank, (name, role) in enumerate((("P", "kv_producer"), ("D", "kv_consumer")))
        }
        self.faults: dict[str, tuple[str, list[int], int]] = {}
        self.last_on_d: str | None = None

    def _engine(self, name: str, rank: int, role: str) -> SimEngine:
        worker = SimKVWorker(name, self.loop, self.options, self.workers)
        slot = EngineSlot(rank, self.on_outputs, lambda sample: None)
        return SimEngine(
            self.options.engine_config(name, role), slot, self.loop, self.options, worker
        )

    def submit(self, req_id: str, fault: str, prompt: list[int], max_tokens: int) -> None:
        self.faults[req_id] = (fault, prompt, max_tokens)
        self.engines["P"].deliver(AddInput(req_id, prompt, 1, {"do_remote_decode": True}))
        if fault == "abort_on_p":
            self.engines["P"].deliver(AbortInput(req_id))

    def on_outputs(self, engine: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if engine == "P" and out.finished and out.kv_transfer_params:
                self._to_decode(out.req_id, out.kv_transfer_params)

    def _to_decode(self, req_id: str, params: dict) -> None:
        fault, prompt, max_tokens = self.faults[req_id]
        d = self.engines["D"]
        add = AddInput(req_id, prompt, max_tokens, params)
        if fault == "max_tokens_0":
            add = replace(add, max_tokens=0)
        elif fault == "empty_prompt":
            add = replace(add, prompt=[])
        elif fault == "oov":
            add = replace(add, prompt=[VOCAB + 1, *prompt[1:]])
        elif fault == "too_long":
            add = replace(
                add, prompt=prompt * (self.options.engine.max_model_len // len(prompt) + 1)
            )
        elif fault == "bad_params":
            add = replace(add, kv_transfer_params={**params, "remote_block_ids": [1]})
        elif fault == "duplicate" and self.last_on_d is not None:
            add = replace(add, req_id=self.last_on_d)  # refused while that one is on D
        d.deliver(add)
        if fault == "resend":
            d.deliver(add)  # the same send twice: the duplicate must not release it
        elif fault == "abort_at_once":
            d.deliver(AbortInput(add.req_id))
        elif fault == "abort_later":
            self.loop.push(
                self.loop.now + to_ns(0.003), DELIVER, 0, d.deliver, AbortInput(add.req_id)
            )
        self.last_on_d = add.req_id

    def run_until(self, t_ns: int) -> None:
        while self.loop.heap and self.loop.heap[0][0] <= t_ns:
            fn, arg = self.loop.pop()
            fn(arg)
        self.loop.now = max(self.loop.now, t_ns)


requests = st.lists(
    st.tuples(
        st.integers(0, 20),  # ms since the previous request
        st.sampled_from(FAULTS),
        st.integers(1, 40),  # prompt tokens
        st.integers(1, 6),
    ),  # max_tokens
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, st.sampled_from(["poll", "event"]), st.sampled_from(["fail", "recompute"]))
def test_no_block_is_held_at_quiescence(ops, liveness, policy):
    """Long before the 30 s lease, every block of both engines is free again and P holds
    no send: nothing was released by expiry, everything by D's word."""
    engine = EngineConfig(
        num_blocks=96,
        block_size=4,
        max_model_len=64,
        liveness=liveness,
        kv_load_failure_policy=policy,
        runner="mock",
    )
    proxy = _HostileProxy(SimOptions(engine=engine, kv=KVTransferConfig(kv_lease_s=30.0)))
    t = 0
    for i, (gap_ms, fault, prompt_len, max_tokens) in enumerate(ops):
        t += to_ns(gap_ms / 1000)
        proxy.run_until(t)
        prompt = [(7 * i + j) % VOCAB for j in range(prompt_len)]
        proxy.submit(f"r{i}", fault, prompt, max_tokens)
    proxy.run_until(t + to_ns(2.0))
    for name, sim_engine in proxy.engines.items():
        sched = sim_engine.core.scheduler
        sched.block_pool.check_invariants()
        assert sched.block_pool.get_num_used_blocks() == 0, (name, sorted(sched.requests))
        assert not sched.requests, (name, sorted(sched.requests))
    ledger = proxy.workers["P"].ledger
    assert not ledger.sends and ledger.counters["num_expired"] == 0
