"""Block transports between connector workers: shared-memory copies and bytes over ZMQ. Runs in: connector-worker process.

A decode worker pulls (NIXL-like one-sided reads): `shm` maps the prefill engine's
registered KV memory once (a handshake over the peer socket) and copies blocks
directly; `zmq` asks the prefill worker for the blocks' bytes, which arrive as one
zero-copy frame. Either way the prefill engine core is not involved.
"""
from __future__ import annotations

import time

import zmq

from connector.messages import (CONNECTOR_CODEC, BlockData, PinSend, ReadBlocks, ReadGranted,
                                RecvSpec)
from engine.kv_cache import KVCache, KVCacheHandle
from engine.messages import DecodeError


class TransferError(RuntimeError):
    """A pull that did not complete; the blocks it should have filled are invalid."""


class PeerTimeout(TransferError):
    """The peer did not answer in time: it is gone or stuck."""


class PeerLink:
    """A DEALER to one peer worker's ROUTER, for request/reply with a timeout."""

    def __init__(self, ctx: zmq.Context, addr: str, timeout_s: float,
                 max_message_bytes: int = -1) -> None:
        self.addr = addr
        self.timeout_ms = int(timeout_s * 1000)
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a reply's payload, at most
        self.socket.connect(addr)

    def send(self, msg: object) -> bool:
        """Fire and forget; False if the peer's queue is full or it is gone."""
        try:
            self.socket.send(CONNECTOR_CODEC.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def request(self, msg: object) -> tuple[object, list[zmq.Frame]]:
        if not self.send(msg):
            raise PeerTimeout(f"{self.addr} takes no requests")
        if not self.socket.poll(self.timeout_ms, zmq.POLLIN):
            # The socket may now hold a late reply; a fresh one keeps replies in step.
            raise PeerTimeout(f"no reply from {self.addr} within {self.timeout_ms} ms")
        frames = self.socket.recv_multipart(copy=False)
        try:
            return CONNECTOR_CODEC.decode(frames[0].bytes), frames[1:]
        except DecodeError as e:
            raise TransferError(f"bad reply from {self.addr}: {e}") from None

    def close(self) -> None:
        self.socket.close(linger=0)


class Puller:
    """Pulls remote blocks into the local KV cache over one transport."""

    def __init__(self, ctx: zmq.Context, transport: str, timeout_s: float = 2.0) -> None:
        self.ctx = ctx
        self.transport = transport
        self.timeout_s = timeout_s
        self.links: dict[str, PeerLink] = {}
        # A peer that did not answer is not asked again for a while (fail fast).
        self.unreachable_until: dict[str, float] = {}
        self.peer_caches: dict[str, KVCache] = {}
        self.num_bytes_pulled = 0
        self.max_message_bytes = -1  # set from the local KV cache's size once it is known

    def link(self, addr: str) -> PeerLink:
        if addr not in self.links:
            self.links[addr] = PeerLink(self.ctx, addr, self.timeout_s, self.max_message_bytes)
        return self.links[addr]

    def pull(self, local: KVCache, spec: RecvSpec) -> None:
        """Fill spec.local_block_ids from the peer's spec.remote_block_ids, or raise TransferError."""
        if len(spec.local_block_ids) != len(spec.remote_block_ids):
            raise TransferError(f"{spec.req_id}: {len(spec.local_block_ids)} local blocks for "
                                f"{len(spec.remote_block_ids)} remote ones")
        if self.unreachable_until.get(spec.remote_addr, 0.0) > time.monotonic():
            raise TransferError(f"{spec.req_id}: peer {spec.remote_addr} is unreachable")
        try:
            if self.transport == "shm":
                self._pull_shm(local, spec)
            else:
                self._pull_zmq(local, spec)
        except PeerTimeout:
            self.unreachable_until[spec.remote_addr] = time.monotonic() + 5 * self.timeout_s
            self._forget(spec.remote_addr)
            raise
        except TransferError:
            self._forget(spec.remote_addr)
            raise
        self.num_bytes_pulled += local.num_bytes_per_block * len(spec.local_block_ids)

    def _pull_shm(self, local: KVCache, spec: RecvSpec) -> None:
        # Every pull first asks the prefill worker to pin the send (a read lease): a send
        # that expired, or whose worker died, has released its blocks, and a copy from the
        # still-mapped memory would read blocks that may be reused. One round trip on
        # ipc (~0.1 ms); the copy must end before the lease does.
        reply, _ = self.link(spec.remote_addr).request(
            PinSend(spec.remote_engine_id, spec.remote_request_id, spec.remote_block_ids))
        if isinstance(reply, BlockData) and not reply.ok:
            raise TransferError(f"{spec.req_id}: read refused by {spec.remote_addr}: {reply.error}")
        if not isinstance(reply, ReadGranted) or reply.req_id != spec.remote_request_id:
            raise TransferError(f"pin at {spec.remote_addr} got {type(reply).__name__}")
        self._copy_shm(local, spec, self._peer_cache(spec, reply.handle))
        if time.monotonic_ns() >= reply.read_until:  # P may have freed them meanwhile
            raise TransferError(f"{spec.req_id}: the copy outlasted its read lease")

    def _peer_cache(self, spec: RecvSpec, handle: dict) -> KVCache:
        peer = self.peer_caches.get(spec.remote_addr)
        if peer is None or peer.handle.to_dict() != handle:
            try:
                peer = KVCache.open(KVCacheHandle.from_dict(handle))
            except (ValueError, OSError) as e:
                raise TransferError(f"cannot map the KV cache of {spec.remote_engine_id}: {e}") from None
            self.peer_caches[spec.remote_addr] = peer
        return peer

    @staticmethod
    def _copy_shm(local: KVCache, spec: RecvSpec, peer: KVCache) -> None:
        try:
            local.copy_blocks_from(peer, spec.remote_block_ids, spec.local_block_ids)
        except (ValueError, IndexError, RuntimeError) as e:
            raise TransferError(f"{spec.req_id}: copy failed: {e}") from None

    def _pull_zmq(self, local: KVCache, spec: RecvSpec) -> None:
        reply, frames = self.link(spec.remote_addr).request(
            ReadBlocks(spec.remote_request_id, spec.remote_block_ids))
        if not isinstance(reply, BlockData) or not reply.ok or len(frames) != 1:
            why = reply.error if isinstance(reply, BlockData) else type(reply).__name__
            raise TransferError(f"{spec.req_id}: read refused by {spec.remote_addr}: {why}")
        try:
            local.write_blocks(spec.local_block_ids, frames[0].buffer)
        except (ValueError, RuntimeError) as e:
            raise TransferError(f"{spec.req_id}: bad block bytes: {e}") from None

    def _forget(self, addr: str) -> None:
        link = self.links.pop(addr, None)
        if link is not None:
            link.close()
        self.peer_caches.pop(addr, None)

    def close(self) -> None:
        for addr in list(self.links):
            self._forget(addr)
