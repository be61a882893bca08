"""Connector wire types: engine core <-> worker, worker <-> worker. Runs in: engine core, worker.

On the engine's codec. KV block bytes never travel inside a message: each BlockData is followed
by one raw, zero-copy ZMQ frame holding `num_chunk_blocks` of the blocks asked for, from
`first_block` on, in order; a read is answered in chunks, so the reader writes one while the next
is on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.proc.messages import Codec


@dataclass(frozen=True, slots=True)
class RegisterKVCache:
    """Engine core -> its worker, once at start: where its KV cache memory is."""

    engine_id: str
    handle: dict  # KVCacheHandle.to_dict(): plain names, sizes, dtypes


@dataclass(frozen=True, slots=True)
class WorkerReady:
    engine_id: str
    pid: int
    kv_addr: str  # where peers read this engine's blocks


@dataclass(frozen=True, slots=True)
class KVCacheRegistered:
    """Worker -> its engine core: the KV cache is mapped (on CUDA: the worker's context
    made and the IPC memory opened, slow on a big GPU), so the engine may say Ready;
    vLLM registers its KV caches with NIXL before the engine serves, too."""

    engine_id: str
    num_blocks: int  # the pool's, the null block included


@dataclass(frozen=True, slots=True)
class RecvSpec:
    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_addr: str


@dataclass(frozen=True, slots=True)
class HeartbeatSpec:
    """D's heartbeat for one P engine: keep these of its sends (P's request ids) leased."""

    remote_engine_id: str
    remote_addr: str
    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class StepMeta:
    """Engine core -> its worker, each step with connector work (vLLM's connector metadata)."""

    reqs_to_send: dict[str, list[int]]
    reqs_to_recv: list[RecvSpec]
    # The lease deadline of each send (time.monotonic_ns(), stamped by P's scheduler
    # side in request_finished); a send without one is leased from its registration.
    send_deadlines: dict[str, int] = field(default_factory=dict)
    heartbeats: list[HeartbeatSpec] = field(default_factory=list)  # D: send these to P


@dataclass(frozen=True, slots=True)
class KVReport:
    """Worker -> its engine core: completions since the last report, and the counters
    that changed since then (the first report: all; the agent merges them)."""

    finished_sending: list[str]
    finished_recving: list[str]
    invalid_block_ids: list[int]
    counters: dict[str, int]


@dataclass(frozen=True, slots=True)
class GetKVHandle:
    """Worker -> peer worker: the handshake of the shm transport (map my memory)."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class KVHandle:
    engine_id: str
    handle: dict


@dataclass(frozen=True, slots=True)
class ReadBlocks:
    """Decode worker -> prefill worker (zmq transport): send me these blocks' bytes."""

    req_id: str
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class BlockData:
    """Prefill worker -> decode worker: one chunk of a read (or its refusal: ok=False,
    no chunk), followed by the chunk's bytes; the chunks of a read come in order."""

    req_id: str
    ok: bool
    error: str
    first_block: int = 0  # index into ReadBlocks.block_ids of the chunk's first block
    num_chunk_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Decode worker -> prefill worker: done reading; free the blocks."""

    req_id: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Decode worker -> prefill worker: D still waits for these sends; extend their
    leases (vLLM NIXL's "HB:req1,req2" notification)."""

    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class ReapLeases:
    """Engine core -> its worker, from a step's get_finished once a lease may be due:
    end the sends whose lease has passed (vLLM reaps them in get_finished)."""


@dataclass(frozen=True, slots=True)
class LeasesReaped:
    """Worker -> its engine core, after the KVReport with what the reap ended: when
    the next lease falls due (time.monotonic_ns()); -1: no send is held."""

    next_deadline_ns: int


@dataclass(frozen=True, slots=True)
class LeaseDue:
    """Worker -> its engine core: heartbeats wait to be applied; reap at the next step."""


@dataclass(frozen=True, slots=True)
class ReadAbandoned:
    """Decode worker -> prefill worker: this send will not be read (D's request ended
    or was refused before its load, or the pull failed): free the blocks. The NIXL
    rule: every way a P/D request ends on D releases P."""

    req_id: str


@dataclass(frozen=True, slots=True)
class PinSend:
    """Decode worker -> prefill worker (shm transport): I am about to copy these blocks
    of this send straight from your memory; hold them until I say "read done" (a read
    lease). Answered by ReadGranted, or BlockData(ok=False) if the send is not held."""

    engine_id: str
    req_id: str
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class ReadGranted:
    """Prefill worker -> decode worker: copy now from `handle`; the blocks stay held
    until "read done" or until `read_until` (time.monotonic_ns() of this host), after
    which the reader must drop its copy."""

    req_id: str
    handle: dict
    read_until: int


# Wire tags: fixed forever (peers decode by them); a new type takes a new number.
CONNECTOR_MESSAGES: dict[int, type] = {
    0: RegisterKVCache,
    1: WorkerReady,
    2: StepMeta,
    3: KVReport,
    4: GetKVHandle,
    5: KVHandle,
    6: ReadBlocks,
    7: BlockData,
    8: ReadDone,
    9: Heartbeat,
    10: ReapLeases,
    11: LeasesReaped,
    12: LeaseDue,
    13: ReadAbandoned,
    14: PinSend,
    15: ReadGranted,
    16: KVCacheRegistered,
}
CONNECTOR_CODEC = Codec(CONNECTOR_MESSAGES, nested=(RecvSpec, HeartbeatSpec))
