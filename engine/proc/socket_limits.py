"""Message size caps (ZMQ_MAXMSGSIZE) for every socket, from the config. Runs in: every process.

A frame over its socket's cap makes libzmq drop the sending connection before the frame is held
whole, so an oversized frame costs nothing. Each cap is the largest legitimate message on its
socket, with room to spare; -1 is libzmq's "no limit".
"""

from __future__ import annotations

import zmq

SLACK_BYTES = 1 << 20  # ids, params, field tags, an error's traceback
TOKEN_ID_BYTES = 9  # msgpack's largest integer encoding
REQUEST_ID_BYTES = 1024  # a request id and its per-request fields (ids are capped at 256 chars)
CLIENT_CAP_BYTES = 64 << 20  # ServeClient: it does not know the serve's config before connecting
OUTPUT_FLOOR_BYTES = 64 << 20  # ~1M aborted requests' outputs
CONTROL_FLOOR_BYTES = 16 << 20


def request_bytes(max_model_len: int) -> int:
    """One AddRequest of a max_model_len prompt (and its transfer params' block ids)."""
    return 2 * TOKEN_ID_BYTES * max_model_len + SLACK_BYTES


def engine_input_bytes(max_model_len: int) -> int:
    """What the frontend sends an engine: a request, or a list of ids to abort."""
    return max(request_bytes(max_model_len), CONTROL_FLOOR_BYTES)


def engine_output_bytes(max_model_len: int, max_num_seqs: int) -> int:
    """One RequestOutputs batch: a step's outputs (tokens and P's block ids per running
    request), and no less than OUTPUT_FLOOR_BYTES for the batch of aborts at shutdown,
    which holds every request the engine has (waiting ones hold no blocks: no bound)."""
    step = max_num_seqs * (REQUEST_ID_BYTES + TOKEN_ID_BYTES * max_model_len) + SLACK_BYTES
    return max(step, OUTPUT_FLOOR_BYTES)


def connector_control_bytes(num_blocks: int, max_num_seqs: int) -> int:
    """StepMeta, KVReport, ReadBlocks, ReadDone: every block and request at once."""
    return max(
        (num_blocks + max_num_seqs) * (REQUEST_ID_BYTES + TOKEN_ID_BYTES) + SLACK_BYTES,
        CONTROL_FLOOR_BYTES,
    )


def block_payload_bytes(kv_cache_bytes: int) -> int:
    """One pull's bytes: at most the whole KV cache of the prefill engine (blocks * block bytes)."""
    return kv_cache_bytes + SLACK_BYTES


def set_max_message_size(sock: zmq.Socket, nbytes: int) -> zmq.Socket:
    """Cap what sock accepts per frame (set before bind/connect: connections copy it)."""
    sock.setsockopt(zmq.MAXMSGSIZE, nbytes)
    return sock
