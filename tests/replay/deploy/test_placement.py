"""The routing decision table's three policies against a brute-force reference, on seeded workloads."""

from __future__ import annotations

import random

import pytest

from replay.deploy.placement import ROUTER_POLICIES, Balancer, PrefixTable


class Reference:
    """Each policy as its definition reads, recomputed from the whole history at every pick."""

    def __init__(self, prefill: list[str], decode: list[str], policy: str) -> None:
        self.prefill, self.decode, self.policy = prefill, decode, policy
        self.in_flight = {e: 0 for e in prefill + decode}
        self.sent: dict[str, list[list[int]]] = {e: [] for e in prefill}  # every request's hashes
        self.num_picked = {"prefill": 0, "decode": 0}

    def matched(self, engine: str, hashes: list[int]) -> int:
        known = {h for request in self.sent[engine] for h in request}
        return next((i for i, h in enumerate(hashes) if h not in known), len(hashes))

    def by_load(self, engines: list[str]) -> str:
        fewest = min(self.in_flight[e] for e in engines)
        return [e for e in engines if self.in_flight[e] == fewest][0]

    def pick(self, role: str, hashes: list[int]) -> str:
        engines = self.prefill if role == "prefill" else self.decode
        i = self.num_picked[role]
        self.num_picked[role] += 1
        if self.policy == "round-robin":
            return engines[i % len(engines)]
        if self.policy == "prefix" and role == "prefill":
            best = max(self.matched(e, hashes) for e in engines)
            engine = self.by_load([e for e in engines if self.matched(e, hashes) == best])
            self.sent[engine].append(hashes)
            return engine
        return self.by_load(engines)


def prefix_workload(rng: random.Random) -> list[int]:
    """A request's block hashes: one of a few shared prefixes, then its own blocks."""
    group = rng.randrange(4)
    shared = [group * 100 + i for i in range(rng.randrange(6))]
    return shared + [rng.randrange(10**9) for _ in range(rng.randrange(3))]


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (1, 3), (4, 4), (3, 1)])
@pytest.mark.parametrize("seed", range(5))
def test_every_pick_equals_the_brute_force_reference(policy, shape, seed):
    rng = random.Random(seed)
    prefill = [f"P{i}" for i in range(shape[0])]
    decode = [f"D{i}" for i in range(shape[1])]
    balancer, reference = Balancer(prefill, decode, policy), Reference(prefill, decode, policy)
    in_flight: list[str] = []
    for _ in range(300):
        if in_flight and rng.random() < 0.45:
            engine = in_flight.pop(rng.randrange(len(in_flight)))
            balancer.ended(engine)
            reference.in_flight[engine] -= 1
            continue
        role = rng.choice(["prefill", "decode"])
        hashes = prefix_workload(rng)
        picked = balancer.pick_prefill(hashes) if role == "prefill" else balancer.pick_decode()
        assert picked == reference.pick(role, hashes)
        balancer.started(picked)
        reference.in_flight[picked] += 1
        in_flight.append(picked)
    assert balancer.num_in_flight == reference.in_flight


def test_round_robin_is_the_toy_proxys_two_cycles():
    balancer = Balancer(["P0", "P1"], ["D0", "D1", "D2"], "round-robin")
    picks = [(balancer.pick_prefill(), balancer.pick_decode()) for _ in range(6)]
    assert picks == [
        ("P0", "D0"),
        ("P1", "D1"),
        ("P0", "D2"),
        ("P1", "D0"),
        ("P0", "D1"),
        ("P1", "D2"),
    ]
    assert balancer.num_requests == {"P0": 3, "P1": 3, "D0": 2, "D1": 2, "D2": 2}


def test_prefix_keeps_a_prefix_group_on_the_engine_that_first_took_it():
    balancer = Balancer(["P0", "P1"], ["D0"], "prefix")
    first = balancer.pick_prefill([1, 2, 3])
    balancer.started(first)  # now loaded: an unrelated request goes to the other
    assert balancer.pick_prefill([9]) != first
    assert balancer.pick_prefill([1, 2, 7]) == first  # two blocks matched beat a lighter load


def test_the_prefix_table_forgets_the_oldest_hashes_first():
    table = PrefixTable(max_blocks=3)
    table.insert([1, 2, 3])
    table.insert([1, 4])  # 1 is touched again; 2 is now the oldest and goes
    assert list(table.hashes) == [3, 1, 4]
    assert table.match([1, 2]) == 1 and table.match([3, 1, 4]) == 3


def test_bad_use_is_a_clear_error():
    with pytest.raises(ValueError, match="router policy"):
        Balancer(["P"], ["D"], "random")
    with pytest.raises(ValueError, match="no prefill engine"):
        Balancer([], ["E"]).pick_prefill()
    with pytest.raises(ValueError, match="no request in flight"):
        Balancer(["P"], ["D"]).ended("D")
