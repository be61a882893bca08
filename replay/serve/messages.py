"""The `kvdrain serve` <-> client protocol: the engine's messages and ServeInfo, on one codec. Runs in: frontend process (serve and its clients).

A client of a serve speaks to it as to an engine (AddRequest, Abort, GetStats in;
RequestOutputs, StatsSnapshot, EngineError out), so the serve's table is the engine's
(engine/proc/messages.py) plus the serve's own under tags the engine's table leaves
free: ServeInfo (8) and TracedRequest (9, a replay's request with the time its trace
meant it for, which `serve --record` writes). Decoding is as strict as the engine's:
the same Codec.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.proc.messages import MESSAGES as ENGINE_MESSAGES
from engine.proc.messages import AddRequest, Codec, RequestOutputMsg


@dataclass(frozen=True, slots=True)
class ServeInfo:
    """`kvdrain serve` -> a client that subscribed (GetStats): what is being served."""

    engines: list[str]
    topology: str
    liveness: str
    vocab_size: int
    block_size: int
    # The rest of what the serve's engines run with, for the report (a serve that does
    # not say sends the defaults).
    runner: str = ""
    max_model_len: int = 0
    num_blocks: int = 0  # per engine, the null block included
    model: str = ""  # the model preset's name
    serve_id: str = ""  # new at every start of a serve: a client that sees it change knows


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """A replay client -> the serve: a request, and when its trace meant it to arrive
    (trace_t: the trace's seconds, on the client's origin). The serve runs the request
    as an AddRequest; its recording writes trace_t (replay/serve/recorder.py), so how late
    the client sent it does not become part of the recorded traffic."""

    request: AddRequest
    trace_t: float


SERVE_TAGS: dict[int, type] = {
    8: ServeInfo,
    9: TracedRequest,
}  # fixed forever, as the engine's tags
if taken := set(SERVE_TAGS) & set(ENGINE_MESSAGES):
    raise ImportError(f"wire tags {sorted(taken)}: the engine's table took the serve's tags")
SERVE_MESSAGES: dict[int, type] = {**ENGINE_MESSAGES, **SERVE_TAGS}
SERVE_CODEC = Codec(SERVE_MESSAGES, nested=(RequestOutputMsg,))
encode = SERVE_CODEC.encode
decode = SERVE_CODEC.decode
