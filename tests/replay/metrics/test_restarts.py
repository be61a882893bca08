"""RestartWatch: a counter that goes back or a new process start time between two readings
of one URL is a restart of the engines it names; anything else is not."""

from __future__ import annotations

from replay.metrics.restarts import MAX_RESTARTS, RestartWatch, restart_faults
from replay.metrics.scrape import parse_plain_samples

ENGINES = {"0": "P", "1": "D"}


def reading(steps: tuple[int, int], start: float | None = 100.0) -> dict[str, list]:
    lines = [f'kvdrain:engine_steps_total{{engine="{e}"}} {n}' for e, n in zip("01", steps)]
    if start is not None:
        lines.append(f"process_start_time_seconds {start}")
    return parse_plain_samples("\n".join(lines) + "\n")


def test_counters_that_grow_and_the_same_process_are_no_restart():
    watch = RestartWatch()
    for k in range(5):
        assert watch.observe(reading((k, 2 * k)), k, k + 0.01, ENGINES) == []
    assert watch.num_restarts == 0 and restart_faults("u", watch) == []


def test_a_counter_that_goes_back_restarts_its_engine_only():
    watch = RestartWatch()
    watch.observe(reading((50, 70)), 1.0, 1.01, ENGINES)
    (restart,) = watch.observe(reading((51, 3)), 2.0, 2.02, ENGINES)
    assert (restart.engine, restart.since, restart.t) == ("D", 1.0, 2.02)
    assert restart.evidence == 'kvdrain:engine_steps_total{engine="1"} went back from 70 to 3'


def test_a_new_process_start_time_restarts_every_engine_behind_the_url():
    watch = RestartWatch()
    watch.observe(reading((50, 70)), 1.0, 1.01, ENGINES)
    restarts = watch.observe(reading((60, 80), start=107.5), 2.0, 2.02, ENGINES)
    assert [r.engine for r in restarts] == ["P", "D"]
    assert restarts[0].evidence == "process_start_time_seconds 100 -> 107.5"


def test_a_series_read_once_or_missing_is_no_evidence():
    watch = RestartWatch()
    watch.observe(reading((50, 70), start=None), 1.0, 1.01, ENGINES)
    assert watch.observe(parse_plain_samples("other 1\n"), 2.0, 2.1, ENGINES) == []
    assert watch.observe(reading((50, 70), start=5.0), 3.0, 3.1, ENGINES) == []  # first start


def test_faults_name_each_engine_once_with_every_span_and_the_restarts_are_bounded():
    watch = RestartWatch()
    for k in range(MAX_RESTARTS + 10):
        watch.observe(reading((0, 0), start=float(k)), k, k + 0.5, ENGINES)
    assert watch.num_restarts == 2 * (MAX_RESTARTS + 9)
    assert len(watch.restarts) == MAX_RESTARTS
    p, d = restart_faults("http://h:1/metrics", watch)
    assert (p["engine"], p["kind"], p["t"]) == ("P", "restarted", 1.5)
    assert p["spans"][0] == [0, 1.5] and len(p["spans"]) == MAX_RESTARTS // 2 + 1
    assert p["cause"].startswith("restarted between 0.000 s and 1.500 s")
    assert f"{MAX_RESTARTS + 9} restarts, the latest between {MAX_RESTARTS + 8}.000 s" in p["cause"]
    watch.rebase(-1.0)
    assert watch.restarts[0].since == -1.0 and watch.last_send_t == MAX_RESTARTS + 8
