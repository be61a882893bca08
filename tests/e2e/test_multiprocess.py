"""The engine core and connector worker processes over ZMQ + msgpack (mock runner)."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest
import zmq

from engine.config import EngineConfig
from engine.proc.client import EngineDeadError, InprocClient, MPClient
from engine.proc.messages import AddRequest, encode
from tests.mp_utils import mock_tokens, topology
from tests.proc_utils import wait_until

PROMPTS = {
    f"r{i}": [1, 2, 3, 4, 5, 6, 7, 8] + list(range(20 + 3 * i, 30 + 3 * i)) for i in range(8)
}


def send_all(h, max_tokens=5):
    for req_id, prompt in PROMPTS.items():
        h.add_request(req_id, prompt, max_tokens)
    return set(PROMPTS)


@pytest.fixture(params=["inproc", "mp"])
def client(request):
    config = EngineConfig(engine_id="E", num_blocks=64, block_size=4)
    c = InprocClient(config) if request.param == "inproc" else MPClient(config)
    try:
        yield c
    finally:
        c.shutdown()


def test_one_engine_both_clients(client):
    client.add_request("a", list(range(10)), 4)
    client.add_request("b", list(range(30, 45)), 3)
    tokens, deadline = {"a": [], "b": []}, time.monotonic() + 10
    done = set()
    while done != {"a", "b"} and time.monotonic() < deadline:
        for o in client.get_outputs(0.05):
            tokens[o.req_id] += o.new_token_ids
            if o.finished:
                done.add(o.req_id)
    assert tokens == {"a": [10, 11, 12, 13], "b": [45, 46, 47]}


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_pd_tokens_equal_single_engine(transport):
    with topology(transport=transport) as h:
        result = h.collect(send_all(h))
        stats = h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 5)
        assert stats is not None and stats.counts["num_sent"] == 8
        assert h.stats("D").counts["num_recved"] == 8
    assert result["tokens"] == {r: mock_tokens(p, 5) for r, p in PROMPTS.items()}
    assert set(result["reasons"].values()) == {"length"}


def test_single_topology():
    with topology(topology_name="single") as h:
        result = h.collect(send_all(h, 3))
    assert result["tokens"] == {r: mock_tokens(p, 3) for r, p in PROMPTS.items()}


@pytest.mark.parametrize("liveness", ["legacy", "poll", "event"])
def test_idle_prefill_engine_frees_blocks_only_when_fixed(liveness):
    """vLLM #43433: D reads 200 ms late, then 2 s of no traffic."""
    with topology(liveness=liveness, pull_delay_ms=200) as h:
        h.collect(send_all(h, 2))
        if liveness == "legacy":
            h.idle_for(2.0)
            stats = h.stats("P")  # wakes the loop, but it does not step
            assert stats.counts["num_used_blocks"] > 0
            assert stats.counts["num_finished_awaiting_free"] == 8
        else:
            # D has finished, so every read is done: P must drain within 500 ms.
            stats = h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 0.5)
            assert stats is not None, f"P still holds blocks: {h.stats('P').counts}"
            h.idle_for(2.0)
            assert h.stats("P").counts["num_used_blocks"] == 0


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_expiry_frees_blocks_when_read_done_is_dropped(liveness):
    with topology(liveness=liveness, drop_read_done=True, kv_lease_s=1.0) as h:
        start = time.monotonic()
        h.collect(send_all(h, 2))
        stats = h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 5)
        elapsed = time.monotonic() - start
        assert stats is not None and 0.9 <= elapsed <= 6.0
        assert stats.counts["num_expired"] == 8 and stats.counts["num_sent"] == 0
        assert stats.counts["num_read_done_dropped"] == 8


def test_legacy_decode_sleeps_while_its_loads_wait():
    """The pre-#43433 loop slept 1 ms per zero-token step while requests were
    unfinished (D's loads pending): under 1,000 steps/s, never a spin."""
    with topology(liveness="legacy", pull_delay_ms=1500) as h:
        send_all(h, 2)
        first = h.wait_for_stats("D", lambda s: s.counts["num_waiting_for_remote_kvs"] == 8, 10)
        assert first is not None
        h.idle_for(0.5)
        last = h.stats("D")
        assert last.counts["num_waiting_for_remote_kvs"] == 8 and last.loop_state == "polling"
        rate = (last.num_steps - first.num_steps) / (last.monotonic - first.monotonic)
        assert 50 < rate <= 1000, rate
        h.collect(set(PROMPTS))


