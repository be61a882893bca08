"""Replay timeline: per-engine samples and per-request records over time. Runs in: frontend process.

Both replay drivers produce one: the virtual clock (replay/sim/simulation.py) from in-process
engines, the wall clock (replay/wall/driver.py) from the real processes. Times are seconds
from the replay's origin. `to_dict`/`from_dict` give plain JSON-ready data and back.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, fields

# Timeline.meta["sampling"]: how the samples were taken. Absent: engine stats, which an
# engine publishes on every change (a parked engine publishes nothing), so a value holds
# until the next sample. SAMPLING_SCRAPED: readings of a server's /metrics at their
# instants (replay/metrics/scrape.py), which say nothing of the time between them.
SAMPLING_SCRAPED = "scraped"
# Timeline.meta["engine_faults"]: the pauses and kills the trace asked for, as the driver
# carried them out: [{"t", "engine", "action", "for_s"}] (for_s None for a kill).
ENGINE_FAULTS = "engine_faults"
# Timeline.meta["skipped_aborts"]: the aborts whose phase had passed ([SkippedAbort]).
SKIPPED_ABORTS = "skipped_aborts"


@dataclass(slots=True, kw_only=True)
class EngineSample:
    """One engine's KV pool and queues at `t` (block counts exclude the null block)."""

    t: float
    engine: str
    num_used_blocks: int  # held by requests (ref > 0)
    num_cached_blocks: int  # free (ref 0) but still holding a prefix hash
    num_free_blocks: int  # ref 0, cached ones included
    num_usable_blocks: int  # the pool's blocks but the null block: used + free
    num_waiting: int
    num_skipped_waiting: int
    num_waiting_for_remote_kvs: int
    num_running: int
    num_finished_awaiting_free: int  # finished, blocks held for the connector
    loop_state: str  # engine/core/liveness.py LOOP_STATE_NAMES, or "unknown" (a scraped server)
    num_steps: int  # engine steps so far
    num_wakeups: int  # transitions out of blocked, plus poll sleeps, so far
    # A scrape's reading (SAMPLING_SCRAPED): when the scrape was sent, `t` being when its
    # answer arrived; the server took the reading somewhere in [send_t, t]. None: taken at t.
    send_t: float | None = None


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """One client request from arrival to its final output (the client's view)."""

    req_id: str
    arrival_t: float  # when the trace says it arrives
    send_t: float  # when the driver sent it
    send_lateness_s: float  # send_t - arrival_t (0 under the virtual clock)
    first_token_t: float | None
    end_t: float | None  # None: never finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_prefix_hit_tokens: (
        int | None
    )  # prefix-cache hits where the prompt was computed; None: not said
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "ignored"
    error: str | None = None
    # sha256 of the comma-joined output token ids, 16 hex digits: compares runs cheaply.
    output_digest: str = ""
    # Seconds between consecutive outputs after the first (vllm bench's itl: one per chunk).
    itls: list[float] = field(default_factory=list)
    last_token_t: float | None = None  # when the latest tokens arrived
    # What a single engine would output for this prompt (replay/verify/outputs.py),
    # as output_digest; "": not checked.
    expected_digest: str = ""
    # [engine, since] of each engine the router gave it, in order (P, then D); empty: not
    # known (a serve's or an HTTP server's routing). replay/verify/windows.py
    # derives how long it was in flight on each.
    stages: list[list] = field(default_factory=list)
    # A fault the trace gave it (replay/trace/records.py): "drop_decode", "reject_decode",
    # or an abort by the phase it landed in ("abort_prefill", "abort_transfer",
    # "abort_decode"); None: none.
    fault: str | None = None
    # P/D: when P answered (its blocks held for D from then), and when D read them (None:
    # never, as far as the client or the engines said); the contract verdicts judge P's
    # blocks by them (replay/verify/).
    prefill_done_t: float | None = None
    read_t: float | None = None
    # D's leg succeeded after P had freed what D read (a lease that ran out first).
    freed_before_read: bool = False

    def enter(self, engine: str, t: float) -> None:
        """The router gave the request to `engine` at t (ignored once it ended for the client)."""
        if self.end_t is None:
            self.stages.append([engine, t])

    @classmethod
    def sent(
        cls, req_id: str, arrival_t: float, send_t: float, num_prompt_tokens: int
    ) -> RequestRecord:
        """The record of a request just sent: nothing received yet."""
        return cls(
            req_id=req_id,
            arrival_t=arrival_t,
            send_t=send_t,
            send_lateness_s=send_t - arrival_t,
            first_token_t=None,
            end_t=None,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=0,
            num_prefix_hit_tokens=0,
            finish_reason=None,
        )

    def on_tokens(self, t: float) -> None:
        """Tokens arrived at t: the first-token time, else one more inter-token latency."""
        if self.first_token_t is None:
            self.first_token_t = t
        else:
            self.itls.append(t - self.last_token_t)
        self.last_token_t = t


