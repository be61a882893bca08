"""An in-process connector agent for core tests: reports after a set number of polls."""

from __future__ import annotations

from engine.core.kv_connector import KVConnectorAgentBase
from engine.core.outputs import KVConnectorOutput


class FakeKVAgent(KVConnectorAgentBase):
    """Sends complete `send_after` get_finished calls after they are registered; loads too."""

    def __init__(self, send_after: int = 3, recv_after: int = 2) -> None:
        self.send_after, self.recv_after = send_after, recv_after
        self.pending_send: dict[str, int] = {}
        self.pending_recv: dict[str, int] = {}
        self.num_polls = 0

    def start_load_kv(self, metadata) -> None:
        if metadata is None:
            return
        for req_id in metadata.reqs_to_send:
            self.pending_send[req_id] = self.send_after
        for req_id in metadata.reqs_to_recv:
            self.pending_recv[req_id] = self.recv_after

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self.num_polls += 1
        return KVConnectorOutput(
            finished_sending=_tick(self.pending_send), finished_recving=_tick(self.pending_recv)
        )


def _tick(pending: dict[str, int]) -> set[str]:
    done = set()
    for req_id in list(pending):
        pending[req_id] -= 1
        if pending[req_id] <= 0:
            done.add(req_id)
            del pending[req_id]
    return done
