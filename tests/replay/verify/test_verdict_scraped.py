"""Verdicts from scraped metrics (--target http://): only scrapes inside a window are
evidence (engine stats keep carrying their last value forward), the HTTP section's status
is the run's, and a trace the server cannot take is a usage error (exit 2) before t = 0."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from replay.verify import outcome
from replay.verify.coverage import WindowCoverage, credit_engine_windows, expected_windows
from replay.verify.outcome import http_outcome, http_verdict, outcome_lines
from replay.verify.report import verdict_line
from replay.verify.rules import VerifyOptions, verify
from replay.verify.timeline import SAMPLING_SCRAPED, EngineSample, RequestRecord, Timeline
from replay.verify.verdict import EXIT_CODES, EXIT_USAGE

pytestmark = pytest.mark.timeout(60)


def sample(t: float, used: int, send_t: float | None = None) -> EngineSample:
    return EngineSample(
        t=t,
        engine="P",
        num_used_blocks=used,
        num_cached_blocks=0,
        num_free_blocks=100 - used,
        num_usable_blocks=100,
        num_waiting=0,
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=0,
        num_running=0,
        num_finished_awaiting_free=0,
        loop_state="unknown",
        num_steps=0,
        num_wakeups=0,
        send_t=send_t,
    )


REQUESTS = [
    RequestRecord(
        req_id="a",
        arrival_t=0.0,
        send_t=0.0,
        send_lateness_s=0.0,
        first_token_t=0.2,
        end_t=1.0,
        num_prompt_tokens=8,
        num_output_tokens=4,
        num_prefix_hit_tokens=0,
        finish_reason="length",
    ),
    RequestRecord(
        req_id="b",
        arrival_t=10.0,
        send_t=10.0,
        send_lateness_s=0.0,
        first_token_t=10.2,
        end_t=10.5,
        num_prompt_tokens=8,
        num_output_tokens=4,
        num_prefix_hit_tokens=0,
        finish_reason="length",
    ),
]


def timeline(samples: list[EngineSample], scraped: bool) -> Timeline:
    meta = {"sampling": SAMPLING_SCRAPED} if scraped else {}
    return Timeline(
        engines=["P"],
        num_usable_blocks={"P": 100},
        samples=samples,
        requests=REQUESTS,
        arrivals=[0.0, 10.0],
        aborts=[],
        end_t=12.0,
        meta=meta,
    )


def test_a_scraped_window_without_a_sample_inside_is_undecided_not_a_leak():
    """The metrics endpoint hung after t = 1 with 5 blocks in use: nothing is known after."""
    held = [sample(0.0, 0), sample(0.5, 5), sample(1.0, 5)]
    verdict = verify(timeline(held, scraped=True), [])
    assert [w.verdict for w in verdict.windows] == ["undecided", "undecided"]
    assert verdict.status == "inconclusive" and verdict.exit_code == 3
    assert all(w.time_to_drain is None for w in verdict.windows)
    # Engine stats: a parked engine publishes nothing, so its last value holds: a leak.
    stats = verify(timeline(held, scraped=False), [])
    assert [w.verdict for w in stats.windows] == ["leak", "leak"] and stats.exit_code == 1


def test_scraped_drained_needs_a_sample_after_the_deadline():
    options = VerifyOptions(drain_deadline_s=0.5)
    before_only = [sample(0.0, 0), sample(0.5, 5), sample(0.99, 0), sample(1.2, 0)]
    w = verify(timeline(before_only, scraped=True), [], options).windows[0]
    assert (w.start, w.verdict) == (1.0, "undecided")  # 1.2 is before the deadline 1.5
    stats = verify(timeline(before_only, scraped=False), [], options).windows[0]
    assert stats.verdict == "drained"  # engine stats: 0 from 0.99 on, carried forward
    seen = before_only + [sample(t, 0) for t in (3.0, 9.0, 10.8, 11.5)]
    assert [w.verdict for w in verify(timeline(seen, scraped=True), [], options).windows] == [
        "drained",
        "drained",
    ]


def test_scraped_leak_needs_blocks_held_after_the_deadline():
    options = VerifyOptions(drain_deadline_s=0.5)
    late = [
        sample(0.0, 0),
        sample(0.5, 5),
        sample(1.1, 5),
        sample(2.0, 0),
        sample(10.8, 0),
        sample(11.5, 0),
    ]
    held_early = timeline(late, scraped=True)
    w = verify(held_early, [], options).windows[0]
    # Held at 1.1, none at 2.0: the drain came by 2.0 (1.0 s, an upper bound), maybe after
    # the 0.5 s deadline: not proven drained, and no reading after the deadline saw blocks.
    assert w.verdict == "undecided" and w.time_to_drain is None
    in_time = timeline(late[:3] + [sample(1.4, 0)] + late[3:], scraped=True)
    w = verify(in_time, [], options).windows[0]
    assert w.verdict == "drained" and w.time_to_drain == pytest.approx(0.4)
    leaky = timeline(late[:3] + [sample(1.8, 5), sample(2.0, 0)] + late[4:], scraped=True)
    verdict = verify(leaky, [], options)
    assert verdict.windows[0].verdict == "leak" and verdict.exit_code == 1


def test_a_scrape_is_evidence_only_for_the_time_between_its_sending_and_its_answer():
    """Window 1.0-10.0 s, deadline 1.5 s. A reading answered late was taken early."""
    options = VerifyOptions(drain_deadline_s=0.5)

    def judge(*readings: EngineSample) -> tuple[str, float | None]:
        w = verify(
            timeline(
                [
                    sample(0.0, 0),
                    sample(0.5, 5),
                    *readings,
                    sample(10.8, 0, 10.6),
                    sample(11.5, 0, 11.2),
                ],
                scraped=True,
            ),
            [],
            options,
        ).windows[0]
        return w.verdict, w.time_to_drain

    # Taken before the window (sent at 0.8, while busy): no evidence of a drain...
    assert judge(sample(2.5, 0, send_t=0.8)) == ("undecided", None)
    # ...nor of a leak.
    assert judge(sample(2.5, 5, send_t=0.8)) == ("undecided", None)
    # Sent before the deadline, answered after it: no evidence either way.
    assert judge(sample(1.1, 5, 1.05), sample(2.5, 5, send_t=1.4)) == ("undecided", None)
    # Sent after the deadline, answered before the end: a leak.
    assert judge(sample(2.5, 5, send_t=1.6))[0] == "leak"
    # Sent after the deadline but answered after the window ended (the next request ran).
    assert judge(sample(10.2, 5, send_t=9.9))[0] == "undecided"
    # Zero for sure inside the window in time, and zero after the deadline: drained.
    assert judge(sample(1.3, 0, 1.0), sample(2.5, 0, 1.6)) == ("drained", pytest.approx(0.3))
    # The same zeros answered late: the drain is not proven by the deadline.
    assert judge(sample(1.7, 0, 1.0), sample(2.5, 0, 1.8)) == ("undecided", None)


def _http_timeline(samples, requests) -> Timeline:
    status = {
        "url": "http://x/metrics",
        "metric": "vllm:kv_cache_usage_perc",
        "unit": "blocks",
        "engines": {"0": "P"},
        "metric_names_found": [],
        "num_scrapes": len(samples),
        "num_failures": 0,
        "errors": [],
    }
    return Timeline(
        engines=["P"],
        num_usable_blocks={"P": 100},
        samples=samples,
        requests=requests,
        arrivals=[r.arrival_t for r in requests],
        aborts=[],
        end_t=9.0,
        meta={
            "driver": "http",
            "sampling": SAMPLING_SCRAPED,
            "http": {"server": {}, "metrics": [status], "latency": {}},
        },
    )


def test_the_http_section_says_the_runs_status_not_its_own():
    """An expected window missed (the server lagged): inconclusive everywhere, never VERIFIED."""
    requests = [
        RequestRecord(
            req_id="a",
            arrival_t=0.0,
            send_t=0.0,
            send_lateness_s=0.0,
            first_token_t=0.2,
            end_t=4.5,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        ),
        RequestRecord(
            req_id="b",
            arrival_t=5.0,
            send_t=5.0,
            send_lateness_s=0.0,
            first_token_t=5.2,
            end_t=5.5,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        ),
    ]
    samples = [sample(t / 10, 5 if (t < 45 or 50 <= t < 55) else 0) for t in range(0, 90)]
    tl = _http_timeline(samples, requests)
    verdict = verify(tl, [], expected=expected_windows([0.0, 5.0], 1.0, None))
    assert verdict.status == "inconclusive"
    status, reasons = http_verdict(tl, verdict)
    assert status == "inconclusive" and reasons == list(verdict.reasons)
    section = http_outcome(tl, verdict)
    assert (section["verdict"], section["exit_code"]) == ("inconclusive", 3)
    assert section["reasons"] == []  # what HTTP adds: nothing was missing from the scrapes
    assert not any("VERIFIED" in line for line in outcome_lines(section))
    assert not hasattr(outcome, "EXIT_CODES") and EXIT_CODES["inconclusive"] == 3


def test_a_violation_stays_one_and_http_gaps_make_a_clean_run_inconclusive():
    requests = [
        RequestRecord(
            req_id="a",
            arrival_t=0.0,
            send_t=0.0,
            send_lateness_s=0.0,
            first_token_t=0.2,
            end_t=1.0,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        )
    ]
    held = [sample(t / 10, 5) for t in range(0, 90)]
    tl = _http_timeline(held, requests)
    tl.meta["http"]["metrics"][0].update(num_failures=2, errors=["HTTP 500"])
    verdict = verify(tl, [])
    assert http_verdict(tl, verdict)[0] == "violation"
    section = http_outcome(tl, verdict)
    assert section["exit_code"] == 1 and "2 of 90 scrapes failed" in section["reasons"][0]
    drained = _http_timeline([sample(t / 10, 5 if t < 10 else 0) for t in range(0, 90)], requests)
    drained.meta["http"]["metrics"][0].update(num_failures=2, errors=["HTTP 500"])
    verdict = verify(drained, [])
    assert verdict.status == "verified" and http_verdict(drained, verdict)[0] == "inconclusive"


def test_a_failed_scrape_matters_inside_an_idle_window_not_in_busy_time():
    """A failed scrape leaves a reading missing: inside a judged window it could hide held
    blocks (inconclusive); in busy time, where nothing is judged, it leaves the run verified.
    (A real vLLM D under load timed out 1 of 356 scrapes mid-burst: a clean run read exit 3.)"""
    requests = [
        RequestRecord(
            req_id="a",
            arrival_t=0.0,
            send_t=0.0,
            send_lateness_s=0.0,
            first_token_t=0.2,
            end_t=1.0,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        )
    ]
    for spans, status in [([[0.3, 0.6]], "verified"), ([[0.3, 0.6], [4.0, 6.0]], "inconclusive")]:
        tl = _http_timeline([sample(t / 10, 5 if t < 10 else 0) for t in range(0, 90)], requests)
        tl.meta["http"]["metrics"][0].update(
            num_failures=len(spans), errors=["TimeoutError"], failure_spans=spans
        )
        verdict = verify(tl, [])
        assert http_verdict(tl, verdict)[0] == status, spans
    lines = outcome_lines(http_outcome(tl, verdict))
    tl.meta["http"]["metrics"][0].update(num_failures=1, failure_spans=[[0.3, 0.6]])
    verdict = verify(tl, [])
    assert "1 failed scrape fell in busy time" in outcome_lines(http_outcome(tl, verdict))[-1]
    assert any("2 of 90 scrapes failed" in line for line in lines)


def _serve_models(stop: threading.Event, box: dict) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})

    async def completions(request: web.Request) -> web.Response:
        box["posts"] = box.get("posts", 0) + 1
        return web.json_response({}, status=500)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["port"] = site._server.sockets[0].getsockname()[1]
        box["ready"].set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await runner.cleanup()

    asyncio.run(main())


def test_token_ids_beyond_the_servers_vocabulary_exit_2_before_t0(tmp_path: Path):
    from tests.e2e.test_cli import invoke

    trace = tmp_path / "big.jsonl"
    trace.write_text(
        json.dumps({"t": 0, "id": "a", "prompt_token_ids": [1, 128000], "max_tokens": 2}) + "\n"
    )
    stop, box = threading.Event(), {"ready": threading.Event()}
    thread = threading.Thread(target=_serve_models, args=(stop, box), daemon=True)
    thread.start()
    try:
        assert box["ready"].wait(20)
        unknown = invoke(
            "replay",
            str(trace),
            "--target",
            f"http://127.0.0.1:{box['port']}",
            "--no-live",
            "--tail",
            "0.2",
        )
        result = invoke(
            "replay",
            str(trace),
            "--target",
            f"http://127.0.0.1:{box['port']}",
            "--no-live",
            "--tail",
            "0.2",
            "--vocab-size",
            "32000",
        )
    finally:
        stop.set()
        thread.join(20)
    assert unknown.exit_code == EXIT_USAGE and "give --vocab-size N" in unknown.output, (
        unknown.output
    )
    assert result.exit_code == EXIT_USAGE, result.output
    assert (
        "prompt token id 128,000 is outside the server's vocabulary [0, 32,000) (from "
        "--vocab-size)" in result.output
    )
    assert "Traceback" not in result.output and "posts" not in box


def test_a_scraped_drained_window_never_under_reports_its_time_to_drain():
    """Any readings (each taken somewhere in [send_t, t]): a window judged drained has a
    time to drain within the deadline, no reading surely taken between the deadline and
    its end saw blocks, and some reading sent after the deadline was answered before it."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    reading = st.tuples(st.floats(0, 12), st.floats(0, 3), st.sampled_from([0, 0, 5]))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(reading, max_size=12))
    def check(readings):
        samples = sorted(
            (sample(t, used, max(t - lag, 0.0)) for t, lag, used in readings), key=lambda s: s.t
        )
        for w in verify(
            timeline(samples, scraped=True), [], VerifyOptions(drain_deadline_s=0.5)
        ).windows:
            if w.verdict != "drained":
                continue
            deadline_t = w.start + 0.5
            assert w.time_to_drain is not None and w.time_to_drain <= 0.5
            evidence = [s for s in samples if s.send_t > deadline_t and s.t < w.end]
            assert evidence and not any(s.num_used_blocks for s in evidence)

    check()


