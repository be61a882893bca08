"""Every wire type round-trips; garbage is a clear DecodeError; the serve socket drops it."""

from __future__ import annotations

from dataclasses import fields

import msgpack
import pytest
import zmq

from connector.messages import (
    CONNECTOR_CODEC,
    CONNECTOR_MESSAGES,
    BlockData,
    GetKVHandle,
    Heartbeat,
    HeartbeatSpec,
    KVCacheRegistered,
    KVHandle,
    KVReport,
    LeaseDue,
    LeasesReaped,
    PinSend,
    ReadAbandoned,
    ReadBlocks,
    ReadDone,
    ReadGranted,
    ReapLeases,
    RecvSpec,
    RegisterKVCache,
    StepMeta,
    WorkerReady,
)
from engine.core.outputs import RequestOutput
from engine.proc.messages import (
    CODEC,
    MESSAGES,
    Abort,
    AddRequest,
    Codec,
    DecodeError,
    EngineError,
    GetStats,
    Ready,
    RequestOutputMsg,
    RequestOutputs,
    Shutdown,
    StatsSnapshot,
    output_from_msg,
    output_to_msg,
)
from replay.serve.messages import SERVE_CODEC, SERVE_MESSAGES, ServeInfo, TracedRequest

SAMPLES = {
    AddRequest: AddRequest("r1", [1, 2, 3], 16, {"do_remote_decode": True}, [7]),
    Abort: Abort(["r1", "r2"]),
    Shutdown: Shutdown(2.5),
    GetStats: GetStats(),
    Ready: Ready("P", 123, 512, 16, 4096, 512, "cpu"),
    RequestOutputs: RequestOutputs(
        "D",
        [
            RequestOutputMsg("r1", [5], "length", {"a": [1]}, 32, None),
            RequestOutputMsg("r2", [], None, None, 0, "boom"),
        ],
    ),
    StatsSnapshot: StatsSnapshot("P", 7, 12.5, "blocked", 100, 3, {"num_used_blocks": 4}),
    EngineError: EngineError("P", "connector worker died"),
    ServeInfo: ServeInfo(["P", "D"], "pd", "event", 512, 16, "mock", 4096, 512, "tiny"),
    TracedRequest: TracedRequest(AddRequest("r1", [1, 2], 4), 12.5),
    RegisterKVCache: RegisterKVCache("P", {"kind": "shm", "shape": [1, 2], "cuda_handle": b"\x00"}),
    WorkerReady: WorkerReady("P", 42, "ipc:///tmp/x/P-kv"),
    KVCacheRegistered: KVCacheRegistered("P", 512),
    StepMeta: StepMeta(
        {"r1": [1, 2]},
        [RecvSpec("r2", [3], [9], "P", "r2", "ipc:///tmp/x")],
        {"r1": 30_000_000_000},
        [HeartbeatSpec("P", "ipc:///tmp/x", ["r3"])],
    ),
    KVReport: KVReport(["r1"], ["r2"], [3, 4], {"num_sent": 1}),
    GetKVHandle: GetKVHandle("P"),
    KVHandle: KVHandle("P", {"kind": "shm"}),
    ReadBlocks: ReadBlocks("r1", [1, 2]),
    BlockData: BlockData("r1", True, ""),
    ReadDone: ReadDone("r1"),
    Heartbeat: Heartbeat(["r1", "r2"]),
    ReapLeases: ReapLeases(),
    LeasesReaped: LeasesReaped(-1),
    LeaseDue: LeaseDue(),
    ReadAbandoned: ReadAbandoned("r1"),
    PinSend: PinSend("P", "r1", [1, 2]),
    ReadGranted: ReadGranted("r1", {"kind": "shm"}, 123_000_000_000),
}


# Every wire tag, pinned: peers decode by them, so a tag never changes or moves.
ENGINE_TAGS = {
    "AddRequest": 0,
    "Abort": 1,
    "Shutdown": 2,
    "GetStats": 3,
    "Ready": 4,
    "RequestOutputs": 5,
    "StatsSnapshot": 6,
    "EngineError": 7,
}
SERVE_TAGS = {
    **ENGINE_TAGS,
    "ServeInfo": 8,
    "TracedRequest": 9,
}  # the engine's messages, and its own
CONNECTOR_TAGS = {
    "RegisterKVCache": 0,
    "WorkerReady": 1,
    "StepMeta": 2,
    "KVReport": 3,
    "GetKVHandle": 4,
    "KVHandle": 5,
    "ReadBlocks": 6,
    "BlockData": 7,
    "ReadDone": 8,
    "Heartbeat": 9,
    "ReapLeases": 10,
    "LeasesReaped": 11,
    "LeaseDue": 12,
    "ReadAbandoned": 13,
    "PinSend": 14,
    "ReadGranted": 15,
    "KVCacheRegistered": 16,
}


