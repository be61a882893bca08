"""Seeded workloads for the parity harness: one builder per scenario, all pure functions of the seed.

Runs in: the parity harness process. Every request fits the pool on its own (kvdrain
refuses one that never could; vLLM would wait for it forever), so any difference is a
scheduling difference, not an admission-control one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from tests.parity.spec import Abort, Arrival, LegFault, Reject, RequestSpec, SchedConfig, Workload

STOP_TOKEN_IDS = (7, 11)
EOS_TOKEN_ID = 2


def _prompt(
    rng: random.Random, lo: int, hi: int, prefixes: list[list[int]] | None = None
) -> tuple[int, ...]:
    head = list(rng.choice(prefixes)) if prefixes and rng.random() < 0.7 else []
    return tuple(head + [rng.randrange(20, 500) for _ in range(rng.randint(lo, hi))])


def _prefixes(rng: random.Random, count: int, block_size: int) -> list[list[int]]:
    """Shared heads; some end on a block boundary, some inside a block."""
    lengths = [block_size * rng.randint(1, 4) + rng.choice((0, 0, 5)) for _ in range(count)]
    return [[rng.randrange(20, 500) for _ in range(n)] for n in lengths]


def _arrivals(
    rng: random.Random, num: int, span: int, make: Callable[[int], RequestSpec]
) -> list[Arrival]:
    """`num` requests over `span` ticks; several often land on the same tick."""
    return [Arrival(rng.randrange(span), make(i)) for i in range(num)]


def _sorted(events: list) -> list:
    # Arrivals before aborts within a tick; stable otherwise.
    return sorted(events, key=lambda e: (e.tick, isinstance(e, Abort)))


def unique(seed: int) -> Workload:
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=128, max_num_batched_tokens=256)
    events = _arrivals(
        rng, 24, 60, lambda i: RequestSpec(f"u{i}", _prompt(rng, 5, 120), rng.randint(1, 24))
    )
    return Workload("unique", seed, config, _sorted(events), num_ticks=160)


def shared_prefix(seed: int) -> Workload:
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=128, max_num_batched_tokens=256)
    prefixes = _prefixes(rng, 3, config.block_size)
    events = _arrivals(
        rng,
        30,
        50,
        lambda i: RequestSpec(f"s{i}", _prompt(rng, 1, 40, prefixes), rng.randint(1, 20)),
    )
    return Workload("shared_prefix", seed, config, _sorted(events), num_ticks=160)


def pressure(seed: int) -> Workload:
    """A small pool: chunked prefill, preemption, evictions of shared prefixes."""
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=40, max_num_batched_tokens=64, max_num_seqs=6)
    prefixes = _prefixes(rng, 2, config.block_size)
    events = _arrivals(
        rng,
        28,
        60,
        lambda i: RequestSpec(f"c{i}", _prompt(rng, 10, 150, prefixes), rng.randint(1, 40)),
    )
    return Workload("pressure", seed, config, _sorted(events), num_ticks=400)


def aborts(seed: int) -> Workload:
    """Aborts while waiting, prefilling, decoding, preempted, finished, and of unknown ids."""
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=40, max_num_batched_tokens=64, max_num_seqs=6)
    arrivals = _arrivals(
        rng, 24, 50, lambda i: RequestSpec(f"a{i}", _prompt(rng, 10, 150), rng.randint(1, 30))
    )
    events: list = list(arrivals)
    for arrival in arrivals:
        if rng.random() < 0.5:
            events.append(
                Abort(arrival.tick + rng.choice((0, 0, 1, 2, 4, 8, 16, 40)), arrival.spec.req_id)
            )
    events.append(Abort(rng.randrange(50), "no-such-request"))
    return Workload("aborts", seed, config, _sorted(events), num_ticks=400)


def stops(seed: int) -> Workload:
    """EOS and stop ids, also on a request's last allowed token (stop beats length)."""
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=64, max_num_batched_tokens=128, eos_token_id=EOS_TOKEN_ID)
    events = _arrivals(
        rng,
        24,
        40,
        lambda i: RequestSpec(
            f"e{i}", _prompt(rng, 5, 80), rng.randint(1, 16), stop_token_ids=STOP_TOKEN_IDS
        ),
    )
    return Workload(
        "stops", seed, config, _sorted(events), eos_prob=0.1, stop_prob=0.1, num_ticks=200
    )


def _p_requests(
    rng: random.Random, num: int, span: int, prefixes: list[list[int]]
) -> list[Arrival]:
    def make(i: int) -> RequestSpec:
        if rng.random() < 0.8:  # the router sends P its share with max_tokens=1
            return RequestSpec(f"p{i}", _prompt(rng, 5, 100, prefixes), 1, remote="decode")
        return RequestSpec(f"q{i}", _prompt(rng, 5, 60, prefixes), rng.randint(1, 8))

    return _arrivals(rng, num, span, make)