@pytest.mark.parametrize("liveness", ["poll", "event"])
def test_heartbeats_keep_prefill_leases_while_decode_waits(liveness):
    """D reads 2.5 s late with a 1.2 s lease: its heartbeats (every 0.2 s while it
    steps) keep P's leases, so every read finds its blocks and P frees on "read done"."""
    with topology(liveness=liveness, pull_delay_ms=2500, kv_lease_s=1.2) as h:
        result = h.collect(send_all(h, 2))
        stats = h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 5)
        assert stats is not None and stats.counts["num_sent"] == 8
        assert stats.counts["num_expired"] == 0 and stats.counts["num_heartbeats"] >= 5
        assert h.stats("D").counts["num_recved"] == 8
    assert result["tokens"] == {r: mock_tokens(p, 2) for r, p in PROMPTS.items()}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_killing_prefill_connector_worker_mid_transfer(policy):
    with topology(policy=policy, pull_delay_ms=3000) as h:
        send_all(h, 3)
        held = h.wait_for_stats("P", lambda s: s.counts["num_finished_awaiting_free"] == 8, 10)
        assert held is not None
        os.kill(held.counts["connector_worker_pid"], signal.SIGKILL)
        freed = h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 5)
        assert freed is not None  # P released what the dead worker held
        result = h.collect(set(PROMPTS), timeout_s=30)
        assert any(
            "connector worker of engine P" in why and "died" in why
            for engine, why in h.router.errors
        )
        # P's connector now offers no KV: new requests are prefilled on D, held nowhere.
        h.add_request("after", PROMPTS["r0"], 3)
        after = h.collect({"after"}, timeout_s=10)
        assert after["tokens"]["after"] == mock_tokens(PROMPTS["r0"], 3)
        assert h.stats("P").counts["num_used_blocks"] == 0
    # D's pulls failed (P's worker is gone): recompute gives the right tokens; fail fails.
    if policy == "recompute":
        assert result["tokens"] == {r: mock_tokens(p, 3) for r, p in PROMPTS.items()}
    else:
        assert set(result["reasons"].values()) == {"error"}


def test_killing_decode_connector_worker_with_fail_policy():
    with topology(policy="fail", pull_delay_ms=3000, kv_lease_s=1.0) as h:
        send_all(h, 3)
        waiting = h.wait_for_stats("D", lambda s: s.counts["num_waiting_for_remote_kvs"] == 8, 10)
        assert waiting is not None
        os.kill(waiting.counts["connector_worker_pid"], signal.SIGKILL)
        result = h.collect(set(PROMPTS), timeout_s=10)
        assert set(result["reasons"].values()) == {"error"}
        assert h.stats("D").counts["num_used_blocks"] == 0
        # P's worker never hears "read done": its expiry releases P's blocks.
        assert h.wait_for_stats("P", lambda s: s.counts["num_used_blocks"] == 0, 5)
        assert any("engine D" in why and "died" in why for _, why in h.router.errors)


def test_garbage_is_dropped_and_counted_everywhere():
    with topology() as h:
        p, d = h.clients["P"], h.clients["D"]
        # Engine input: garbage, a truncated frame, wrong field types, an unknown tag.
        good = encode(AddRequest("x", [1, 2, 3], 2))
        for frame in (
            b"\xc1garbage",
            good[:-3],
            msgpack.packb([0, 7, "no", 1, None, None]),
            msgpack.packb([250]),
        ):
            p.input.send(frame)
        # Connector worker peer socket: garbage from a stranger.
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(f"ipc://{h.router.run_dir}/P-kv")
        peer.send(b"not msgpack")
        peer.send_multipart([b"a", b"b", b"c"])
        # Frontend output socket: garbage pushed at the client.
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(d.addrs.output)
        push.send(b"\x00\x01junk")
        result = h.collect(send_all(h, 2))
        assert result["tokens"] == {r: mock_tokens(q, 2) for r, q in PROMPTS.items()}
        assert h.stats("P").counts["num_bad_messages"] == 4
        assert h.wait_for_stats("P", lambda s: s.counts.get("num_bad_messages", 0) >= 4, 5)
        assert d.num_bad_messages == 1
        peer.close()
        push.close()


