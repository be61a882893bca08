"""Message size caps (ZMQ_MAXMSGSIZE) for every socket, sized from the config. Runs in: every process.

A frame over its socket's cap makes libzmq drop the connection that sent it before
the frame is held whole, so a 200 MB frame on the serve's port costs nothing. Each cap
is the largest legitimate message on that socket, with room to spare:
- a request (frontend -> engine, client -> serve): max_model_len token ids, msgpack's
  worst case 9 bytes each, plus ids and transfer params;
- an engine's outputs (engine -> frontend): a step's outputs, or the batch of aborts
  for every request it holds at shutdown (64 MiB at least), stats and error text;
- connector control (engine <-> its connector worker, worker <- peers): block ids and
  request ids per step, at most every block and request at once;
- block payloads (prefill worker -> decode worker): at most every block of the KV cache.
A cap of -1 is libzmq's "no limit".
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
