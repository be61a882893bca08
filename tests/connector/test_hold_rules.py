"""How P lets go of an unread send in each vLLM release: the send ledger's HoldRules."""

from __future__ import annotations

import pytest

from connector.send_ledger import HoldRules, ReapSchedule, SendLedger

S = 1_000_000_000  # ns


@pytest.mark.parametrize(
    "release, hold_s, heartbeats, scans_all",
    [
        ("0.10.0", 120.0, False, False),
        ("0.11.2", 480.0, False, False),
        ("0.21.0", 480.0, False, False),
        ("0.22.0", 30.0, True, False),
        ("0.30.0", 30.0, True, False),
        ("0.31.0", 30.0, True, True),
        ("0.34.0", 30.0, True, True),
    ],
)
def test_each_release_holds_an_unread_send_its_own_way(release, hold_s, heartbeats, scans_all):
    """nixl_connector.py NixlConnectorWorker.get_finished's fallback timer up to 0.21;
    nixl/base_worker.py's lease, heartbeats (_handle_heartbeat) and reaper
    (_reap_expired_send_leases) from 0.22, the reaper scanning every lease from 0.31."""
    assert HoldRules.of(release, kv_lease_s=30.0) == HoldRules(
        round(hold_s * S), heartbeats, scans_all
    )


def test_a_release_older_than_any_fallback_free_is_refused():
    with pytest.raises(ValueError, match="vllm_release"):
        HoldRules.of("0.9.1", 30.0)


def ledger(release: str) -> SendLedger:
    rules = HoldRules.of(release, kv_lease_s=30.0)
    return SendLedger(rules.hold_ns, rules=rules)


def test_a_fixed_timer_is_not_extended_by_heartbeats():
    timer = ledger("0.21")
    timer.register("a", [1], now=0, deadline=480 * S)
    assert timer.receive_heartbeat(["a"]) is False  # nothing for the engine to reap
    assert timer.reap(470 * S).finished_sending == []
    assert timer.reap(480 * S).finished_sending == ["a"]
    lease = ledger("0.22")
    lease.register("a", [1], now=0, deadline=30 * S)
    assert lease.receive_heartbeat(["a"]) is True
    assert lease.reap(25 * S).finished_sending == []  # extended to 25 + 20 s
    assert lease.reap(44 * S).finished_sending == []
    assert lease.reap(45 * S).finished_sending == ["a"]


@pytest.mark.parametrize("release, reaped_at_40", [("0.30", []), ("0.31", ["b", "c"])])
def test_an_in_order_reaper_stops_at_the_first_send_not_yet_due(release, reaped_at_40):
    """Before 0.31 the reaper walks the sends in registration order and stops at the
    first live one: a heartbeated send strands the expired ones behind it."""
    sends = ledger(release)
    for i, req_id in enumerate("abc"):
        sends.register(req_id, [i + 1], now=i * S, deadline=30 * S + i * S)
    sends.receive_heartbeat(["a"])
    assert sends.reap(29 * S).finished_sending == []  # a: now 29 + 20 s
    assert sends.reap(40 * S).finished_sending == reaped_at_40
    # When a reap next ends a send: the head's lease in order, else the earliest.
    assert sends.next_lease_deadline() == 49 * S
    sends.read_done("a", 41 * S)  # a is read: the reaper gets past it
    assert sends.reap(41 * S).finished_sending == ([] if reaped_at_40 else ["b", "c"])
    assert sends.next_lease_deadline() is None


def test_after_a_send_ends_an_in_order_reaper_is_asked_again_at_once():
    """The engine's side (connector/agent.py, replay/sim/kv_worker.py) asks its worker to
    reap only when a lease may be due; under an in-order reaper a send that ends may
    uncover expired ones, and vLLM reaps in every get_finished, so it asks at once."""
    in_order, scans_all = ReapSchedule(reap_on_finish=True), ReapSchedule()
    for schedule in (in_order, scans_all):
        schedule.on_reaped(49 * S)
        schedule.on_finished()
    assert in_order.due(holds_sends=True) == 0 and in_order.due(holds_sends=False) is None
    assert scans_all.due(holds_sends=True) == 49 * S
    in_order.on_reaped(49 * S)
    assert in_order.due(holds_sends=True) == 49 * S
