"""What P does with an unread request's blocks while idle, release by release, on the virtual clock.

Each test drives a P and a D engine (replay/sim's SimEngine, the engine core and the send
ledger the processes run) told one vLLM release, through the fault that leaves P's send
unread, and asserts when P frees it. Each cites the vLLM file and function it mirrors
(engine/core/release.py's facts); where vLLM's own code can run here, tests/parity checks
the same rule against it (`--check-releases`).
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, KVTransferConfig
from engine.core.outputs import RequestOutput
from engine.core.release import VllmRelease, liveness_of
from replay.sim.clock import DELIVER, EventLoop, to_ns
from replay.sim.engine import AbortInput, AddInput, EngineSlot, SimEngine
from replay.sim.kv_worker import SimKVWorker
from replay.sim.options import SimOptions

PROMPT = list(range(1, 30))  # 8 blocks of 4 tokens
FATES = ("read", "drop", "reject", "abort_in_step")


class _Proxy:
    """A P/D proxy on the virtual clock: each request goes to P, then to D as its fate
    says: read (D pulls it), drop (the D leg is never sent), reject (D refuses it before
    admission: max_tokens 0), abort_in_step (the client aborts it while P runs its last
    prefill step)."""

    def __init__(self, release: str, liveness: str | None = None, pull_delay_ms: float = 0.0):
        engine = EngineConfig(
            num_blocks=64,
            block_size=4,
            max_model_len=256,
            liveness=liveness or liveness_of(VllmRelease.parse(release)),
            vllm_release=release,
        )
        kv = KVTransferConfig(pull_delay_ms=pull_delay_ms)
        self.options = SimOptions(engine=engine, kv=kv)
        self.loop, self.workers, self.fates = EventLoop(), {}, {}
        self.outputs: dict[str, RequestOutput] = {}
        self.engines = {
            name: self._engine(name, rank, role)
            for rank, (name, role) in enumerate((("P", "kv_producer"), ("D", "kv_consumer")))
        }

    def _engine(self, name: str, rank: int, role: str) -> SimEngine:
        worker = SimKVWorker(name, self.loop, self.options, self.workers)
        slot = EngineSlot(rank, self.on_outputs, lambda sample: None)
        config = self.options.engine_config(name, role)
        return SimEngine(config, slot, self.loop, self.options, worker)

    def submit(self, req_id: str, fate: str, t: float) -> None:
        self.fates[req_id] = fate
        add = AddInput(req_id, PROMPT, 1, {"do_remote_decode": True})
        self.loop.push(to_ns(t), DELIVER, 0, self.engines["P"].deliver, add)
        if fate == "abort_in_step":  # P's step starts at t and takes 4 ms or more
            abort = AbortInput(req_id)
            self.loop.push(to_ns(t + 0.001), DELIVER, 0, self.engines["P"].deliver, abort)

    def on_outputs(self, engine: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if engine != "P" or not out.finished:
                continue
            self.outputs[out.req_id] = out
            fate = self.fates[out.req_id]
            if out.kv_transfer_params and fate in ("read", "reject"):
                max_tokens = 4 if fate == "read" else 0
                add = AddInput(out.req_id, PROMPT, max_tokens, out.kv_transfer_params)
                self.engines["D"].deliver(add)

    def run_until(self, t: float) -> None:
        while self.loop.heap and self.loop.heap[0][0] <= to_ns(t):
            fn, arg = self.loop.pop()
            fn(arg)
        self.loop.now = max(self.loop.now, to_ns(t))

    def held_on_p(self) -> set[str]:
        """P's finished requests whose blocks it still holds for D."""
        return set(self.engines["P"].core.scheduler.held_for_send)

    def p_used_blocks(self) -> int:
        return self.engines["P"].core.scheduler.block_pool.get_num_used_blocks()


@pytest.mark.parametrize("release", ["0.22", "0.30", "0.31", "0.34"])
def test_from_0_22_a_dropped_leg_is_freed_when_its_lease_ends(release):
    """nixl/base_worker.py NixlBaseConnectorWorker._reap_expired_send_leases: P frees an
    unread send kv_lease_duration (30 s) after request_finished stamped it, and the idle P
    steps to reap it (#43433's loop; kvdrain's event loop wakes at the lease)."""
    proxy = _Proxy(release)
    proxy.submit("r", "drop", 0.0)
    proxy.run_until(29.9)
    assert proxy.held_on_p() == {"r"} and proxy.p_used_blocks() > 0
    proxy.run_until(30.1)
    assert proxy.held_on_p() == set() and proxy.p_used_blocks() == 0
    assert proxy.workers["P"].ledger.counters["num_expired"] == 1
    assert proxy.engines["P"].num_steps < 10  # woken once, at the lease: no step in between