def p_side(seed: int, legacy: bool = False) -> Workload:
    """Prefill side: delayed frees released by finished_sending after random delays."""
    rng = random.Random(seed)
    config = SchedConfig(
        num_blocks=48,
        max_num_batched_tokens=128,
        max_num_seqs=6,
        role="P",
        eos_token_id=EOS_TOKEN_ID,
        legacy=legacy,
    )
    prefixes = _prefixes(rng, 2, config.block_size)
    arrivals = _p_requests(rng, 26, 60 if not legacy else 120, prefixes)
    events: list = list(arrivals)
    events += [
        Abort(a.tick + rng.randint(0, 3), a.spec.req_id) for a in arrivals if rng.random() < 0.15
    ]
    return Workload(
        "legacy_p" if legacy else "p_side",
        seed,
        config,
        _sorted(events),
        eos_prob=0.2,
        max_report_delay=8 if not legacy else 30,
        num_ticks=300,
    )


def _d_requests(
    rng: random.Random, num: int, span: int, prefixes: list[list[int]]
) -> list[Arrival]:
    def make(i: int) -> RequestSpec:
        if rng.random() < 0.75:  # shared heads: two loads of one head cache it twice
            return RequestSpec(
                f"d{i}", _prompt(rng, 5, 100, prefixes), rng.randint(1, 12), remote="prefill"
            )
        return RequestSpec(f"l{i}", _prompt(rng, 5, 60), rng.randint(1, 8))

    return _arrivals(rng, num, span, make)


def d_side(seed: int, legacy: bool = False) -> Workload:
    """Decode side: remote loads (WAITING_FOR_REMOTE_KVS), finished_recving, failed loads."""
    rng = random.Random(seed)
    config = SchedConfig(
        num_blocks=64, max_num_batched_tokens=128, max_num_seqs=4, role="D", legacy=legacy
    )
    prefixes = _prefixes(rng, 2, config.block_size)
    arrivals = _d_requests(rng, 24, 50 if not legacy else 120, prefixes)
    events: list = list(arrivals)
    events += [
        Abort(a.tick + rng.randint(0, 4), a.spec.req_id) for a in arrivals if rng.random() < 0.15
    ]
    return Workload(
        "legacy_d" if legacy else "d_side",
        seed,
        config,
        _sorted(events),
        max_report_delay=6 if not legacy else 20,
        load_failure_prob=0.3,
        num_ticks=300,
    )


def d_pressure(seed: int) -> Workload:
    """Decode side, small pool: local prompts prefill in chunks beside remote loads of
    shared heads; loads are admitted under the full-sequence rule, finished loads wait
    for a seat (lazy promotion), preemptions and evictions follow."""
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=36, max_num_batched_tokens=48, max_num_seqs=5, role="D")
    prefixes = _prefixes(rng, 2, config.block_size)

    def make(i: int) -> RequestSpec:
        if rng.random() < 0.5:
            return RequestSpec(
                f"d{i}", _prompt(rng, 5, 80, prefixes), rng.randint(1, 16), remote="prefill"
            )
        return RequestSpec(f"l{i}", _prompt(rng, 40, 160), rng.randint(1, 16))

    arrivals = _arrivals(rng, 28, 60, make)
    events: list = list(arrivals)
    events += [
        Abort(a.tick + rng.randint(0, 6), a.spec.req_id) for a in arrivals if rng.random() < 0.1
    ]
    return Workload(
        "d_pressure",
        seed,
        config,
        _sorted(events),
        max_report_delay=10,
        load_failure_prob=0.2,
        num_ticks=400,
    )


def p_pressure(seed: int) -> Workload:
    """Prefill side, small pool: local requests decode long enough to preempt one another
    beside remote-decode prefills whose frees are delayed. Under async scheduling a
    request preempted with output in flight drops that output (a producer's hand-off
    needs the KV the preemption freed: vLLM's requires_kv_delivery)."""
    rng = random.Random(seed)
    config = SchedConfig(
        num_blocks=28,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        role="P",
        eos_token_id=EOS_TOKEN_ID,
    )
    prefixes = _prefixes(rng, 2, config.block_size)

    def make(i: int) -> RequestSpec:
        if rng.random() < 0.4:
            return RequestSpec(f"p{i}", _prompt(rng, 5, 80, prefixes), 1, remote="decode")
        return RequestSpec(f"q{i}", _prompt(rng, 10, 80, prefixes), rng.randint(15, 60))

    arrivals = _arrivals(rng, 28, 60, make)
    events: list = list(arrivals)
    events += [
        Abort(a.tick + rng.randint(0, 6), a.spec.req_id) for a in arrivals if rng.random() < 0.1
    ]
    return Workload(
        "p_pressure",
        seed,
        config,
        _sorted(events),
        eos_prob=0.05,
        max_report_delay=8,
        num_ticks=400,
    )


