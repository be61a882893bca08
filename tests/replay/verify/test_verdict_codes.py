"""The exit-code table (replay/verify/verdict.py) is one table, the same everywhere."""

from __future__ import annotations

import pytest

from replay.verify.verdict import (
    EXIT_CODES,
    EXIT_FAULT,
    EXIT_INCONCLUSIVE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    EXIT_VIOLATION,
    exit_code_for,
    status_for,
)


def test_the_table():
    assert (
        EXIT_OK,
        EXIT_VIOLATION,
        EXIT_USAGE,
        EXIT_INCONCLUSIVE,
        EXIT_FAULT,
        EXIT_INTERRUPTED,
        EXIT_TERMINATED,
    ) == (0, 1, 2, 3, 4, 130, 143)
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES)
    for status, code in EXIT_CODES.items():
        assert exit_code_for(status) == code and status_for(code) == status
    with pytest.raises(ValueError):
        exit_code_for("fine")


def test_worst_status_wins():
    from replay.verify.verdict import worst

    assert worst("verified", "inconclusive") == "inconclusive"
    assert worst("inconclusive", "violation", "verified") == "violation"
    assert worst("violation", "fault") == "fault"
    assert worst("verified") == "verified"
