"""What D's worker does once a pull ends: report, release P. Runs in: connector worker, simulator.

Sans-IO, shared by worker_proc.py and replay/sim/kv_worker.py, so the two decode sides cannot
drift. A pull reads through P's SendLedger.read (a pin for shm, the bytes for zmq). Done in time:
finished_recving, and "read done" to P (ReadDone). Refused, a copy past its pin's read lease, or
any failure: its blocks are reported invalid with finished_recving (kv_load_failure_policy
decides) and P frees the send unread (ReadAbandoned).
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.messages import RecvSpec


@dataclass(frozen=True, slots=True)
class PullOutcome:
    req_id: str  # D's request: finished_recving
    invalid_block_ids: list[int]  # empty: the load succeeded
    read: bool  # True: ReadDone to P; False: ReadAbandoned (P frees it unread)


def copy_within_read_lease(read_until: int, now: int) -> bool:
    """A pinned copy that ended at `now` (ns) is good only before its read lease ended."""
    return now < read_until


def pull_outcome(spec: RecvSpec, ok: bool) -> PullOutcome:
    """The report and the release for a pull that succeeded (ok) or failed."""
    return PullOutcome(spec.req_id, [] if ok else list(spec.local_block_ids), ok)
