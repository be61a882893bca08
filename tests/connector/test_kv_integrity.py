"""No silent KV corruption: shm reads are pinned, refused once a
send is gone, and a corrupt prefix changes the mock runner's output.

The finding: with a short lease and a pull delay, P expired its sends, D still copied
them out of P's shared memory after the blocks were freed and reused, 13 of 16 outputs
differed from a clean run, and the replay said VERIFIED. Now D's worker asks P's worker
to pin a send before copying (PinSend -> ReadGranted with a read lease; an expiry during
the copy waits for it), a send that is no longer held is refused and the load fails
under kv_load_failure_policy, and the mock runner stamps tokens into real KV memory so
that corrupt KV shows in the outputs the replay checks.
"""

from __future__ import annotations

import time

import pytest
import zmq

from connector.messages import (
    CONNECTOR_CODEC,
    KVReport,
    LeasesReaped,
    ReadAbandoned,
    ReapLeases,
    RecvSpec,
    StepMeta,
)
from connector.send_ledger import READ_LEASE_NS, UNKNOWN_REQUEST, ReadReply, SendLedger
from connector.transfer import Puller, TransferError
from connector.worker_proc import ConnectorWorkerConfig, ConnectorWorkerProc
from engine.config import EngineConfig, ModelConfig
from engine.core.engine_core import EngineCore
from engine.runner.kv_cache import KVCache
from engine.runner.mock_runner import MockModelRunner
from tests.mp_utils import spawned_p_worker

LEASE = 1_000


# ---- the ledger: pins ---------------------------------------------------------------------


def test_a_pin_defers_an_expiry_until_the_copy_is_done():
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1, 2], now=0, deadline=LEASE)
    (granted,) = ledger.read("d", "r1", [1, 2], now=LEASE - 1, pin=True).replies
    assert granted == ReadReply("d", "r1", [1, 2], pin=True, read_until=LEASE - 1 + READ_LEASE_NS)
    assert ledger.reap(now=LEASE).finished_sending == []  # D is copying: the expiry waits
    assert ledger.counters["num_expiries_deferred"] == 1
    assert ledger.read_done("r1", now=LEASE + 5).finished_sending == ["r1"]
    assert ledger.counters["num_sent"] == 1 and ledger.counters["num_expired"] == 0


def test_a_pin_that_runs_out_lets_the_lease_end():
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1], now=0, deadline=LEASE)
    ledger.read("d", "r1", [1], now=0, pin=True)
    assert ledger.reap(now=LEASE).finished_sending == []
    assert ledger.next_lease_deadline() == READ_LEASE_NS
    assert ledger.reap(now=READ_LEASE_NS).finished_sending == ["r1"]
    # D's copy ran past its read lease: it drops it and says so, never "read done".
    ledger.read_done("r1", now=READ_LEASE_NS + 1, read=False)
    assert ledger.counters["num_reads_after_expiry"] == 0


def test_a_pin_of_an_expired_or_unknown_send_is_refused():
    ledger = SendLedger(LEASE, early_hold_ns=100)
    ledger.register("r1", [1], now=0, deadline=LEASE)
    assert ledger.reap(now=LEASE).finished_sending == ["r1"]
    # Known to have expired: refused at once, not held (D's failure is not delayed).
    out = ledger.read("d", "r1", [1], now=LEASE + 1, pin=True)
    assert out.replies == [ReadReply("d", "r1", [1], UNKNOWN_REQUEST, pin=True)]
    assert out.hold_deadlines == [] and not ledger.early
    assert ledger.counters["num_reads_refused"] == 1
    # Never registered: held briefly (P may register it in its next step), then refused.
    assert ledger.read("d", "ghost", [1], now=LEASE + 1, pin=True).replies == []
    out = ledger.expire_holds(now=LEASE + 101)
    assert out.replies == [ReadReply("d", "ghost", [1], UNKNOWN_REQUEST, pin=True)]
    assert ledger.counters["num_reads_refused"] == 2


def test_a_read_done_for_a_send_nobody_asked_to_read_is_a_read_after_expiry():
    """The finding's signature: D copied without asking (the old shm path) after P freed."""
    ledger = SendLedger(LEASE)
    ledger.register("r1", [1], now=0, deadline=LEASE)
    ledger.reap(now=LEASE)
    ledger.read_done("r1", now=LEASE + 1)
    assert ledger.counters["num_reads_after_expiry"] == 1


# ---- the worker processes --------------------------------------------------------------------


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> bytes:
    assert sock.poll(int(timeout_s * 1000)), "no message in time"
    return sock.recv()