def engine_reading(t: float, engine: str, used: int, running: int) -> EngineSample:
    return EngineSample(
        t=t,
        engine=engine,
        num_used_blocks=used,
        num_cached_blocks=0,
        num_free_blocks=100 - used,
        num_usable_blocks=100,
        num_waiting=0,
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=0,
        num_running=running,
        num_finished_awaiting_free=0,
        loop_state="unknown",
        num_steps=0,
        num_wakeups=0,
        send_t=t - 0.01,
    )


def busy_trace_with_an_idle_decode_engine(
    held: int, queue_gauges: list[str], idle_until: float = 8.0
) -> Timeline:
    """D0 has no request from t=2 to t=idle_until (its metrics say 0 running and waiting)
    and holds `held` blocks, while D1 stays busy: no idle gap of the whole trace."""
    samples = []
    for i in range(100):
        t = 0.1 * i
        d0_idle = 2.0 <= t <= idle_until
        samples.append(engine_reading(t, "D0", held if d0_idle else 4, 0 if d0_idle else 1))
        samples.append(engine_reading(t, "D1", 4, 1))
    requests = [
        RequestRecord(
            req_id=f"r{i}",
            arrival_t=0.5 * i,
            send_t=0.5 * i,
            send_lateness_s=0.0,
            first_token_t=0.5 * i + 0.2,
            end_t=0.5 * i + 0.8,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        )
        for i in range(20)
    ]
    meta = {"sampling": SAMPLING_SCRAPED, "queue_gauges": queue_gauges}
    return Timeline(
        engines=["D0", "D1"],
        num_usable_blocks={"D0": 100, "D1": 100},
        samples=samples,
        requests=requests,
        arrivals=[r.arrival_t for r in requests],
        aborts=[],
        end_t=10.0,
        meta=meta,
    )


