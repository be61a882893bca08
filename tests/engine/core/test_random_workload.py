"""Seeded random workloads: arrivals, aborts, prefix sharing, pool pressure, delayed frees,
remote loads whose reports arrive late, stale or twice, and load failures."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.liveness import LoopAction, next_action
from engine.core.outputs import KVConnectorOutput, ModelRunnerOutput
from engine.core.request import RequestStatus
from engine.utils import cdiv
from tests.utils import assert_scheduler_empty, make_request, make_scheduler

PREFIXES = [[7] * 8, [9] * 12, list(range(40, 52))]


class FakeWorld:
    """Plays the connector worker: reports each registered transfer after a random delay."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pending: list[tuple[int, str, str, list[int]]] = []  # (due, kind, id, blocks)
        self.delivered: list[tuple[str, str]] = []
        self.now = 0

    def register(self, meta) -> None:
        for req_id in meta.reqs_to_send:
            self.pending.append((self.now + self.rng.randint(0, 6), "send", req_id, []))
        for req_id, load in meta.reqs_to_recv.items():
            self.pending.append(
                (self.now + self.rng.randint(0, 6), "recv", req_id, load.local_block_ids)
            )

    def reports(self, flush: bool = False) -> KVConnectorOutput:
        out = KVConnectorOutput()
        due = [p for p in self.pending if flush or p[0] <= self.now]
        self.pending = [p for p in self.pending if p not in due]
        for _, kind, req_id, blocks in due:
            (out.finished_sending if kind == "send" else out.finished_recving).add(req_id)
            if kind == "recv" and blocks and self.rng.random() < 0.2:
                out.invalid_block_ids.add(self.rng.choice(blocks))
            self.delivered.append((kind, req_id))
        if self.delivered and self.rng.random() < 0.1:  # a stale duplicate
            kind, req_id = self.rng.choice(self.delivered)
            (out.finished_sending if kind == "send" else out.finished_recving).add(req_id)
        if self.rng.random() < 0.05:
            out.finished_sending.add("unknown")
        return out


def make_random_request(rng: random.Random, i: int):
    prompt = list(rng.choice(PREFIXES)) if rng.random() < 0.6 else []
    prompt += [rng.randrange(500) for _ in range(rng.randint(1, 30))]
    kind = rng.random()
    if kind < 0.3:
        params, max_tokens = {"do_remote_decode": True}, 1
    elif kind < 0.55:
        n = cdiv(len(prompt), 4)
        params = {
            "do_remote_prefill": True,
            "remote_request_id": f"p{i}",
            "remote_engine_id": "P",
            "remote_block_ids": list(range(1000, 1000 + n)),
            "remote_addr": "",
        }
        max_tokens = rng.randint(1, 8)
    else:
        params, max_tokens = None, rng.randint(1, 12)
    return make_request(f"r{i}", max_tokens=max_tokens, params=params, prompt=prompt)


def one_step(sched, world: FakeWorld, flush: bool = False) -> LoopAction:
    """One engine step, then what the liveness rule says the loop does next."""
    out = sched.schedule()
    world.register(out.kv_connector_metadata)
    sampled = {s.req_id: (s.token_ids[-1] + 1) % 512 for s in out.scheduled if s.sample}
    reports = world.reports(flush)
    sched.update_from_output(out, ModelRunnerOutput(sampled, {}, reports))
    sched.block_pool.check_invariants()
    world.now += 1
    can_progress = sched.can_progress(out, not reports.is_empty())  # the engine's own rule
    return next_action(
        sched.config.liveness,
        sched.has_requests(),
        out.total_num_scheduled_tokens > 0,
        can_progress,
        sched.has_deferred_requests(),
        has_unfinished=sched.has_unfinished_requests(),
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    liveness=st.sampled_from(["legacy", "poll", "event"]),
    policy=st.sampled_from(["recompute", "fail"]),
)
def test_random_workload_releases_everything(seed, liveness, policy):
    rng = random.Random(seed)
    sched = make_scheduler(
        use_kv_connector=True,
        liveness=liveness,
        num_blocks=24,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        kv_load_failure_policy=policy,
    )
    world = FakeWorld(rng)
    for i in range(rng.randint(5, 40)):
        sched.add_request(make_random_request(rng, i))
        if rng.random() < 0.15 and sched.requests:
            sched.finish_requests(
                [rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED
            )
        for _ in range(rng.randint(0, 3)):
            one_step(sched, world)
    # Quiescence: no more arrivals. Follow the liveness rule exactly: a loop that may
    # block on its input parks for good; one that blocks on the connector too must
    # have a report coming, or it would hang with work pending.
    action = LoopAction.STEP
    for _ in range(2000):
        if action is LoopAction.WAIT_INPUT:
            break
        if action is LoopAction.WAIT_ANY:
            assert world.pending, "blocked on the connector with no report to come: a hang"
            world.now = min(p[0] for p in world.pending)  # sleep until the next report
        action = one_step(sched, world, flush=rng.random() < 0.1)
    else:
        raise AssertionError("never quiesced")
    if liveness == "legacy":
        # The bug: whatever is still held for a send stays held while the loop parks.
        assert set(sched.requests) == sched.held_for_send | sched.held_for_recv
        return
    assert_scheduler_empty(sched)