@pytest.fixture
def prefill_worker(tmp_path):
    """A real prefill connector worker (shm) with a registered KV cache, and its agent socket."""
    with spawned_p_worker(tmp_path) as (config, cache, agent, _):
        yield config, cache, agent


def test_an_shm_read_of_an_expired_send_is_refused_not_copied(prefill_worker):
    """Today's code copied the freed (here: reused) blocks and reported success."""
    config, cache, agent = prefill_worker
    cache.pages[:, 3] = 7  # the send's block
    agent.send(CONNECTOR_CODEC.encode(StepMeta({"r1": [3]}, [], {"r1": time.monotonic_ns()})))
    agent.send(CONNECTOR_CODEC.encode(ReapLeases()))  # P steps: the lease has passed
    report = CONNECTOR_CODEC.decode(_recv(agent))
    assert isinstance(report, KVReport) and report.finished_sending == ["r1"]
    assert isinstance(CONNECTOR_CODEC.decode(_recv(agent)), LeasesReaped)
    cache.pages[:, 3] = 9  # P's engine reused the block for another request
    local = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=4)
    puller = Puller(zmq.Context.instance(), "shm", timeout_s=5.0)
    try:
        with pytest.raises(TransferError, match="refused"):
            puller.pull(local, RecvSpec("d1", [5], [3], "P", "r1", config.kv_addr))
        assert not local.pages[:, 5].any()  # nothing was copied
    finally:
        puller.close()
        local.close()


def test_an_shm_read_of_a_held_send_is_pinned_and_exact(prefill_worker):
    config, cache, agent = prefill_worker
    cache.pages[:, 2] = 5
    far = time.monotonic_ns() + 60 * 10**9
    agent.send(CONNECTOR_CODEC.encode(StepMeta({"r1": [2]}, [], {"r1": far})))
    local = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=4)
    puller = Puller(zmq.Context.instance(), "shm", timeout_s=5.0)
    try:
        puller.pull(local, RecvSpec("d1", [6], [2], "P", "r1", config.kv_addr))
        assert (local.pages[:, 6] == 5).all()
    finally:
        puller.close()
        local.close()


def test_a_refused_pull_fails_the_load_and_releases_p(tmp_path):
    """D's worker: the refusal becomes invalid blocks (kv_load_failure_policy decides) and
    P hears ReadAbandoned, never "read done"."""
    d = ConnectorWorkerProc(
        ConnectorWorkerConfig(
            engine_id="D", agent_addr=f"ipc://{tmp_path}/agent", kv_addr=f"ipc://{tmp_path}/kv"
        )
    )
    p_kv = zmq.Context.instance().socket(zmq.ROUTER)
    p_kv.setsockopt(zmq.LINGER, 0)
    try:
        p_kv.bind(f"ipc://{tmp_path}/p-kv")
        d.kv_cache = KVCache.allocate(ModelConfig(), num_blocks=8, block_size=4)
        spec = RecvSpec("d1", [4, 5], [1, 2], "P", "p1", f"ipc://{tmp_path}/p-kv")
        d.puller.timeout_s = 0.2  # P (this socket) never answers the pin
        d._on_step_meta(StepMeta({}, [spec]))
        d._fire_timers()  # the pull is due at once (no pull delay)
        assert d.report.invalid_block_ids == [4, 5] and d.report.finished_recving == ["d1"]
        messages = [
            CONNECTOR_CODEC.decode(p_kv.recv_multipart()[-1]) for _ in range(2) if p_kv.poll(2000)
        ]
        assert messages[-1] == ReadAbandoned("p1")
    finally:
        d.kv_cache.close()
        p_kv.close()
        d.close()


# ---- the mock runner's stamps ---------------------------------------------------------------


def _core_with_kv() -> tuple[EngineCore, KVCache]:
    config = EngineConfig(num_blocks=16, block_size=4, runner="mock")
    kv = KVCache.allocate(config.model, config.num_blocks, config.block_size)
    return EngineCore(config, MockModelRunner(config, kv)), kv


def _run(core: EngineCore, req_id: str, prompt: list[int], max_tokens: int = 3) -> list[int]:
    core.add_request(req_id, prompt, max_tokens)
    tokens: list[int] = []
    for _ in range(50):
        for out in core.step().outputs:
            tokens += out.new_token_ids
            if out.finished:
                return tokens
    raise AssertionError("never finished")