def test_over_http_an_engine_idle_by_its_own_metrics_is_judged_in_that_window():
    leak = verify(busy_trace_with_an_idle_decode_engine(held=6, queue_gauges=["D0", "D1"]), [])
    own = [w for w in leak.windows if w.engine == "D0" and not w.is_tail]
    # from when the request under way at t=2 (sent at 1.5) ended: it may have been D0's
    assert own and own[0].start == pytest.approx(2.3) and own[0].verdict == "leak"
    assert leak.exit_code == 1
    drained = verify(busy_trace_with_an_idle_decode_engine(held=0, queue_gauges=["D0", "D1"]), [])
    assert [w.verdict for w in drained.windows if w.engine == "D0" and not w.is_tail] == ["drained"]


def test_over_http_without_queue_gauges_no_engine_window_is_claimed():
    verdict = verify(busy_trace_with_an_idle_decode_engine(held=6, queue_gauges=[]), [])
    assert not [w for w in verdict.windows if not w.is_tail]


def lone_prefill_engine_holding_unread_kv(freed_at: float) -> Timeline:
    """A real P/D pair: P prefills at t=0.1 (its metrics show it running once), then counts
    the request neither running nor waiting while it holds 3 blocks for D, which reads
    them late (D's first token at t=6) because D is slow; P frees them at `freed_at`."""
    samples = [
        engine_reading(
            0.1 * i, "P", 0 if 0.1 * i < 0.1 or 0.1 * i >= freed_at else 3, 1 if i == 1 else 0
        )
        for i in range(100)
    ]
    samples += [
        engine_reading(0.1 * i, "D", 0 if 0.1 * i < 6.0 or 0.1 * i >= 6.5 else 2, 0)
        for i in range(100)
    ]
    request = RequestRecord(
        req_id="r0",
        arrival_t=0.0,
        send_t=0.0,
        send_lateness_s=0.0,
        first_token_t=6.0,
        end_t=6.5,
        num_prompt_tokens=300,
        num_output_tokens=4,
        num_prefix_hit_tokens=0,
        finish_reason="length",
    )
    meta = {"sampling": SAMPLING_SCRAPED, "queue_gauges": ["P", "D"]}
    return Timeline(
        engines=["P", "D"],
        num_usable_blocks={"P": 100, "D": 100},
        samples=samples,
        requests=[request],
        arrivals=[0.0],
        aborts=[],
        end_t=10.0,
        meta=meta,
    )


