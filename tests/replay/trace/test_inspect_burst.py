"""`inspect` says what a burst costs: 200,000 requests at one timestamp took 518 MB and 40 s
on the virtual clock, and nothing said so before the run."""

from __future__ import annotations

import json

from replay.trace.inspect import BURST_NOTE, format_inspection, inspect_trace


def _trace(tmp_path, times, prompt_len=32):
    path = tmp_path / "burst.jsonl"
    path.write_text(
        "".join(
            json.dumps({"t": t, "id": f"r{i}", "prompt_len": prompt_len, "max_tokens": 4}) + "\n"
            for i, t in enumerate(times)
        )
    )
    return path


def test_the_busiest_second_and_what_it_costs_the_virtual_clock_are_said(tmp_path):
    times = [0.5] * 10 + [5.0 + i / BURST_NOTE for i in range(BURST_NOTE)] + [9.0]
    insp = inspect_trace(_trace(tmp_path, times))
    assert (insp.burst.t, insp.burst.num_requests) == (5.0, BURST_NOTE)
    assert insp.burst.num_prompt_tokens == 32 * BURST_NOTE
    [line] = [x for x in format_inspection(insp) if "busiest second" in x]
    mib = insp.burst.virtual_bytes() / 2**20
    assert line.startswith(f"  busiest second: {BURST_NOTE:,} requests from t=5.000 s wait")
    assert f"about {mib:,.0f} MiB" in line and 10 < mib < 100


def test_a_trace_without_a_burst_says_nothing_of_one(tmp_path):
    insp = inspect_trace(_trace(tmp_path, [i * 0.5 for i in range(100)]))
    assert insp.burst.num_requests == 2
    assert not [x for x in format_inspection(insp) if "busiest" in x]
