"""The usage plot scales: a thousand idle windows draw as a strip and points in a bounded
number of artists, labels of a few windows stay inside their axes and apart, and no mark
reaches the legends right of the axes."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.verify.rules import IdleWindow, Verdict
from replay.verify.timeline import EngineSample, Timeline

pytest.importorskip("matplotlib")
from replay.verify.plot import AGGREGATE_WINDOWS, build_figure, write_plot  # noqa: E402

PERIOD_S = 3.0  # one burst every 3 s, idle between, as the Mooncake trace


def _sample(t: float, engine: str, used: int) -> EngineSample:
    return EngineSample(
        t=t,
        engine=engine,
        num_used_blocks=used,
        num_cached_blocks=0,
        num_free_blocks=100 - used,
        num_usable_blocks=100,
        num_waiting=0,
        num_skipped_waiting=0,
        num_waiting_for_remote_kvs=0,
        num_running=0,
        num_finished_awaiting_free=0,
        loop_state="blocked",
        num_steps=0,
        num_wakeups=0,
    )


def _leaky_run(num_windows: int) -> tuple[Timeline, Verdict]:
    """P holds 10 + i blocks through window i; D drains every window."""
    samples, windows = [], []
    for i in range(num_windows):
        t = i * PERIOD_S
        samples += [_sample(t, "P", 10 + i % 50), _sample(t, "D", 30), _sample(t + 0.2, "D", 0)]
        start, end = t + 0.2, t + PERIOD_S
        windows.append(
            IdleWindow(
                engine="P",
                start=start,
                end=end,
                is_tail=False,
                num_used_at_start=10 + i % 50,
                time_to_drain=None,
                verdict="leak",
                num_blocks_held=10 + i % 50,
            )
        )
        windows.append(
            IdleWindow(
                engine="D",
                start=start,
                end=end,
                is_tail=False,
                num_used_at_start=0,
                time_to_drain=0.0,
                verdict="drained",
                num_blocks_held=0,
            )
        )
    end_t = num_windows * PERIOD_S
    timeline = Timeline(
        engines=["P", "D"],
        num_usable_blocks={"P": 100, "D": 100},
        samples=samples,
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=end_t,
    )
    return timeline, Verdict(windows=tuple(windows), violations=())


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def _num_artists(fig) -> int:
    return sum(len(ax.get_children()) for ax in fig.axes)


def test_a_thousand_leak_windows_draw_as_points_without_labels_in_bounded_artists():
    few = build_figure(*_leaky_run(AGGREGATE_WINDOWS + 1), deadline_s=0.5)
    many = build_figure(*_leaky_run(1180), deadline_s=0.5)
    assert _num_artists(many) == _num_artists(few)  # not one artist per window
    p_axes = many.axes[0]
    assert not _texts(p_axes)  # no per-window labels
    points = [c for c in p_axes.collections if c.get_label() == "held at deadline: leak"]
    assert len(points) == 1 and len(points[0].get_offsets()) == 1180
    assert points[0].get_offsets()[0].tolist() == [0.2 + 0.5, 10.0]  # deadline, blocks held
    legend = [t.get_text() for t in p_axes.get_legend().get_texts()]
    assert "1,180 windows leak\n(held: median 34, max 59)" in legend


def test_a_few_leak_windows_keep_labels_and_deadline_marks():
    fig = build_figure(*_leaky_run(3), deadline_s=0.5)
    p_axes = fig.axes[0]
    assert _texts(p_axes) == ["leak: 10 held", "leak: 11 held", "leak: 12 held"]
    assert [line.get_label() for line in p_axes.lines if "deadline" in line.get_label()] == [
        "drain deadline 0.5 s"
    ]


def test_labels_that_would_overlap_or_leave_the_axes_are_left_out():
    timeline, verdict = _leaky_run(AGGREGATE_WINDOWS)  # 24 labels on a 72 s axis: too close
    fig = build_figure(timeline, verdict, deadline_s=0.5)
    fig.canvas.draw()
    p_axes = fig.axes[0]
    boxes = [t.get_window_extent() for t in p_axes.texts]
    assert 1 < len(boxes) < AGGREGATE_WINDOWS
    assert all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    assert all(b.x1 <= p_axes.bbox.x1 + 1 for b in boxes)


@pytest.mark.parametrize("num_windows", [3, 1180])
def test_every_mark_is_clipped_to_its_axes_and_no_legend_is_covered(num_windows: int):
    fig = build_figure(*_leaky_run(num_windows), deadline_s=0.5)
    fig.canvas.draw()
    for ax in fig.axes:
        marks = [*ax.collections, *ax.patches, *ax.texts, *ax.lines]
        assert all(m.get_clip_on() for m in marks)
        legend = ax.get_legend().get_window_extent()
        for other in fig.axes:
            assert legend.x0 >= other.bbox.x1  # right of every axes, where nothing draws


def test_write_plot_writes_a_png(tmp_path: Path):
    path = tmp_path / "usage.png"
    write_plot(path, *_leaky_run(40), title="t", deadline_s=0.5)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_title_with_dollar_signs_is_drawn_as_text_not_as_mathtext(tmp_path: Path):
    """The title holds the trace's file name and, over HTTP, the server's name and version:
    "a$\\nosuch{$.jsonl" failed the plot with matplotlib's mathtext ParseFatalException, a
    traceback and exit 1 after a VERIFIED run."""
    path = tmp_path / "usage.png"
    write_plot(path, *_leaky_run(4), title="a$\\nosuch{$.jsonl | vLLM $x^$", deadline_s=0.5)
    assert path.read_bytes()[:4] == b"\x89PNG"


def _eight_engines() -> tuple[Timeline, Verdict]:
    """4p4d: each P holds blocks through both windows, each D drains."""
    names = [f"P{i}" for i in range(4)] + [f"D{i}" for i in range(4)]
    samples, windows = [], []
    for k in range(2):
        t = k * PERIOD_S
        for name in names:
            held = 10 + k if name.startswith("P") else 0
            samples += [_sample(t, name, 30), _sample(t + 0.2, name, held)]
            windows.append(
                IdleWindow(
                    engine=name,
                    start=t + 0.2,
                    end=t + PERIOD_S,
                    is_tail=False,
                    num_used_at_start=held,
                    time_to_drain=None if held else 0.0,
                    verdict="leak" if held else "drained",
                    num_blocks_held=held,
                )
            )
    timeline = Timeline(
        engines=names,
        num_usable_blocks={n: 100 for n in names},
        samples=samples,
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=2 * PERIOD_S,
    )
    return timeline, Verdict(windows=tuple(windows), violations=())


def test_eight_engines_draw_one_panel_per_role_with_a_line_per_engine():
    fig = build_figure(*_eight_engines(), deadline_s=0.5)
    fig.canvas.draw()
    p_axes, d_axes = fig.axes  # no cached blocks: no cached panel
    assert (
        p_axes.get_ylabel() == "P (4): used blocks" and d_axes.get_ylabel() == "D (4): used blocks"
    )
    assert [line.get_label() for line in p_axes.lines if line.get_label().startswith("P")] == [
        "P0",
        "P1",
        "P2",
        "P3",
    ]
    assert not p_axes.texts  # no per-window labels
    legend = [t.get_text() for t in p_axes.get_legend().get_texts()]
    assert "8 windows leak\n(held: median 10, max 11)" in legend
    for ax in fig.axes:
        assert all(m.get_clip_on() for m in [*ax.collections, *ax.patches, *ax.lines])
        assert ax.get_legend().get_window_extent().x0 >= ax.bbox.x1


def test_the_title_stays_above_the_first_panel_at_any_height(monkeypatch):
    import replay.verify.plot as plot

    monkeypatch.setattr(plot, "MAX_ENGINE_PANELS", 8)  # eight panels: a 20 in tall figure
    fig = build_figure(*_eight_engines(), title="a title", deadline_s=0.5)
    assert len(fig.axes) == 8
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert fig._suptitle.get_window_extent(renderer).y0 >= fig.axes[0].bbox.y1