def test_every_message_type_round_trips():
    assert set(SAMPLES) == set(SERVE_MESSAGES.values()) | set(CONNECTOR_MESSAGES.values())
    for cls, msg in SAMPLES.items():
        codec = (
            CODEC
            if cls in MESSAGES.values()
            else SERVE_CODEC
            if cls in SERVE_MESSAGES.values()
            else CONNECTOR_CODEC
        )
        assert codec.decode(codec.encode(msg)) == msg


def test_a_serve_info_is_the_serves_message_which_the_engines_codec_refuses():
    frame = SERVE_CODEC.encode(SAMPLES[ServeInfo])
    assert ServeInfo not in MESSAGES.values()
    with pytest.raises(DecodeError, match="unknown message tag 8"):
        CODEC.decode(frame)
    assert (
        SERVE_CODEC.decode(CODEC.encode(SAMPLES[Ready])) == SAMPLES[Ready]
    )  # the engine's, as they are


@pytest.mark.parametrize(
    "codec,registry,pinned",
    [
        (CODEC, MESSAGES, ENGINE_TAGS),
        (SERVE_CODEC, SERVE_MESSAGES, SERVE_TAGS),
        (CONNECTOR_CODEC, CONNECTOR_MESSAGES, CONNECTOR_TAGS),
    ],
)
def test_tags_are_pinned_and_unique(codec: Codec, registry: dict, pinned: dict):
    assert {cls.__name__: tag for tag, cls in registry.items()} == pinned
    assert len(set(pinned.values())) == len(pinned) == len(set(registry.values()))
    for tag, cls in registry.items():
        assert msgpack.unpackb(codec.encode(SAMPLES[cls]))[0] == tag


def test_codec_refuses_ambiguous_tags():
    with pytest.raises(ValueError, match="two tags"):
        Codec({0: Abort, 1: Abort})
    with pytest.raises(ValueError, match="non-negative"):
        Codec({-1: Abort})


def test_output_wire_conversion_round_trips():
    # One field on the wire per field of the record: a new field needs both.
    assert [f.name for f in fields(RequestOutputMsg)] == [f.name for f in fields(RequestOutput)]
    output = RequestOutput("r1", [5, 6], "length", {"do_remote_prefill": True}, 32, None)
    msg = output_to_msg(output)
    assert msg == RequestOutputMsg("r1", [5, 6], "length", {"do_remote_prefill": True}, 32, None)
    assert (
        output_from_msg(CODEC.decode(CODEC.encode(RequestOutputs("P", [msg]))).outputs[0]) == output
    )
    assert output_to_msg(output, "client-7").req_id == "client-7"
    error = RequestOutput("r2", [], "error", error="boom")
    assert output_from_msg(output_to_msg(error)) == error


@pytest.mark.parametrize(
    "frame,why",
    [
        (b"\xc1", "not msgpack"),
        (CODEC.encode(SAMPLES[AddRequest])[:-2], "not msgpack"),
        (msgpack.packb({"tag": 0}), "expected [tag"),
        (msgpack.packb([]), "expected [tag"),
        (msgpack.packb([True, "x"]), "expected [tag"),
        (msgpack.packb([99]), "unknown message tag 99"),
        (msgpack.packb([1]), "Abort: expected 1 fields, got 0"),
        (msgpack.packb([1, ["a"], "extra"]), "Abort: expected 1 fields, got 2"),
        (
            msgpack.packb([0, "r", [1, "2"], 3, None, None]),
            "AddRequest.prompt_token_ids: expected int",
        ),
        (
            msgpack.packb([0, "r", [1], True, None, None]),
            "AddRequest.max_tokens: expected int, got bool",
        ),
        (
            msgpack.packb([5, "P", [["r", [1], None, None, 0]]]),
            "RequestOutputMsg: expected 6 fields",
        ),
    ],
)
def test_garbage_is_a_clear_decode_error(frame: bytes, why: str):
    with pytest.raises(DecodeError, match=why.replace("[", r"\[")):
        CODEC.decode(frame)


