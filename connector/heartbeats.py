"""D's lease heartbeats: which remote sends D still waits for, and when. Runs in: engine core.

As vLLM 0.32's NIXL scheduler side (nixl/base_scheduler.py), pure: a request with do_remote_prefill
and the remote fields is tracked from add_request until its finished_recving or request_finished;
all tracked ids go out, by remote engine, at most every lease // 6 (the first at once), so D
heartbeats only while it steps. One throttle, as in vLLM: a request added just after one waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.messages import HeartbeatSpec


@dataclass(slots=True)
class _Remote:
    engine_id: str
    addr: str
    req_id: str  # P's request id: the lease's key there


@dataclass(slots=True)
class HeartbeatTracker:
    """Tracked requests and the one throttle, on the scheduler side's clock (ns).

    interval_ns is lease_ns // 6 and P's extension lease_ns * 2 // 3 (send_ledger.py), vLLM's
    5 s and 20 s for its default 30 s lease. A deliberate difference: vLLM floors both in whole
    seconds, which gives a 1 s lease a 0 s interval; kvdrain keeps them proportional, so the
    sub-second leases of tests and fault reproductions still heartbeat. The two agree whenever
    the lease is a multiple of 6 s, the default included.
    """

    interval_ns: int
    tracked: dict[str, _Remote] = field(default_factory=dict)  # by D's request id
    last_sent_ns: int | None = None

    def track(self, req_id: str, params: dict | None) -> None:
        """A new request: track it if it will load from a remote prefill."""
        if not params or not params.get("do_remote_prefill"):
            return
        fields_ = [params.get(k) for k in ("remote_engine_id", "remote_addr", "remote_request_id")]
        if all(isinstance(v, str) and v for v in fields_):  # vLLM: all remote fields given
            self.tracked[req_id] = _Remote(*fields_)

    def stop(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)

    def package(self, now_ns: int) -> list[HeartbeatSpec]:
        """The heartbeats for this step's metadata: all tracked ids if one is due, else none."""
        if not self.tracked or (
            self.last_sent_ns is not None and now_ns - self.last_sent_ns < self.interval_ns
        ):
            return []
        self.last_sent_ns = now_ns
        by_engine: dict[tuple[str, str], list[str]] = {}
        for remote in self.tracked.values():
            by_engine.setdefault((remote.engine_id, remote.addr), []).append(remote.req_id)
        return [
            HeartbeatSpec(engine_id, addr, sorted(ids))
            for (engine_id, addr), ids in sorted(by_engine.items())
        ]

    def next_due_ns(self, now_ns: int) -> int | None:
        """When package() next gives something (ns); None: nothing is tracked."""
        if not self.tracked:
            return None
        return now_ns if self.last_sent_ns is None else self.last_sent_ns + self.interval_ns
