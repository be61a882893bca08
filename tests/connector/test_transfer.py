"""The zmq transport's chunked block reads (connector/transfer.py): a read answered in
chunks fills exactly the blocks that one frame, or the plain read_blocks/write_blocks
path, fills; a chunk out of order, of another read, or missing fails the pull."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest
import zmq

import connector.transfer as transfer
from connector.messages import CONNECTOR_CODEC, BlockData, ReadBlocks, RecvSpec
from connector.transfer import PeerTimeout, Puller, TransferError, keep_freed_buffers, send_blocks
from engine.config import ModelConfig
from engine.runner.kv_cache import KVCache

NUM_BLOCKS = 16
SRC_IDS = [9, 3, 14, 1, 7, 12, 5]
DST_IDS = [2, 11, 6, 15, 4, 10, 8]


@pytest.fixture
def caches():
    model = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=8)
    src, dst, ref = (KVCache.allocate(model, NUM_BLOCKS, block_size=4) for _ in range(3))
    src.pages[...] = np.random.default_rng(0).integers(0, 256, src.pages.shape, dtype=np.uint8)
    yield src, dst, ref
    for cache in (src, dst, ref):
        cache.close()


def _serve_one_read(
    router: zmq.Socket, answer: Callable[[zmq.Frame, ReadBlocks], None]
) -> threading.Thread:
    """A thread that answers the first ReadBlocks on router with answer(identity, msg)."""

    def run() -> None:
        if router.poll(10_000):
            identity, payload = router.recv_multipart(copy=False)
            answer(identity, CONNECTOR_CODEC.decode(payload.bytes))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def peer(tmp_path):
    """(a prefill worker's ROUTER, its address, a zmq Puller); closed afterwards."""
    addr = f"ipc://{tmp_path}/kv"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(addr)
    puller = Puller(zmq.Context.instance(), "zmq", timeout_s=5.0)
    yield router, addr, puller
    puller.close()
    router.close(linger=0)


@pytest.mark.parametrize("blocks_per_chunk", [1, 3, len(SRC_IDS), 100])
def test_a_chunked_pull_fills_what_the_plain_copy_fills(caches, peer, blocks_per_chunk):
    """Fast path (chunks of whole blocks, written as they come) == slow path
    (read_blocks -> write_blocks in one piece), byte for byte over the whole cache."""
    src, dst, ref = caches
    router, addr, puller = peer
    chunk_bytes = blocks_per_chunk * src.num_bytes_per_block
    thread = _serve_one_read(
        router,
        lambda identity, msg: send_blocks(
            router, identity, msg.req_id, src, msg.block_ids, chunk_bytes
        ),
    )
    puller.pull(dst, RecvSpec("d1", DST_IDS, SRC_IDS, "P", "p1", addr))
    thread.join(10)
    ref.write_blocks(DST_IDS, src.read_blocks(SRC_IDS))
    assert np.array_equal(dst.pages, ref.pages)  # the same blocks, and no other, changed
    assert puller.num_bytes_pulled == len(SRC_IDS) * src.num_bytes_per_block


def _chunks(
    router: zmq.Socket, dealer: zmq.Socket, cache: KVCache, block_ids: list[int], chunk_bytes: int
) -> list[tuple[BlockData, bytes]]:
    dealer.send(b"read")
    identity, _ = router.recv_multipart()
    send_blocks(router, identity, "r1", cache, block_ids, chunk_bytes)
    chunks, num_done = [], 0
    while num_done < max(len(block_ids), 1):
        assert dealer.poll(10_000)
        header, data = dealer.recv_multipart()
        chunks.append((CONNECTOR_CODEC.decode(header), data))
        num_done += max(chunks[-1][0].num_chunk_blocks, 1)
    assert not dealer.poll(50)  # nothing after the last chunk
    return chunks


@pytest.mark.parametrize(
    "max_chunks, blocks_per_chunk, expected",
    [
        (64, 3, [(0, 3), (3, 3), (6, 1)]),
        (64, 100, [(0, 7)]),
        (2, 1, [(0, 4), (4, 3)]),  # MAX_CHUNKS bounds the messages of one read
    ],
)
def test_send_blocks_sends_whole_blocks_in_order(
    caches, peer, monkeypatch, max_chunks, blocks_per_chunk, expected
):
    src, _, _ = caches
    router, addr, _ = peer
    monkeypatch.setattr(transfer, "MAX_CHUNKS", max_chunks)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(addr)
    try:
        chunks = _chunks(router, dealer, src, SRC_IDS, blocks_per_chunk * src.num_bytes_per_block)
        assert [(h.first_block, h.num_chunk_blocks) for h, _ in chunks] == expected
        assert all(h.req_id == "r1" and h.ok for h, _ in chunks)
        assert b"".join(data for _, data in chunks) == src.read_blocks(SRC_IDS)
        (empty,) = _chunks(router, dealer, src, [], src.num_bytes_per_block)  # one empty chunk
        assert empty == (BlockData("r1", True, "", 0, 0), b"")
    finally:
        dealer.close(linger=0)


def _send_chunk(router: zmq.Socket, identity: zmq.Frame, header: BlockData, data: bytes) -> None:
    router.send_multipart([identity, CONNECTOR_CODEC.encode(header), data])


@pytest.mark.parametrize(
    "second",
    [
        BlockData("p1", True, "", 1, 1),  # skips a block
        BlockData("p1", True, "", 0, 1),  # repeats one
        BlockData("other", True, "", 2, 1),  # another read's
        BlockData("p1", True, "", 2, 9),  # more blocks than asked for
        BlockData("p1", False, "gone"),  # a refusal mid-read
    ],
)
def test_a_chunk_out_of_step_fails_the_pull(caches, peer, second):
    src, dst, _ = caches
    router, addr, puller = peer
    block = src.read_blocks([1])

    def answer(identity: zmq.Frame, msg: ReadBlocks) -> None:
        _send_chunk(router, identity, BlockData("p1", True, "", 0, 2), block * 2)
        _send_chunk(router, identity, second, block * second.num_chunk_blocks)

    thread = _serve_one_read(router, answer)
    with pytest.raises(TransferError) as err:
        puller.pull(dst, RecvSpec("d1", [2, 3, 4], [1, 1, 1], "P", "p1", addr))
    thread.join(10)
    assert not isinstance(err.value, PeerTimeout)
    assert addr not in puller.links  # a fresh link next time: no stale chunk is read


def test_a_read_that_stops_mid_way_times_out(caches, peer):
    src, dst, _ = caches
    router, addr, _ = peer
    puller = Puller(zmq.Context.instance(), "zmq", timeout_s=0.3)
    thread = _serve_one_read(
        router,
        lambda identity, msg: _send_chunk(
            router, identity, BlockData("p1", True, "", 0, 1), src.read_blocks([1])
        ),
    )
    try:
        with pytest.raises(PeerTimeout):
            puller.pull(dst, RecvSpec("d1", [2, 3], [1, 1], "P", "p1", addr))
    finally:
        thread.join(10)
        puller.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_buffers_takes_effect_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert keep_freed_buffers()