def test_a_prefill_engine_holding_kv_that_decode_has_not_read_yet_is_not_idle():
    verdict = verify(lone_prefill_engine_holding_unread_kv(freed_at=6.2), [])
    assert not verdict.violations, [v.message for v in verdict.violations]
    assert verdict.exit_code == 0
    p_windows = [w for w in verdict.windows if w.engine == "P"]
    assert p_windows and all(w.start >= 6.0 for w in p_windows)
    leak = verify(lone_prefill_engine_holding_unread_kv(freed_at=20.0), [])
    assert leak.exit_code == 1 and {w.engine for w in leak.windows if w.verdict == "leak"} == {"P"}


@pytest.mark.parametrize("names", [("kv:P", "kv:D"), ("prefill", "decode"), ("P", "D")])
def test_a_prefill_engine_is_known_by_its_role_whatever_its_source_calls_it(names):
    """--metrics kv=URL names a server's engines kv:P and kv:D, --metrics prefill=URL names
    one prefill: each P is still judged as a prefill (its windows leave out the requests
    awaiting their first token), never as a decode engine."""
    timeline = lone_prefill_engine_holding_unread_kv(freed_at=6.2)
    rename = dict(zip(("P", "D"), names))
    for s in timeline.samples:
        s.engine = rename[s.engine]
    timeline.engines = list(names)
    timeline.num_usable_blocks = {n: 100 for n in names}
    timeline.meta["queue_gauges"] = list(names)
    verdict = verify(timeline, [])
    assert verdict.exit_code == 0, [v.message for v in verdict.violations]


