"""The engine-core process shell's loop in this process: its snapshots and its waits, synchronous and with async scheduling (mock runner)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
import zmq

from engine.config import EngineAddresses, EngineConfig
from engine.core.outputs import SchedulerStats
from engine.proc.core_proc import EngineCoreProc, stats_counts
from engine.proc.messages import (
    Abort,
    AddRequest,
    GetStats,
    Ready,
    RequestOutputs,
    Shutdown,
    StatsSnapshot,
    decode,
    encode,
)

TIMEOUT_MS = 10_000


def test_stats_counts_is_asdict():
    stats = SchedulerStats(*range(1, len(dataclasses.fields(SchedulerStats)) + 1))
    assert stats_counts(stats) == dataclasses.asdict(stats)
    assert list(stats_counts(stats)) == list(dataclasses.asdict(stats))  # same order


@contextlib.contextmanager
def running_loop(tmp_path, **overrides):
    """An EngineCoreProc looping in a thread; yields (proc, send, messages so far, recv_until)."""
    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addrs = EngineAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    to_engine.bind(addrs.input)
    from_engine.bind(addrs.output)
    config = EngineConfig(
        **{"engine_id": "E", "num_blocks": 64, "block_size": 4, "liveness": "event", **overrides}
    )
    proc = EngineCoreProc(config, addrs)
    thread = threading.Thread(target=proc.run_busy_loop)
    thread.start()
    received: list[object] = []

    def recv_until(predicate) -> None:
        """Receive until a message that satisfies predicate (bounded)."""
        while True:
            if not from_engine.poll(TIMEOUT_MS):
                raise TimeoutError(f"no message from the engine in {TIMEOUT_MS} ms")
            received.append(decode(from_engine.recv()))
            if predicate(received[-1]):
                return

    try:
        yield proc, lambda msg: to_engine.send(encode(msg)), received, recv_until
    finally:
        to_engine.send(encode(Shutdown(1.0)))
        thread.join(10)
        proc.close()
        to_engine.close(0)
        from_engine.close(0)
        ctx.term()
    assert not thread.is_alive()


@pytest.fixture
def engine_loop(tmp_path):
    with running_loop(tmp_path) as loop:
        yield loop


def test_snapshots_only_when_something_a_reader_shows_changed(engine_loop):
    proc, send, received, recv_until = engine_loop
    recv_until(lambda m: isinstance(m, Ready))
    for i in range(3):
        send(AddRequest(f"r{i}", list(range(10 * i, 10 * i + 9)), 4))
    finished: set[str] = set()

    def all_finished(m: object) -> bool:
        if isinstance(m, RequestOutputs):
            finished.update(o.req_id for o in m.outputs if o.finish_reason is not None)
        return len(finished) == 3

    recv_until(all_finished)
    recv_until(
        lambda m: (
            isinstance(m, StatsSnapshot)
            and m.loop_state == "blocked"
            and m.num_steps > 0
            and m.counts["num_used_blocks"] == 0
        )
    )
    snaps = [m for m in received if isinstance(m, StatsSnapshot)]
    # The loop publishes one at most per step, and never one a reader could not tell
    # from the one before it (same loop state, same counts).
    assert len(snaps) <= proc.core.num_steps + 1
    for before, after in zip(snaps, snaps[1:]):
        assert (before.loop_state, before.counts) != (after.loop_state, after.counts)
    assert [s.seq for s in snaps] == list(range(1, len(snaps) + 1))
    # A GetStats is answered even when nothing changed (the bench and top rely on it).
    send(GetStats())
    recv_until(lambda m: isinstance(m, StatsSnapshot) and m.seq == snaps[-1].seq + 1)
    probe = received[-1].counts  # the same, but that the probe's wake-up is counted as one
    assert {**probe, "num_probe_wakeups": 0} == snaps[-1].counts and probe["num_probe_wakeups"] == 1


def test_one_poller_per_kind_of_wait(engine_loop):
    proc, send, received, recv_until = engine_loop
    recv_until(lambda m: isinstance(m, Ready))
    for round_ in range(3):
        send(AddRequest(f"r{round_}", [1, 2, 3, 4, 5], 2))
        recv_until(
            lambda m: (
                isinstance(m, RequestOutputs)
                and any(o.req_id == f"r{round_}" and o.finish_reason for o in m.outputs)  # noqa: B023
            )
        )
        recv_until(lambda m: isinstance(m, StatsSnapshot) and m.loop_state == "blocked")
    assert proc.num_wakeups >= 3
    assert len(proc._pollers) == 1  # every wait so far was on the input alone, one poller


class _PipeAgent:
    """A connector agent whose only wait handle is a pipe the test writes to."""

    error = None

    def __init__(self) -> None:
        self.read_fd, self.write_fd = __import__("os").pipe()

    def wait_handles(self) -> list[object]:
        return [self.read_fd]


def test_a_wait_says_whether_the_input_may_hold_messages(tmp_path):
    """The loop drains the frontend input after a wait only if the wait saw it readable
    (or did not watch it): a wake-up for a connector report skips that drain."""
    import os

    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addrs = EngineAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    to_engine.bind(addrs.input)
    from_engine.bind(addrs.output)
    proc = EngineCoreProc(
        EngineConfig(engine_id="E", num_blocks=64, block_size=4, liveness="event"), addrs
    )
    agent = proc.core.connector_agent = _PipeAgent()
    try:
        assert proc._wait(with_connector=True, timeout_ms=0) is False  # timeout, input watched
        assert (
            proc._wait(with_connector=False, timeout_ms=0, with_input=False) is True
        )  # not watched
        os.write(agent.write_fd, b"x")  # a "report": the connector handle is readable
        assert proc._wait(with_connector=True, timeout_ms=TIMEOUT_MS) is False
        os.read(agent.read_fd, 1)
        to_engine.send(encode(GetStats()))
        assert proc._wait(with_connector=True, timeout_ms=TIMEOUT_MS) is True
        assert proc._wait(with_connector=False, timeout_ms=TIMEOUT_MS) is True
        assert proc.num_wakeups == 5
    finally:
        proc.core.connector_agent = None
        os.close(agent.read_fd)
        os.close(agent.write_fd)
        proc.close()
        to_engine.close(0)
        from_engine.close(0)
        ctx.term()


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_an_async_scheduling_engine_serves_requests_and_goes_idle_with_nothing_held(
    tmp_path, liveness
):
    with running_loop(tmp_path, liveness=liveness, async_scheduling=True) as (
        proc,
        send,
        _,
        recv_until,
    ):
        recv_until(lambda m: isinstance(m, Ready))
        prompts = {f"r{i}": list(range(10 * i, 10 * i + 9)) for i in range(3)}
        for req_id, prompt in prompts.items():
            send(AddRequest(req_id, prompt, 4))
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
        recv_until(
            lambda m: (
                isinstance(m, StatsSnapshot)
                and m.loop_state == "blocked"
                and m.counts["num_used_blocks"] == 0
                and m.counts["num_running"] == 0
            )
        )
        # The mock runner samples last + 1: the same tokens the synchronous loop gives.
        assert tokens == {r: [p[-1] + 1 + k for k in range(4)] for r, p in prompts.items()}
        assert not proc.core.batch_queue


def test_stats_probes_that_wake_a_parked_engine_are_counted_apart(engine_loop):
    """A parked engine woken only by GetStats (the frontend's 1 Hz probe, top) does not
    count those as its own wake-ups: they show as num_probe_wakeups."""
    proc, send, received, recv_until = engine_loop
    recv_until(lambda m: isinstance(m, Ready))
    send(AddRequest("r", [1, 2, 3, 4, 5], 2))
    recv_until(
        lambda m: isinstance(m, StatsSnapshot) and m.loop_state == "blocked" and m.num_steps > 0
    )
    parked = received[-1].num_wakeups
    for _ in range(5):
        seq = max(m.seq for m in received if isinstance(m, StatsSnapshot))
        send(GetStats())
        recv_until(lambda m, seq=seq: isinstance(m, StatsSnapshot) and m.seq == seq + 1)
    last = received[-1]
    assert last.num_wakeups == parked and last.counts["num_probe_wakeups"] == 5


class _ForwardThatWaitsForInput:
    """The mock runner, but its forward returns only once the engine's input holds a
    message (bounded): an input that arrives during the forward, deterministically. It
    runs on the engine loop's thread, so polling the loop's socket is safe."""

    def __init__(self, proc: EngineCoreProc) -> None:
        self.proc, self.runner = proc, proc.core.model_runner
        self.running = threading.Event()  # a forward with tokens has started

    def execute(self, sched_out):
        if sched_out.total_num_scheduled_tokens:
            self.running.set()
            assert self.proc.input.poll(TIMEOUT_MS, zmq.POLLIN), "no input during the forward"
        return self.runner.execute(sched_out)


@pytest.mark.parametrize("release, taken_first", [("0.12", False), ("0.13", True), ("0.34", True)])
def test_an_abort_during_the_forward_is_taken_before_its_output_from_0_13(
    tmp_path, release, taken_first
):
    """vllm/v1/engine/core.py EngineCore.step: `_process_aborts_queue()` right before
    `update_from_output` (0.13.0, #29987); before, the abort waited for the next input
    drain, and the request finished with its token first."""
    with running_loop(tmp_path, vllm_release=release) as (proc, send, received, recv_until):
        recv_until(lambda m: isinstance(m, Ready))
        proc.core.model_runner = runner = _ForwardThatWaitsForInput(proc)
        send(AddRequest("r", [1, 2, 3, 4, 5], 1))
        assert runner.running.wait(TIMEOUT_MS / 1000)
        send(Abort(["r"]))  # the forward waits for it
        recv_until(
            lambda m: isinstance(m, RequestOutputs) and any(o.req_id == "r" for o in m.outputs)
        )
        (out,) = [o for o in received[-1].outputs if o.req_id == "r"]
        if taken_first:
            assert (out.finish_reason, out.new_token_ids) == ("abort", [])
        else:
            assert (out.finish_reason, out.new_token_ids) == ("length", [6])
        recv_until(lambda m: isinstance(m, StatsSnapshot) and m.loop_state == "blocked")
        assert proc.core.scheduler.block_pool.get_num_used_blocks() == 0
