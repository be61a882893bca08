"""Recording served traffic as a kvdrain JSONL trace (`serve --record`). Runs in: frontend process.

Requests and aborts are written as they arrive, with t in seconds since the first
request (the serve's time before it is not part of the traffic). A request a replay
client sent with the time its trace meant it for (TracedRequest) is written at that
time, so the client's lateness does not become part of the traffic: the client's first
such request is written at its arrival and each later one at that plus the trace's time
since it (the trace's gaps as the trace meant them), never before a line already written
(the trace format's times are non-decreasing). The file is flushed line by line, so a
crash loses at most a line.

Snapshots: every engine's block counts and queues, written once nothing has been in
flight and no count has changed for SETTLE_S (and they differ from the last written),
stamped then. So a snapshot is a settled idle state, never a lull inside a burst nor a
drain half done: a replay of the recording (either clock) whose requests end within
SETTLE_S of the recorded ones reaches the same state by then, and under the event and
poll liveness policies matches it exactly (tolerance 0: the replay's default for a
recording whose header has SETTLED_KEY). A replay still busy at a snapshot lagged the
recording: the snapshot is not reached (replay/verify/rules.py), never violated. Under
legacy a parked engine's held blocks depend on which connector reports it read before
it parked, a matter of milliseconds, so they can differ by a request's blocks (measured
on the bundled example: a replay's tail held 15 where the recording held 33).

The HTTP front of `serve --http --record` gives its requests to the router through a
RecordingRouter, so they are recorded in the same file, on the same clock.

The header carries the engines' configuration (RECORDED_CONFIG: pool size, block size,
liveness, topology, max_model_len), so that a replay of the recording runs the same
engines unless told otherwise (`adopt_recorded`); it is written with the first record,
once the serve knows the pool its engines allocated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO

from engine.proc.messages import StatsSnapshot

QUEUE_KEYS = (
    "num_waiting",
    "num_skipped_waiting",
    "num_waiting_for_remote_kvs",
    "num_running",
    "num_finished_awaiting_free",
)


SETTLE_S = 1.0  # nothing in flight and no count changed this long: a snapshot (the default --idle-threshold)
SETTLED_KEY = "snapshot_settle_s"  # in a header: SETTLE_S, its snapshots settled (a replay matches them exactly)
# Header key -> the replay option it sets (the same names).
RECORDED_CONFIG = ("num_blocks", "block_size", "liveness", "topology", "max_model_len")


class TraceRecorder:
    def __init__(self, path: Path, metadata: dict) -> None:
        self.file: TextIO = path.open("w")
        self.metadata = {
            "kvdrain_trace": 1,
            "recorded_by": "kvdrain serve",
            SETTLED_KEY: SETTLE_S,
            **metadata,
        }
        self.origin: float | None = None  # the first request's arrival
        self._last_t = 0.0  # of the last line written
        self._trace_offsets: dict[object, float] = {}  # a client -> its first request's t - trace_t
        self._header_written = False
        self._last_snapshot: str | None = None
        self._settling: tuple[str, float] | None = (
            None  # (the counts, held since): idle, not yet written
        )
        self.clock = time.monotonic

    def configure(self, **config: object) -> None:
        """What the engines run with, known once they started (before the first record)."""
        self.metadata.update({k: v for k, v in config.items() if v})

    def now(self) -> float:
        now = self.clock()
        if self.origin is None:
            self.origin = now
        return round(now - self.origin, 6)

    def _write(self, obj: dict) -> None:
        if not self._header_written:
            self._header_written = True
            self._write(self.metadata)
        if "t" in obj:  # never before a line already written: a traced request may lead now()
            obj["t"] = self._last_t = max(obj["t"], self._last_t)
        self.file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.file.flush()

    def request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        trace_t: float | None = None,
        source: object = None,
    ) -> None:
        """A request at its arrival, or at trace_t (when `source`, its client, said its
        trace meant it sent) on the recording's clock."""
        self._write(
            {
                "t": self._request_t(trace_t, source),
                "id": req_id,
                "prompt_token_ids": prompt_token_ids,
                "max_tokens": max_tokens,
            }
        )

    def _request_t(self, trace_t: float | None, source: object) -> float:
        now = self.now()
        if trace_t is None:
            return now
        offset = self._trace_offsets.setdefault(source, now - trace_t)
        return round(trace_t + offset, 6)

    def abort(self, req_id: str) -> None:
        self._write({"t": self.now(), "abort": req_id})

    def snapshot(self, latest: dict[str, StatsSnapshot], in_flight: bool = False) -> None:
        """Every engine's latest block counts and queues, written once they held still for
        SETTLE_S with nothing in flight, if they differ from the last written (none before
        the first request: the recording starts there). Called every round of the serve."""
        if self.origin is None or in_flight or not latest:
            self._settling = None
            return
        kv = {
            e: {"used": s.counts["num_used_blocks"], "free": s.counts["num_free_blocks"]}
            for e, s in sorted(latest.items())
        }
        queues = {
            e: {k.removeprefix("num_"): s.counts[k] for k in QUEUE_KEYS}
            for e, s in sorted(latest.items())
        }
        key = json.dumps([kv, queues])
        if self._settling is None or self._settling[0] != key:
            self._settling = (key, self.clock())
        elif self.clock() - self._settling[1] >= SETTLE_S and key != self._last_snapshot:
            self._last_snapshot = key
            self._write({"t": self.now(), "kv": kv, "queues": queues})

    def close(self) -> None:
        if not self._header_written:  # no traffic: the header alone
            self._header_written = True
            self.file.write(json.dumps(self.metadata, separators=(",", ":")) + "\n")
        self.file.close()


class RecordingRouter:
    """A router whose requests and aborts are recorded as they are given to it, at their
    arrival, the rest passed through: `serve --http --record`'s HTTP front sends through
    one, so HTTP clients are recorded as the zmq serve records its own."""

    def __init__(self, router, recorder: TraceRecorder) -> None:
        self.router, self.recorder = router, recorder

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], max_tokens: int, pd: bool | None = None
    ) -> None:
        self.router.add_request(req_id, prompt_token_ids, max_tokens, pd)
        self.recorder.request(req_id, prompt_token_ids, max_tokens)

    def abort(self, req_id: str) -> None:
        self.router.abort(req_id)
        self.recorder.abort(req_id)

    def __getattr__(self, name: str):
        return getattr(self.router, name)


def adopt_recorded(
    header: dict[str, object], given: dict[str, object], explicit: set[str]
) -> dict[str, object]:
    """The options a replay of a recording takes from its header: each RECORDED_CONFIG key
    the header has and the user did not set. An explicit option that differs from the
    recording's is a ValueError naming both (the replay would not be of the recording)."""
    adopted = {}
    for name in RECORDED_CONFIG:
        if name not in header:
            continue
        recorded = header[name]
        if name in explicit:
            if given.get(name) != recorded:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} {given.get(name)} conflicts with the recording's "
                    f"{name} {recorded} (its header); drop {flag} to replay the "
                    f"recording as it ran"
                )
            continue
        adopted[name] = recorded
    return adopted
