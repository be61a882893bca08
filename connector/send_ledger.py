"""The prefill side's send ledger: held sends, leases, reads. Runs in: connector worker, simulator.

Sans-IO, vLLM 0.32's NIXL prefill side (nixl/base_worker.py): each call takes `now` (integer ns
of a monotonic clock: worker_proc.py's, or the simulator's virtual time) and returns a
LedgerOutput: sends finished (finished_sending), read replies, hold deadlines set. A send ends by
D's "read done" or a reap P's step asks for: a parked engine reaps nothing, and its worker
keeps serving reads of the blocks it still holds. HoldRules say how the release followed lets
go of an unread send: a lease D's heartbeats extend (0.22+) or a fixed timer (before), a reap
that scans every send (0.31+) or stops at the first not yet due, in registration order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.core.release import VllmRelease, fallback_timer_s, has_kv_lease, reaper_scans_all

# How long an early read waits for its send to be registered: less than the decode
# side's 2 s read timeout (connector/transfer.py), so it gets an answer either way.
EARLY_HOLD_NS = 1_000_000_000

# Ids held before their registration, at most (each a few hundred bytes): a step
# finishes at most max_num_seqs requests, so thousands are never legitimate.
MAX_EARLY_HOLDS = 4096

# Finished ids remembered to drop a duplicate "read done", at most (oldest forgotten).
MAX_RECENTLY_FINISHED = 4096

# How long a granted shm read (a pin) may take. The reader copies straight out of P's
# memory, so until then no expiry frees the send; the reader checks the same deadline
# (one host, one monotonic clock) after its copy and drops a copy that ran past it.
READ_LEASE_NS = 2_000_000_000

UNKNOWN_REQUEST = "unknown or expired request"
BLOCKS_NOT_HELD = "blocks not held for this request"


@dataclass(frozen=True, slots=True)
class HoldRules:
    """How P lets go of a send D has not read, in one vLLM release (engine/core/release.py)."""

    hold_ns: int  # the lease (kv_lease_duration) or, before 0.22, the fallback timer
    heartbeats: bool = True  # D's heartbeats extend it (a lease; a timer is never extended)
    # Every expired send is reaped; else the reap goes through the sends in registration
    # order and stops at the first not yet due (vLLM before 0.31).
    reaper_scans_all: bool = True

    @classmethod
    def of(cls, release: str, kv_lease_s: float) -> HoldRules:
        """The rules of `release` ("X.Y"); kv_lease_s is the lease where it has one."""
        parsed = VllmRelease.parse(release)
        lease = has_kv_lease(parsed)
        hold_s = kv_lease_s if lease else fallback_timer_s(parsed)
        if hold_s is None:
            raise ValueError(f"vllm_release: {release} frees no unread send on its own")
        return cls(round(hold_s * 1e9), lease, reaper_scans_all(parsed))


@dataclass(frozen=True, slots=True)
class ReadReply:
    """The answer to one read: serve `block_ids` (error "") or refuse with `error`."""

    reply_to: object  # the driver's handle on the reader (a ROUTER identity)
    req_id: str
    block_ids: list[int]
    error: str = ""
    pin: bool = False  # an shm read: the reader copies from P's memory itself
    read_until: int = 0  # a granted pin: the send is not freed before this (ns)

    @property
    def ok(self) -> bool:
        return not self.error

    def refused(self, error: str) -> ReadReply:
        """This read, refused with `error` (dataclasses.replace, without its cost)."""
        return ReadReply(
            self.reply_to, self.req_id, self.block_ids, error, self.pin, self.read_until
        )

    def granted_until(self, read_until: int) -> ReadReply:
        """This pin, granted until `read_until`."""
        return ReadReply(
            self.reply_to, self.req_id, self.block_ids, self.error, self.pin, read_until
        )


@dataclass(slots=True)
class LedgerOutput:
    """What one call decided; the driver does the I/O."""

    finished_sending: list[str] = field(default_factory=list)
    replies: list[ReadReply] = field(default_factory=list)
    hold_deadlines: list[int] = field(default_factory=list)  # early holds set by this call (ns)


@dataclass(slots=True)
class _Send:
    block_ids: list[int]
    seq: int  # this registration: the lease's key
    registered_at: int
    deadline: int  # the lease
    read_until: int = 0  # a granted shm read runs until then: the lease waits for it
    was_read: bool = False  # a read was served or granted while it was held


@dataclass(slots=True)
class _EarlyHold:
    seq: int
    deadline: int
    reads: list[ReadReply] = field(default_factory=list)  # error "": not answered yet
    read_done: bool = False


class SendLedger:
    """The prefill side's protocol state; each method's docstring gives its rule."""

    max_early_holds = MAX_EARLY_HOLDS

    def __init__(
        self,
        lease_ns: int,
        drop_read_done: bool = False,
        early_hold_ns: int = EARLY_HOLD_NS,
        rules: HoldRules | None = None,
    ) -> None:
        """lease_ns: how long an unread send is held; rules (their hold_ns is lease_ns):
        how it lets go; None: vLLM 0.32's lease."""
        self.lease_ns, self.early_hold_ns = lease_ns, early_hold_ns
        self.lease_extension_ns = lease_ns * 2 // 3
        self.rules = rules if rules is not None else HoldRules(lease_ns)
        self.drop_read_done = drop_read_done
        self.sends: dict[str, _Send] = {}  # registered, not yet read or expired
        self.early: dict[str, _EarlyHold] = {}  # arrived before their registration
        # Expired sends -> whether a read was served while held: a late "read done" is
        # stale, and for one never served it means D read freed memory without asking.
        self.expired: dict[str, bool] = {}
        # Ids that finished lately (insertion-ordered, bounded): a "read done" for one is a
        # duplicate, not an early arrival for a registration to come.
        self.recently_finished: dict[str, None] = {}
        self.heartbeats: list[str] = []  # received, applied at the next reap
        self._leases: list[tuple[int, int, str]] = []  # heap of (deadline, seq, req_id)
        self._holds: list[tuple[int, int, str]] = []  # the same, of early holds
        self._seq = 0
        self.counters = dict.fromkeys(
            (
                "num_sent",
                "num_expired",
                "num_read_done_dropped",
                "num_reads_after_expiry",
                "num_heartbeats",
                "num_released_unread",
                "num_reads_refused",
                "num_expiries_deferred",
            ),
            0,
        )

    # ---- what P's engine says -------------------------------------------------------

    def register(
        self, req_id: str, block_ids: list[int], now: int, deadline: int | None = None
    ) -> LedgerOutput:
        """These blocks wait for a remote read, leased until `deadline` (P's scheduler side
        stamped now + kv_lease_duration in request_finished; default: a lease from now): hold
        them until "read done" or a reap, or settle what came early. A lease belongs to one
        registration: a re-used id never inherits an old one."""
        out = LedgerOutput()
        self.sends[req_id] = _Send(list(block_ids), self._next_seq(), now, 0)
        self.expired.pop(req_id, None)
        self.recently_finished.pop(req_id, None)
        early = self.early.pop(req_id, None)
        for read in early.reads if early is not None else []:
            out.replies.append(self._answer(read, now))
        if early is not None and early.read_done:
            self._finish(req_id, expired=False, out=out)
        else:
            self.extend(req_id, now + self.lease_ns if deadline is None else deadline)
        return out

    def reap(self, now: int) -> LedgerOutput:
        """P's engine steps and asks (vLLM's _reap_expired_send_leases in get_finished).

        The queued heartbeats first: each named send still held gets max(lease, now +
        lease_ns * 2 // 3), vLLM's kv_lease_duration * 2 // 3 in ns so that short test leases
        work. Then every held send whose lease has passed (now >= lease) ends, counted as
        expired, unless a read lease runs: its expiry waits for it (num_expiries_deferred)."""
        for req_id in self.heartbeats if self.rules.heartbeats else ():
            send = self.sends.get(req_id)
            if send is not None and now + self.lease_extension_ns > send.deadline:
                self.extend(req_id, now + self.lease_extension_ns)
        self.heartbeats.clear()
        out = LedgerOutput()
        if not self.rules.reaper_scans_all:
            self._reap_in_order(now, out)
            return out
        while self._leases and self._leases[0][0] <= now:
            deadline, seq, req_id = heapq.heappop(self._leases)
            send = self.sends.get(req_id)
            if not self._is_live(send, deadline, seq):
                continue
            self._expire(req_id, send, now, out)
        return out

    def _reap_in_order(self, now: int, out: LedgerOutput) -> None:
        """vLLM's reap before 0.31: the held sends in registration order, up to the first
        whose lease has not passed (a heartbeated one strands expired ones behind it)."""
        while self.sends:
            req_id, send = next(iter(self.sends.items()))
            if send.deadline > now or not self._expire(req_id, send, now, out):
                return

    def _expire(self, req_id: str, send: _Send, now: int, out: LedgerOutput) -> bool:
        """End a send whose lease passed, unless a read lease runs: the expiry then waits
        for the copy. Whether it ended."""
        if send.read_until > now:
            self.counters["num_expiries_deferred"] += 1
            self.extend(req_id, send.read_until)
            return False
        self._finish(req_id, expired=True, out=out)
        return True

    def next_lease_deadline(self) -> int | None:
        """When a reap next ends a send (ns), heartbeats not yet applied: the earliest
        lease, or under an in-order reap the first registered send's; None: no send is held."""
        if not self.rules.reaper_scans_all:
            return next(iter(self.sends.values())).deadline if self.sends else None
        return self._peek(self._leases, self.sends)

    def extend(self, req_id: str, deadline: int) -> None:
        """Move a held send's lease to `deadline`; nothing if it is not held."""
        send = self.sends.get(req_id)
        if send is not None:
            send.deadline = deadline
            if self.rules.reaper_scans_all:  # an in-order reap reads the sends themselves
                heapq.heappush(self._leases, (deadline, send.seq, req_id))

    # ---- what D's worker says -------------------------------------------------------

    def receive_heartbeat(self, req_ids: list[str]) -> bool:
        """D still waits for these sends: queued for the next reap, as vLLM handles its "HB:"
        notifications inside get_finished. True when the queue was empty, so the driver tells
        the engine there is something to reap."""
        self.counters["num_heartbeats"] += 1
        if not self.rules.heartbeats:  # a fixed timer: nothing to extend
            return False
        first = not self.heartbeats
        self.heartbeats.extend(req_ids)
        return first

    def read(
        self, reply_to: object, req_id: str, block_ids: list[int], now: int, pin: bool = False
    ) -> LedgerOutput:
        """A read of a send's blocks: answered now, or held until the send is registered.

        D can get there first: P's final output reaches the frontend at the end of the step
        in which the request finished, but P registers the send in its next step; so an early
        read is held for early_hold_ns from its id's first early arrival. A read of a send
        known to have expired is refused at once: D's load fails without waiting.
        pin: an shm read (D copies straight out of P's memory), granted a read lease
        (READ_LEASE_NS) during which no expiry frees the send; a send that expired or was
        never held is refused (num_reads_refused), so D fails the load instead of copying
        freed blocks. D drops a copy that ended after its read lease."""
        out = LedgerOutput()
        read = ReadReply(reply_to, req_id, list(block_ids), pin=pin)
        if req_id in self.sends:
            out.replies.append(self._answer(read, now))
        elif req_id in self.expired:  # gone: refused now, D's failure is not delayed
            self.counters["num_reads_refused"] += 1
            out.replies.append(read.refused(UNKNOWN_REQUEST))
        else:  # not yet registered
            hold = self._hold_early(req_id, now, self.early_hold_ns, out)
            if hold is None:  # too many early arrivals held: refused at once
                self.counters["num_reads_refused"] += 1
                out.replies.append(read.refused(UNKNOWN_REQUEST))
            else:
                hold.reads.append(read)
        return out

    def read_done(self, req_id: str, now: int, read: bool = True) -> LedgerOutput:
        """D has the blocks: free the send, or hold the news for a lease until the send comes.

        read=False: D will never read them (ReadAbandoned: its request ended or was refused
        first, or its pull failed), counted in num_released_unread, never as a read after
        expiry. A "read done" for a send that expired with no read served or pin granted counts
        num_reads_after_expiry (D read memory P had freed without asking). One for a send that
        already finished (one of the last MAX_RECENTLY_FINISHED) is a duplicate, counted
        (num_read_done_duplicates) and dropped, so it never finishes a later registration of
        the id unread. With drop_read_done every one is dropped
        (num_read_done_dropped): only the lease frees."""
        out = LedgerOutput()
        if not read:
            self.counters["num_released_unread"] += 1
        if self.drop_read_done:
            self.counters["num_read_done_dropped"] += 1
        elif req_id in self.sends:
            self._finish(req_id, expired=False, out=out)
        elif req_id in self.expired:
            # P freed them already. After a served read or a pin (whose copy ended
            # before the lease it was granted) that is only late news; without one, D
            # read memory P may have reused: the verdict's violation.
            if read and not self.expired.pop(req_id):
                self.counters["num_reads_after_expiry"] += 1
            self.expired.pop(req_id, None)
        elif req_id in self.recently_finished:  # a second "read done" (or release) of it
            self.counters["num_read_done_duplicates"] = (
                self.counters.get("num_read_done_duplicates", 0) + 1
            )
        else:  # held as long as a send could wait: P registers it in its next step
            hold = self._hold_early(req_id, now, self.lease_ns, out)
            if hold is not None:
                hold.read_done = True
        return out

    # ---- the worker's own timer -----------------------------------------------------

    def next_hold_deadline(self) -> int | None:
        """When `expire_holds` next has something to do (ns); None: no early hold."""
        return self._peek(self._holds, self.early)

    def expire_holds(self, now: int) -> LedgerOutput:
        """Early holds whose time is up and that no registration claimed: forgotten, their
        reads refused. The worker's own business: its driver calls this once
        next_hold_deadline() has come, whether its engine steps or not."""
        out = LedgerOutput()
        while self._holds and self._holds[0][0] <= now:
            deadline, seq, req_id = heapq.heappop(self._holds)
            if self._is_live(self.early.get(req_id), deadline, seq):
                self._forget_early(req_id, out)
        return out

    def oldest_registration(self) -> int | None:
        """When the longest-held send was registered (ns); None: none is held."""
        return min((s.registered_at for s in self.sends.values()), default=None)

    # ---- internals ------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @staticmethod
    def _is_live(holder: _Send | _EarlyHold | None, deadline: int, seq: int) -> bool:
        """The heap entry is the current deadline of the current holder of its id."""
        return holder is not None and holder.seq == seq and holder.deadline == deadline

    def _peek(self, heap: list[tuple[int, int, str]], holders: dict) -> int | None:
        while heap and not self._is_live(holders.get(heap[0][2]), heap[0][0], heap[0][1]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _answer(self, read: ReadReply, now: int) -> ReadReply:
        """Serve a read of a held send (a pin: leased for READ_LEASE_NS), or refuse it."""
        send, block_ids = self.sends[read.req_id], read.block_ids
        # The usual read is the send's tail (D's prefix hits are its head): a subset.
        is_tail = block_ids == send.block_ids[len(send.block_ids) - len(block_ids) :]
        if not is_tail and not set(send.block_ids).issuperset(block_ids):
            self.counters["num_reads_refused"] += 1
            return read.refused(BLOCKS_NOT_HELD)
        send.was_read = True
        if not read.pin:
            return read
        send.read_until = max(send.read_until, now + READ_LEASE_NS)
        return read.granted_until(send.read_until)

    def _finish(self, req_id: str, expired: bool, out: LedgerOutput) -> None:
        send = self.sends.pop(req_id)
        self.counters["num_expired" if expired else "num_sent"] += 1
        if expired:
            self.expired[req_id] = send.was_read
        self.recently_finished[req_id] = None
        if len(self.recently_finished) > MAX_RECENTLY_FINISHED:
            del self.recently_finished[next(iter(self.recently_finished))]
        out.finished_sending.append(req_id)

    def _hold_early(
        self, req_id: str, now: int, hold_ns: int, out: LedgerOutput
    ) -> _EarlyHold | None:
        """The hold of an id not registered yet; its first arrival sets how long it lasts.

        None, counted in num_early_dropped, when max_early_holds ids are held already:
        legitimate early arrivals are a step's worth, so only a flood of unknown ids
        (a stranger's, or a stuck peer's) gets here, and it must not grow the worker."""
        hold = self.early.get(req_id)
        if hold is None and len(self.early) >= self.max_early_holds:
            self.counters["num_early_dropped"] = (
                self.counters.get("num_early_dropped", 0) + 1
            )  # appears on the first drop
            return None
        if hold is None:
            hold = self.early[req_id] = _EarlyHold(self._next_seq(), now + hold_ns)
            heapq.heappush(self._holds, (hold.deadline, hold.seq, req_id))
            out.hold_deadlines.append(hold.deadline)
        return hold

    def _forget_early(self, req_id: str, out: LedgerOutput) -> None:
        """The send never got registered (aborted on P, or a stranger's id)."""
        for read in self.early.pop(req_id).reads:
            self.counters["num_reads_refused"] += 1
            out.replies.append(read.refused(UNKNOWN_REQUEST))


@dataclass(slots=True)
class ReapSchedule:
    """The engine side's view of its worker's leases: when a step must ask for a reap.

    Sans-IO; the agent (connector/agent.py) and the simulator's worker keep one each.
    It knows the deadlines P's scheduler side stamped, the worker's answer after each
    reap (its next lease, heartbeats applied), and whether heartbeats wait (LeaseDue):
    then the next step reaps at once, as vLLM's get_finished applies them every step.
    """

    lease_due: int | None = None  # the earliest lease this side knows of (ns)
    heartbeats_queued: bool = False
    # An in-order reaper (HoldRules.reaper_scans_all False): a send that ends may uncover
    # expired ones behind it, so the next step reaps, as vLLM's get_finished always does.
    reap_on_finish: bool = False
    sends_finished: bool = False

    def on_register(self, deadline: int) -> None:
        self.lease_due = deadline if self.lease_due is None else min(self.lease_due, deadline)

    def on_finished(self) -> None:
        """Sends were reported finished (read, or released unread)."""
        self.sends_finished = self.reap_on_finish

    def on_reaped(self, next_deadline: int | None) -> None:
        self.lease_due, self.heartbeats_queued, self.sends_finished = next_deadline, False, False

    def due(self, holds_sends: bool) -> int | None:
        """When a step must reap (ns; 0: at once); None: no need while nothing changes."""
        if self.heartbeats_queued or (self.sends_finished and holds_sends):
            return 0
        return self.lease_due if holds_sends else None
