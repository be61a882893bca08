"""Faults a wall replay sees, named: an engine or connector worker that died, stopped answering, or stalled a transfer. Runs in: frontend process.

Sans-IO: the driver (replay/live/driver.py) hands over what it observed, with its own
clock, and asks when to probe. Sources:
- an engine's EngineError (its connector worker died or stopped answering a reap;
  engine/proc/core_proc.py sends it once) or the engine's own death (EngineDeadError);
- an engine silent for `stall_s` that left a stats request unanswered (stopped or
  stuck): the driver asks every engine that has been silent for `probe_interval_s`, so an idle engine
  costs a wake-up a second (a legacy engine parked on its input wakes, answers and does
  not step: a probe never frees its blocks);
- connector counters in the stats that only a stall moves: reads of P's blocks that
  timed out (num_pull_timeouts, D's worker), a KV load or a lease reap that waited over a
  second (max_recv_wait_ms on D, max_reap_wait_ms on P: connector/agent.py).
With a judge (replay/live/starvation.py: the engines' pids known), a silent engine that is
alive and runnable but starved of CPU is no fault: it is kept in `starved` (the run is
inconclusive) until it answers or the judge finds it stopped, dead or stuck.
Each (engine, kind) is one fault, from its first sighting; its cause keeps the latest
numbers. replay/verify/rules.py turns them into the `fault` status (exit 4) and tells a
leak that follows a fault from a liveness leak.
"""
from __future__ import annotations

from dataclasses import dataclass

from replay.live.starvation import StarvationJudge

STALL_S = 3.0  # an engine that answers no stats request this long is stopped or stuck
PROBE_INTERVAL_S = 1.0


@dataclass(slots=True)
class Fault:
    t: float  # first seen (replay seconds)
    engine: str  # "" when no one engine is to blame
    kind: str  # "died" | "error" | "stalled" | "transfer_timeout" | "slow_load" | "slow_reap"
    cause: str
    end_t: float | None = None  # a stall that ended (the engine answered again)


@dataclass(slots=True, kw_only=True)
class Starved:
    t: float  # last heard before the silence (replay seconds)
    engine: str
    cause: str  # the figures (starvation.py classify)
    end_t: float | None = None  # when it answered again


# Counter -> (kind, how to say it); each counter only moves when something stalls.
_COUNTER_CAUSES = {
    "num_pull_timeouts": ("transfer_timeout", lambda v: (
        f"{v} read{'s' if v != 1 else ''} of the prefill engine's KV timed out: its connector "
        f"worker did not answer (stopped, stuck or dead)")),
    "max_recv_wait_ms": ("slow_load", lambda v: (
        f"a KV load waited {v / 1000:.1f} s past its pull delay: a connector worker was stopped "
        f"or stuck")),
    "max_reap_wait_ms": ("slow_reap", lambda v: (
        f"its connector worker took {v / 1000:.1f} s to answer a lease reap (stopped or stuck)")),
}


class FaultWatch:
    def __init__(self, engines: list[str], stall_s: float = STALL_S,
                 probe_interval_s: float = PROBE_INTERVAL_S, judge: StarvationJudge | None = None) -> None:
        self.stall_s, self.probe_interval_s, self.judge = stall_s, probe_interval_s, judge
        self.starved: list[Starved] = []  # silences of engines alive but starved, first first
        self.heard: dict[str, float] = dict.fromkeys(engines, 0.0)  # last snapshot (replay s)
        self.asked: dict[str, float | None] = dict.fromkeys(engines)  # first unanswered probe
        self.last_probe = float("-inf")
        self.by_key: dict[tuple[str, str], Fault] = {}

    @property
    def faults(self) -> list[Fault]:
        return sorted(self.by_key.values(), key=lambda f: f.t)

    def on_error(self, t: float, engine: str, message: str, kind: str = "error") -> None:
        """An engine reported a fatal error, or died (kind "died")."""
        lines = message.strip().splitlines()
        self._note(t, engine, kind, lines[-1] if lines else kind)  # a traceback's last line

    def on_snapshot(self, t: float, engine: str, counts: dict[str, int]) -> None:
        self.heard[engine] = t
        self.asked[engine] = None
        stall = self.by_key.get((engine, "stalled"))
        if stall is not None and stall.end_t is None:
            stall.end_t = t
        for s in self.starved:
            if s.engine == engine and s.end_t is None:
                s.end_t = t
        if self.judge is not None:
            self.judge.on_answer(engine)
        for name, (kind, say) in _COUNTER_CAUSES.items():
            value = counts.get(name, 0)
            if value > 0:
                self._note(t, engine, kind, say(value))

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
            if asked is not None and t - asked >= self.probe_interval_s and silent_s >= self.stall_s:
                cause = f"engine {engine} answered no stats request for {silent_s:.1f} s (stopped or stuck)"
                judged = self.judge.judge(engine, silent_s) if self.judge is not None else None
                if judged is not None and judged.kind == "starved" and (engine, "stalled") not in self.by_key:
                    self._note_starved(engine, judged.cause)
                    continue
                cause = cause if judged is None else judged.cause
                key = (engine, "stalled")
                fault = self.by_key.setdefault(key, Fault(self.heard[engine], engine, "stalled", cause))
                fault.cause, fault.end_t = cause, None

    def _note_starved(self, engine: str, cause: str) -> None:
        open_ = next((s for s in self.starved if s.engine == engine and s.end_t is None), None)
        if open_ is None:
            self.starved.append(Starved(t=self.heard[engine], engine=engine, cause=cause))
        else:
            open_.cause = cause

    def _note(self, t: float, engine: str, kind: str, cause: str) -> None:
        fault = self.by_key.get((engine, kind))
        if fault is None:
            self.by_key[(engine, kind)] = Fault(t, engine, kind, cause)
        else:
            fault.cause = cause
