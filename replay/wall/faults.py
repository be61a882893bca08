"""Faults a wall replay sees, named: an engine or connector worker that died, stopped answering, or stalled a transfer. Runs in: frontend process.

Sans-IO: the driver (replay/wall/driver.py) hands over what it observed, with its own
clock, and asks when to probe. Sources:
- an engine's EngineError (its connector worker died or stopped answering a reap;
  engine/proc/core_proc.py sends it once) or the engine's own death (EngineDeadError);
- an engine silent for `stall_s` that left a stats request unanswered (stopped or
  stuck): the driver asks every engine that has been silent for `probe_interval_s`, so an idle engine
  costs a wake-up a second (a legacy engine parked on its input wakes, answers and does
  not step: a probe never frees its blocks);
- connector counters in the stats that only a stall moves: reads of P's blocks that
  timed out (num_pull_timeouts, D's worker), a KV load or a lease reap that waited over a
  second (num_slow_recvs on D, num_slow_reaps on P: connector/agent.py).
These counts live as long as the engines, and a serve's outlive many replays, so each
replay judges them from its own start: an engine's first snapshot is its baseline and
only what grew since is a fault (since_start does the same for the Timeline's counters).
Another client's work (an engine snapshot taken while this replay had no request in
flight that shows requests waiting or running: a serve shared with another replay) is no
fault either: it is kept in `shared`, and the run is inconclusive from then on.
With a judge (replay/runtime/starvation.py: the engines' pids known), a silent engine that is
alive and runnable but starved of CPU is no fault: it is kept in `starved` (the run is
inconclusive) until it answers or the judge finds it stopped, dead or stuck.
Each (engine, kind) is one fault, from its first sighting; its cause keeps the latest
numbers. replay/verify/rules.py turns them into the `fault` status (exit 4) and tells a
leak that follows a fault from a liveness leak.
A pause or a kill the trace asked for (`expect`) is no fault: what it shows is kept in
`expected` instead. A pause shows as its engine's stall, and as the slow loads and reaps
it counts once it runs again, until STALL_S after its end (an engine silent past that is
stalled after all); a kill, as its engine's silence for good, and as the reads of its
blocks that time out or wait on other engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from replay.runtime.starvation import StarvationJudge
from replay.verify.units import seconds

STALL_S = 3.0  # an engine that answers no stats request this long is stopped or stuck
PROBE_INTERVAL_S = 1.0
# What an expected pause shows on its engine, and what an expected kill shows elsewhere.
_PAUSE_SHOWS = ("stalled", "slow_load", "slow_reap")
_KILL_SHOWS_ELSEWHERE = ("transfer_timeout", "slow_load")


@dataclass(slots=True)
class Fault:
    t: float  # first seen (replay seconds)
    engine: str  # "" when no one engine is to blame
    kind: str  # "died" | "error" | "stalled" | "transfer_timeout" | "slow_load" | "slow_reap"
    cause: str
    end_t: float | None = None  # a stall that ended (the engine answered again)


@dataclass(frozen=True, slots=True, kw_only=True)
class Expectation:
    """A pause or a kill the trace asked for, and until when what it shows is expected."""

    t: float
    engine: str
    action: str  # "pause" | "kill"
    until: float  # a pause: its end plus STALL_S; a kill: for good

    def covers(self, t: float, engine: str, kind: str) -> bool:
        if not self.t <= t <= self.until:
            return False
        if self.action == "pause":
            return engine == self.engine and kind in _PAUSE_SHOWS
        return engine == self.engine or kind in _KILL_SHOWS_ELSEWHERE


@dataclass(slots=True, kw_only=True)
class Shared:
    """Another client's requests on an engine while this replay had none there: no fault,
    but its blocks cannot be told from this replay's, so nothing after it is judged."""

    t: float  # first seen (replay seconds)
    engine: str
    cause: str


@dataclass(slots=True, kw_only=True)
class Starved:
    t: float  # last heard before the silence (replay seconds)
    engine: str
    cause: str  # the figures (starvation.py classify)
    end_t: float | None = None  # when it answered again