def test_the_scrapes_before_the_first_send_open_no_engine_window():
    timeline = lone_prefill_engine_holding_unread_kv(freed_at=6.2)
    for s in timeline.samples:
        s.t, s.send_t = s.t - 3.0, s.send_t - 3.0  # 3 s of pre-flight readings, all idle
    verdict = verify(timeline, [])
    assert all(w.start >= 0.0 for w in verdict.windows), [
        (w.engine, w.start) for w in verdict.windows
    ]


def test_over_http_a_prefill_engine_among_several_is_not_idle_while_any_request_awaits_its_first_token():
    """Which P had a request is the server's routing: any request before its first token may
    be one whose KV this P holds for D, though its metrics show nothing running or waiting."""
    timeline = busy_trace_with_an_idle_decode_engine(held=6, queue_gauges=["P0", "P1"])
    for s in timeline.samples:
        s.engine = {"D0": "P0", "D1": "P1"}[s.engine]
    timeline.engines, timeline.num_usable_blocks = ["P0", "P1"], {"P0": 100, "P1": 100}
    verdict = verify(timeline, [])
    assert not [w for w in verdict.windows if w.engine == "P0" and not w.is_tail]


def test_over_http_the_tail_is_judged_once_per_engine():
    """The trace's tail starts when the last request ended (the client's view); an engine's
    own tail from its metrics starts a reading later, inside it: one window, not two."""
    verdict = verify(lone_prefill_engine_holding_unread_kv(freed_at=6.2), [])
    tails = [w.engine for w in verdict.windows if w.is_tail]
    assert sorted(tails) == ["D", "P"], [(w.engine, w.start, w.end) for w in verdict.windows]


def routed_prefill_engines(
    held: int, names: tuple[str, str] = ("P0", "P1"), upstreams: tuple[str, str] = ("P0", "P1")
) -> Timeline:
    """The trace above behind kvdrain's proxy, P0 and P1 for D0 and D1: the proxy named each
    request's way (stages), the ones sent from t=2 to t=8 went to P1, the others to P0."""
    timeline = busy_trace_with_an_idle_decode_engine(held=held, queue_gauges=list(names))
    for s in timeline.samples:
        s.engine = {"D0": names[0], "D1": names[1]}[s.engine]
    timeline.engines, timeline.num_usable_blocks = list(names), {n: 100 for n in names}
    for r in timeline.requests:
        r.stages = [
            [upstreams[1] if 2.0 <= r.send_t < 8.0 else upstreams[0], r.send_t],
            ["D", r.send_t],
        ]
    return timeline