def d_decode_pressure(seed: int) -> Workload:
    """Decode side, small pool: loaded and local requests decode long enough to preempt
    one another. Under async scheduling a request scheduled in the step in flight frees
    its blocks only once that step is processed (vLLM's defer_block_free on a consumer),
    and such a request is not preempted to make room."""
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=32, max_num_batched_tokens=64, max_num_seqs=6, role="D")
    prefixes = _prefixes(rng, 2, config.block_size)

    def make(i: int) -> RequestSpec:
        if rng.random() < 0.4:
            return RequestSpec(
                f"d{i}", _prompt(rng, 5, 60, prefixes), rng.randint(8, 30), remote="prefill"
            )
        return RequestSpec(f"l{i}", _prompt(rng, 10, 80), rng.randint(10, 40))

    arrivals = _arrivals(rng, 28, 60, make)
    events: list = list(arrivals)
    events += [
        Abort(a.tick + rng.randint(0, 8), a.spec.req_id) for a in arrivals if rng.random() < 0.15
    ]
    return Workload(
        "d_decode_pressure",
        seed,
        config,
        _sorted(events),
        max_report_delay=6,
        load_failure_prob=0.1,
        num_ticks=400,
    )


def d_recompute(seed: int) -> Workload:
    """d_side with kv_load_failure_policy=recompute on both sides: failed loads retry
    from their valid prefix, or from scratch with a fresh prefix lookup."""
    workload = d_side(seed)
    config = replace(workload.config, kv_load_failure_policy="recompute")
    return replace(workload, name="d_recompute", config=config, load_failure_prob=0.5)


def pressure_no_reserve(seed: int) -> Workload:
    """pressure with scheduler_reserve_full_isl=False on both sides: admit when the
    first chunk fits."""
    workload = pressure(seed)
    config = replace(workload.config, reserve_full_isl=False)
    return replace(workload, name="pressure_no_reserve", config=config)


def p_faults(seed: int) -> Workload:
    """Prefill side under a P/D deployment's faults: a D leg that never reads the send
    (dropped: P's worker frees it when the lease runs out), a D that refuses the leg (its
    worker tells P to free the send), and an abort while the step carrying the request's
    last prefill chunk runs (taken before that step's output: freed at once, never
    held). Long prompts prefill in chunks, so that step is often not the first."""
    rng = random.Random(seed)
    config = SchedConfig(
        num_blocks=48,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        role="P",
        eos_token_id=EOS_TOKEN_ID,
    )
    prefixes = _prefixes(rng, 2, config.block_size)
    arrivals = _p_requests(rng, 26, 80, prefixes)
    leg_faults: dict[str, LegFault] = {}
    aborts_in_last_prefill = set()
    for arrival in arrivals:
        req_id, roll = arrival.spec.req_id, rng.random()
        if arrival.spec.remote != "decode":
            continue
        if roll < 0.2:
            leg_faults[req_id] = "dropped"
        elif roll < 0.35:
            leg_faults[req_id] = "rejected"
        elif roll < 0.6:
            aborts_in_last_prefill.add(req_id)
    return Workload(
        "p_faults",
        seed,
        config,
        _sorted(list(arrivals)),
        eos_prob=0.1,
        max_report_delay=8,
        num_ticks=300,
        leg_faults=leg_faults,
        lease_ticks=40,
        aborts_in_last_prefill=frozenset(aborts_in_last_prefill),
    )


def d_faults(seed: int) -> Workload:
    """Decode side with legs D refuses before admission (a bad request, say): D steps to
    tell P to free each one's send while its other loads go on."""
    rng = random.Random(seed)
    config = SchedConfig(num_blocks=64, max_num_batched_tokens=128, max_num_seqs=4, role="D")
    prefixes = _prefixes(rng, 2, config.block_size)
    events: list = []
    for arrival in _d_requests(rng, 24, 50, prefixes):
        refused = arrival.spec.remote == "prefill" and rng.random() < 0.3
        events.append(Reject(arrival.tick, arrival.spec) if refused else arrival)
        if rng.random() < 0.15:
            events.append(Abort(arrival.tick + rng.randint(0, 4), arrival.spec.req_id))
    return Workload(
        "d_faults",
        seed,
        config,
        _sorted(events),
        max_report_delay=6,
        load_failure_prob=0.1,
        num_ticks=300,
    )


def legacy_p(seed: int) -> Workload:
    """Pre-#43433 vLLM (has_finished_requests patched back) against kvdrain's legacy."""
    return p_side(seed, legacy=True)


def legacy_d(seed: int) -> Workload:
    return d_side(seed, legacy=True)


WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "unique": unique,
    "shared_prefix": shared_prefix,
    "pressure": pressure,
    "aborts": aborts,
    "stops": stops,
    "p_side": p_side,
    "d_side": d_side,
    "d_pressure": d_pressure,
    "d_recompute": d_recompute,
    "p_pressure": p_pressure,
    "d_decode_pressure": d_decode_pressure,
    "pressure_no_reserve": pressure_no_reserve,
    "p_faults": p_faults,
    "d_faults": d_faults,
    "legacy_p": legacy_p,
    "legacy_d": legacy_d,
}
