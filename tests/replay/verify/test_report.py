"""The report and plot say what was observed and nothing else: a figure not observed is
unknown (None, `-`), never 0; the plot leaves out panels without data and its title names
what was replayed against."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.verify.plot import plot_title, system_label, write_plot
from replay.verify.report import build_report, prefix_hits, summary_lines
from replay.verify.rules import verify
from replay.verify.timeline import EngineSample, RequestRecord, Timeline


def _record(req_id: str, arrival: float, hits: int | None) -> RequestRecord:
    return RequestRecord(
        req_id=req_id,
        arrival_t=arrival,
        send_t=arrival,
        send_lateness_s=0.0,
        first_token_t=arrival,
        end_t=arrival + 0.5,
        num_prompt_tokens=8,
        num_output_tokens=1,
        num_prefix_hit_tokens=hits,
        finish_reason="length",
    )


def _sample(engine: str, t: float, used: int, cached: int = 0) -> EngineSample:
    return EngineSample(
        t=t,
        engine=engine,
        num_used_blocks=used,
        num_cached_blocks=cached,
        num_free_blocks=10 - used,
        num_usable_blocks=10,
        num_waiting=0,
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=0,
        num_running=0,
        num_finished_awaiting_free=0,
        loop_state="unknown",
        num_steps=0,
        num_wakeups=0,
    )


def _timeline(
    hits: list[int | None], counters: dict, engines=("P", "D"), cached: int = 0
) -> Timeline:
    records = [_record(f"r{i}", 2.0 * i, h) for i, h in enumerate(hits)]
    samples = [
        _sample(e, t, used, cached) for e in engines for t, used in ((0.0, 3), (0.6, 0), (4.0, 0))
    ]
    return Timeline(
        engines=list(engines),
        num_usable_blocks={e: 10 for e in engines},
        samples=samples,
        requests=records,
        arrivals=[r.arrival_t for r in records],
        aborts=[],
        end_t=5.0,
        counters=counters,
    )


UNKNOWN = {
    "num_steps": None,
    "num_wakeups": None,
    "num_expired": None,
    "num_prefix_hit_tokens": None,
}


def test_prefix_hits_are_the_requests_own_else_the_engines_counters_else_unknown():
    assert prefix_hits(_timeline([3, None, 4], {})) == (7, "requests")
    counted = {"P": {**UNKNOWN, "num_prefix_hit_tokens": 256.0}, "D": dict(UNKNOWN)}
    assert prefix_hits(_timeline([None, None], counted)) == (256, "vllm:prefix_cache_hits_total")
    assert prefix_hits(_timeline([None, None], {"P": UNKNOWN, "D": UNKNOWN})) == (None, None)


def test_figures_the_server_does_not_count_print_as_unknown_never_0():
    timeline = _timeline([None, None], {"P": UNKNOWN, "D": UNKNOWN})
    report = build_report(timeline, verify(timeline, []), {}, {}, [])
    assert [e["num_steps"] for e in report["engines"]] == [None, None]
    assert report["requests"]["num_prefix_hit_tokens"] is None
    lines = summary_lines(report)
    p_row = next(line for line in lines if line.startswith("P "))
    assert p_row.split()[-3:] == ["-", "-", "-"]
    assert "prefix-cache hits unknown;" in next(
        line for line in lines if line.startswith("requests:")
    )


def test_kvdrains_own_engines_still_print_their_counts():
    timeline = _timeline([1, 2], {"P": {"num_steps": 40, "num_wakeups": 7, "num_expired": 0}})
    p_row = next(
        line
        for line in summary_lines(build_report(timeline, verify(timeline, []), {}, {}, []))
        if line.startswith("P ")
    )
    assert p_row.split()[-3:] == ["40", "7", "0"]


def test_the_title_names_the_server_and_its_version_or_kvdrains_liveness():
    vllm = {
        "engine": {
            "source": "http server",
            "server": "vLLM",
            "version": None,
            "engines": {"P": {"version": "0.21.0"}, "D": {"version": "0.21.0"}},
        }
    }
    assert system_label(vllm) == "vLLM 0.21.0"
    assert (
        system_label({"engine": {"source": "http server", "server": "vLLM", "engines": {}}})
        == "vLLM (version unknown)"
    )
    assert system_label({"engine": {"liveness": "legacy"}}) == "kvdrain, liveness legacy"
    assert (
        plot_title("pd_idle.jsonl", system_label(vllm), "wall", "violation", 1)
        == "pd_idle.jsonl | vLLM 0.21.0 | clock wall | VIOLATION (exit 1)"
    )


@pytest.mark.parametrize(
    "engines,cached,num_axes", [(("P", "D"), 0, 2), (("P", "D"), 2, 3), ((), 0, 1)]
)
def test_the_plot_leaves_out_panels_without_data(
    tmp_path: Path, monkeypatch, engines, cached, num_axes
):
    import matplotlib.figure

    drawn = {}

    def savefig(fig, path, **kwargs):
        drawn["axes"], drawn["title"] = len(fig.axes), fig._suptitle.get_text()
        path.write(b"\x89PNG")  # the plot is drawn into memory, then written

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    timeline = _timeline([1], {}, engines, cached)
    write_plot(
        tmp_path / "usage.png", timeline, verify(timeline, []), "pd_idle.jsonl | vLLM 0.32.0"
    )
    assert drawn == {"axes": num_axes, "title": "pd_idle.jsonl | vLLM 0.32.0"}


def test_an_interrupted_runs_verdict_line_says_what_ran_with_its_time_to_the_millisecond():
    from replay.verify.report import verdict_line

    report = {
        "status": "interrupted",
        "exit_code": 130,
        "num_observed_windows": 2,
        "num_expected_windows": 4,
        "reasons": [],
        "violations": [],
        "windows": [{"verdict": "drained"}] * 4 + [{"verdict": "undecided"}],
        "coverage": [{"state": "observed"}] * 2 + [{"state": "unreached"}] * 2,
        "stop": {"by": "q", "after_s": 6.0279988, "num_sent": 24, "num_requests": 32},
    }
    assert verdict_line(report) == (
        "INTERRUPTED: by q after 6.028 s and 24 of 32 requests: 4 of 4 reached "
        "windows drained; 2 not reached; the engines were shut down (exit 130)"
    )
    report["settings"] = {"target": "http://127.0.0.1:8000"}  # another's server: left running
    assert verdict_line(report).endswith(
        "; the target's engines were left as they were (this run owns none) (exit 130)"
    )
    del report["settings"]
    report["stop"]["num_sent"] = 0
    assert summary_lines(report) == [
        "INTERRUPTED: by q during start-up, before any request was sent; "
        "nothing is left running (exit 130)"
    ]


def test_a_verified_run_of_one_expected_window_says_the_1_window():
    from replay.verify.report import verdict_line

    report = {
        "status": "verified",
        "exit_code": 0,
        "num_observed_windows": 1,
        "num_expected_windows": 1,
    }
    assert (
        verdict_line(report)
        == "VERIFIED: every engine drained in the 1 expected idle window (exit 0)"
    )
    report.update(num_observed_windows=2, num_expected_windows=2)
    assert (
        verdict_line(report)
        == "VERIFIED: every engine drained in each of the 2 expected idle windows (exit 0)"
    )


def test_the_coverage_line_says_its_count_is_the_traces_and_the_tables_each_engines_own():
    from replay.verify.report import coverage_line

    gaps = [{"state": "observed", "engine": ""}] * 3 + [{"state": "observed", "engine": "P"}]
    report = {
        "num_observed_windows": 4,
        "num_expected_windows": 4,
        "coverage": gaps,
        "engines": [{"engine": "P", "num_windows": 4}, {"engine": "D", "num_windows": 3}],
    }
    assert coverage_line(report) == (
        "idle windows: 4 of 4 expected observed (3 gaps of the whole trace, the tail included, "
        "and 1 of one engine's own); the table's windows are each engine's own, the ones it was judged in"
    )
    same = dict(
        report,
        coverage=gaps[:3],
        num_observed_windows=3,
        num_expected_windows=3,
        engines=[{"engine": "P", "num_windows": 3}, {"engine": "D", "num_windows": 3}],
    )
    assert coverage_line(same) == "idle windows: 3 of 3 expected observed (the tail included)"