def output_digest(token_ids: list[int]) -> str:
    """16 hex digits of sha256 over the comma-joined token ids: compares runs cheaply."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class AbortRecord:
    """The client aborted `req_id` at `t`."""

    t: float
    req_id: str


@dataclass(frozen=True, slots=True)
class SkippedAbort:
    """An abort the trace asked for in a phase its request had already passed: never sent."""

    t: float  # the abort's time in the trace (replay seconds)
    req_id: str
    when: str  # the phase it waited for: "prefill" | "transfer" | "decode"
    phase: str | None  # where the request was; None: it had ended
    line: int = 0  # in the trace file (an abort --fault put in: its request's)

    def describe(self) -> str:
        """One line for the summary."""
        where = "it had ended" if self.phase is None else f"it was in {self.phase}"
        line = f", line {self.line}" if self.line else ""
        return f"abort of {self.req_id!r} in {self.when} (t={self.t:.3f} s{line}) skipped: {where}"


MAX_SKIPPED_ABORTS_SHOWN = 5


def skipped_abort_lines(timeline: Timeline) -> list[str]:
    """The summary's lines for the aborts skipped, the first few, then how many more."""
    skipped = [SkippedAbort(**s) for s in timeline.meta.get(SKIPPED_ABORTS, ())]
    lines = [s.describe() for s in skipped[:MAX_SKIPPED_ABORTS_SHOWN]]
    if len(skipped) > MAX_SKIPPED_ABORTS_SHOWN:
        lines.append(f"... and {len(skipped) - MAX_SKIPPED_ABORTS_SHOWN:,} more skipped aborts")
    return lines


@dataclass(slots=True, kw_only=True)
class Timeline:
    """Everything a replay observed; the input of verify() and the reports."""

    engines: list[str]
    num_usable_blocks: dict[str, int]  # per engine, the null block excluded
    samples: list[EngineSample]  # in time order
    requests: list[RequestRecord]  # in arrival order
    arrivals: list[float]  # request arrival times, non-decreasing
    aborts: list[AbortRecord]
    end_t: float  # the replay stopped observing here
    # Per-engine totals at end_t (num_steps, num_wakeups, num_expired, ...).
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    # How the timeline was made (driver, liveness, topology, options), JSON-ready; a
    # "num_blocks" there is EngineConfig's, the null block included.
    meta: dict[str, object] = field(default_factory=dict)

    def samples_for(self, engine: str) -> list[EngineSample]:
        """This engine's samples, in time order."""
        if engine not in self.engines:
            raise ValueError(f"engine: unknown engine {engine!r}, have {self.engines}")
        return [s for s in self.samples if s.engine == engine]

    def is_scraped(self) -> bool:
        """Samples are scrapes (see SAMPLING_SCRAPED): nothing is known between them."""
        return self.meta.get("sampling") == SAMPLING_SCRAPED

    def request(self, req_id: str) -> RequestRecord:
        for record in self.requests:
            if record.req_id == req_id:
                return record
        raise KeyError(req_id)

    def to_dict(self) -> dict:
        """Plain dicts and lists, ready for json.dumps."""
        return {
            "engines": list(self.engines),
            "num_usable_blocks": dict(self.num_usable_blocks),
            "samples": [asdict(s) for s in self.samples],
            "requests": [asdict(r) for r in self.requests],
            "arrivals": list(self.arrivals),
            "aborts": [asdict(a) for a in self.aborts],
            "end_t": self.end_t,
            "counters": {k: dict(v) for k, v in self.counters.items()},
            "meta": dict(self.meta),
        }

    @staticmethod
    def from_dict(data: dict) -> Timeline:
        """The inverse of to_dict; a missing or unknown field raises ValueError."""
        try:
            return Timeline(
                engines=list(data["engines"]),
                num_usable_blocks={str(k): int(v) for k, v in data["num_usable_blocks"].items()},
                samples=[_build(EngineSample, s) for s in data["samples"]],
                requests=[_build(RequestRecord, r) for r in data["requests"]],
                arrivals=[float(t) for t in data["arrivals"]],
                aborts=[_build(AbortRecord, a) for a in data["aborts"]],
                end_t=float(data["end_t"]),
                counters={k: dict(v) for k, v in data.get("counters", {}).items()},
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"timeline: malformed data: {e!r}") from None


def _build(cls: type, data: dict) -> object:
    names = {f.name for f in fields(cls)}
    unknown = sorted(data.keys() - names)
    if unknown:
        raise ValueError(f"timeline: {cls.__name__}: unknown field {unknown[0]!r}")
    return cls(**data)


def engine_role(engine: str) -> str:
    """An engine's role from its name: "P" of P, P3, prefill and a scraped source's NAME:P0
    (the source's name dropped), "D" of D0 and decode; any other name is its own role."""
    name = engine.rpartition(":")[2]
    stem = name.rstrip("0123456789") or name
    return {"prefill": "P", "decode": "D"}.get(stem.lower(), stem)