def test_over_http_a_prefill_engine_among_several_is_judged_in_its_own_window_where_the_proxy_named_the_ways():
    leak = verify(routed_prefill_engines(held=6), [])
    own = [w for w in leak.windows if w.engine == "P0" and not w.is_tail]
    assert [(round(w.start, 6), round(w.end, 6), w.verdict) for w in own] == [(2.0, 8.0, "leak")]
    assert leak.exit_code == 1
    drained = verify(routed_prefill_engines(held=0), [])
    assert [w.verdict for w in drained.windows if w.engine == "P0" and not w.is_tail] == ["drained"]
    assert drained.exit_code == 0


def test_the_engines_of_an_upstream_named_in_the_way_are_its_series_name_colon_label():
    """A serve behind the proxy as P0 exposes its engines as P0:P and P0:D: both are P0's."""
    own = verify(routed_prefill_engines(held=6, names=("P0:P", "P1:P")), [])
    assert [w.engine for w in own.windows if w.verdict == "leak" and not w.is_tail] == ["P0:P"]
    other = verify(routed_prefill_engines(held=6, names=("P01", "P1"), upstreams=("P0", "P1")), [])
    assert not [
        w for w in other.windows if w.engine == "P01" and not w.is_tail
    ]  # no way named P01: by role


def test_a_request_whose_way_is_not_named_may_be_on_any_engine_of_its_role():
    timeline = routed_prefill_engines(held=6)
    timeline.requests[10].stages.clear()  # sent at t=5, answered without the header
    own = [w for w in verify(timeline, []).windows if w.engine == "P0" and not w.is_tail]
    assert [(round(w.start, 6), round(w.end, 6)) for w in own] == [(2.0, 5.0), (5.2, 8.0)]


def prefill_idle_inside_a_gap_decode_is_still_busy_in() -> Timeline:
    """Gap 1.0-5.5 s of the trace; request b (sent at 1.0) reaches D at 3.5 s (first token)
    and ends at 4.8 s, so the client sees no idle window there (0.7 s < 1 s), while P's own
    metrics show it idle from 3.5 s holding 6 blocks, D running b until it ends."""
    samples = []
    for i in range(80):
        t = 0.1 * i
        p_busy = t < 0.2 or 1.0 <= t < 3.5 or t >= 5.5
        samples.append(engine_reading(t, "P", 6 if t >= 0.2 else 0, 1 if p_busy else 0))
        samples.append(engine_reading(t, "D", 0, 1 if t < 1.0 or 3.5 <= t < 4.8 or t >= 5.5 else 0))
    requests = [
        RequestRecord(
            req_id=name,
            arrival_t=arrival,
            send_t=arrival,
            send_lateness_s=0.0,
            first_token_t=first,
            end_t=end,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        )
        for name, arrival, first, end in (
            ("a", 0.0, 0.2, 1.0),
            ("b", 1.0, 3.5, 4.8),
            ("c", 5.5, 5.7, 6.0),
        )
    ]
    meta = {"sampling": SAMPLING_SCRAPED, "queue_gauges": ["P", "D"]}
    return Timeline(
        engines=["P", "D"],
        num_usable_blocks={"P": 100, "D": 100},
        samples=samples,
        requests=requests,
        arrivals=[0.0, 1.0, 5.5],
        aborts=[],
        end_t=8.0,
        meta=meta,
    )


def test_a_gap_where_an_engine_was_judged_in_its_own_window_is_said_observed_on_that_engine():
    timeline = prefill_idle_inside_a_gap_decode_is_still_busy_in()
    verdict = verify(timeline, [], expected=expected_windows(timeline.arrivals, 1.0, None))
    leak = [w for w in verdict.windows if w.verdict == "leak" and 1.0 < w.start < 5.5]
    assert [w.engine for w in leak] == ["P"]
    gap = [c for c in verdict.coverage if c.start == 1.0]
    assert [(c.state, c.judged_on) for c in gap] == [("missed", ("P",))]
    missed = [r for r in verdict.reasons if "1.000-5.500" in r]
    assert missed and "observed on P alone" in missed[0], missed


