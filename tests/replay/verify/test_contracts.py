"""Verdicts by the contract the deployment's release keeps: an unread request's blocks are due by
the lease, at once, or (pre-#43433) held while P idles; freed too early is a violation too.

Timelines are placed by hand: P and D, a request sent straight through (D read it) and one
whose D leg was dropped or rejected (P answered, D never read), samples of P's blocks.
"""

from __future__ import annotations

import pytest

from engine.core.release import VllmRelease
from replay.verify.contract import Contract, UnreadIndex, tail_for
from replay.verify.report import build_report, summary_lines
from replay.verify.rules import STILL_DRAINING, VerifyOptions, verify
from replay.verify.safety import EXPIRY_LOG, expiry_log_findings
from replay.verify.timeline import SAMPLING_SCRAPED, EngineSample, RequestRecord, Timeline

LEASE = "lease 30 s + extension 20 s"


def release(text: str, **kw) -> Contract:
    return Contract(release=VllmRelease.parse(text), release_from="test", **kw)


def request(
    req_id: str,
    arrival: float,
    end: float,
    *,
    fault: str | None = None,
    read: bool = True,
    freed_before_read: bool = False,
) -> RequestRecord:
    """A P/D request: P has it from its arrival and answers 0.5 s later; D reads at once
    (read) or never (a dropped or rejected D leg ends the request at P's answer)."""
    answered = arrival + 0.5
    return RequestRecord(
        req_id=req_id,
        arrival_t=arrival,
        send_t=arrival,
        send_lateness_s=0.0,
        first_token_t=end if read else None,
        end_t=end,
        num_prompt_tokens=64,
        num_output_tokens=4 if read else 0,
        num_prefix_hit_tokens=0,
        finish_reason="length" if read else "error",
        error=None if read else "no D leg",
        stages=[["P", arrival], ["D", answered]] if read else [["P", arrival]],
        fault=fault,
        prefill_done_t=answered,
        read_t=answered + 0.1 if read else None,
        freed_before_read=freed_before_read,
    )


def sample(engine: str, t: float, used: int, send_t: float | None = None) -> EngineSample:
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
        num_running=0,
        num_finished_awaiting_free=0,
        loop_state="blocked",
        num_steps=0,
        num_wakeups=0,
        send_t=send_t,
    )


def timeline(requests, p_used, end_t, *, scraped=False, counters=None) -> Timeline:
    """P's usage as (t, used) points, D idle throughout."""
    samples = [sample("P", t, used, t - 0.05 if scraped else None) for t, used in p_used]
    samples += [sample("D", 0.0, 0)]
    return Timeline(
        engines=["P", "D"],
        num_usable_blocks={"P": 100, "D": 100},
        samples=sorted(samples, key=lambda s: s.t),
        requests=requests,
        arrivals=[r.arrival_t for r in requests],
        aborts=[],
        end_t=end_t,
        counters=counters or {},
        meta={"sampling": SAMPLING_SCRAPED} if scraped else {},
    )


def dropped_then_idle(freed_at: float | None, end_t: float = 76.0) -> Timeline:
    """r1 at 0.0, its D leg dropped: P answers at 0.5 and holds its 5 blocks until
    freed_at (None: the whole run); then 75 s of idle (the tail)."""
    points = [(0.0, 5)] + ([(freed_at, 0)] if freed_at is not None else [])
    return timeline([request("r1", 0.0, 0.5, fault="drop_decode", read=False)], points, end_t)


def p_windows(verdict):
    return [w for w in verdict.windows if w.engine == "P"]


def test_a_dropped_leg_leaks_on_0_21_where_p_does_not_step_while_idle():
    verdict = verify(dropped_then_idle(None), [], contract=release("0.21"))
    (w,) = p_windows(verdict)
    assert w.verdict == "leak" and verdict.exit_code == 1
    assert w.deadline_s == pytest.approx(0.5) and w.num_unread == 1
    assert "pre-#43433" in w.contract
    assert "pre-#43433" in verdict.violations[0].detail


def test_the_miniature_s_legacy_loop_is_pre_43433_whatever_its_release():
    verdict = verify(dropped_then_idle(31.0), [], contract=release("0.34", legacy=True))
    assert p_windows(verdict)[0].verdict == "leak"


