"""Block transports between connector workers: shm copies, ZMQ bytes. Runs in: connector worker.

A decode worker pulls (NIXL-like one-sided reads); the prefill engine core is never involved.
`shm` maps the prefill engine's registered KV memory once (a handshake over the peer socket) and
copies blocks directly; `zmq` asks the prefill worker for the blocks' bytes, which arrive in
chunks of whole blocks, each a zero-copy frame, so both sides work on one chunk while the next is
on the wire.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import zmq

from connector.messages import (
    CONNECTOR_CODEC,
    BlockData,
    PinSend,
    ReadBlocks,
    ReadGranted,
    RecvSpec,
)
from connector.pull_outcome import copy_within_read_lease
from engine.proc.messages import DecodeError
from engine.runner.kv_cache import KVCache, KVCacheHandle

CHUNK_BYTES = 2 << 20  # a zmq read's chunk: whole blocks, about this many bytes ...
MAX_CHUNKS = 64  # ... in at most this many chunks (a ROUTER drops past its high-water mark)
# glibc's mallopt: buffers under MMAP_THRESHOLD_BYTES come from the heap, and up to
# TRIM_THRESHOLD_BYTES of freed heap stay mapped (see keep_freed_buffers).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit
TRIM_THRESHOLD_BYTES = 64 << 20
SLOW_REPLY_MS = 50  # a reply this late runs the link's on_slow_reply, then is waited for
CLOSE_LINGER_MS = 200  # Puller.close: a message sent just before still goes out


class TransferError(RuntimeError):
    """A pull that did not complete; the blocks it should have filled are invalid."""


class PeerTimeout(TransferError):
    """The peer did not answer in time: it is gone or stuck."""


class PeerLink:
    """A DEALER to one peer worker's ROUTER, for request/reply with a timeout."""

    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        timeout_s: float,
        max_message_bytes: int = -1,
        on_slow_reply: Callable[[], None] | None = None,
    ) -> None:
        self.addr = addr
        self.timeout_ms = int(timeout_s * 1000)
        self.on_slow_reply = on_slow_reply
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
        return self.receive()

    def receive(self) -> tuple[object, list[zmq.Frame]]:
        """The next reply (a message and the raw frames after it), or PeerTimeout."""
        if not self._wait():
            # The socket may now hold a late reply; a fresh one keeps replies in step.
            raise PeerTimeout(f"no reply from {self.addr} within {self.timeout_ms} ms")
        frames = self.socket.recv_multipart(copy=False)
        try:
            return CONNECTOR_CODEC.decode(frames[0].bytes), frames[1:]
        except DecodeError as e:
            raise TransferError(f"bad reply from {self.addr}: {e}") from None

    def _wait(self) -> bool:
        """Whether a reply came within the timeout; once one is SLOW_REPLY_MS late,
        on_slow_reply runs first (the connector worker sends what it held back)."""
        hook = self.on_slow_reply
        if hook is None or self.timeout_ms <= SLOW_REPLY_MS:
            return bool(self.socket.poll(self.timeout_ms, zmq.POLLIN))
        if self.socket.poll(SLOW_REPLY_MS, zmq.POLLIN):
            return True
        hook()
        return bool(self.socket.poll(self.timeout_ms - SLOW_REPLY_MS, zmq.POLLIN))

    def close(self, linger_ms: int = 0) -> None:
        self.socket.close(linger=linger_ms)


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
        self.on_slow_reply: Callable[[], None] | None = None  # each link's (PeerLink._wait)

    def link(self, addr: str) -> PeerLink:
        if addr not in self.links:
            self.links[addr] = PeerLink(
                self.ctx, addr, self.timeout_s, self.max_message_bytes, self.on_slow_reply
            )
        return self.links[addr]

    def pull(self, local: KVCache, spec: RecvSpec) -> None:
        """Fill spec.local_block_ids from the peer's remote_block_ids, or raise TransferError."""
        if len(spec.local_block_ids) != len(spec.remote_block_ids):
            raise TransferError(
                f"{spec.req_id}: {len(spec.local_block_ids)} local blocks for "
                f"{len(spec.remote_block_ids)} remote ones"
            )
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
        # still-mapped memory would read blocks that may be reused. The copy must end
        # before the lease does.
        reply, _ = self.link(spec.remote_addr).request(
            PinSend(spec.remote_engine_id, spec.remote_request_id, spec.remote_block_ids)
        )
        if isinstance(reply, BlockData) and not reply.ok:
            raise TransferError(f"{spec.req_id}: read refused by {spec.remote_addr}: {reply.error}")
        if not isinstance(reply, ReadGranted) or reply.req_id != spec.remote_request_id:
            raise TransferError(f"pin at {spec.remote_addr} got {type(reply).__name__}")
        self._copy_shm(local, spec, self._peer_cache(spec, reply.handle))
        if not copy_within_read_lease(
            reply.read_until, time.monotonic_ns()
        ):  # P may have freed them
            raise TransferError(f"{spec.req_id}: the copy outlasted its read lease")

    def _peer_cache(self, spec: RecvSpec, handle: dict) -> KVCache:
        peer = self.peer_caches.get(spec.remote_addr)
        if peer is None or peer.handle.to_dict() != handle:
            try:
                peer = KVCache.open(KVCacheHandle.from_dict(handle))
            except (ValueError, OSError) as e:
                raise TransferError(
                    f"cannot map the KV cache of {spec.remote_engine_id}: {e}"
                ) from None
            self.peer_caches[spec.remote_addr] = peer
        return peer

    @staticmethod
    def _copy_shm(local: KVCache, spec: RecvSpec, peer: KVCache) -> None:
        try:
            local.copy_blocks_from(peer, spec.remote_block_ids, spec.local_block_ids)
        except (ValueError, IndexError, RuntimeError) as e:
            raise TransferError(f"{spec.req_id}: copy failed: {e}") from None

    def _pull_zmq(self, local: KVCache, spec: RecvSpec) -> None:
        """Write each chunk of send_blocks' answer as it comes (the next is on its way); a
        chunk of about CHUNK_BYTES also stays in the CPU's cache between the two copies."""
        link = self.link(spec.remote_addr)
        reply, frames = link.request(ReadBlocks(spec.remote_request_id, spec.remote_block_ids))
        num_done = self._write_chunk(local, spec, reply, frames, 0)
        while num_done < len(spec.local_block_ids):
            reply, frames = link.receive()
            num_done = self._write_chunk(local, spec, reply, frames, num_done)

    @staticmethod
    def _write_chunk(
        local: KVCache, spec: RecvSpec, reply: object, frames: list[zmq.Frame], num_done: int
    ) -> int:
        """Write one chunk after num_done blocks; returns the blocks done now."""
        if not isinstance(reply, BlockData) or not reply.ok or len(frames) != 1:
            why = reply.error if isinstance(reply, BlockData) else type(reply).__name__
            raise TransferError(f"{spec.req_id}: read refused by {spec.remote_addr}: {why}")
        end = num_done + reply.num_chunk_blocks
        num_wanted = len(spec.local_block_ids)
        if (
            reply.req_id != spec.remote_request_id
            or reply.first_block != num_done
            or end > num_wanted
            or (reply.num_chunk_blocks <= 0 < num_wanted)
        ):
            raise TransferError(
                f"{spec.req_id}: chunk of {reply.num_chunk_blocks} blocks from "
                f"{reply.first_block} of {reply.req_id!r} after {num_done} blocks"
            )
        try:
            local.write_blocks(spec.local_block_ids[num_done:end], frames[0].buffer)
        except (ValueError, RuntimeError) as e:
            raise TransferError(f"{spec.req_id}: bad block bytes: {e}") from None
        return end

    def _forget(self, addr: str, linger_ms: int = 0) -> None:
        link = self.links.pop(addr, None)
        if link is not None:
            link.close(linger_ms)
        self.peer_caches.pop(addr, None)

    def close(self) -> None:
        """Close every link; what was just sent on one (a last ReadDone) gets CLOSE_LINGER_MS."""
        for addr in list(self.links):
            self._forget(addr, CLOSE_LINGER_MS)