def test_a_gap_where_every_engine_was_judged_in_its_own_window_is_observed():
    gap = WindowCoverage(
        start=1.0, end=5.5, is_tail=False, state="missed", quiet_from=4.8, lag_s=None
    )
    judged = [("P", (3.5, 5.5, False)), ("D0", (4.0, 5.5, False)), ("D1", (0.2, 1.0, False))]
    assert [(c.state, c.judged_on) for c in credit_engine_windows([gap], judged, ["P", "D0"])] == [
        ("observed", ("D0", "P"))
    ]
    assert [
        (c.state, c.judged_on) for c in credit_engine_windows([gap], judged, ["P", "D0", "D1"])
    ] == [("missed", ("D0", "P"))]


def decode_engine_idle_for_a_moment(held: int, idle: tuple[float, float]) -> Timeline:
    """Requests every 0.5 s until t=10.3, then a drained tail until t=14; D0 has none of
    them in `idle` (its metrics say 0 running) and holds `held` blocks there, D1 stays busy."""
    samples = []
    for i in range(140):
        t = 0.1 * i
        busy = t < 10.3
        d0_idle = idle[0] <= t <= idle[1]
        samples.append(
            engine_reading(
                t, "D0", held if d0_idle else 4 if busy else 0, 0 if d0_idle or not busy else 1
            )
        )
        samples.append(engine_reading(t, "D1", 4 if busy else 0, 1 if busy else 0))
    requests = [
        RequestRecord(
            req_id=f"r{i}",
            arrival_t=0.5 * i,
            send_t=0.5 * i,
            send_lateness_s=0.0,
            first_token_t=0.5 * i + 0.2,
            end_t=0.5 * i + 0.8,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        )
        for i in range(20)
    ]
    meta = {"sampling": SAMPLING_SCRAPED, "queue_gauges": ["D0", "D1"]}
    return Timeline(
        engines=["D0", "D1"],
        num_usable_blocks={"D0": 100, "D1": 100},
        samples=samples,
        requests=requests,
        arrivals=[r.arrival_t for r in requests],
        aborts=[],
        end_t=14.0,
        meta=meta,
    )


def test_an_engine_window_shorter_than_the_drain_deadline_in_busy_time_is_too_short_to_judge():
    """No drain can be proven or disproven in a window shorter than the deadline; one that no
    observed gap of the trace overlaps leaves a run whose expected windows all drained
    verified, and the verdict says it was not judged."""
    options = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=2.0)
    timeline = decode_engine_idle_for_a_moment(held=6, idle=(2.0, 3.4))
    verdict = verify(timeline, [], options, expected=expected_windows(timeline.arrivals, 1.0, None))
    short = [w for w in verdict.windows if not w.is_tail]
    assert [(w.engine, w.verdict) for w in short] == [("D0", "undecided")] and short[0].length < 2.0
    assert verdict.status == "verified" and verdict.num_too_short == 1, verdict.reasons
    report = verdict.to_dict()
    assert "1 engine window shorter than the drain deadline not judged" in verdict_line(report)
    assert [(w["engine"], w["too_short"]) for w in report["windows"]] == [
        ("D0", True),
        ("D0", False),
        ("D1", False),
    ]
    # no coverage computed: no window is known to be spare, so the same window is still a reason
    unmodelled = verify(timeline, [], options)
    assert unmodelled.status == "inconclusive" and "undecided" in unmodelled.reasons[0]


def test_a_short_undecided_window_inside_an_observed_gap_still_makes_the_run_inconclusive():
    options = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=2.0)
    timeline = decode_engine_idle_for_a_moment(held=6, idle=(2.0, 3.4))
    timeline.end_t = 11.5  # the tail, 1.2 s, is itself shorter than the deadline, and expected
    verdict = verify(timeline, [], options, expected=expected_windows(timeline.arrivals, 1.0, None))
    assert verdict.status == "inconclusive" and verdict.num_too_short == 1
    assert any("undecided" in r and "at 10.300 s" in r for r in verdict.reasons), verdict.reasons


def test_a_gap_is_not_credited_with_an_engine_window_that_was_not_decided():
    timeline = prefill_idle_inside_a_gap_decode_is_still_busy_in()
    options = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=5.0)  # P's window: undecided
    verdict = verify(timeline, [], options, expected=expected_windows(timeline.arrivals, 1.0, None))
    assert [w.verdict for w in verdict.windows if w.engine == "P" and 1.0 < w.start < 5.5] == [
        "undecided"
    ]
    assert [(c.state, c.judged_on) for c in verdict.coverage if c.start == 1.0] == [("missed", ())]