@pytest.mark.parametrize("release, timer_s", [("0.10", 120.0), ("0.12", 480.0), ("0.21", 480.0)])
def test_before_0_22_an_idle_p_holds_a_dropped_leg_until_it_steps(release, timer_s):
    """nixl_connector.py NixlConnectorWorker.get_finished (0.10-0.21): the fallback timer
    (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s; 120 s before 0.11.2) is read only when P
    steps, and the pre-#43433 loop (scheduler.py has_finished_requests) parks an idle P:
    held through any idle time, freed by the first step after the timer."""
    proxy = _Proxy(release)
    proxy.submit("r", "drop", 0.0)
    proxy.run_until(3 * timer_s)
    assert proxy.held_on_p() == {"r"}
    assert proxy.engines["P"].num_steps < 10  # parked: the idle time cost no step
    proxy.submit("next", "read", 3 * timer_s)
    proxy.run_until(3 * timer_s + 0.1)
    assert proxy.held_on_p() == {"next"}  # its own "read done" waits for the next step
    assert proxy.workers["P"].ledger.counters["num_expired"] == 1


@pytest.mark.parametrize("release, timer_s", [("0.11.1", 120.0), ("0.21", 480.0)])
def test_before_0_22_a_stepping_p_frees_a_dropped_leg_at_the_timer_not_before(release, timer_s):
    """The same timer under `--liveness event` (a loop that steps for it): freed when the
    timer ends, and D's heartbeats extend nothing (no lease before 0.22: D sends none)."""
    proxy = _Proxy(release, liveness="event", pull_delay_ms=600_000)
    proxy.submit("slow", "read", 0.0)  # D waits 600 s before it reads, sending no heartbeat
    proxy.submit("r", "drop", 0.1)
    proxy.run_until(timer_s)
    assert proxy.held_on_p() == {"slow", "r"}
    proxy.run_until(timer_s + 0.2)
    assert proxy.held_on_p() == set()  # the slow one too: its timer is not extended
    assert proxy.workers["P"].ledger.counters["num_heartbeats"] == 0


@pytest.mark.parametrize(
    "release, freed_at_once", [("0.20.2", False), ("0.21", False), ("0.22", True), ("0.34", True)]
)
def test_d_refusing_a_leg_frees_p_at_once_from_0_22(release, freed_at_once):
    """vllm/v1/engine/async_llm.py AsyncLLM.notify_kv_transfer_request_rejected (0.21,
    #41269): D's refusal before admission tells P, which frees at once. 0.21 has it, but
    its idle P never steps to read it (the pre-#43433 loop); before 0.21 nobody tells P."""
    proxy = _Proxy(release)
    proxy.submit("r", "reject", 0.0)
    proxy.run_until(1.0)
    assert proxy.held_on_p() == (set() if freed_at_once else {"r"})
    proxy.submit("next", "read", 100.0)  # P steps again, long before any timer
    proxy.run_until(100.1)
    notified = VllmRelease.parse(release) >= VllmRelease(0, 21)
    assert ("r" in proxy.held_on_p()) is not notified
    assert proxy.workers["P"].ledger.counters["num_expired"] == 0


@pytest.mark.parametrize(
    "release, freed_at_once", [("0.12", False), ("0.13", True), ("0.34", True)]
)
def test_an_abort_during_ps_last_prefill_step_frees_at_once_from_0_13(release, freed_at_once):
    """vllm/v1/engine/core.py EngineCore._process_aborts_queue (0.13, #29987): an abort
    that arrives while P runs the request's last prefill step is taken before that
    step's output, so P frees at once; before, the connector took the request as
    finished, its blocks pinned until the fallback timer (#29906: router timeouts left
    KV un-freeable for minutes)."""
    proxy = _Proxy(release)
    proxy.submit("r", "abort_in_step", 0.0)
    proxy.run_until(1.0)
    assert proxy.outputs["r"].finish_reason == ("abort" if freed_at_once else "length")
    assert proxy.held_on_p() == (set() if freed_at_once else {"r"})
    assert (proxy.p_used_blocks() == 0) is freed_at_once


@pytest.mark.parametrize("release, stranded", [("0.22", True), ("0.30", True), ("0.31", False)])
def test_before_0_31_a_heartbeated_send_strands_expired_ones_behind_it(release, stranded):
    """nixl/base_worker.py NixlBaseConnectorWorker._reap_expired_send_leases (0.31,
    #50789): the reaper scans every lease; before, it stopped at the first one not yet
    due, so a send D keeps heartbeating (D slow to read it) strands the expired sends
    registered after it until it is read."""
    proxy = _Proxy(release, pull_delay_ms=100_000)  # D reads 100 s after it gets a leg
    proxy.submit("slow", "read", 0.0)
    proxy.submit("dropped", "drop", 0.1)
    proxy.run_until(40.0)  # the dropped one's lease ended at 30.1 s
    assert proxy.held_on_p() == ({"slow", "dropped"} if stranded else {"slow"})
    proxy.run_until(101.0)  # D has read the slow one: the reaper gets past it
    assert proxy.held_on_p() == set() and proxy.p_used_blocks() == 0
    assert proxy.workers["P"].ledger.counters["num_expired"] == 1