def test_stamped_kv_keeps_the_mock_formula_and_corrupt_kv_changes_the_output():
    core, kv = _core_with_kv()
    try:
        prompt = list(range(10, 22))
        assert _run(core, "a", prompt) == [22, 23, 24]  # last + 1, as ever
        assert _run(core, "b", prompt) == [22, 23, 24]  # a prefix hit on intact blocks
        kv.pages[0, 1:] = 0  # every block's stamps wiped: "reused" behind the cache's back
        assert _run(core, "c", prompt) != [22, 23, 24]
        assert core.model_runner.stamps.num_mismatches == 1
    finally:
        kv.close()


# ---- the verdict: corrupt KV is a violation ---------------------------------------------------


def _timeline(records, counters=None):
    from replay.verify.timeline import EngineSample, Timeline

    samples = [
        EngineSample(
            t=0.0,
            engine="P",
            num_used_blocks=0,
            num_cached_blocks=0,
            num_free_blocks=10,
            num_usable_blocks=10,
            num_waiting=0,
            num_skipped_waiting=0,
            num_waiting_for_remote_kvs=0,
            num_running=0,
            num_finished_awaiting_free=0,
            loop_state="blocked",
            num_steps=0,
            num_wakeups=0,
        )
    ]
    return Timeline(
        engines=["P"],
        num_usable_blocks={"P": 10},
        samples=samples,
        requests=records,
        arrivals=[r.arrival_t for r in records],
        aborts=[],
        end_t=5.0,
        counters=counters or {},
    )


def _record(
    req_id: str, digest: str, expected: str, reason: str = "length", error: str | None = None
):
    from replay.verify.timeline import RequestRecord

    return RequestRecord(
        req_id=req_id,
        arrival_t=0.0,
        send_t=0.0,
        send_lateness_s=0.0,
        first_token_t=0.1,
        end_t=0.2,
        num_prompt_tokens=8,
        num_output_tokens=3,
        num_prefix_hit_tokens=0,
        finish_reason=reason,
        error=error,
        output_digest=digest,
        expected_digest=expected,
    )


def test_a_read_after_expiry_is_a_violation_with_its_cause():
    """The finding printed VERIFIED though P counted reads after expiry."""
    from replay.verify.rules import verify

    verdict = verify(_timeline([_record("a", "x", "")], {"P": {"num_reads_after_expiry": 7}}), [])
    (violation,) = verdict.violations
    assert verdict.status == "violation" and violation.kind == "read_after_expiry"
    assert (
        violation.engine == "P" and "7 reads" in violation.detail and "corrupt" in violation.detail
    )


def test_an_output_that_differs_from_a_single_engines_is_a_violation():
    from replay.verify.rules import verify

    records = [
        _record("ok", "d1", "d1"),
        _record("bad", "d2", "d3"),
        _record("unchecked", "d4", ""),
        _record("failed", "d5", "d6", reason="error", error="KV load failed"),
        _record("aborted", "d7", "d8", reason="abort"),
    ]
    verdict = verify(_timeline(records), [])
    assert [(v.kind, "'bad'" in v.detail) for v in verdict.violations] == [
        ("output_mismatch", True)
    ]


def test_the_mock_formula_is_what_a_single_engine_generates():
    """The oracle of --check-outputs against an EngineCore with the mock runner: EOS and
    max_model_len stop it the same way."""
    import random
    from dataclasses import replace

    from replay.verify.outputs import mock_output_tokens

    rng = random.Random(0)
    for case in range(40):
        vocab = rng.choice([16, 512])
        base = EngineConfig(num_blocks=64, block_size=4, max_model_len=24, runner="mock")
        config = replace(
            base,
            model=replace(base.model, vocab_size=vocab),
            eos_token_id=rng.choice([None, 5, vocab - 1]),
        )
        prompt = [rng.randrange(config.model.vocab_size) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, 12)
        core = EngineCore(config, MockModelRunner(config))
        assert _run(core, f"c{case}", prompt, max_tokens) == mock_output_tokens(
            prompt, max_tokens, config
        )


@pytest.mark.slow
def test_a_mock_wall_replay_checks_every_output_by_default(tmp_path):
    import json

    from click.testing import CliRunner

    from cli import cli

    report = tmp_path / "report.json"
    requests = tmp_path / "requests.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            "examples/pd_idle.jsonl",
            "--runner",
            "mock",
            "--no-live",
            "--speedup",
            "4",
            "--report",
            str(report),
            "--requests",
            str(requests),
        ],
    )
    # What is under test is the output check; a loaded machine may shrink a gap (exit 3).
    assert result.exit_code in (0, 3), result.output
    written = json.loads(report.read_text())
    assert written["settings"]["check_outputs"] is True
    assert not [v for v in written["violations"] if v["kind"] == "output_mismatch"]
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    assert records and all(r["expected_digest"] == r["output_digest"] for r in records)
