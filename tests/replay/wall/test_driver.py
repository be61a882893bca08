"""The wall-clock driver against a scripted target: no engine processes."""

from __future__ import annotations

from engine.proc.client import EngineDeadError
from replay.trace.records import TraceRequest
from replay.wall.driver import WallClockReplay, WallOptions


class _DyingTarget:
    """A target whose engine `dead` dies on the first request, naming another engine."""

    vocab_size = 64

    def __init__(self, engines: list[str], dead: str, message: str) -> None:
        self.engines, self.dead, self.message = engines, dead, message
        self.errors: list[tuple[str, str]] = []

    def add_request(self, req_id, prompt_token_ids, max_tokens, pd=None, trace_t=None) -> None:
        raise EngineDeadError(self.dead, self.message)

    def abort(self, req_id: str) -> None: ...

    def poll(self, timeout_s: float) -> list:
        return []

    def take_stats(self) -> list:
        return []

    def request_stats(self) -> None: ...

    def shutdown(self) -> None: ...


def test_a_dead_engine_is_the_fault_of_the_engine_the_error_carries_not_one_its_message_names():
    message = "engine D failed to start:\nengine P refused its connector's handshake"
    target = _DyingTarget(["P", "D"], dead="D", message=message)
    timeline = WallClockReplay(target, WallOptions(tail_s=0.01)).run(
        [TraceRequest(t=0.0, req_id="r0", max_tokens=1, prompt_len=4)]
    )
    assert [(f["engine"], f["kind"]) for f in timeline.meta["faults"]] == [("D", "died")]
