"""A trace's pauses and kills, carried out on a local wall replay's engine processes. Runs in: frontend process.

A pause stops the engine core process (SIGSTOP) and continues it (SIGCONT) for_s later:
its steps stop, and with them the heartbeats D sends for P's leases, while its connector
worker runs on, as on the virtual clock (replay/sim/engine.py). A kill is the engine
client's own kill (SIGKILL of the engine core and its connector worker), after which the
router loses the engine (PDRouter.lose_engine). Every paused engine is continued before
the run ends, whatever ends it (resume_all).
"""

from __future__ import annotations

import contextlib
import os
import signal


class EngineSignals:
    """The pauses under way on a local router's engines (its MPClients), and their kills."""

    def __init__(self, target: object) -> None:
        self.target = target
        self.paused: dict[str, float] = {}  # engine -> when its pause ends (replay seconds)

    def pause(self, engine: str, now: float, for_s: float) -> None:
        pid = self._pid(engine)
        if pid is None or getattr(self.target, "routing", None) is None:
            raise ValueError(f"pause: engine {engine} is not a process of this replay's")
        if engine in self.target.routing.gone:
            return  # killed already: nothing to pause
        if engine not in self.paused:
            os.kill(pid, signal.SIGSTOP)
        self.paused[engine] = max(now + for_s, self.paused.get(engine, now))

    def resume_due(self, now: float) -> list[str]:
        """SIGCONT to the engines whose pause has ended by now; their names."""
        due = [engine for engine, until in self.paused.items() if until <= now]
        for engine in due:
            self._resume(engine)
        return due

    def resume_all(self) -> None:
        for engine in list(self.paused):
            self._resume(engine)

    def kill(self, engine: str) -> None:
        client = self.target.clients[engine]
        if self._pid(engine) is None or getattr(self.target, "routing", None) is None:
            raise ValueError(f"kill: engine {engine} is not a process of this replay's")
        if engine in self.target.routing.gone:
            return  # killed already
        self.paused.pop(engine, None)  # SIGKILL ends a stopped process too
        client.kill()
        self.target.lose_engine(engine)

    def _resume(self, engine: str) -> None:
        del self.paused[engine]
        pid = self._pid(engine)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _pid(self, engine: str) -> int | None:
        client = getattr(self.target, "clients", {}).get(engine)
        process = getattr(client, "process", None)
        return getattr(process, "pid", None)