def test_a_dropped_leg_drains_within_lease_and_extension_on_0_22_and_later():
    for name in ("0.22", "0.32.0", "0.34"):
        verdict = verify(dropped_then_idle(31.0), [], contract=release(name))
        (w,) = p_windows(verdict)
        assert (w.verdict, w.contract) == ("drained", f"1 unread request, {LEASE}"), name
        assert w.time_to_drain == pytest.approx(30.5) and verdict.exit_code == 0
        assert w.deadline_s == pytest.approx(50.0)  # from P's answer at 0.5 s, not the start
    late = verify(dropped_then_idle(60.0), [], contract=release("0.32"))
    assert p_windows(late)[0].verdict == "leak" and late.exit_code == 1
    assert f"due 50.000 s in: 1 unread request, {LEASE}" in late.violations[0].detail
    # Without a contract (or before it): the drain deadline judged it, a false leak.
    assert p_windows(verify(dropped_then_idle(31.0), []))[0].verdict == "leak"


def test_the_lease_follows_the_deployment_s_kv_lease():
    contract = release("0.32", lease_s=6.0)
    assert contract.unread_terms(None) == "lease 6 s + extension 4 s"
    verdict = verify(dropped_then_idle(31.0), [], contract=contract)
    assert p_windows(verdict)[0].verdict == "leak"


def short_window_then_tail(freed_at: float) -> Timeline:
    """r1 dropped at 0.5 (P holds 5 blocks); r2 runs 11.0-12.0 (P takes 3 more, gives them
    back at its end); P frees r1's at freed_at, in the tail 12.0-76.0."""
    requests = [
        request("r1", 0.0, 0.5, fault="drop_decode", read=False),
        request("r2", 11.0, 12.0),
    ]
    points = [(0.0, 5), (11.0, 8), (12.0, 5), (freed_at, 0)]
    return timeline(requests, points, 76.0)


def test_a_window_that_ends_before_the_lease_is_not_a_leak_for_its_blocks():
    verdict = verify(short_window_then_tail(31.0), [], contract=release("0.32"))
    first, tail = p_windows(verdict)
    assert (first.start, first.end, first.verdict) == (0.5, 11.0, "undecided")
    assert first.note.startswith("held within its contract") and first.num_unread == 1
    assert tail.verdict == "drained" and tail.num_unread == 1
    assert verdict.status == "verified", verdict.reasons  # the tail judged what it held
    # The later window that covers the deadline judges them: held past it, a leak there.
    late = verify(short_window_then_tail(70.0), [], contract=release("0.32"))
    assert [w.verdict for w in p_windows(late)] == ["undecided", "leak"]
    assert late.exit_code == 1
    # Before the contract: the short window was a leak of blocks the lease still held.
    assert p_windows(verify(short_window_then_tail(31.0), []))[0].verdict == "leak"


def test_blocks_still_within_their_contract_when_the_run_ends_are_inconclusive():
    verdict = verify(dropped_then_idle(None, end_t=20.0), [], contract=release("0.32"))
    (w,) = p_windows(verdict)
    assert w.verdict == "undecided" and verdict.status == "inconclusive"
    assert "lengthen --tail" in verdict.reasons[0]


def rejected_then_idle(freed_at: float) -> Timeline:
    requests = [request("r1", 0.0, 0.5, fault="reject_decode", read=False)]
    return timeline(requests, [(0.0, 5), (freed_at, 0)], 30.0)


def test_a_rejection_drains_at_once_from_0_22_not_on_0_20():
    at_once = verify(rejected_then_idle(0.6), [], contract=release("0.22"))
    (w,) = p_windows(at_once)
    assert w.verdict == "drained" and "D's rejection notifies P" in w.contract
    held = verify(rejected_then_idle(20.0), [], contract=release("0.32"))
    assert p_windows(held)[0].verdict == "leak"  # the lease is not the rejection's contract
    old = verify(rejected_then_idle(20.0), [], contract=release("0.20"))
    assert p_windows(old)[0].verdict == "leak" and "pre-#43433" in p_windows(old)[0].contract
    # 0.21 has the notification, but an idle 0.21 P never steps to read it.
    assert "pre-#43433" in release("0.21").unread_terms("reject_decode")


