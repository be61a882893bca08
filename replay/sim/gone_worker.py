"""A killed engine's connector worker on the virtual clock: gone, it refuses every read. Runs in: frontend process.

It takes the killed worker's place among its peers (replay/sim/kv_worker.py looks a peer
up when a pull starts), so D's pull of a killed P's blocks fails under
kv_load_failure_policy, as a wall replay's read of a dead worker does once it times out;
"read done", releases and heartbeats sent to it are lost.
"""

from __future__ import annotations

from connector.send_ledger import UNKNOWN_REQUEST, LedgerOutput, ReadReply


class _RefusingLedger:
    """A SendLedger that holds nothing any more."""

    def read(
        self, reply_to: object, req_id: str, block_ids: list[int], now: int, pin: bool = False
    ) -> LedgerOutput:
        refused = ReadReply(reply_to, req_id, list(block_ids), UNKNOWN_REQUEST, pin)
        return LedgerOutput(replies=[refused])


class GoneWorker:
    """What a peer finds where a killed engine's worker was."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ledger = _RefusingLedger()

    def _apply(self, out: LedgerOutput) -> None:
        for reply in out.replies:  # reply_to: the reading worker and its pull
            reader, recv = reply.reply_to
            reader._on_read_reply(recv, reply)

    def _on_read_done(self, req_id: str) -> None:
        return None

    def _on_abandoned(self, req_id: str) -> None:
        return None

    def _on_heartbeat(self, req_ids: list[str]) -> None:
        return None
