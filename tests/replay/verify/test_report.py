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
    return RequestRecord(req_id, arrival, arrival, 0.0, arrival, arrival + 0.5, 8, 1, hits, "length")


def _sample(engine: str, t: float, used: int, cached: int = 0) -> EngineSample:
    return EngineSample(t, engine, used, cached, 10 - used, 10, 0, 0, 0, 0, 0, "unknown", 0, 0)


def _timeline(hits: list[int | None], counters: dict, engines=("P", "D"), cached: int = 0) -> Timeline:
    records = [_record(f"r{i}", 2.0 * i, h) for i, h in enumerate(hits)]
    samples = [_sample(e, t, used, cached) for e in engines for t, used in ((0.0, 3), (0.6, 0), (4.0, 0))]
    return Timeline(list(engines), {e: 10 for e in engines}, samples, records,
                    [r.arrival_t for r in records], [], 5.0, counters=counters)


UNKNOWN = {"num_steps": None, "num_wakeups": None, "num_expired": None, "num_prefix_hit_tokens": None}


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
    assert "prefix-cache hits unknown;" in next(line for line in lines if line.startswith("requests:"))


def test_kvdrains_own_engines_still_print_their_counts():
    timeline = _timeline([1, 2], {"P": {"num_steps": 40, "num_wakeups": 7, "num_expired": 0}})
    p_row = next(line for line in summary_lines(build_report(timeline, verify(timeline, []), {}, {}, []))
                 if line.startswith("P "))
    assert p_row.split()[-3:] == ["40", "7", "0"]


def test_the_title_names_the_server_and_its_version_or_kvdrains_liveness():
    vllm = {"engine": {"source": "http server", "server": "vLLM", "version": None,
                       "engines": {"P": {"version": "0.21.0"}, "D": {"version": "0.21.0"}}}}
    assert system_label(vllm) == "vLLM 0.21.0"
    assert system_label({"engine": {"source": "http server", "server": "vLLM", "engines": {}}}) == \
        "vLLM (version unknown)"
    assert system_label({"engine": {"liveness": "legacy"}}) == "kvdrain, liveness legacy"
    assert plot_title("pd_idle.jsonl", system_label(vllm), "wall", "violation", 1) == \
        "pd_idle.jsonl | vLLM 0.21.0 | clock wall | VIOLATION (exit 1)"


@pytest.mark.parametrize("engines,cached,num_axes", [(("P", "D"), 0, 2), (("P", "D"), 2, 3), ((), 0, 1)])
def test_the_plot_leaves_out_panels_without_data(tmp_path: Path, monkeypatch, engines, cached, num_axes):
    import matplotlib.figure

    drawn = {}

    def savefig(fig, path, **kwargs):
        drawn["axes"], drawn["title"] = len(fig.axes), fig._suptitle.get_text()
        Path(path).write_bytes(b"\x89PNG")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    timeline = _timeline([1], {}, engines, cached)
    write_plot(tmp_path / "usage.png", timeline, verify(timeline, []), "pd_idle.jsonl | vLLM 0.32.0")
    assert drawn == {"axes": num_axes, "title": "pd_idle.jsonl | vLLM 0.32.0"}
