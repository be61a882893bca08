"""Freed too early: requests whose D leg read blocks P had already freed. Runs in: frontend process.

The safety half of a contract (contract.py is its liveness half): a lease that runs out
before a slow or paused D reads lets P free, and maybe reuse, blocks D then copies, and
the client still gets its answer. Evidence, strongest first:
- the request's own record (RequestRecord.freed_before_read), where the driver knows it
  (the miniature's connector sees a read of a send whose lease had expired);
- the connector's count of such reads (the miniature: counters num_reads_after_expiry),
  past what the records name;
- over vLLM: `vllm:nixl_num_notifications_after_expiry` (0.32+), counted over the run
  (Timeline.counters num_notifications_after_expiry); before 0.32, lease expiries
  (`vllm:nixl_num_kv_expired_reqs`) beyond the requests that ended unread or unanswered,
  since an expiry of a request whose D leg then succeeded freed it before D read;
- over vLLM with a log known (the launcher's): P's "Potentially invalid KV blocks for
  unrecognized request" lines, each after a "Releasing expired KV blocks" of that request
  (meta EXPIRY_LOG, from expiry_log_findings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from replay.verify.contract import is_unread
from replay.verify.timeline import RequestRecord, Timeline, engine_role
from replay.verify.windows import on_upstream

EXPIRY_LOG = "expiry_log"  # Timeline.meta: engine -> ExpiryLog.to_dict()
_RELEASED = re.compile(
    r"Releasing expired KV blocks for request (\S+) which were retrieved by (\d+)"
)
_INVALID = re.compile(r"Potentially invalid KV blocks for unrecognized request (\S+)")
MAX_NAMED = 3  # requests named in one violation's detail


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """What the safety check found for one engine or one request."""

    kind: str = "freed_before_read"  # or "read_after_expiry": the connector's own count
    engine: str
    t: float
    detail: str


@dataclass(slots=True, kw_only=True)
class ExpiryLog:
    """One engine's log lines about expired leases: (line number, vLLM request id)."""

    released: list[tuple[int, str]]  # released by expiry before any D read them
    invalid: list[tuple[int, str]]  # D read a request P no longer knew (freed before read)

    def to_dict(self) -> dict:
        return {"released": self.released, "invalid": self.invalid}


def expiry_log_findings(lines: Iterable[str]) -> ExpiryLog:
    """A vLLM P log's expiry lines (NIXL's base_worker and pull_worker)."""
    log = ExpiryLog(released=[], invalid=[])
    for number, line in enumerate(lines, 1):
        if (m := _RELEASED.search(line)) is not None and m.group(2) == "0":
            log.released.append((number, m.group(1)))
        elif (m := _INVALID.search(line)) is not None:
            log.invalid.append((number, m.group(1)))
    return log


def expiry_logs(logs: Iterable[tuple[str, Path]]) -> dict[str, dict]:
    """engine -> its log's expiry lines (ExpiryLog.to_dict), for the logs that can be read."""
    out = {}
    for engine, path in logs:
        try:
            with open(path, errors="replace") as f:
                out[engine] = expiry_log_findings(f).to_dict()
        except OSError:
            continue
    return out


def freed_before_read(timeline: Timeline) -> list[Finding]:
    """Every sign that a D leg read blocks P had freed (see the module docstring)."""
    named = _from_records(timeline.requests)
    out = [f for f, _ in named]
    on_engine: dict[str, int] = {}
    for _, engine in named:
        on_engine[engine] = on_engine.get(engine, 0) + 1
    for engine, counters in sorted(timeline.counters.items()):
        out += _from_counters(timeline, engine, counters, on_engine)
    for engine, log in sorted((timeline.meta.get(EXPIRY_LOG) or {}).items()):
        out += _from_log(timeline, engine, log)
    return out