def test_min_coverage_zero_with_no_window_observed_is_no_pass():
    """Requests every 2 s, each 2.5 s long: every gap of the trace is swallowed; D0 has only
    moments of its own, shorter than the deadline: nothing was judged, so nothing passes."""
    requests = [
        RequestRecord(
            req_id=f"r{i}",
            arrival_t=2.0 * i,
            send_t=2.0 * i,
            send_lateness_s=0.0,
            first_token_t=2.0 * i + 0.2,
            end_t=2.0 * i + 2.5,
            num_prompt_tokens=8,
            num_output_tokens=4,
            num_prefix_hit_tokens=0,
            finish_reason="length",
        )
        for i in range(5)
    ]
    samples = []
    for i in range(110):
        t = 0.1 * i
        d0_idle = (t % 2.0) < 1.5 and 1.0 < t < 10.0
        samples.append(engine_reading(t, "D0", 6 if d0_idle else 4, 0 if d0_idle else 1))
        samples.append(engine_reading(t, "D1", 4, 1))
    timeline = Timeline(
        engines=["D0", "D1"],
        num_usable_blocks={"D0": 100, "D1": 100},
        samples=samples,
        requests=requests,
        arrivals=[r.arrival_t for r in requests],
        aborts=[],
        end_t=10.5,
        meta={"sampling": SAMPLING_SCRAPED, "queue_gauges": ["D0", "D1"]},
    )
    options = VerifyOptions(idle_threshold_s=1.0, drain_deadline_s=2.0, min_coverage=0.0)
    verdict = verify(timeline, [], options, expected=expected_windows(timeline.arrivals, 1.0, None))
    assert verdict.status == "inconclusive" and not verdict.partial


def test_over_http_an_engine_that_is_not_scraped_is_expected_in_no_window_of_its_own():
    """The model of the run foresees a P idle while D decodes; the run scrapes D alone, so
    nothing can say whether P was idle there: no reason claims it was not."""
    from replay.verify.windows import EngineWindow

    timeline = busy_trace_with_an_idle_decode_engine(held=0, queue_gauges=["D0", "D1"])
    expected_own = [EngineWindow("P", 3.0, 5.0, False), EngineWindow("D0", 2.3, 8.0, False)]
    verdict = verify(timeline, [], VerifyOptions(), None, expected_own)
    assert [(c.engine, c.state) for c in verdict.coverage] == [("D0", "observed")]
    assert not any("P's own" in r for r in verdict.reasons), verdict.reasons
    unscraped = verify(
        busy_trace_with_an_idle_decode_engine(held=0, queue_gauges=[]),
        [],
        VerifyOptions(),
        None,
        expected_own,
    )  # scraped, but no queue gauges
    assert unscraped.coverage == () and unscraped.exit_code == 0, unscraped.reasons


def restart(engine: str, since: float, t: float) -> dict:
    """A restart fault as replay/metrics/restarts.py restart_faults writes it."""
    return {
        "t": t,
        "engine": engine,
        "kind": "restarted",
        "cause": f"restarted between {since:.3f} s and {t:.3f} s",
        "end_t": None,
        "spans": [[since, t]],
    }


def test_a_window_an_engine_restarted_in_is_never_drained_and_the_run_is_a_fault():
    """The readings after a restart are of another process: they show no drain."""
    options = VerifyOptions(drain_deadline_s=0.5)
    zeros = [sample(t, 0) for t in (1.2, 1.3, 1.6, 3.0, 9.0, 10.8, 11.5)]
    run = timeline([sample(0.0, 0), sample(0.5, 5), *zeros], scraped=True)
    assert verify(run, [], options).status == "verified"  # the control: no restart known
    run.meta["faults"] = [restart("P", 1.2, 1.3)]
    verdict = verify(run, [], options)
    assert [w.verdict for w in verdict.windows] == ["undecided", "drained"]
    assert verdict.status == "fault" and verdict.exit_code == 4
    assert verdict.reasons == (
        "1 idle window not judged drained: the engine restarted inside (first: P at 1.000 s, "
        "restarted between 1.200 s and 1.300 s); a restart frees blocks without draining them",
    )


def test_blocks_held_before_a_restart_are_still_a_leak_caused_by_it():
    options = VerifyOptions(drain_deadline_s=0.5)
    held = [sample(0.0, 0), sample(0.5, 5), sample(1.6, 5), sample(1.8, 0), sample(3.0, 0)]
    run = timeline(held + [sample(10.8, 0), sample(11.5, 0)], scraped=True)
    run.meta["faults"] = [restart("P", 1.6, 1.8)]
    verdict = verify(run, [], options)
    assert verdict.windows[0].verdict == "leak" and verdict.status == "fault"
    assert verdict.violations[0].kind == "fault_leak"
    assert "restarted between 1.600 s and 1.800 s" in verdict.violations[0].detail
