"""The exit-code table: one status per way a run can end, the same in the exit status, the report JSON and the README. Runs in: frontend process.

| status         | exit | meaning                                                                  |
|----------------|------|--------------------------------------------------------------------------|
| `verified`     | 0    | every expected idle window was observed and every engine drained in it   |
| `violation`    | 1    | a leak, a conservation or snapshot mismatch, an unfinished request       |
| `error`        | 2    | bad usage or input (options, trace), or a target that cannot be reached  |
| `inconclusive` | 3    | the run proves nothing either way: an expected window not observed (the  |
|                |      | engines lagged or starved), too many requests ignored, KV usage not      |
|                |      | observable, another client's requests on the engines                     |
| `fault`        | 4    | an engine or connector worker died, stopped answering or restarted       |
| `interrupted`  | 130  | Ctrl-C (SIGINT, 128 + 2)                                                 |
| `terminated`   | 143  | SIGTERM (128 + 15)                                                       |

A violation wins over inconclusive (a leak that was seen is a leak); a fault wins
over both (what the engines did after one of them died says nothing about liveness).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2
EXIT_INCONCLUSIVE = 3
EXIT_FAULT = 4
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

EXIT_CODES = {
    "verified": EXIT_OK,
    "violation": EXIT_VIOLATION,
    "error": EXIT_USAGE,
    "inconclusive": EXIT_INCONCLUSIVE,
    "fault": EXIT_FAULT,
    "interrupted": EXIT_INTERRUPTED,
    "terminated": EXIT_TERMINATED,
}
STATUSES = tuple(EXIT_CODES)


def exit_code_for(status: str) -> int:
    """The exit status of a run that ended with `status` (one of STATUSES)."""
    if status not in EXIT_CODES:
        raise ValueError(f"status: must be one of {STATUSES}, got {status!r}")
    return EXIT_CODES[status]


def status_for(exit_code: int) -> str:
    """The inverse of exit_code_for."""
    for status, code in EXIT_CODES.items():
        if code == exit_code:
            return status
    raise ValueError(f"exit_code: not in the table: {exit_code!r}")


# Which status a run ends with when several apply: the later, the stronger.
SEVERITY = ("verified", "inconclusive", "violation", "fault", "error", "interrupted", "terminated")


def worst(*statuses: str) -> str:
    """The strongest of `statuses` (a leak seen beats a gap in coverage; a fault beats both)."""
    return max(statuses, key=SEVERITY.index)
