"""Recording served traffic as a kvdrain JSONL trace (`serve --record`). Runs in: frontend process.

Requests and aborts are written as they arrive, with t in seconds since the recorder
started; a snapshot of every engine's block counts and queues is written whenever
nothing is in flight and the counts changed (the moments a replay of the recording
can reproduce). The file is flushed line by line, so a crash loses at most a line.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO

from engine.proc.messages import StatsSnapshot

QUEUE_KEYS = ("num_waiting", "num_skipped_waiting", "num_waiting_for_remote_kvs", "num_running",
              "num_finished_awaiting_free")


class TraceRecorder:
    def __init__(self, path: Path, metadata: dict) -> None:
        self.file: TextIO = path.open("w")
        self.origin = time.monotonic()
        self._last_snapshot: str | None = None
        self._write({"kvdrain_trace": 1, "recorded_by": "kvdrain serve", **metadata})

    def now(self) -> float:
        return round(time.monotonic() - self.origin, 6)

    def _write(self, obj: dict) -> None:
        self.file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.file.flush()

    def request(self, req_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self._write({"t": self.now(), "id": req_id, "prompt_token_ids": prompt_token_ids,
                     "max_tokens": max_tokens})

    def abort(self, req_id: str) -> None:
        self._write({"t": self.now(), "abort": req_id})

    def snapshot(self, latest: dict[str, StatsSnapshot]) -> None:
        """Block counts and queues of every engine, if they changed since the last one."""
        kv = {e: {"used": s.counts["num_used_blocks"], "free": s.counts["num_free_blocks"]}
              for e, s in sorted(latest.items())}
        queues = {e: {k.removeprefix("num_"): s.counts[k] for k in QUEUE_KEYS}
                  for e, s in sorted(latest.items())}
        key = json.dumps([kv, queues])
        if key != self._last_snapshot:
            self._last_snapshot = key
            self._write({"t": self.now(), "kv": kv, "queues": queues})

    def close(self) -> None:
        self.file.close()