def test_a_stepping_loop_without_a_lease_keeps_the_fallback_timer():
    contract = release("0.21", legacy=False)  # the miniature: 0.21's expiry, event liveness
    assert contract.unread_s(None) == 480.0
    assert contract.unread_terms(None) == "fallback timer 480 s, read when P steps"
    assert release("0.11.1", legacy=False).unread_s("drop_decode") == 120.0


def test_a_d_leg_that_read_blocks_p_had_freed_is_a_violation():
    requests = [request("r1", 0.0, 2.0, freed_before_read=True)]
    verdict = verify(timeline(requests, [(0.0, 5), (0.5, 0)], 10.0), [], contract=release("0.32"))
    (v,) = verdict.violations
    assert (v.kind, v.engine) == ("freed_before_read", "P") and "'r1'" in v.detail
    assert verdict.exit_code == 1
    # The connector's own count of the same read is not a second violation.
    counted = timeline(
        requests, [(0.0, 5), (0.5, 0)], 10.0, counters={"P": {"num_reads_after_expiry": 1}}
    )
    assert [v.kind for v in verify(counted, []).violations] == ["freed_before_read"]
    more = timeline(
        requests, [(0.0, 5), (0.5, 0)], 10.0, counters={"P": {"num_reads_after_expiry": 3}}
    )
    kinds = [v.kind for v in verify(more, []).violations]
    assert kinds == ["freed_before_read", "read_after_expiry"]


def test_vllm_s_notifications_after_expiry_are_reads_of_freed_blocks():
    requests = [request("r1", 0.0, 2.0)]
    points = [(0.0, 5), (0.6, 0), (3.0, 0), (9.9, 0)]
    clean = timeline(requests, points, 10.0, scraped=True, counters={"P": {"num_expired": 0}})
    assert not verify(clean, []).violations
    after = {"P": {"num_expired": 1, "num_notifications_after_expiry": 1}}
    verdict = verify(timeline(requests, points, 10.0, scraped=True, counters=after), [])
    (v,) = verdict.violations
    assert v.kind == "freed_before_read" and "nixl_num_notifications_after_expiry" in v.detail


def test_before_0_32_expiries_past_the_unread_requests_are_reads_of_freed_blocks():
    requests = [request("r1", 0.0, 0.5, fault="drop_decode", read=False), request("r2", 1.0, 3.0)]
    points = [(0.0, 5), (0.6, 5), (40.0, 0), (59.9, 0)]
    one = timeline(requests, points, 60.0, scraped=True, counters={"P": {"num_expired": 1}})
    assert not [v for v in verify(one, []).violations if v.kind == "freed_before_read"]
    two = timeline(requests, points, 60.0, scraped=True, counters={"P": {"num_expired": 2}})
    (v,) = [v for v in verify(two, []).violations if v.kind == "freed_before_read"]
    assert "at least 1 D leg succeeded" in v.detail


def test_p_s_log_says_which_requests_d_read_after_their_lease_expired():
    log = expiry_log_findings(
        [
            "INFO ... Releasing expired KV blocks for request cmpl-a-0 which were retrieved "
            "by 0 remote worker(s) before lease expired.",
            "INFO ... Releasing expired KV blocks for request cmpl-b-0 which were retrieved "
            "by 1 remote worker(s) before lease expired.",
            "ERROR ... Potentially invalid KV blocks for unrecognized request cmpl-a-0 were "
            "retrieved by a decode worker. They may have expired.",
        ]
    )
    assert log.released == [(1, "cmpl-a-0")] and log.invalid == [(3, "cmpl-a-0")]
    t = timeline([request("r1", 0.0, 2.0)], [(0.0, 5), (0.6, 0), (9.9, 0)], 10.0, scraped=True)
    t.meta[EXPIRY_LOG] = {"P": log.to_dict()}
    (v,) = verify(t, []).violations
    assert v.kind == "freed_before_read" and "cmpl-a-0 (line 3, released at line 1)" in v.detail


def falling_tail(p_used, *, unread: bool) -> Timeline:
    """A 6 s tail after r1 (ended at 1.0), P's blocks falling 21 -> 18 over it."""
    r1 = request("r1", 0.0, 1.0, read=not unread, fault="drop_decode" if unread else None)
    return timeline([r1], p_used, 7.0)