def _from_records(requests: Iterable[RequestRecord]) -> list[tuple[Finding, str]]:
    out = []
    for r in requests:
        if not r.freed_before_read:
            continue
        engine = r.stages[0][0] if r.stages else ""
        t = next((x for x in (r.read_t, r.end_t) if x is not None), r.arrival_t)
        answered = "" if r.prefill_done_t is None else f" at {r.prefill_done_t:.3f} s"
        read = "" if r.read_t is None else f", D read them at {r.read_t:.3f} s"
        detail = (
            f"request {r.req_id!r}: freed before read: P answered{answered} and freed its "
            f"blocks before D read them{read}; D's leg still succeeded, so its output may "
            f"come from KV P had reused"
        )
        out.append((Finding(engine=engine, t=t, detail=detail), engine))
    return out


def _from_counters(
    timeline: Timeline, engine: str, counters: dict, on_engine: dict[str, int]
) -> list[Finding]:
    """The connector's or the server's counts, past what the records already name."""
    named = on_engine.get(engine, 0) + on_engine.get("", 0)
    reads = (counters.get("num_reads_after_expiry") or 0) - named
    if reads > 0:
        return [
            Finding(
                kind="read_after_expiry",
                engine=engine,
                t=timeline.end_t,
                detail=f"{reads} read{'s' if reads != 1 else ''} of sends whose lease had "
                f"expired: the decode side copied blocks this engine had freed and may have "
                f"reused, so its KV may be corrupt",
            )
        ]
    if not timeline.is_scraped() or engine_role(engine) != "P" or named:
        return []
    after = counters.get("num_notifications_after_expiry")
    if after is not None:
        if not after:
            return []
        return [
            Finding(
                engine=engine,
                t=timeline.end_t,
                detail=f"freed before read: {after:g} notification{'s' if after != 1 else ''} "
                f"after expiry (vllm:nixl_num_notifications_after_expiry): D read blocks "
                f"this engine had freed when their lease ran out, and the client got its "
                f"answer on KV that may have been reused",
            )
        ]
    return _excess_expiries(timeline, engine, counters.get("num_expired"))


def _excess_expiries(timeline: Timeline, engine: str, expired: float | None) -> list[Finding]:
    """Before vLLM 0.32 (no notification counter): lease expiries beyond the requests that
    may have expired unread were of requests whose D leg succeeded after P freed them."""
    if not expired:
        return []
    mine = [r for r in timeline.requests if _on(r, engine)]
    may_expire = sum(not _succeeded(r) or is_unread(r) for r in mine)
    excess = int(expired) - may_expire
    if excess <= 0:
        return []
    return [
        Finding(
            engine=engine,
            t=timeline.end_t,
            detail=f"freed before read: {int(expired)} lease expiries "
            f"(vllm:nixl_num_kv_expired_reqs) but only {may_expire} of its requests ended "
            f"unread or failed: at least {excess} D leg{'s' if excess != 1 else ''} "
            f"succeeded after this engine had freed its blocks",
        )
    ]


def _on(record: RequestRecord, engine: str) -> bool:
    """The request went through this prefill engine (every one, where its way is not known)."""
    return on_upstream(engine, record.stages[0][0]) if record.stages else True


def _succeeded(record: RequestRecord) -> bool:
    return (
        record.fault is None
        and record.error is None
        and record.finish_reason in ("stop", "length")
        and record.first_token_t is not None
    )


def _from_log(timeline: Timeline, engine: str, log: dict) -> list[Finding]:
    invalid = [tuple(x) for x in log.get("invalid", ())]
    if not invalid:
        return []
    released = {req_id: number for number, req_id in log.get("released", ())}
    shown = ", ".join(
        f"{req_id} (line {number}"
        + (f", released at line {released[req_id]}" if req_id in released else "")
        + ")"
        for number, req_id in invalid[:MAX_NAMED]
    )
    more = f" and {len(invalid) - MAX_NAMED} more" if len(invalid) > MAX_NAMED else ""
    return [
        Finding(
            engine=engine,
            t=timeline.end_t,
            detail=f"freed before read: its log says D read blocks of {len(invalid)} "
            f"request{'s' if len(invalid) != 1 else ''} it had released when their lease "
            f'expired ("Potentially invalid KV blocks"): {shown}{more}',
        )
    ]
