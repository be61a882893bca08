"""What a deployment promises for P's blocks of a request D never read. Runs in: frontend process.

The promise is its vLLM release's. A request D read (RequestRecord.read_t) gives its
blocks back within the drain deadline; an unread one's (P answered,
RequestRecord.prefill_done_t, and D never read: a dropped or rejected D leg, an abort
before D read) are held for D, and the release says how long:
- the pre-#43433 loop (vLLM <= 0.21, or the miniature's `legacy` liveness): P does not step
  while idle, so nothing frees them there: judged at the drain deadline, held then a leak;
- D's rejection, where it notifies P (0.21+) and P steps: at once;
- a lease (0.22+): the lease plus one heartbeat's extension (30 s + 20 s by default);
- else the fallback timer (480 s; 120 s before 0.11.2), read when P steps.
rules.py judges each idle window by the latest of these deadlines among the unread requests
P still holds; the release and lease come from the deployment (resolve_contract).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.core.release import (
    DEFAULT_RELEASE,
    KV_LEASE_S,
    VllmRelease,
    fallback_timer_s,
    has_kv_lease,
    lease_extension_s,
    notifies_rejection,
    steps_while_delayed_frees,
)
from replay.verify.timeline import RequestRecord, engine_role
from replay.verify.windows import on_upstream

REJECTED = "reject_decode"  # RequestRecord.fault of a D leg D refused before admission
NEWEST_MODELLED = "not learned: the newest release modelled"
NIXL_DEFAULT_LEASE = "NIXL's default kv_lease_duration"


@dataclass(frozen=True, slots=True, kw_only=True)
class Contract:
    """The release and lease a deployment runs, and where each was learned."""

    release: VllmRelease = DEFAULT_RELEASE
    release_from: str = NEWEST_MODELLED
    lease_s: float = KV_LEASE_S
    lease_from: str = NIXL_DEFAULT_LEASE
    # The pre-#43433 loop: the miniature says it by its liveness; None: from the release.
    legacy: bool | None = None

    @property
    def steps_while_idle(self) -> bool:
        """P keeps stepping while only delayed frees are pending (#43433)."""
        if self.legacy is not None:
            return not self.legacy
        return steps_while_delayed_frees(self.release)

    def unread_s(self, fault: str | None) -> float | None:
        """Seconds from P's answer by which P frees an unread request's blocks; None:
        nothing frees them while P idles (judged at the drain deadline)."""
        if not self.steps_while_idle:
            return None
        if fault == REJECTED and notifies_rejection(self.release):
            return 0.0
        if has_kv_lease(self.release):
            return self.lease_s + lease_extension_s(self.lease_s)
        return fallback_timer_s(self.release)

    def unread_terms(self, fault: str | None) -> str:
        """The promise for an unread request, in words ("lease 30 s + extension 20 s")."""
        if not self.steps_while_idle:
            return "pre-#43433 loop: nothing frees them while P idles"
        if fault == REJECTED and notifies_rejection(self.release):
            return "D's rejection notifies P: freed at once"
        if has_kv_lease(self.release):
            return f"lease {self.lease_s:g} s + extension {lease_extension_s(self.lease_s):g} s"
        timer = fallback_timer_s(self.release)
        if timer is None:
            return "no lease and no fallback timer: nothing frees them"
        return f"fallback timer {timer:g} s, read when P steps"

    def held_s(self, fault: str | None) -> float:
        """How long P may hold an unread request's blocks before its own expiry frees them
        once it steps (what counts as still held at a window; inf: never)."""
        promised = self.unread_s(fault)
        if promised is not None:
            return promised
        if has_kv_lease(self.release):
            return self.lease_s + lease_extension_s(self.lease_s)
        timer = fallback_timer_s(self.release)
        return math.inf if timer is None else timer

    def describe(self) -> str:
        """One line: the release and its source, the loop, the lease and its source."""
        loop = "pre-#43433 loop" if not self.steps_while_idle else "idle P steps (#43433)"
        if has_kv_lease(self.release):
            lease = (
                f"lease {self.lease_s:g} s + extension {lease_extension_s(self.lease_s):g} s "
                f"({self.lease_from})"
            )
        else:
            timer = fallback_timer_s(self.release)
            lease = "no lease" + ("" if timer is None else f", fallback timer {timer:g} s")
        return f"vLLM {self.release} ({self.release_from}), {loop}, {lease}"

    def to_dict(self) -> dict:
        return {
            "release": str(self.release),
            "release_from": self.release_from,
            "lease_s": self.lease_s,
            "lease_extension_s": lease_extension_s(self.lease_s),
            "lease_from": self.lease_from,
            "steps_while_idle": self.steps_while_idle,
            "text": self.describe(),
        }


def resolve_contract(
    *,
    learned: tuple[VllmRelease, str] | None = None,
    given: tuple[VllmRelease, str] | None = None,
    lease: tuple[float, str] | None = None,
    legacy: bool | None = None,
) -> Contract:
    """The contract from what the deployment said (learned: its /version) or was said to
    run (given: --vllm-release, or what a launcher started, which the caller passes as
    learned), else the newest release modelled, said so; the lease given, else NIXL's
    default 30 s, said so."""
    release, release_from = learned or given or (DEFAULT_RELEASE, NEWEST_MODELLED)
    lease_s, lease_from = lease or (KV_LEASE_S, NIXL_DEFAULT_LEASE)
    return Contract(
        release=release,
        release_from=release_from,
        lease_s=lease_s,
        lease_from=lease_from,
        legacy=legacy,
    )


def is_unread(record: RequestRecord) -> bool:
    """P answered and D never read its blocks (they are held for D under the contract)."""
    return record.prefill_done_t is not None and record.read_t is None


@dataclass(frozen=True, slots=True)
class Unread:
    """One unread request's blocks on P: from P's answer, due by `due_t` (None: at the
    window's drain deadline), held at most until `until_t` by P's own expiry."""

    req_id: str
    since: float
    due_t: float | None
    until_t: float
    terms: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowContract:
    """What an idle window is judged by on one engine: its deadline and why."""

    deadline_t: float  # the blocks held at its start are due by then
    num_unread: int  # unread requests P still held for D at its start
    text: str  # "1 unread request, lease 30 s + extension 20 s" or "drain deadline 0.5 s"


class UnreadIndex:
    """The unread requests on each prefill engine, for judging its windows. A request's
    P is its way's first stage (a dropped D leg's way has only that one); a request whose
    way is not known is on every prefill engine (engine_role "P")."""

    def __init__(self, requests: Iterable[RequestRecord], contract: Contract) -> None:
        by_engine: dict[str, list[Unread]] = {}
        anywhere: list[Unread] = []  # ways not known
        for record in requests:
            if not is_unread(record):
                continue
            since = record.prefill_done_t
            promised = contract.unread_s(record.fault)
            unread = Unread(
                record.req_id,
                since,
                None if promised is None else since + promised,
                since + contract.held_s(record.fault),
                contract.unread_terms(record.fault),
            )
            if record.stages:
                by_engine.setdefault(record.stages[0][0], []).append(unread)
            else:
                anywhere.append(unread)
        self.by_engine = {e: _ByAnswer(held) for e, held in by_engine.items()}
        self.anywhere = _ByAnswer(anywhere)

    def __bool__(self) -> bool:
        return bool(self.by_engine or self.anywhere.unread)

    def held_at(self, engine: str, start: float, end: float) -> list[Unread]:
        """The unread requests the engine still held for D over a window: P answered
        before it ended, and P's own expiry had not freed them by its start."""
        out = [  # a scraped engine is its upstream's: NAME, or NAME:label of several
            u
            for name, held in self.by_engine.items()
            if on_upstream(engine, name)
            for u in held.held(start, end)
        ]
        if engine_role(engine) == "P":
            out += self.anywhere.held(start, end)
        return out

    def judge_by(
        self, engine: str, start: float, end: float, drain_deadline_s: float
    ) -> WindowContract:
        """The window's deadline: the drain deadline, or later where an unread request's
        contract runs past it (the latest such decides, named in the text)."""
        drain_t = start + drain_deadline_s
        held = self.held_at(engine, start, end)
        if not held:
            return WindowContract(
                deadline_t=drain_t, num_unread=0, text=f"drain deadline {drain_deadline_s:g} s"
            )
        latest = max(held, key=lambda u: -math.inf if u.due_t is None else u.due_t)
        deadline_t = max(drain_t, -math.inf if latest.due_t is None else latest.due_t)
        n = len(held)
        text = f"{n} unread request{'s' if n != 1 else ''}, {latest.terms}"
        return WindowContract(deadline_t=deadline_t, num_unread=n, text=text)


class _ByAnswer:
    """Unread requests in the order P answered them."""

    def __init__(self, unread: list[Unread]) -> None:
        self.unread = sorted(unread, key=lambda u: u.since)
        self.since = [u.since for u in self.unread]

    def held(self, start: float, end: float) -> list[Unread]:
        hi = bisect.bisect_right(self.since, end)
        return [u for u in self.unread[:hi] if u.until_t >= start]


def tail_for(
    requests: Sequence[RequestRecord], contract: Contract, drain_deadline_s: float
) -> float:
    """How long a tail after the last request must be for its window to reach every
    unread request's contract deadline still pending then, plus the drain deadline
    (0: none is pending)."""
    ends = [r.end_t for r in requests if r.end_t is not None]
    if not ends:
        return 0.0
    last_end = max(ends)
    due = [
        r.prefill_done_t + s
        for r in requests
        if is_unread(r) and (s := contract.unread_s(r.fault)) is not None
    ]
    latest = max(due, default=-math.inf)
    return latest - last_end + drain_deadline_s if latest > last_end else 0.0