# Count -> (kind, how to say it from the growth n and the counts); each count only grows,
# and only when something stalls.
_COUNTER_CAUSES: dict[str, tuple[str, Callable[[int, dict[str, int]], str]]] = {
    "num_pull_timeouts": (
        "transfer_timeout",
        lambda n, c: (
            f"{n} read{'s' if n != 1 else ''} of the prefill engine's KV timed out: its connector "
            f"worker did not answer (stopped, stuck or dead)"
        ),
    ),
    "num_slow_recvs": (
        "slow_load",
        lambda n, c: (
            f"{_waits(n, 'a KV load', 'KV loads', c.get('last_recv_wait_ms', 0))} past "
            f"{'its' if n == 1 else 'their'} pull delay: a connector worker was stopped or stuck"
        ),
    ),
    "num_slow_reaps": (
        "slow_reap",
        lambda n, c: (
            f"{_waits(n, 'a lease reap', 'lease reaps', c.get('last_reap_wait_ms', 0))} for its "
            f"connector worker's answer (stopped or stuck)"
        ),
    ),
}
# The Timeline's counters that are counts (replay/sim/engine.py SimEngine.counters has
# the same names): per replay, like the fault counts.
TIMELINE_COUNTS = (
    "num_steps",
    "num_wakeups",
    "num_model_steps",
    "num_expired",
    "num_reads_after_expiry",
    "num_read_done_dropped",
    "num_bad_params",
    "num_stale_kv_reports",
    "num_preemptions",
    "num_prefix_hit_tokens",
)


_ACTIVE = ("num_waiting", "num_skipped_waiting", "num_running")  # an engine's requests in flight


def _waits(n: int, one: str, many: str, latest_ms: int) -> str:
    """'a KV load waited 2.400 s' or '3 KV loads waited over a second (the latest 1.200 s)'."""
    if n == 1:
        return f"{one} waited {seconds(latest_ms / 1000)}"
    return f"{n} {many} waited over a second (the latest {seconds(latest_ms / 1000)})"


def since_start(
    first: dict[str, int], latest: dict[str, int], counts: tuple[str, ...] = TIMELINE_COUNTS
) -> dict[str, int]:
    """`latest` with each of `counts` as its growth since `first` (an engine's first
    snapshot of this replay); the rest (gauges) as they are."""
    return {
        name: value - first.get(name, 0) if name in counts else value
        for name, value in latest.items()
    }