def test_dead_engine_is_an_error_not_a_hang():
    with topology(topology_name="single") as h:
        client = h.clients["E"]
        os.kill(client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            for _ in range(100):
                h.router.poll(0.05)
        assert time.monotonic() - start < 1.0


def test_shutdown_leaves_no_process_socket_or_segment():
    with topology() as h:
        h.collect(send_all(h, 2))
        pids = [c.process.pid for c in h.clients.values()]
        pids += [h.stats(c.engine_id).counts["connector_worker_pid"] for c in h.clients.values()]
        run_dir = h.router.run_dir
    for pid in pids:
        assert not _alive(pid), f"process {pid} survived shutdown"
    assert not os.path.exists(run_dir)
    # Segments are named kvdrain-kv-<owner pid>-<random>; none of ours may remain.
    ours = [
        f for f in os.listdir("/dev/shm") if any(f.startswith(f"kvdrain-kv-{pid}-") for pid in pids)
    ]
    assert not ours


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"  # a zombie is dead but not reaped by its parent


def test_sigterm_shuts_an_engine_down_gracefully():
    """SIGTERM wakes a blocked engine, aborts what is in flight, waits (bounded) for the
    receive still writing into its blocks, and exits cleanly."""
    with topology(pull_delay_ms=3000) as h:
        d = h.clients["D"]
        h.add_request("r", list(range(10)), 5)
        assert h.wait_for_stats("D", lambda s: s.counts["num_waiting_for_remote_kvs"] == 1, 10)
        os.kill(d.process.pid, signal.SIGTERM)
        d.process.join(10)
        assert d.process.exitcode == 0
        outputs = h.backlog + d.drain()  # the abort and the final stats
        assert [o.finish_reason for o in outputs if o.finished] == ["abort"]
        assert d.latest_stats.loop_state == "stopped"
        assert d.latest_stats.counts["num_used_blocks"] == 0  # the receive ended first


def test_sending_to_a_dead_engine_raises_instead_of_blocking():
    with topology() as h:
        d = h.clients["D"]
        os.kill(d.process.pid, signal.SIGKILL)
        d.process.join(5)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine core D"):
            for i in range(2000):  # more than a socket's high-water mark
                d.add_request(f"x{i}", [1, 2, 3], 2)
        assert time.monotonic() - start < 5.0


def test_rejected_transfer_params_reach_the_stats_snapshot():
    """PDConnector.num_bad_params (D prefills locally instead) is published with the counts."""
    with topology() as h:
        assert h.stats("D").counts["num_bad_params"] == 0
        bad = {
            "do_remote_prefill": True,
            "remote_block_ids": [5],
            "remote_request_id": "x",
            "remote_engine_id": "P",
            "remote_addr": "",
        }  # too few blocks for the prompt
        h.clients["D"].add_request("bad", list(range(18)), 2, bad)
        stats = h.wait_for_stats("D", lambda s: s.counts["num_bad_params"] == 1, 5)
        assert stats is not None, h.stats("D").counts


def test_a_connector_worker_orphaned_by_its_engines_death_is_stopped_by_its_own_id():
    """P's engine SIGKILLed leaves its connector worker behind; here it is stopped too
    (SIGSTOP), so it cannot leave on its own: the frontend stops it by the pid P reported."""
    from engine.proc.run_dir import is_alive

    with topology() as h:
        p = h.clients["P"]
        stats = h.wait_for_stats("P", lambda s: s.counts.get("connector_worker_pid"), 10)
        worker = stats.counts["connector_worker_pid"]
        os.kill(worker, signal.SIGSTOP)
        os.kill(p.process.pid, signal.SIGKILL)
        p.process.join(5)
        p.kill()
        wait_until(
            lambda: not is_alive(worker) or _state(worker) == "Z",
            10,  # SIGKILL lands
            "the worker dead (a zombie until init reaps it)",
        )


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]
