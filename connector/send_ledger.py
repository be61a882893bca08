"""The prefill side's send ledger: held sends, their deadlines, "read done" and early arrivals, with time passed in. Runs in: connector-worker process (and the simulator, on virtual time).

Sans-IO: no sockets, no clock. Each call takes `now`, integer nanoseconds of a monotonic
clock (time.monotonic_ns() in connector/worker_proc.py, virtual time in
replay/sim/kv_worker.py), and returns a LedgerOutput saying what to do: sends that
finished (to report as finished_sending), read replies to send, deadlines it set. The
driver calls `expire(now)` once `next_deadline()` has come.

The rules (vLLM's NIXL connector, prefill side):
- `register`: P's engine says these blocks wait for a remote read. They are held until
  D says "read done" or the send's deadline (registration + expiry) passes
  (VLLM_NIXL_ABORT_REQUEST_TIMEOUT). A deadline belongs to one registration: a re-used
  id never inherits an old one. `extend` moves a held send's deadline (a lease's hook).
- D can get there first: P's final output reaches the frontend at the end of the step
  in which the request finished, but P registers the send only in its next step. Early
  reads are held for `early_hold_ns`, an early "read done" for the expiry, both counted
  from the first early arrival of that id; a hold that is never claimed is forgotten
  and its reads are refused.
- A "read done" for a send that expired unread is counted (num_reads_after_expiry): P
  freed the blocks already. With `drop_read_done`, every "read done" is dropped and
  counted (num_read_done_dropped): only expiry frees.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

# How long an early read waits for its send to be registered: less than the decode
# side's 2 s read timeout (connector/transfer.py), so it gets an answer either way.
EARLY_HOLD_NS = 1_000_000_000

UNKNOWN_REQUEST = "unknown or expired request"
BLOCKS_NOT_HELD = "blocks not held for this request"


@dataclass(frozen=True, slots=True)
class ReadReply:
    """The answer to one read: serve `block_ids` (error "") or refuse with `error`."""

    reply_to: object  # the driver's handle on the reader (a ROUTER identity)
    req_id: str
    block_ids: list[int]
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(slots=True)
class LedgerOutput:
    """What one call decided; the driver does the I/O."""

    finished_sending: list[str] = field(default_factory=list)
    replies: list[ReadReply] = field(default_factory=list)
    deadlines: list[int] = field(default_factory=list)  # set by this call (ns)


@dataclass(slots=True)
class _Send:
    block_ids: list[int]
    seq: int  # this registration: the deadline's key
    registered_at: int
    deadline: int


@dataclass(slots=True)
class _EarlyHold:
    seq: int
    deadline: int
    reads: list[ReadReply] = field(default_factory=list)  # error "": not answered yet
    read_done: bool = False


class SendLedger:
    """The prefill side's protocol state; see the module docstring for the rules."""

    def __init__(self, expiry_ns: int, drop_read_done: bool = False,
                 early_hold_ns: int = EARLY_HOLD_NS) -> None:
        self.expiry_ns, self.early_hold_ns = expiry_ns, early_hold_ns
        self.drop_read_done = drop_read_done
        self.sends: dict[str, _Send] = {}  # registered, not yet read or expired
        self.early: dict[str, _EarlyHold] = {}  # arrived before their registration
        self.expired: set[str] = set()  # expired unread: a late "read done" is stale
        self._deadlines: list[tuple[int, int, str]] = []  # heap of (deadline, seq, req_id)
        self._seq = 0
        self.counters = dict.fromkeys(("num_sent", "num_expired", "num_read_done_dropped",
                                       "num_reads_after_expiry"), 0)

    # ---- what P's engine says -------------------------------------------------------

    def register(self, req_id: str, block_ids: list[int], now: int) -> LedgerOutput:
        """These blocks wait for a remote read: hold them, or settle what came early."""
        out = LedgerOutput()
        send = self.sends[req_id] = _Send(list(block_ids), self._next_seq(), now, 0)
        self.expired.discard(req_id)
        early = self.early.pop(req_id, None)
        for read in early.reads if early is not None else []:
            out.replies.append(self._answer(read.reply_to, req_id, read.block_ids))
        if early is not None and early.read_done:
            self._finish(req_id, expired=False, out=out)
        else:
            self._set_deadline(req_id, send, now + self.expiry_ns, out)
        return out

    def extend(self, req_id: str, deadline: int) -> LedgerOutput:
        """Move a held send's deadline (a lease renewal); nothing if it is not held."""
        out = LedgerOutput()
        send = self.sends.get(req_id)
        if send is not None:
            self._set_deadline(req_id, send, deadline, out)
        return out

    # ---- what D's worker says -------------------------------------------------------

    def read(self, reply_to: object, req_id: str, block_ids: list[int], now: int) -> LedgerOutput:
        """A read of a send's blocks: answered now, or held until the send is registered."""
        out = LedgerOutput()
        if req_id in self.sends:
            out.replies.append(self._answer(reply_to, req_id, block_ids))
        else:
            hold = self._hold_early(req_id, now, self.early_hold_ns, out)
            hold.reads.append(ReadReply(reply_to, req_id, list(block_ids)))
        return out

    def read_done(self, req_id: str, now: int) -> LedgerOutput:
        """D has the blocks: free the send, or remember it until the send comes."""
        out = LedgerOutput()
        if self.drop_read_done:
            self.counters["num_read_done_dropped"] += 1
        elif req_id in self.sends:
            self._finish(req_id, expired=False, out=out)
        elif req_id in self.expired:
            self.expired.discard(req_id)
            self.counters["num_reads_after_expiry"] += 1  # P freed them already
        else:  # held as long as a send could wait: P registers it in its next step
            self._hold_early(req_id, now, self.expiry_ns, out).read_done = True
        return out

    # ---- time -----------------------------------------------------------------------

    def next_deadline(self) -> int | None:
        """When `expire` next has something to do (ns); None: nothing is timed."""
        while self._deadlines and not self._is_live(*self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: int) -> LedgerOutput:
        """Everything whose deadline is <= now: sends expire, unclaimed early holds go."""
        out = LedgerOutput()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, seq, req_id = heapq.heappop(self._deadlines)
            if not self._is_live(deadline, seq, req_id):
                continue  # read meanwhile, re-registered, or the deadline moved
            if req_id in self.sends:
                self._finish(req_id, expired=True, out=out)
            else:
                self._forget_early(req_id, out)
        return out

    def oldest_registration(self) -> int | None:
        """When the longest-held send was registered (ns); None: none is held."""
        return min((s.registered_at for s in self.sends.values()), default=None)

    # ---- internals ------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _set_deadline(self, req_id: str, holder: _Send | _EarlyHold, deadline: int,
                      out: LedgerOutput) -> None:
        holder.deadline = deadline
        heapq.heappush(self._deadlines, (deadline, holder.seq, req_id))
        out.deadlines.append(deadline)

    def _is_live(self, deadline: int, seq: int, req_id: str) -> bool:
        """The heap entry is the current deadline of the current holder of req_id."""
        holder = self.sends.get(req_id) or self.early.get(req_id)
        return holder is not None and holder.seq == seq and holder.deadline == deadline

    def _answer(self, reply_to: object, req_id: str, block_ids: list[int]) -> ReadReply:
        if not set(block_ids) <= set(self.sends[req_id].block_ids):
            return ReadReply(reply_to, req_id, list(block_ids), BLOCKS_NOT_HELD)
        return ReadReply(reply_to, req_id, list(block_ids))

    def _finish(self, req_id: str, expired: bool, out: LedgerOutput) -> None:
        del self.sends[req_id]
        self.counters["num_expired" if expired else "num_sent"] += 1
        if expired:
            self.expired.add(req_id)
        out.finished_sending.append(req_id)

    def _hold_early(self, req_id: str, now: int, hold_ns: int, out: LedgerOutput) -> _EarlyHold:
        """The hold of an id not registered yet; its first arrival sets how long it lasts."""
        hold = self.early.get(req_id)
        if hold is None:
            hold = self.early[req_id] = _EarlyHold(self._next_seq(), 0)
            self._set_deadline(req_id, hold, now + hold_ns, out)
        return hold

    def _forget_early(self, req_id: str, out: LedgerOutput) -> None:
        """The send never got registered (aborted on P, or a stranger's id)."""
        for read in self.early.pop(req_id).reads:
            out.replies.append(ReadReply(read.reply_to, req_id, read.block_ids, UNKNOWN_REQUEST))