class FaultWatch:
    def __init__(
        self,
        engines: list[str],
        stall_s: float = STALL_S,
        probe_interval_s: float = PROBE_INTERVAL_S,
        judge: StarvationJudge | None = None,
    ) -> None:
        self.stall_s, self.probe_interval_s, self.judge = stall_s, probe_interval_s, judge
        self.starved: list[Starved] = []  # silences of engines alive but starved, first first
        self.shared: dict[str, Shared] = {}  # engine -> the first sign of another client
        self.heard: dict[str, float] = dict.fromkeys(engines, 0.0)  # last snapshot (replay s)
        self.asked: dict[str, float | None] = dict.fromkeys(engines)  # first unanswered probe
        self.last_probe = float("-inf")
        self.by_key: dict[tuple[str, str], Fault] = {}
        self.first: dict[str, dict[str, int]] = {}  # each engine's first counts: the baseline
        self.expectations: list[Expectation] = []
        self.expected_by_key: dict[tuple[str, str], Fault] = {}  # what they showed
        self.gone: set[str] = set()  # killed as the trace asked: no longer heard or probed

    @property
    def faults(self) -> list[Fault]:
        return sorted(self.by_key.values(), key=lambda f: f.t)

    @property
    def expected(self) -> list[Fault]:
        """What the pauses and kills the trace asked for showed: no faults."""
        return sorted(self.expected_by_key.values(), key=lambda f: f.t)

    def expect(self, t: float, engine: str, action: str, for_s: float | None = None) -> None:
        """The trace pauses (for for_s) or kills `engine` at t."""
        until = math.inf if action == "kill" else t + for_s + self.stall_s
        self.expectations.append(Expectation(t=t, engine=engine, action=action, until=until))
        if action == "kill":
            self.gone.add(engine)
            self.heard.pop(engine, None)
            self.asked.pop(engine, None)

    def _is_expected(self, t: float, engine: str, kind: str) -> bool:
        return any(e.covers(t, engine, kind) for e in self.expectations)

    def on_error(self, t: float, engine: str, message: str, kind: str = "error") -> None:
        """An engine reported a fatal error, or died (kind "died")."""
        lines = message.strip().splitlines()
        self._note(t, engine, kind, lines[-1] if lines else kind)  # a traceback's last line

    def on_snapshot(self, t: float, engine: str, counts: dict[str, int]) -> None:
        if engine in self.gone:
            return
        self.heard[engine] = t
        self.asked[engine] = None
        for book in (self.by_key, self.expected_by_key):
            stall = book.get((engine, "stalled"))
            if stall is not None and stall.end_t is None:
                stall.end_t = t
        first = self.first.setdefault(engine, dict(counts))
        for s in self.starved:
            if s.engine == engine and s.end_t is None:
                s.end_t = t
        if self.judge is not None:
            self.judge.on_answer(engine)
        for name, (kind, say) in _COUNTER_CAUSES.items():
            grown = counts.get(name, 0) - first.get(name, 0)
            if grown > 0:
                self._note(t, engine, kind, say(grown, counts))

    def on_activity(
        self, t: float, engine: str, counts: dict[str, int], quiet_since: float | None
    ) -> None:
        """A snapshot taken at t; quiet_since: since when this replay has had no request in
        flight (None: it has some). Requests on the engine then are another client's."""
        if quiet_since is None or t <= quiet_since:
            return
        num_active = sum(counts.get(name, 0) for name in _ACTIVE)
        if num_active > 0 and engine not in self.shared:
            self.shared[engine] = Shared(
                t=t,
                engine=engine,
                cause=(
                    f"{num_active} request{'s' if num_active != 1 else ''} of another client "
                    f"waiting or running while this replay had none in flight: the serve is "
                    f"shared, and its blocks cannot be told from this replay's (replay against "
                    f"a serve of your own)"
                ),
            )

    def should_probe(self, t: float) -> bool:
        """Ask for stats now? (some engine has been silent a while; at most once per interval)"""
        if t - self.last_probe < self.probe_interval_s:
            return False
        silent = [e for e, heard in self.heard.items() if t - heard >= self.probe_interval_s]
        if not silent:
            return False
        self.last_probe = t
        for engine in silent:
            if self.asked[engine] is None:
                self.asked[engine] = t
                if self.judge is not None:
                    self.judge.on_probe(engine)
        return True

    def check(self, t: float) -> None:
        """Name every engine silent for stall_s that left a probe unanswered a while."""
        for engine, asked in self.asked.items():
            silent_s = t - self.heard[engine]
            if (
                asked is not None
                and t - asked >= self.probe_interval_s
                and silent_s >= self.stall_s
            ):
                cause = f"engine {engine} answered no stats request for {seconds(silent_s)} (stopped or stuck)"
                judged = self.judge.judge(engine, silent_s) if self.judge is not None else None
                if (
                    judged is not None
                    and judged.kind == "starved"
                    and (engine, "stalled") not in self.by_key
                    and not self._is_expected(t, engine, "stalled")  # paused: not starved
                ):
                    self._note_starved(engine, judged.cause)
                    continue
                cause = cause if judged is None else judged.cause
                fault = self._book(t, engine, "stalled").setdefault(
                    (engine, "stalled"), Fault(self.heard[engine], engine, "stalled", cause)
                )
                fault.cause, fault.end_t = cause, None

    def _note_starved(self, engine: str, cause: str) -> None:
        open_ = next((s for s in self.starved if s.engine == engine and s.end_t is None), None)
        if open_ is None:
            self.starved.append(Starved(t=self.heard[engine], engine=engine, cause=cause))
        else:
            open_.cause = cause

    def _book(self, t: float, engine: str, kind: str) -> dict[tuple[str, str], Fault]:
        """Where what is seen at t goes: `expected` while a pause or kill covers it, else
        the faults (a stall that outlasts its pause among them, moved there)."""
        key = (engine, kind)
        if self._is_expected(t, engine, kind):
            return self.expected_by_key
        ongoing = self.expected_by_key.get(key)
        if ongoing is not None and ongoing.end_t is None and key not in self.by_key:
            self.by_key[key] = self.expected_by_key.pop(key)
        return self.by_key

    def _note(self, t: float, engine: str, kind: str, cause: str) -> None:
        book = self._book(t, engine, kind)
        fault = book.get((engine, kind))
        if fault is None:
            book[(engine, kind)] = Fault(t, engine, kind, cause)
        else:
            fault.cause = cause