def send_blocks(
    sock: zmq.Socket,
    reply_to: zmq.Frame | bytes,
    req_id: str,
    cache: KVCache,
    block_ids: list[int],
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Answer a ReadBlocks on a ROUTER: the blocks' bytes in chunks of whole blocks, each
    [BlockData, bytes] with the bytes gathered into a fresh array that libzmq sends
    without a copy (it keeps the array alive until sent), so the next chunk is gathered
    while libzmq sends the last. The chunks are gathered now, while the blocks are held; a
    read of no blocks is answered by one empty chunk."""
    per_chunk = max(1, chunk_bytes // cache.num_bytes_per_block, -(-len(block_ids) // MAX_CHUNKS))
    for first in range(0, max(len(block_ids), 1), per_chunk):
        ids = block_ids[first : first + per_chunk]
        header = CONNECTOR_CODEC.encode(BlockData(req_id, True, "", first, len(ids)))
        sock.send_multipart([reply_to, header, cache.gather_blocks(ids)], copy=False)


def keep_freed_buffers() -> bool:
    """Let this process reuse freed transfer buffers instead of faulting in fresh pages.

    A pull allocates its chunks anew: the gathered arrays on the sending side, libzmq's
    receive buffers on the other. glibc returns a freed chunk of 2 MiB to the OS when
    the heap's free top passes its trim threshold (twice the largest chunk freed so
    far), so the next pull page-faults and zeroes every page again (measured: 15-17 ms
    of CPU per 16 MiB pull in 2 MiB chunks, 9-11 ms without the faults). Here chunks
    under 32 MiB come from the heap and up to 64 MiB of it stays mapped when free. For
    connector workers (and what plays one); glibc only (False elsewhere: no change).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
