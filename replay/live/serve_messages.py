"""The `kvdrain serve` <-> client protocol: the engine's messages and ServeInfo, on one codec. Runs in: frontend process (serve and its clients).

A client of a serve speaks to it as to an engine (AddRequest, Abort, GetStats in;
RequestOutputs, StatsSnapshot, EngineError out), so the serve's table is the engine's
(engine/proc/messages.py) plus ServeInfo under tag 8, which the engine's table leaves
free. Decoding is as strict as the engine's: the same Codec.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.proc.messages import MESSAGES as ENGINE_MESSAGES
from engine.proc.messages import Codec, RequestOutputMsg


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


SERVE_INFO_TAG = 8  # fixed forever, as the engine's tags
if SERVE_INFO_TAG in ENGINE_MESSAGES:
    raise ImportError(f"wire tag {SERVE_INFO_TAG}: the engine's table took the serve's tag")
SERVE_MESSAGES: dict[int, type] = {**ENGINE_MESSAGES, SERVE_INFO_TAG: ServeInfo}
SERVE_CODEC = Codec(SERVE_MESSAGES, nested=(RequestOutputMsg,))
encode = SERVE_CODEC.encode
decode = SERVE_CODEC.decode