def test_a_window_that_ends_still_draining_before_its_deadline_is_not_a_leak():
    options = VerifyOptions(drain_deadline_s=2.0)
    falling = [(0.0, 21), (2.0, 20), (4.0, 19), (6.0, 18)]
    verdict = verify(falling_tail(falling, unread=True), [], options, contract=release("0.32"))
    (w,) = p_windows(verdict)
    assert (w.verdict, w.note) == ("undecided", STILL_DRAINING)
    assert verdict.exit_code == 3 and STILL_DRAINING in verdict.reasons[0]
    # Flat, not falling: held within its contract (no later window: inconclusive too).
    flat = verify(falling_tail([(0.0, 21)], unread=True), [], options, contract=release("0.32"))
    assert p_windows(flat)[0].note.startswith("held within its contract")
    # Past its deadline (the blocks of a request D read: the drain deadline) it is a leak.
    read = verify(falling_tail(falling, unread=False), [], options, contract=release("0.32"))
    assert p_windows(read)[0].verdict == "leak"


def test_a_short_window_still_falling_says_so():
    requests = [request("r1", 0.0, 1.0), request("r2", 2.5, 3.0)]
    points = [(0.0, 9), (1.2, 6), (2.4, 3), (2.5, 5), (3.1, 0)]
    verdict = verify(timeline(requests, points, 9.0), [], VerifyOptions(drain_deadline_s=2.0))
    first = p_windows(verdict)[0]
    assert (first.end, first.verdict, first.note) == (2.5, "undecided", STILL_DRAINING)


def test_the_summary_says_the_contract_that_judged_each_window():
    verdict = verify(dropped_then_idle(31.0), [], contract=release("0.32"))
    settings = {"target": "http://p", "engine": {}}
    lines = summary_lines(build_report(dropped_then_idle(31.0), verdict, settings, {}, []))
    assert "contract: vLLM 0.32.0 (test), idle P steps (#43433), " + LEASE in "\n".join(lines)
    assert f"  P drained 30.5 s in: 1 unread request, {LEASE} (tail at 0.500 s)" in lines
    report = build_report(dropped_then_idle(31.0), verdict, settings, {}, [])
    assert report["contract"]["release"] == "0.32.0" and report["contract"]["lease_s"] == 30.0
    (w,) = [w for w in report["windows"] if w["engine"] == "P"]
    assert (w["contract"], w["num_unread"], w["deadline_s"]) == (
        f"1 unread request, {LEASE}",
        1,
        50.0,
    )
    # A local run with no unread request keeps its summary as it was.
    plain = timeline([request("r1", 0.0, 1.0)], [(0.0, 5), (1.0, 0)], 5.0)
    plain_verdict = verify(plain, [], contract=release("0.32"))
    plain_lines = summary_lines(build_report(plain, plain_verdict, {"engine": {}}, {}, []))
    assert not [line for line in plain_lines if line.startswith("contract:")]


def test_the_default_tail_reaches_the_longest_contract_pending_at_the_last_request():
    requests = [request("r1", 0.0, 1.0), request("r2", 2.0, 2.5, fault="drop_decode", read=False)]
    assert tail_for(requests, release("0.32"), 0.5) == pytest.approx(50.5)
    assert tail_for(requests, release("0.21"), 0.5) == 0.0  # judged at the drain deadline
    assert tail_for(requests[:1], release("0.32"), 0.5) == 0.0


def test_a_request_whose_way_is_not_known_is_held_on_every_prefill_engine():
    r = request("r1", 0.0, 0.5, fault="drop_decode", read=False)
    r.stages = []
    index = UnreadIndex([r], release("0.32"))
    assert [u.req_id for u in index.held_at("P0", 1.0, 5.0)] == ["r1"]
    assert index.held_at("D", 1.0, 5.0) == []
    assert index.held_at("P0", 60.0, 65.0) == []  # its lease and extension were over


def test_a_scraped_engine_holds_the_unread_requests_of_its_upstream():
    r = request("r1", 0.0, 0.5, fault="drop_decode", read=False)
    index = UnreadIndex([r], release("0.32"))
    assert [u.req_id for u in index.held_at("P:0", 1.0, 5.0)] == ["r1"]
    assert index.held_at("P1", 1.0, 5.0) == []
