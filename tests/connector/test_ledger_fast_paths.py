"""The send ledger's cheap paths against the straightforward ones: same replies, same counters."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from connector.send_ledger import BLOCKS_NOT_HELD, READ_LEASE_NS, ReadReply, SendLedger

LEASE = 10_000


def reference_answer(ledger: SendLedger, read: ReadReply, now: int) -> ReadReply:
    """SendLedger._answer as first written: a set comparison and dataclasses.replace."""
    send = ledger.sends[read.req_id]
    if not set(read.block_ids) <= set(send.block_ids):
        ledger.counters["num_reads_refused"] += 1
        return replace(read, error=BLOCKS_NOT_HELD)
    send.was_read = True
    if not read.pin:
        return read
    send.read_until = max(send.read_until, now + READ_LEASE_NS)
    return replace(read, read_until=send.read_until)


@pytest.mark.parametrize("seed", range(4))
def test_answer_equals_the_set_comparison(seed):
    rng = random.Random(seed)
    for i in range(300):
        send = rng.sample(range(1, 40), rng.randint(1, 12))
        kind = rng.randrange(5)
        if kind == 0:  # the tail, as D reads after local prefix hits
            read = send[rng.randint(0, len(send)) :]
        elif kind == 1:  # a subset in another order
            read = rng.sample(send, rng.randint(0, len(send)))
        elif kind == 2:  # longer than the send
            read = send + [rng.randrange(40, 50)]
        elif kind == 3:  # a block never held
            read = send[1:] + [rng.randrange(40, 50)]
        else:  # duplicates
            read = send[-1:] * 2
        ledgers = [SendLedger(LEASE), SendLedger(LEASE)]
        replies = []
        for ledger in ledgers:
            ledger.register("r", send, now=i)
        pin = rng.random() < 0.5
        replies.append(ledgers[0].read("d", "r", read, now=i + 1, pin=pin).replies)
        replies.append(
            [reference_answer(ledgers[1], ReadReply("d", "r", list(read), pin=pin), i + 1)]
        )
        assert replies[0] == replies[1]
        assert ledgers[0].counters == ledgers[1].counters
        assert [(s.was_read, s.read_until) for s in ledgers[0].sends.values()] == [
            (s.was_read, s.read_until) for s in ledgers[1].sends.values()
        ]


def test_refused_and_granted_until_equal_replace():
    read = ReadReply(("peer", 3), "r1", [4, 5], pin=True)
    assert read.refused("no") == replace(read, error="no")
    assert read.granted_until(77) == replace(read, read_until=77)
    granted = read.granted_until(77)
    assert granted.refused("gone") == replace(granted, error="gone")
