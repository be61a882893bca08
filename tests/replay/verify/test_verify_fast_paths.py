"""The verifier's fast paths against their definitions: each window's client lateness, the engine windows that hold a trace window, the spans of every request on each engine, every engine's samples."""

from __future__ import annotations

import math
import random

import pytest

from replay.verify import windows
from replay.verify.coverage import ExpectedWindow, client_lateness, client_latenesses
from replay.verify.rules import EngineSeries
from replay.verify.timeline import EngineSample, RequestRecord, Timeline


def seeded_requests(rng: random.Random, n: int) -> list[RequestRecord]:
    out = []
    for i in range(n):
        arrival = round(rng.uniform(0, 100), rng.choice([0, 1, 3]))  # ties on purpose
        end = (
            None
            if rng.random() < 0.1
            else arrival + round(rng.expovariate(0.3), rng.choice([0, 2]))
        )
        late = rng.choice([0.0, -0.001, rng.expovariate(100)])
        out.append(
            RequestRecord(
                req_id=f"r{i}",
                arrival_t=arrival,
                send_t=arrival + late,
                send_lateness_s=late,
                first_token_t=None,
                end_t=end,
                num_prompt_tokens=8,
                num_output_tokens=4,
                num_prefix_hit_tokens=None,
                finish_reason="stop",
            )
        )
    return out


def seeded_windows(rng: random.Random, n: int) -> list[ExpectedWindow]:
    out = []
    for _ in range(n):
        start = round(rng.uniform(0, 100), rng.choice([0, 1, 3]))
        tail = rng.random() < 0.1
        end = math.inf if tail else start + round(rng.uniform(0, 20), rng.choice([0, 1]))
        quiet = rng.choice([None, start, round(rng.uniform(start - 5, start + 5), 1)])
        out.append(ExpectedWindow(start, end, tail, quiet, rng.random() < 0.8))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_every_windows_client_lateness_equals_its_definition(seed):
    rng = random.Random(seed)
    requests = seeded_requests(rng, rng.choice([0, 1, 40, 300]))
    expected = seeded_windows(rng, rng.choice([0, 1, 30, 200]))
    assert client_latenesses(expected, requests) == [client_lateness(w, requests) for w in expected]


def seeded_trace_windows(rng: random.Random, n: int) -> list[windows.Window]:
    out, t = [], 0.0
    for _ in range(n):  # disjoint and in order, as _gaps makes them; and some that are not
        t += rng.choice([0.0, 1e-10, rng.uniform(0, 5)])
        end = t + rng.choice([0.0, rng.uniform(0, 10)])
        out.append((t, end, False))
        t = end
    if rng.random() < 0.5:
        out += [(rng.uniform(0, 50), rng.uniform(50, 80), False) for _ in range(3)]
    return out


def _agrees_with_its_definition(seed: int, bisecting, definition) -> None:
    """bisecting(trace_windows)(window) == definition(window, trace_windows) on seeded
    windows, many of them on or a hair from the trace windows' edges."""
    rng = random.Random(seed)
    trace_windows = seeded_trace_windows(rng, rng.choice([0, 1, 50]))
    fast = bisecting(trace_windows)
    edges = [x for s, e, _ in trace_windows for x in (s, e, s - 5e-10, e + 5e-10, s + 2e-9)]
    for _ in range(500):
        start = rng.choice(edges) if edges and rng.random() < 0.7 else rng.uniform(-1, 120)
        end = rng.choice(edges) if edges and rng.random() < 0.5 else start + rng.uniform(0, 30)
        window = (start, end, rng.random() < 0.1)
        assert fast(window) == definition(window, trace_windows), window


@pytest.mark.parametrize("seed", range(8))
def test_holding_a_trace_window_by_bisection_equals_its_definition(seed):
    _agrees_with_its_definition(seed, windows._Holds, windows.holds_any)


@pytest.mark.parametrize("seed", range(8))
def test_lying_inside_a_trace_window_by_bisection_equals_its_definition(seed):
    _agrees_with_its_definition(seed, windows._Inside, windows.inside_any)


def seeded_routed_requests(rng: random.Random, n: int) -> list[RequestRecord]:
    """Requests with ways of one to three stages, times that tie, cross and are ints."""
    out = []
    for r in seeded_requests(rng, n):
        t = r.arrival_t
        for _ in range(rng.choice([0, 1, 2, 2, 3])):
            t = rng.choice([t, int(t), t + rng.uniform(0, 3)])
            r.stages.append([rng.choice(["P", "P1", "D", "D0"]), t])
        r.first_token_t = rng.choice(
            [None, r.arrival_t, int(r.arrival_t), r.arrival_t + rng.uniform(0, 9)]
        )
        out.append(r)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_every_engines_spans_equal_the_requests_intervals(seed):
    rng = random.Random(seed)
    requests = seeded_routed_requests(rng, rng.choice([0, 1, 40, 300]))
    by_definition: dict[str, list[tuple[float, float]]] = {}
    for r in requests:
        for engine, since, until in windows.intervals(r):
            by_definition.setdefault(engine, []).append((since, until))
    spans = windows.spans_by_engine(requests)
    assert spans == by_definition
    assert {e: [tuple(map(type, s)) for s in v] for e, v in spans.items()} == {
        e: [tuple(map(type, s)) for s in v] for e, v in by_definition.items()
    }


@pytest.mark.parametrize("seed", range(4))
def test_every_engines_series_in_one_pass_equals_each_engines_own(seed):
    rng = random.Random(seed)
    samples = [
        EngineSample(
            t=float(i),
            engine=rng.choice(["P", "D", "X"]),
            num_used_blocks=0,
            num_cached_blocks=0,
            num_free_blocks=4,
            num_usable_blocks=4,
            num_waiting=0,
            num_skipped_waiting=0,
            num_waiting_for_remote_kvs=0,
            num_running=0,
            num_finished_awaiting_free=0,
            loop_state="idle",
            num_steps=i,
            num_wakeups=0,
        )
        for i in range(rng.choice([0, 1, 50]))
    ]
    timeline = Timeline(
        engines=["D", "P"],
        num_usable_blocks={"P": 4, "D": 4},
        samples=samples,
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=60.0,
    )  # X: a sample of no engine
    assert EngineSeries.of_all(timeline) == {e: EngineSeries.of(timeline, e) for e in ("D", "P")}
    assert list(EngineSeries.of_all(timeline)) == ["D", "P"]
