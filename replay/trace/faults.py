"""The faults a trace asks for, and what a target can carry out of them. Runs in: frontend process.

The records are replay/trace/records.py's: an abort in a phase (TraceAbort.when), a
request's fault (drop_decode, reject_decode) and an engine's pause or kill
(TraceEngineFault); `--fault` names them as FAULT_NAMES (replay/trace/fault_shares.py).
The validating pass (replay/trace/reader.py) checks each record against the target's
FaultSupport, so a fault the target cannot carry out is a `file:line: field: what` error,
exit 2, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.trace.formats import FieldError
from replay.trace.records import (
    ABORT_PHASES,
    REQUEST_FAULTS,
    TraceAbort,
    TraceEngineFault,
    TraceRecord,
    TraceRequest,
)

# `--fault` names: the request faults under their own names, an abort by its phase.
FAULT_NAMES: tuple[str, ...] = (*REQUEST_FAULTS, *(f"abort_{phase}" for phase in ABORT_PHASES))


def abort_phase(name: str) -> str | None:
    """The phase of an `abort_<phase>` fault name; None for a request fault."""
    prefix, _, phase = name.partition("_")
    return phase if prefix == "abort" and phase in ABORT_PHASES else None


@dataclass(frozen=True, slots=True)
class FaultSupport:
    """What a target carries out. Phased aborts and request faults need kvdrain's own
    router (replay/deploy/pd_flow.py); a pause or a kill, engines whose processes
    kvdrain owns (the virtual clock's, a local wall replay's)."""

    target: str  # how an error names the target: "the virtual clock", "a --target"
    engines: tuple[str, ...] = ()  # those a pause or kill may name; (): none
    routes: bool = True  # kvdrain's router takes the requests: phases and D legs are its
    has_decode_leg: bool = True  # the topology sends requests from P to D

    def check(self, record: TraceRecord) -> None:
        """A FieldError if the target cannot carry out what `record` asks for."""
        if isinstance(record, TraceAbort) and record.when is not None:
            self._need_router("when", f"an abort in the {record.when} phase")
        elif isinstance(record, TraceRequest) and record.fault is not None:
            why = self.why_not(record.fault)
            if why is not None:
                raise FieldError("fault", why)
        elif isinstance(record, TraceEngineFault):
            self._check_engine(record)

    def why_not(self, name: str) -> str | None:
        """Why the target cannot carry out fault `name` (FAULT_NAMES), or None."""
        if not self.routes:
            return f"{name}: {self._no_router()}"
        if abort_phase(name) is None and not self.has_decode_leg:
            return f"{name}: topology single has no D leg"
        return None

    def _need_router(self, field: str, what: str) -> None:
        if not self.routes:
            raise FieldError(field, f"{what}: {self._no_router()}")

    def _no_router(self) -> str:
        return (
            f"{self.target} routes requests itself, so kvdrain cannot tell a request's "
            f"phase or hold back its D leg (the virtual clock and a local wall replay can)"
        )

    def _check_engine(self, record: TraceEngineFault) -> None:
        if not self.engines:
            raise FieldError(
                record.action,
                f"{self.target} runs processes kvdrain does not own: a {record.action} needs "
                f"the virtual clock or a local wall replay",
            )
        if record.engine not in self.engines:
            raise FieldError(
                record.action,
                f"no engine {record.engine!r} in this topology (it has {', '.join(self.engines)})",
            )
