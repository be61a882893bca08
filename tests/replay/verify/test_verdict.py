"""Honest verdicts: verified, violation, and inconclusive when a run did not cover what it should.

The oracle for coverage is hand-made timelines (requests and samples placed by hand)
and the virtual clock, which is the forecast of the engines and so observes every
window it expects.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from replay.sim.options import SimOptions
from replay.sim.simulation import simulate
from replay.trace.reader import read_trace
from replay.trace.shaping import ShapingOptions, shape
from replay.verify.coverage import (
    candidate_gaps,
    expected_windows,
    ignored_by_cause,
    ignored_cause,
    quiet_from,
)
from replay.verify.rules import VerifyOptions, idle_windows, verify
from replay.verify.timeline import EngineSample, RequestRecord, Timeline
from tests.paths import AZURE, EXAMPLE, public_trace


def _record(
    req_id: str,
    arrival: float,
    end: float | None,
    *,
    tokens: int = 1,
    reason: str | None = "length",
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        req_id=req_id,
        arrival_t=arrival,
        send_t=arrival,
        send_lateness_s=0.0,
        first_token_t=None if end is None else arrival,
        end_t=end,
        num_prompt_tokens=8,
        num_output_tokens=tokens,
        num_prefix_hit_tokens=0,
        finish_reason=reason,
        error=error,
    )


def _sample(t: float, used: int) -> EngineSample:
    return EngineSample(
        t=t,
        engine="E",
        num_used_blocks=used,
        num_cached_blocks=0,
        num_free_blocks=10 - used,
        num_usable_blocks=10,
        num_waiting=0,
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=0,
        num_running=0,
        num_finished_awaiting_free=0,
        loop_state="blocked",
        num_steps=0,
        num_wakeups=0,
    )


def _timeline(records: list[RequestRecord], samples: list[EngineSample], end_t: float) -> Timeline:
    return Timeline(
        engines=["E"],
        num_usable_blocks={"E": 10},
        samples=samples,
        requests=records,
        arrivals=[r.arrival_t for r in records],
        aborts=[],
        end_t=end_t,
    )


# Two bursts with a 4 s gap: a at 0 (ends 0.5), b at 4 (ends 4.5), tail to 8.
def _two_bursts(b_end: float = 4.5, a_end: float = 0.5) -> Timeline:
    return _timeline(
        [_record("a", 0.0, a_end), _record("b", 4.0, b_end)],
        [_sample(0.0, 3), _sample(a_end, 0), _sample(4.0, 3), _sample(b_end, 0)],
        8.0,
    )


def test_candidate_gaps_and_quiet_times():
    assert candidate_gaps([0.0, 0.5, 4.0, 4.2, 9.0], 1.0) == [(0.5, 4.0), (4.2, 9.0)]
    records = [_record("a", 0.0, 3.0), _record("b", 1.0, 1.5), _record("c", 5.0, None)]
    assert quiet_from(records, [1.0, 4.0, 6.0]) == [3.0, 3.0, float("inf")]
    assert quiet_from(records, [0.0]) == [float("-inf")]


def test_verified_lists_every_expected_window():
    timeline = _two_bursts()
    expected = expected_windows(timeline.arrivals, 1.0, None)
    verdict = verify(timeline, [], VerifyOptions(), expected)
    assert verdict.status == "verified" and verdict.exit_code == 0 and not verdict.reasons
    assert verdict.num_covered() == (2, 2)  # the gap and the tail
    assert [c.state for c in verdict.coverage] == ["observed", "observed"]
    data = verdict.to_dict()
    assert (data["status"], data["exit_code"], data["num_expected_windows"]) == ("verified", 0, 2)


def test_a_leak_is_a_violation_even_when_coverage_is_short():
    timeline = _two_bursts()
    timeline.samples[1] = _sample(0.5, 2)  # blocks stay held through the gap
    forecast = _two_bursts()
    timeline.requests[1].end_t = 7.9  # and the tail was barely observed
    verdict = verify(
        timeline, [], VerifyOptions(), expected_windows(timeline.arrivals, 1.0, forecast)
    )
    assert verdict.status == "violation" and verdict.exit_code == 1


def test_lag_that_swallows_a_window_is_inconclusive_with_the_lag():
    forecast = _two_bursts()  # the forecast: a ends at 0.5, a 3.5 s quiet gap
    lagged = _two_bursts(a_end=3.5)  # the run: a ends at 3.5, only 0.5 s of quiet
    expected = expected_windows(forecast.arrivals, 1.0, forecast)
    assert [w.is_expected for w in expected] == [True, True]
    verdict = verify(lagged, [], VerifyOptions(), expected)
    assert verdict.status == "inconclusive" and verdict.exit_code == 3
    assert [c.state for c in verdict.coverage] == ["missed", "observed"]
    assert verdict.coverage[0].lag_s == pytest.approx(3.0)
    assert verdict.num_covered() == (1, 2)
    assert "lagged the forecast by 3.000 s" in verdict.reasons[0]
    assert "0.000-4.000 s" in verdict.reasons[0] and "until 3.500 s" in verdict.reasons[0]
    # Without the coverage check the same run would have passed: the point of it.
    assert verify(lagged, [], VerifyOptions()).status == "verified"


def test_a_window_missed_because_the_client_sent_late_blames_the_client():
    """The same lag, but request a was sent 2.9 s late (a client busy parsing a 10 MB
    /metrics, say): the client lagged, not the engines."""
    forecast = _two_bursts()
    lagged = _two_bursts(a_end=3.5)
    lagged.requests[0].send_t, lagged.requests[0].send_lateness_s = 2.9, 2.9
    verdict = verify(
        lagged, [], VerifyOptions(), expected_windows(forecast.arrivals, 1.0, forecast)
    )
    assert verdict.coverage[0].send_lateness_s == pytest.approx(2.9)
    assert "the client lagged: it sent requests up to 2.900 s late" in verdict.reasons[0]
    assert "the engines lagged" not in verdict.reasons[0]


def test_an_interrupted_run_says_which_windows_it_never_reached():
    forecast = _two_bursts()  # expects the gap at 0.5-4.0 and the tail
    stopped = _timeline([_record("a", 0.0, 0.3)], [_sample(0.0, 3), _sample(0.3, 0)], 0.4)
    verdict = verify(
        stopped, [], VerifyOptions(), expected_windows(forecast.arrivals, 1.0, forecast)
    )
    assert [c.state for c in verdict.coverage] == ["unreached", "unreached"]
    assert verdict.status == "inconclusive"
    assert all("not reached" in r and "stopped before it ended" in r for r in verdict.reasons)
    assert not any("lagged" in r for r in verdict.reasons)  # no negative lag blamed


def test_a_gap_the_forecast_itself_fills_is_busy_not_missed():
    busy = _two_bursts(a_end=3.5)  # the trace's own work fills the gap, in the forecast too
    verdict = verify(busy, [], VerifyOptions(), expected_windows(busy.arrivals, 1.0, busy))
    assert [c.state for c in verdict.coverage] == ["busy", "observed"]
    assert verdict.status == "verified" and verdict.num_covered() == (1, 1)


def test_a_run_that_never_went_quiet_misses_the_tail():
    forecast = _two_bursts()
    run = _two_bursts(b_end=9.0)  # still in flight when observation stopped at 8
    verdict = verify(run, [], VerifyOptions(), expected_windows(forecast.arrivals, 1.0, forecast))
    assert verdict.coverage[-1].state == "missed" and verdict.status == "inconclusive"
    assert "the tail" in verdict.reasons[0]


def test_ignored_requests_are_counted_by_cause_and_make_it_inconclusive():
    too_long = "prompt has 9000 tokens; max_model_len is 8192"
    no_room = "up to 900 tokens need 57 KV blocks; the pool has 31"
    records = [_record(f"r{i}", 0.1 * i, 0.1 * i + 0.05) for i in range(96)]
    records += [
        _record("x1", 0.2, 0.2, tokens=0, error=too_long),
        _record("x2", 0.3, 0.3, tokens=0, error=too_long),
        _record("x3", 0.4, 0.4, tokens=0, reason="ignored", error=no_room),
        _record("x4", 0.5, 0.5, tokens=0, error=None),
    ]  # length with no error: not ignored
    assert [ignored_cause(r) for r in records[-4:]] == [
        "prompt longer than max_model_len",
        "prompt longer than max_model_len",
        "can never fit the KV pool",
        None,
    ]
    timeline = _timeline(records, [_sample(0.0, 0)], 20.0)
    timeline.arrivals.sort()
    verdict = verify(timeline, [], VerifyOptions())
    assert verdict.ignored == {
        "prompt longer than max_model_len": 2,
        "can never fit the KV pool": 1,
    }
    assert verdict.status == "inconclusive" and "3 of 100 requests ignored" in verdict.reasons[0]
    assert verify(timeline, [], VerifyOptions(allow_ignored=True)).status == "verified"
    assert verify(timeline, [], VerifyOptions(max_ignored_share=0.05)).status == "verified"
    assert ignored_by_cause(records[:96]) == {}


def test_an_undecided_window_is_not_verified():
    timeline = _timeline([_record("a", 0.0, 0.5)], [_sample(0.0, 3)], 0.7)  # 0.2 s tail, held
    verdict = verify(timeline, [], VerifyOptions(idle_threshold_s=0.1, drain_deadline_s=0.5))
    assert {w.verdict for w in verdict.windows} == {"undecided"}
    assert verdict.status == "inconclusive" and "undecided" in verdict.reasons[0]


@pytest.mark.parametrize("liveness", ["legacy", "event"])
def test_the_virtual_clock_observes_every_window_it_expects(liveness):
    engine = EngineConfig(num_blocks=512, max_model_len=4096, liveness=liveness)
    timeline = simulate(shape(read_trace(EXAMPLE), ShapingOptions()), SimOptions(engine=engine))
    expected = expected_windows(timeline.arrivals, 1.0, timeline)
    assert len(candidate_gaps(timeline.arrivals, 1.0)) == 3
    verdict = verify(timeline, [], VerifyOptions(), expected)
    assert [c.state for c in verdict.coverage] == ["observed"] * 4
    assert len(idle_windows(timeline, 1.0)) == 4 and not verdict.reasons


@public_trace(AZURE)
def test_the_virtual_clock_covers_a_dense_public_trace():
    # 400 requests of the Azure code trace: some gaps over the threshold are filled by the
    # trace's own work (busy); every one the forecast expects is observed.
    engine = EngineConfig(
        num_blocks=40000, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256
    )
    records = shape(read_trace(AZURE), ShapingOptions(max_requests=400))
    timeline = simulate(records, SimOptions(engine=engine))
    expected = expected_windows(timeline.arrivals, 1.0, timeline)
    verdict = verify(timeline, [], VerifyOptions(), expected)
    states = [c.state for c in verdict.coverage]
    assert "missed" not in states and states.count("observed") == len(idle_windows(timeline, 1.0))
    assert verdict.status == "verified"


def test_a_late_drain_is_told_apart_from_a_window_that_never_drained_in_one_precision():
    late = _timeline(
        [_record("a", 0.0, 0.5), _record("b", 4.0, 4.5)],
        [_sample(0.0, 3), _sample(0.5, 2), _sample(3.2345678, 0), _sample(4.0, 3), _sample(4.5, 0)],
        8.0,
    )
    (violation,) = verify(late, [], VerifyOptions(drain_deadline_s=1.0)).violations
    assert violation.detail == (
        "late drain: idle window: 2 blocks held until 2.735 s after its "
        "start, past the drain deadline"
    )
    never = _two_bursts()
    never.samples[1] = _sample(0.5, 2)
    never.samples.insert(2, _sample(2.0, 5))  # a later sample (a scrape's lag) saw more
    (violation,) = verify(never, [], VerifyOptions()).violations
    assert violation.detail == (
        "never drained: idle window of 3.500 s: 2 blocks used at its "
        "start, 5 at its last sample that had any"
    )


def test_an_interrupted_run_says_what_it_reached_in_one_line_and_judges_not_the_window_it_cut():
    timeline = _timeline(
        [_record("a", 0.0, 0.5), _record("b", 4.0, 4.5)],
        [_sample(0.0, 3), _sample(0.5, 0), _sample(4.0, 3), _sample(6.0, 3)],
        6.0,
    )
    timeline.requests[1].end_t = 4.5
    timeline.meta["interrupted"] = "SIGINT"  # cut at 6 s, b's blocks not yet freed
    arrivals = [0.0, 4.0] + [10.0 + 2 * i for i in range(1171)]  # the trace it did not reach
    verdict = verify(timeline, [], VerifyOptions(), expected_windows(arrivals, 1.0, None))
    assert verdict.violations == ()  # the cut tail is not a leak
    assert list(verdict.reasons) == [
        "stopped early: 1 of 1 reached windows drained; 1,172 not reached "
        "(first: the idle gap 4.000-10.000 s: the replay stopped before it ended)"
    ]


def _lagged_run() -> tuple[Timeline, tuple]:
    forecast = _two_bursts()
    lagged = _two_bursts(a_end=3.5)  # the gap swallowed by 3 s of lag; the tail observed
    return lagged, expected_windows(forecast.arrivals, 1.0, forecast)


def test_lag_without_min_coverage_is_inconclusive_and_says_what_to_do():
    lagged, expected = _lagged_run()
    verdict = verify(lagged, [], VerifyOptions(), expected)
    assert verdict.status == "inconclusive" and not verdict.partial
    assert verdict.reasons[-1].startswith(
        "to cover the windows the engines' lag swallowed: measure this "
        "machine's step costs (`kvdrain calibrate -o FILE`, then "
        "--calibration FILE)"
    )
    assert "(--clock virtual)" in verdict.reasons[-1] and "--min-coverage F" in verdict.reasons[-1]


def test_min_coverage_met_is_a_pass_on_partial_coverage_naming_what_lag_cost():
    lagged, expected = _lagged_run()
    verdict = verify(lagged, [], VerifyOptions(min_coverage=0.5), expected)
    assert (verdict.status, verdict.exit_code, verdict.reasons) == ("verified", 0, ())
    assert verdict.partial == (
        "every engine drained in all 1 observed windows; 1 of 2 expected not "
        "observed because the engines lagged the forecast by up to 3.000 s "
        "(coverage 50% >= --min-coverage 50%)"
    )
    assert verdict.to_dict()["partial_coverage"] == verdict.partial


def test_min_coverage_not_met_stays_inconclusive():
    lagged, expected = _lagged_run()
    assert verify(lagged, [], VerifyOptions(min_coverage=0.9), expected).status == "inconclusive"


def test_a_run_that_saw_no_kv_usage_observed_no_window_however_its_requests_gapped():
    blind = _timeline([_record("a", 0.0, 0.5), _record("b", 4.0, 4.5)], [], 8.0)  # no --metrics
    blind.engines.clear()
    verdict = verify(blind, [], VerifyOptions(), expected_windows(blind.arrivals, 1.0, None))
    assert verdict.num_covered() == (0, 2)  # not "2 of 2 expected idle windows observed"
    assert [c.state for c in verdict.coverage] == ["unobservable", "unobservable"]
    assert verdict.status == "inconclusive" and "KV usage was observed" in verdict.reasons[0]


def test_a_snapshot_violation_states_its_sample_time_to_the_millisecond_as_every_time_is():
    from replay.trace.records import TraceSnapshot

    timeline = _timeline([_record("a", 0.0, 0.5)], [_sample(0.0, 0), _sample(1.9712104, 3)], 3.0)
    snapshot = TraceSnapshot(4.349, {"E": {"used": 0}}, line=7)
    (violation,) = [
        v for v in verify(timeline, [snapshot], VerifyOptions()).violations if v.kind == "snapshot"
    ]
    assert violation.detail.startswith("sample at 1.971 s (line 7): used 3 != recorded 0"), (
        violation.detail
    )


IDLE_QUEUES = {
    "E": {
        "waiting": 0,
        "skipped_waiting": 0,
        "waiting_for_remote_kvs": 0,
        "running": 0,
        "finished_awaiting_free": 0,
    }
}


def test_a_recorded_idle_snapshot_the_replay_reached_still_busy_is_not_reached_not_violated():
    from replay.trace.records import TraceSnapshot

    # The recording was idle at 1.5 s (every queue empty); this replay lagged: request a ran to 2.0 s.
    lagged = _two_bursts(a_end=2.0)
    snapshot = TraceSnapshot(1.5, {"E": {"used": 0}}, IDLE_QUEUES, line=4)
    verdict = verify(lagged, [snapshot], VerifyOptions())
    assert (
        not [v for v in verdict.violations if v.kind == "snapshot"]
        and verdict.status == "inconclusive"
    )
    assert "recorded snapshot not reached: t=1.500 s (line 4)" in verdict.reasons[-1]
    # Reached (the replay idle there too), it is compared: a held block is a violation.
    on_time = _two_bursts()
    on_time.samples[1] = _sample(0.5, 1)
    (violation,) = [
        v for v in verify(on_time, [snapshot], VerifyOptions()).violations if v.kind == "snapshot"
    ]
    assert "used 1 != recorded 0" in violation.detail
    # A snapshot that recorded work in flight is compared wherever the replay is.
    busy = TraceSnapshot(1.5, {"E": {"used": 0}}, {"E": {**IDLE_QUEUES["E"], "running": 1}}, line=4)
    assert [v.kind for v in verify(lagged, [busy], VerifyOptions()).violations] == ["snapshot"]


def test_a_recorded_idle_snapshot_the_replay_was_quiet_at_for_less_than_a_drain_deadline_is_not_reached():
    from replay.trace.records import TraceSnapshot

    # request a ended at 1.2 s, 0.3 s before the snapshot: its engine may still hold a block it
    # has not been told to free (a lagging replay), which the 0-tolerance compare called a violation
    just_quiet = _two_bursts(a_end=1.2)
    just_quiet.samples[1] = _sample(1.2, 1)
    snapshot = TraceSnapshot(1.5, {"E": {"used": 0}}, IDLE_QUEUES, line=4)
    verdict = verify(just_quiet, [snapshot], VerifyOptions(drain_deadline_s=0.5))
    assert not [v for v in verdict.violations if v.kind == "snapshot"]
    assert "recorded snapshot not reached: t=1.500 s (line 4)" in verdict.reasons[-1]
    # quiet for longer than the deadline, the held block is a violation
    held = verify(just_quiet, [snapshot], VerifyOptions(drain_deadline_s=0.2))
    assert "snapshot" in [v.kind for v in held.violations]  # (and the window's leak)


def test_the_tail_is_reached_when_the_models_last_arrival_rounds_to_the_runs():
    """`replay TRACE --start 40`, the last request at 50.3 s: the run sent it at
    50.3 - 40 = 10.299999999999997 s, the model (the virtual clock's integer nanoseconds)
    put the tail at 10.3 s, and the tail read "not reached" in three runs of three."""
    late = 50.3 - 40
    run = _timeline(
        [_record("a", 0.0, 0.5), _record("b", late, late + 0.5)],
        [_sample(0.0, 3), _sample(0.5, 0), _sample(late, 3), _sample(late + 0.5, 0)],
        late + 3.0,
    )
    model = _timeline(
        [_record("a", 0.0, 0.5), _record("b", 10.3, 10.8)],
        [_sample(0.0, 3), _sample(0.5, 0), _sample(10.3, 3), _sample(10.8, 0)],
        13.3,
    )
    verdict = verify(run, [], VerifyOptions(), expected_windows(model.arrivals, 1.0, model))
    assert [c.state for c in verdict.coverage] == ["observed", "observed"]
    assert verdict.status == "verified", verdict.reasons


def _unfinished(meta: dict) -> Timeline:
    """Two bursts; the second's request still running when the run ended."""
    timeline = _two_bursts()
    timeline.requests[1].end_t = None
    timeline.samples[-1] = _sample(4.5, 3)
    timeline.meta.update(meta)
    return timeline


def test_a_request_that_never_ended_on_a_healthy_run_is_a_violation():
    verdict = verify(_unfinished({}), [], VerifyOptions())
    assert verdict.status == "violation"
    assert [v.kind for v in verdict.violations] == ["unfinished"]


def test_a_request_still_running_when_its_engine_starved_is_inconclusive_not_a_violation():
    """Beside four CPU hogs at nice -15 the README's main replay ended VIOLATION: 11 requests
    "never ended", still running when the replay stopped, the engines given 2-4% of a core."""
    starved = {"t": 1.0, "end_t": None, "engine": "E", "cause": "2% of a core"}
    verdict = verify(_unfinished({"starved": [starved]}), [], VerifyOptions())
    assert verdict.status == "inconclusive" and not verdict.violations
    assert any(
        r.startswith("1 request still running when the run ended, its engines starved of CPU")
        and "'b'" in r
        for r in verdict.reasons
    ), verdict.reasons


def test_a_request_still_running_when_the_run_was_stopped_is_not_judged():
    """`q` in the live view: "request 'b2-r8' never ended ... 1 violation" before."""
    verdict = verify(_unfinished({"interrupted": "q"}), [], VerifyOptions())
    assert not verdict.violations
    assert any(r.startswith("stopped early: 1 request still running") for r in verdict.reasons)


def test_another_clients_requests_on_a_shared_serve_are_inconclusive_never_a_fault():
    """A second replay on a serve another replay was using ended FAULT (exit 4), which is
    for dead engines; and the leak its requests made in the first replay's window is not
    this replay's to judge."""
    timeline = _two_bursts()
    timeline.samples[1] = _sample(0.5, 2)  # blocks held through the gap: the other client's
    seen = {"t": 2.0, "engine": "E", "cause": "1 request of another client"}
    timeline.meta["shared"] = [seen]
    verdict = verify(timeline, [], VerifyOptions())
    assert verdict.status == "inconclusive" and not verdict.faults and not verdict.violations
    assert any(r.startswith("shared: E from 2.000 s: 1 request") for r in verdict.reasons)
    timeline.meta["shared"] = []
    assert verify(timeline, [], VerifyOptions()).status == "violation"  # without: a leak
