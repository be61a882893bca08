"""The fake model and the fake connector worker that feed both schedulers identical inputs.

Runs in: the parity harness process. Every choice is a pure function of (seed, req_id,
position), never of the order in which a side asks, so two sides that agree get the
same tokens and the same transfer reports, and two that disagree show it in their
snapshots rather than in their inputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tests.parity.spec import VOCAB_SIZE, Workload


def _rng(*key: object) -> random.Random:
    return random.Random(":".join(str(k) for k in key))  # str seeds hash deterministically


class FakeModel:
    """One sampled token per request whose prompt is complete; may be EOS or a stop id."""

    def __init__(self, workload: Workload) -> None:
        self.seed = workload.seed
        self.eos_token_id = workload.config.eos_token_id
        self.eos_prob = workload.eos_prob
        self.stop_prob = workload.stop_prob

    def token(self, req_id: str, position: int, stop_token_ids: tuple[int, ...]) -> int:
        rng = _rng(self.seed, "token", req_id, position)
        roll = rng.random()
        if self.eos_token_id is not None and roll < self.eos_prob:
            return self.eos_token_id
        if stop_token_ids and roll > 1.0 - self.stop_prob:
            return rng.choice(stop_token_ids)
        token = rng.randrange(VOCAB_SIZE - 2)
        # Never hit EOS or a stop id by accident: only the rolls above do.
        while token == self.eos_token_id or token in stop_token_ids:
            token += 1
        return token


@dataclass(slots=True)
class KVReports:
    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class FakeKVWorker:
    """Plays the connector's worker side: reports each transfer after a seeded delay
    (a send's leg fault sets its own: the lease, or D's quick refusal).

    A load may lose one block (reported in invalid_block_ids with its finished_recving,
    as NIXL does). Reports come out sorted: vLLM iterates finished_sending as a set
    (order depends on PYTHONHASHSEED), kvdrain sorts; feeding sorted ids and fixing
    the hash seed keeps both on the same order.
    """

    def __init__(self, workload: Workload) -> None:
        self.seed = workload.seed
        self.max_delay = workload.max_report_delay
        self.load_failure_prob = workload.load_failure_prob
        self.leg_faults = workload.leg_faults
        self.lease_ticks = workload.lease_ticks
        self.pending: dict[tuple[str, str], tuple[int, list[int]]] = {}

    def register(self, now: int, sends: list[str], recvs: dict[str, list[int]]) -> None:
        for req_id in sends:
            self.pending[("send", req_id)] = (now + self._delay("send", req_id), [])
        for req_id, block_ids in recvs.items():
            self.pending[("recv", req_id)] = (now + self._delay("recv", req_id), block_ids)

    def reports(self, now: int) -> KVReports:
        out = KVReports()
        for key in sorted(k for k, (due, _) in self.pending.items() if due <= now):
            kind, req_id = key
            _, block_ids = self.pending.pop(key)
            if kind == "send":
                out.finished_sending.append(req_id)
                continue
            out.finished_recving.append(req_id)
            rng = _rng(self.seed, "fail", req_id)
            if block_ids and rng.random() < self.load_failure_prob:
                out.invalid_block_ids.add(block_ids[rng.randrange(len(block_ids))])
        return out

    def _delay(self, kind: str, req_id: str) -> int:
        fault = self.leg_faults.get(req_id) if kind == "send" else None
        if fault == "dropped":  # never read: P's worker reaps it when its lease runs out
            return self.lease_ticks
        max_delay = 2 if fault == "rejected" else self.max_delay  # D's worker notifies P
        return _rng(self.seed, "delay", kind, req_id).randint(0, max_delay)