def test_serve_socket_drops_garbage_and_keeps_serving(tmp_path):
    from engine.config import EngineConfig
    from engine.proc.client import InprocClient
    from replay.deploy.pd_router import PDRouter
    from replay.serve.server import ServeOptions, Server

    router = PDRouter([InprocClient(EngineConfig(engine_id="E", num_blocks=64, block_size=4))])
    server = Server(
        router, ServeOptions(f"ipc://{tmp_path}/serve"), ServeInfo(["E"], "single", "event", 512, 4)
    )
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        client.connect(server.address)
        for frame in (b"junk", msgpack.packb([0, 1, 2]), SERVE_CODEC.encode(Shutdown(1.0))):
            client.send(frame)
        client.send(SERVE_CODEC.encode(AddRequest("a", [1, 2, 3], 2)))
        outputs = []
        for _ in range(200):
            if server.socket.poll(50):
                server._drain_clients()
            for output in router.poll(0):
                server._forward(output)
            while client.poll(0):
                outputs.extend(SERVE_CODEC.decode(client.recv()).outputs)
            if outputs and outputs[-1].finish_reason:
                break
        assert server.num_bad_messages == 3
        assert [t for o in outputs for t in o.new_token_ids] == [4, 5]
    finally:
        client.close()
        server.close()
        router.shutdown()


def test_agent_drops_garbage_reports():
    """The engine core's side of the connector socket: bad reports are counted, not fatal."""
    from connector.agent import PendingTransfers  # no worker process: just the bookkeeping
    from connector.pd import PDConnectorMetadata
    from engine.core.outputs import KVConnectorOutput

    pending = PendingTransfers()
    pending.start(PDConnectorMetadata(reqs_to_send={"r1": [1]}))
    out = KVConnectorOutput()
    for data in (
        b"junk",
        CONNECTOR_CODEC.encode(ReadDone("r1")),
        CONNECTOR_CODEC.encode(KVReport(["r1"], [], [], {"num_sent": 1})),
    ):
        pending.merge(data, out)
    assert pending.counters == {"num_bad_reports": 2, "num_sent": 1}
    assert out.finished_sending == {"r1"} and not pending.sends


# Values of every wire shape, right and wrong, to put in any field.
_FUZZ_VALUES = [
    0,
    7,
    -1,
    True,
    False,
    1.5,
    "s",
    "",
    b"b",
    None,
    [],
    [1, 2],
    [1, True],
    ["a", "b"],
    ["a", 1],
    [1.5],
    [[1]],
    {},
    {"a": 1},
    {"a": True},
    {"a": "x"},
    {1: 2},
    {"a": [1]},
    {"a": 1.5},
    [["r", [1], None, None, 0, None]],
    [["r", [1], None, None, 0]],
    [["r", [3], [9], "P", "r", "a"]],
    [["P", "a", ["r"]]],
    [["P", "a", [1]]],
]


@pytest.mark.parametrize(
    "codec,registry",
    [(CODEC, MESSAGES), (SERVE_CODEC, SERVE_MESSAGES), (CONNECTOR_CODEC, CONNECTOR_MESSAGES)],
)
def test_fast_decode_equals_the_reference_checks(codec: Codec, registry: dict):
    """The fast field checks (type sets, one C pass per list or dict) accept exactly
    what the reference per-item checks accept, and raise the same error otherwise."""
    import random

    reference = Codec(
        registry,
        nested=tuple(cls for cls in codec._checks if cls not in registry.values()),
        fast=False,
    )
    rng = random.Random(14)
    for cls in registry.values():
        base = msgpack.unpackb(codec.encode(SAMPLES[cls]), strict_map_key=False)
        assert reference.encode(SAMPLES[cls]) == codec.encode(SAMPLES[cls])
        frames = [base]
        for _ in range(300):
            frame = list(base)
            for _ in range(rng.randint(1, 2)):
                if len(frame) > 1:
                    frame[rng.randrange(1, len(frame))] = rng.choice(_FUZZ_VALUES)
            frames.append(frame)
        for frame in frames:
            data = msgpack.packb(frame, use_bin_type=True)
            outcomes = []
            for c in (codec, reference):
                try:
                    outcomes.append(("ok", c.decode(data)))
                except DecodeError as e:
                    outcomes.append(("error", str(e)))
            assert outcomes[0] == outcomes[1], (cls.__name__, frame)
