"""N prefill and M decode engines on the virtual clock: routing policies and each engine's own idle windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from replay.pipeline import ReplayConfig, run_replay
from replay.trace.reader import read_trace
from replay.verify.rules import verify
from replay.verify.windows import idle_windows_by_engine
from tests.paths import EXAMPLE
from tests.replay.sim.test_simulate import run


def two_prefix_groups(
    pause: tuple[float, float] = (4.0, 12.0), end: float = 16.0, spacing: float = 0.5
) -> list[dict]:
    """Group A (one shared prefix) and group B (another) every `spacing` s until end, A
    pausing through `pause`: the trace never idles, but the engine A's prefix lives on does."""
    lines: list[dict] = [{"kvdrain_trace": 1, "name": "two prefix groups"}]
    for i in range(int(end / spacing)):
        t = round(i * spacing, 6)
        for group, base in (("a", 100), ("b", 200)):
            if group == "a" and pause[0] <= t < pause[1]:
                continue
            lines.append(
                {
                    "t": t,
                    "id": f"{group}{i}",
                    "hash_ids": [base, base + 1, base + 2, 1000 + i],
                    "prompt_len": 64,
                    "max_tokens": 4,
                }
            )
    return lines


def write(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def replay(path: Path, liveness: str, clock: str = "virtual", **overrides) -> object:
    engine = EngineConfig(liveness=liveness, runner="mock", **overrides)
    return run_replay(
        ReplayConfig(trace=path, clock=clock, topology="2p1d", router="prefix", engine=engine)
    )


@pytest.mark.parametrize("topology", ["2p2d", "1p3d", "4p4d"])
def test_round_robin_xpyd_holds_the_blocks_one_p_and_one_d_hold(topology):
    """Every request's blocks are counted once, wherever it ran: the peak of the sums over
    the engines' samples differs, but each engine drains and the total work is the same."""
    records = list(read_trace(EXAMPLE))
    one = run(records, "event")
    many = run(records, "event", topology=topology)
    assert [r.num_output_tokens for r in many.requests] == [
        r.num_output_tokens for r in one.requests
    ]
    assert (
        sum(c["num_routed_requests"] for c in many.counters.values())
        == sum(c["num_routed_requests"] for c in one.counters.values())
        == 2 * len(one.requests)
    )
    verdict = verify(many, [])
    assert verdict.status == "verified" and {w.engine for w in verdict.windows} == set(many.engines)


def test_a_starved_prefill_engines_own_window_is_a_leak_under_legacy(tmp_path):
    """Under the prefix router, group A's P idles from t=4 while group B keeps the system
    busy: no idle gap of the whole trace exists before the tail, yet the pre-#43433 loop
    holds A's blocks through that P's own idle time."""
    path = write(tmp_path, two_prefix_groups())
    result = replay(path, "legacy")
    starved = [w for w in result.verdict.windows if not w.is_tail and w.verdict == "leak"]
    assert starved, result.verdict.windows
    assert {w.engine for w in starved} == {"P0"}
    window = starved[0]
    assert 3.5 <= window.start < 4.0 and window.end == 12.0 and window.num_blocks_held > 0
    assert result.verdict.exit_code == 1
    counts = {e: c["num_routed_requests"] for e, c in result.timeline.counters.items()}
    assert counts == {"P0": 16, "P1": 32, "D0": 48}  # A's 16 on P0, B's 32 on P1


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_poll_and_event_drain_the_starved_prefill_engines_window(tmp_path, liveness):
    result = replay(write(tmp_path, two_prefix_groups()), liveness)
    own = [w for w in result.verdict.windows if w.engine == "P0" and not w.is_tail]
    assert own and all(w.verdict == "drained" for w in own)
    assert result.verdict.status == "verified" and result.verdict.exit_code == 0


def test_engine_windows_come_from_each_requests_own_way(tmp_path):
    result = replay(write(tmp_path, two_prefix_groups()), "event")
    by_engine = idle_windows_by_engine(result.timeline, 1.0)
    assert [(round(s), e, tail) for s, e, tail in by_engine["P0"]][0] == (
        4,
        12.0,
        False,
    )  # A's pause
    assert [is_tail for _, _, is_tail in by_engine["P1"]] == [True]  # B never stops until the end
    first_a = result.timeline.request("a0")
    assert [engine for engine, _ in first_a.stages] == ["P0", "D0"]


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_a_decode_engine_reading_from_two_prefill_engines_keeps_both_leases_alive(liveness):
    """D waits longer than a lease for each pull (pull delay 2 s, lease 1.2 s); its heartbeats
    go to whichever P holds each request, so neither P lets a send expire."""
    records = list(read_trace(EXAMPLE))
    timeline = run(records, liveness, topology="2p1d", kv_lease_s=1.2, pull_delay_s=2.0)
    senders = {engine for r in timeline.requests for engine, _ in r.stages[:-1]}
    assert senders == {"P0", "P1"}
    assert timeline.counters["P0"]["num_expired"] == timeline.counters["P1"]["num_expired"] == 0
    assert all(r.finish_reason == "length" and r.num_output_tokens for r in timeline.requests)
