"""Restarts told from drains: counters that go back, a new process. Runs in: frontend process.

A server's counters only grow while its process lives, and its
`process_start_time_seconds` (prometheus_client's process collector, which vLLM's
registry has) names that process. Between two readings of one metrics URL, a counter series
(the same name and labels) that went back, or a start time that changed, is a restart:
the engines behind the URL died and came back, or another process answers there, and
what they hold afterwards says nothing of a drain. The restart happened after the earlier
reading's scrape was sent and before the later one's answer: that span is all that is known.
A series read once only, or missing from a reading, is no evidence either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from replay.verify.outcome import printable

# Counters every vLLM or kvdrain engine keeps; each series is compared with its last value.
RESTART_COUNTERS = (
    "kvdrain:engine_steps_total",
    "kvdrain:engine_wakeups_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
PROCESS_START = "process_start_time_seconds"
MAX_RESTARTS = 100  # kept with their spans; past it, only counted
RESTARTED = "restarted"  # the fault's kind (replay/verify/rules.py reads it)


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """One engine's restart seen between two readings of its URL."""

    since: float  # the earlier reading's scrape was sent then: the restart came later
    t: float  # the later reading's answer: the restart came before
    engine: str  # its timeline name
    evidence: str  # what went back or changed, as the server said it


@dataclass(slots=True)
class RestartWatch:
    """One URL's counters and process start time from reading to reading (sans-IO)."""

    counters: dict[tuple, float] = field(default_factory=dict)
    start_time: float | None = None
    last_send_t: float | None = None
    restarts: list[Restart] = field(default_factory=list)  # the first MAX_RESTARTS
    latest: dict[str, Restart] = field(default_factory=dict)  # each engine's, kept or not
    counts: dict[str, int] = field(default_factory=dict)  # each engine's restarts

    @property
    def num_restarts(self) -> int:
        return sum(self.counts.values())

    def observe(
        self, samples: dict[str, list], send_t: float, t: float, engines: dict[str, str]
    ) -> list[Restart]:
        """Each engine's restart this reading shows since the last (engines: engine label
        -> timeline name, of this reading)."""
        evidence = self._counters_went_back(samples, engines)  # every series kept, too
        process = self._process_changed(samples)
        if process is not None:  # a new process: every engine behind the URL
            evidence = dict.fromkeys(engines, process)
        since, self.last_send_t = self.last_send_t, send_t
        if since is None:
            return []
        out = [
            Restart(since=since, t=t, engine=engines[label], evidence=printable(why))
            for label, why in evidence.items()
        ]
        self.record(out)
        return out

    def record(self, restarts: list[Restart]) -> None:
        """Restarts seen (by observe, or another process answering for the same engine)."""
        for restart in restarts:
            self.latest[restart.engine] = restart
            self.counts[restart.engine] = self.counts.get(restart.engine, 0) + 1
        self.restarts += restarts[: max(MAX_RESTARTS - len(self.restarts), 0)]

    def rebase(self, shift: float) -> None:
        """Every time `shift` seconds later (the replay's t = 0 moved)."""
        if self.last_send_t is not None:
            self.last_send_t += shift
        self.restarts = [_shifted(r, shift) for r in self.restarts]
        self.latest = {e: _shifted(r, shift) for e, r in self.latest.items()}

    def _process_changed(self, samples: dict[str, list]) -> str | None:
        value = next((s.value for s in samples.get(PROCESS_START, ()) if _finite(s.value)), None)
        if value is None:
            return None
        before, self.start_time = self.start_time, value
        if before is None or before == value:
            return None
        return f"{PROCESS_START} {before:.15g} -> {value:.15g}"

    def _counters_went_back(
        self, samples: dict[str, list], engines: dict[str, str]
    ) -> dict[str, str]:
        """Engine label -> the first of its series that went back (a series of no engine of
        this reading is every engine's)."""
        out: dict[str, str] = {}
        for name in RESTART_COUNTERS:
            for sample in samples.get(name, ()):
                if not _finite(sample.value):
                    continue
                key = (name, tuple(sorted(sample.labels.items())))
                before, self.counters[key] = self.counters.get(key), sample.value
                if before is None or sample.value >= before:
                    continue
                why = (
                    f"{_series(name, sample.labels)} went back from {before:g} to {sample.value:g}"
                )
                engine = sample.labels.get("engine", "")
                for label in [engine] if engine in engines else engines:
                    out.setdefault(label, why)
        return out


def _shifted(restart: Restart, shift: float) -> Restart:
    return replace(restart, since=restart.since + shift, t=restart.t + shift)


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _series(name: str, labels: dict[str, str]) -> str:
    inside = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inside}}}" if inside else name


def restart_faults(url: str, watch: RestartWatch) -> list[dict]:
    """One fault per engine that restarted (replay/wall/faults.py Fault as a dict, kind
    RESTARTED): at its first restart's answer, its cause naming when and why; `spans`
    holds the (since, t) of every kept restart and of the latest, for the rules to tell
    which windows held one."""
    out = []
    for engine, latest in watch.latest.items():
        mine = [r for r in watch.restarts if r.engine == engine]
        first = mine[0] if mine else latest
        if latest not in mine:
            mine.append(latest)
        n = watch.counts[engine]
        cause = (
            f"restarted between {first.since:.3f} s and {first.t:.3f} s ({first.evidence} at "
            f"{printable(url)}): the engine died and came back, so its blocks were freed "
            f"by the restart, not drained"
        )
        if n > 1:
            cause += f"; {n} restarts, the latest between {latest.since:.3f} s and {latest.t:.3f} s"
        out.append(
            {
                "t": first.t,
                "engine": engine,
                "kind": RESTARTED,
                "cause": cause,
                "end_t": None,
                "spans": [[r.since, r.t] for r in mine],
            }
        )
    return out


def restart_sentence(url: str, restart: Restart) -> str:
    """One line for a live view: who restarted, when, and why it is known."""
    return (
        f"{restart.engine} at {printable(url)} restarted between {restart.since:.3f} s and "
        f"{restart.t:.3f} s ({restart.evidence}): blocks freed by a restart are not a drain"
    )
