"""The engine-core process loop with async scheduling (the batch queue), in a thread, over its real sockets."""
from __future__ import annotations

import threading

import pytest
import zmq

from engine.config import EngineAddresses, EngineConfig
from engine.proc.core_proc import EngineCoreProc
from engine.proc.messages import AddRequest, Ready, RequestOutputs, Shutdown, StatsSnapshot, decode, encode

TIMEOUT_MS = 10_000


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_an_async_scheduling_engine_serves_requests_and_goes_idle_with_nothing_held(tmp_path, liveness):
    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addrs = EngineAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    to_engine.bind(addrs.input)
    from_engine.bind(addrs.output)
    config = EngineConfig(engine_id="E", num_blocks=64, block_size=4, liveness=liveness,
                          async_scheduling=True)
    proc = EngineCoreProc(config, addrs)
    thread = threading.Thread(target=proc.run_busy_loop)
    thread.start()
    received: list[object] = []

    def recv_until(predicate) -> None:
        while True:
            if not from_engine.poll(TIMEOUT_MS):
                raise TimeoutError(f"no message from the engine in {TIMEOUT_MS} ms")
            received.append(decode(from_engine.recv()))
            if predicate(received[-1]):
                return
    try:
        recv_until(lambda m: isinstance(m, Ready))
        prompts = {f"r{i}": list(range(10 * i, 10 * i + 9)) for i in range(3)}
        for req_id, prompt in prompts.items():
            to_engine.send(encode(AddRequest(req_id, prompt, 4)))
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()

        def all_finished(m: object) -> bool:
            if isinstance(m, RequestOutputs):
                for o in m.outputs:
                    tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        finished.add(o.req_id)
            return len(finished) == 3
        recv_until(all_finished)
        recv_until(lambda m: isinstance(m, StatsSnapshot) and m.loop_state == "blocked"
                   and m.counts["num_used_blocks"] == 0 and m.counts["num_running"] == 0)
        # The mock runner samples last + 1: the same tokens the synchronous loop gives.
        assert tokens == {r: [p[-1] + 1 + k for k in range(4)] for r, p in prompts.items()}
        assert not proc.core.batch_queue
    finally:
        to_engine.send(encode(Shutdown(1.0)))
        thread.join(10)
        proc.close()
        to_engine.close(0)
        from_engine.close(0)
        ctx.term()
    assert not thread.is_alive()
