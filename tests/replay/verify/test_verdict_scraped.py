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

from replay.http import outcome
from replay.http.outcome import http_outcome, http_verdict, outcome_lines
from replay.verify.coverage import expected_windows
from replay.verify.rules import VerifyOptions, verify
from replay.verify.timeline import SAMPLING_SCRAPED, EngineSample, RequestRecord, Timeline
from replay.verify.verdict import EXIT_CODES, EXIT_USAGE

pytestmark = pytest.mark.timeout(60)


def sample(t: float, used: int) -> EngineSample:
    return EngineSample(t, "P", used, 0, 100 - used, 100, 0, 0, 0, 0, 0, "unknown", 0, 0)


REQUESTS = [RequestRecord("a", 0.0, 0.0, 0.0, 0.2, 1.0, 8, 4, 0, "length"),
            RequestRecord("b", 10.0, 10.0, 0.0, 10.2, 10.5, 8, 4, 0, "length")]


def timeline(samples: list[EngineSample], scraped: bool) -> Timeline:
    meta = {"sampling": SAMPLING_SCRAPED} if scraped else {}
    return Timeline(["P"], {"P": 100}, samples, REQUESTS, [0.0, 10.0], [], 12.0, meta=meta)


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
    assert [w.verdict for w in verify(timeline(seen, scraped=True), [], options).windows] == \
        ["drained", "drained"]


def test_scraped_leak_needs_blocks_held_after_the_deadline():
    options = VerifyOptions(drain_deadline_s=0.5)
    late = [sample(0.0, 0), sample(0.5, 5), sample(1.1, 5), sample(2.0, 0), sample(10.8, 0),
            sample(11.5, 0)]
    held_early = timeline(late, scraped=True)
    w = verify(held_early, [], options).windows[0]
    assert w.verdict == "drained" and w.time_to_drain == pytest.approx(1.0)  # an upper bound
    leaky = timeline(late[:3] + [sample(1.8, 5), sample(2.0, 0)] + late[4:], scraped=True)
    verdict = verify(leaky, [], options)
    assert verdict.windows[0].verdict == "leak" and verdict.exit_code == 1


def _http_timeline(samples, requests) -> Timeline:
    status = {"url": "http://x/metrics", "metric": "vllm:kv_cache_usage_perc", "unit": "blocks",
              "engines": {"0": "P"}, "metric_names_found": [], "num_scrapes": len(samples),
              "num_failures": 0, "errors": []}
    return Timeline(["P"], {"P": 100}, samples, requests, [r.arrival_t for r in requests], [], 9.0,
                    meta={"driver": "http", "sampling": SAMPLING_SCRAPED,
                          "http": {"server": {}, "metrics": [status], "latency": {}}})


def test_the_http_section_says_the_runs_status_not_its_own():
    """An expected window missed (the server lagged): inconclusive everywhere, never VERIFIED."""
    requests = [RequestRecord("a", 0.0, 0.0, 0.0, 0.2, 4.5, 8, 4, 0, "length"),
                RequestRecord("b", 5.0, 5.0, 0.0, 5.2, 5.5, 8, 4, 0, "length")]
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
    requests = [RequestRecord("a", 0.0, 0.0, 0.0, 0.2, 1.0, 8, 4, 0, "length")]
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
    trace.write_text(json.dumps({"t": 0, "id": "a", "prompt_token_ids": [1, 128000], "max_tokens": 2})
                     + "\n")
    stop, box = threading.Event(), {"ready": threading.Event()}
    thread = threading.Thread(target=_serve_models, args=(stop, box), daemon=True)
    thread.start()
    try:
        assert box["ready"].wait(20)
        unknown = invoke("replay", str(trace), "--target", f"http://127.0.0.1:{box['port']}",
                         "--no-live", "--tail", "0.2")
        result = invoke("replay", str(trace), "--target", f"http://127.0.0.1:{box['port']}",
                        "--no-live", "--tail", "0.2", "--vocab-size", "32000")
    finally:
        stop.set()
        thread.join(20)
    assert unknown.exit_code == EXIT_USAGE and "give --vocab-size N" in unknown.output, unknown.output
    assert result.exit_code == EXIT_USAGE, result.output
    assert "prompt token id 128,000 is outside the server's vocabulary [0, 32,000) (from " \
           "--vocab-size)" in result.output
    assert "Traceback" not in result.output and "posts" not in box
