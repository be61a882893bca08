"""The usage plot (--plot PNG) and its data (--series CSV). Runs in: frontend process.

One panel per engine for used KV blocks (the line that matters, on its own axis, with
the pool's capacity when it is in range), and one panel below for cached (free, still
hashed) blocks of every engine. Idle windows are shaded by verdict; expected windows the
run did not observe are hatched. A panel with a few windows marks each window's drain
deadline and labels each leak with the blocks it held; past AGGREGATE_WINDOWS it draws
the windows as a verdict strip along the panel's top and the blocks held at each
deadline as points, with no per-window labels, so a trace of a thousand windows draws
in one collection per kind. Past MAX_ENGINE_PANELS engines (4p4d), one panel per role
holds a line per engine, a verdict strip per engine above the data and the blocks each
held at its deadlines as points. Every mark is clipped to its axes; legends sit right of the
axes, where nothing is drawn. Time runs from 0 (the replay's origin): samples taken
before it (a serve's stats during the lead-in) are clipped to 0. A panel with no data is
left out: an engine without samples, and the cached panel when no engine ever had a
cached block (vLLM does not export the count). The title names what was replayed
against: kvdrain and its liveness policy, or the server and version.
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import asdict, fields
from pathlib import Path

from replay.verify.rules import IdleWindow, Verdict
from replay.verify.timeline import EngineSample, Timeline, engine_role

WINDOW_COLOURS = {"drained": "tab:green", "leak": "tab:red", "undecided": "tab:orange"}
CAPACITY_IN_RANGE = 4.0  # capacity drawn when at most this many times the peak
AGGREGATE_WINDOWS = 24  # past this many windows on one engine: a strip and points, no labels
STRIP = (0.94, 0.06)  # the verdict strip: bottom and height, in axes fractions
LABEL_FONT_PT = 8
DPI = 110
MAX_ENGINE_PANELS = 4  # more engines than this: one panel per role, a line per engine
ROLE_STRIP_H = 0.16  # the verdict strips of a role panel, stacked, in axes fractions
ENGINE_COLOURS = (
    "tab:purple",
    "tab:blue",
    "tab:olive",
    "tab:cyan",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "black",
)


def write_series(path: Path, timeline: Timeline) -> None:
    """Every sample as one CSV row (EngineSample's fields), in time order, t clipped to >= 0."""
    names = [f.name for f in fields(EngineSample)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for sample in timeline.samples:
            row = asdict(sample)
            row["t"] = max(row["t"], 0.0)
            writer.writerow(row)


def _steps(samples: list[EngineSample], end_t: float, attr: str) -> tuple[list[float], list[int]]:
    """Step-plot points from t = 0 to end_t, each value held until the next sample."""
    xs = [max(s.t, 0.0) for s in samples]
    ys = [getattr(s, attr) for s in samples]
    if xs and xs[-1] < end_t:
        xs.append(end_t)
        ys.append(ys[-1])
    return xs, ys


def _spans(windows: list[IdleWindow]) -> list[tuple[float, float]]:
    return [(max(w.start, 0.0), w.end - max(w.start, 0.0)) for w in windows]


def _by_verdict(windows: list[IdleWindow]) -> dict[str, list[IdleWindow]]:
    groups: dict[str, list[IdleWindow]] = {}
    for w in windows:
        groups.setdefault(w.verdict, []).append(w)
    return groups


def _shade(
    ax, groups: dict[str, list[IdleWindow]], band: tuple[float, float], alpha: float
) -> None:
    """One collection per verdict over `band` (axes fractions), whatever the count."""
    for name, windows in groups.items():
        ax.broken_barh(
            _spans(windows),
            band,
            transform=ax.get_xaxis_transform(),
            facecolors=WINDOW_COLOURS.get(name, "grey"),
            alpha=alpha,
            lw=0,
            clip_on=True,
        )


def _deadline_lines(ax, windows: list[IdleWindow], deadline_s: float) -> None:
    xs = [w.start + deadline_s for w in windows if w.start + deadline_s < w.end]
    if xs:
        ax.vlines(
            xs,
            0,
            1,
            transform=ax.get_xaxis_transform(),
            colors="grey",
            ls=":",
            lw=0.8,
            clip_on=True,
        )


def _label_leaks(ax, windows: list[IdleWindow], top: float) -> None:
    """'leak: N held' at each leak's start (at its end, right-aligned, where the start is too
    near the right edge), skipping any that would overlap the one before; clipped to the
    axes either way."""
    x0, x1 = ax.get_xlim()
    width_px = ax.get_window_extent().width or 1.0
    px_per_s = width_px / max(x1 - x0, 1e-9)
    next_free_px = float("-inf")
    for w in sorted((w for w in windows if w.verdict == "leak"), key=lambda w: w.start):
        text = f"leak: {w.num_blocks_held:,} held"
        text_px = len(text) * LABEL_FONT_PT * 0.62 * DPI / 72 + 4
        left_px, x, ha, dx = (max(w.start, 0.0) - x0) * px_per_s, max(w.start, 0.0), "left", 2
        if left_px + text_px > width_px:
            x, ha, dx = min(w.end, x1), "right", -2
            left_px = (x - x0) * px_per_s - text_px
        if left_px < next_free_px or left_px < 0:
            continue
        ax.annotate(
            text,
            (x, top),
            xytext=(dx, -2),
            textcoords="offset points",
            ha=ha,
            va="top",
            fontsize=LABEL_FONT_PT,
            color="tab:red",
            annotation_clip=True,
            clip_on=True,
        )
        next_free_px = left_px + text_px


def _held_points(ax, windows: list[IdleWindow], deadline_s: float) -> None:
    """The blocks each leaking or undecided window still held at its deadline, as points."""
    for name in ("leak", "undecided"):
        marked = [w for w in windows if w.verdict == name]
        if marked:
            ax.scatter(
                [w.start + deadline_s for w in marked],
                [w.num_blocks_held for w in marked],
                s=9,
                marker="o",
                color=WINDOW_COLOURS[name],
                zorder=3,
                clip_on=True,
                label=f"held at deadline: {name}",
            )


def _window_legend(ax, groups: dict[str, list[IdleWindow]], aggregated: bool) -> None:
    for name, colour in WINDOW_COLOURS.items():
        if name not in groups:
            continue
        windows = groups[name]
        label = f"idle window: {name}"
        if aggregated:
            held = [w.num_blocks_held for w in windows]
            label = f"{len(windows):,} windows {name}"
            if name != "drained":
                label += f"\n(held: median {statistics.median(held):,.0f}, max {max(held):,})"
        ax.fill_between([], [], color=colour, alpha=0.5 if aggregated else 0.25, label=label)


def _hatch_missed(ax, verdict: Verdict, end_t: float) -> None:
    spans = [
        (max(c.start, 0.0), (end_t if c.end is None else c.end) - max(c.start, 0.0))
        for c in verdict.coverage
        if c.state == "missed"
    ]
    if spans:
        ax.broken_barh(
            spans,
            (0, 1),
            transform=ax.get_xaxis_transform(),
            facecolors="none",
            hatch="//",
            edgecolor="grey",
            lw=0,
            clip_on=True,
        )


def _capacity(ax, timeline: Timeline, engine: str, peak: int) -> float:
    """Draw the capacity line when in range (else name it in the legend); the y top."""
    capacity = timeline.num_usable_blocks.get(engine, 0)
    if capacity and capacity <= CAPACITY_IN_RANGE * max(peak, 1):
        ax.axhline(capacity, color="black", ls="--", lw=0.9, label=f"capacity {capacity:,}")
        return capacity * 1.08
    ax.plot([], [], " ", label=f"capacity {capacity:,} (off scale)")
    return max(peak * 1.15, 1.0)


def _used_panel(
    ax, timeline: Timeline, verdict: Verdict, engine: str, deadline_s: float | None
) -> None:
    xs, ys = _steps(timeline.samples_for(engine), timeline.end_t, "num_used_blocks")
    ax.step(
        xs,
        ys,
        where="post",
        color="tab:purple",
        lw=1.0 if len(xs) > 2000 else 1.4,
        label="used blocks",
    )
    windows = [w for w in verdict.windows if w.engine == engine]
    aggregated = len(windows) > AGGREGATE_WINDOWS
    top = _capacity(ax, timeline, engine, max(ys, default=0))
    if aggregated:
        top /= 1 - STRIP[1]  # room above the data for the strip
    ax.set_ylim(0, top)
    groups = _by_verdict(windows)
    _shade(ax, groups, STRIP if aggregated else (0, 1), 0.5 if aggregated else 0.13)
    _hatch_missed(ax, verdict, timeline.end_t)
    if deadline_s is not None and aggregated:
        _held_points(ax, windows, deadline_s)
    elif deadline_s is not None:
        _deadline_lines(ax, windows, deadline_s)
        ax.plot([], [], color="grey", ls=":", lw=0.8, label=f"drain deadline {deadline_s:g} s")
    if not aggregated:
        _label_leaks(ax, windows, top)
    _window_legend(ax, groups, aggregated)
    if any(c.state == "missed" for c in verdict.coverage):
        ax.fill_between(
            [],
            [],
            facecolor="none",
            hatch="//",
            edgecolor="grey",
            label="expected window not observed",
        )
    ax.set_ylabel(f"{engine}: used blocks")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def role_groups(engines: list[str]) -> list[tuple[str, list[str]]]:
    """Past MAX_ENGINE_PANELS engines, one (role, engines) per role, in first-seen order;
    else one per engine (its own panel)."""
    if len(engines) <= MAX_ENGINE_PANELS:
        return [(e, [e]) for e in engines]
    groups: dict[str, list[str]] = {}
    for engine in engines:
        groups.setdefault(engine_role(engine), []).append(engine)
    return list(groups.items())


def _role_panel(
    ax,
    timeline: Timeline,
    verdict: Verdict,
    role: str,
    engines: list[str],
    deadline_s: float | None,
) -> None:
    """A line per engine of one role; above the data, a verdict strip per engine (its
    windows), and the blocks each held at its deadlines as points in its colour."""
    peak = 0
    for i, engine in enumerate(engines):
        xs, ys = _steps(timeline.samples_for(engine), timeline.end_t, "num_used_blocks")
        ax.step(
            xs,
            ys,
            where="post",
            color=ENGINE_COLOURS[i % len(ENGINE_COLOURS)],
            lw=1.1,
            label=engine,
        )
        peak = max(peak, max(ys, default=0))
    strip_h = ROLE_STRIP_H / len(engines)
    top = max(peak * 1.15, 1.0) / (1 - ROLE_STRIP_H)  # room above the data for the strips
    ax.set_ylim(0, top)
    windows = [w for w in verdict.windows if w.engine in engines]
    for i, engine in enumerate(engines):
        own = _by_verdict([w for w in windows if w.engine == engine])
        _shade(ax, own, (1 - (i + 1) * strip_h, strip_h * 0.85), 0.6)
        held = [w for w in windows if w.engine == engine and w.verdict != "drained"]
        if deadline_s is not None and held:
            ax.scatter(
                [w.start + deadline_s for w in held],
                [w.num_blocks_held for w in held],
                s=12,
                color=ENGINE_COLOURS[i % len(ENGINE_COLOURS)],
                edgecolors="tab:red",
                linewidths=0.8,
                zorder=3,
                clip_on=True,
            )
    _hatch_missed(ax, verdict, timeline.end_t)
    if deadline_s is not None and any(w.verdict != "drained" for w in windows):
        ax.scatter(
            [],
            [],
            s=12,
            color="white",
            edgecolors="tab:red",
            linewidths=0.8,
            label=f"held at the {deadline_s:g} s deadline",
        )
    _window_legend(ax, _by_verdict(windows), aggregated=True)
    capacity = max((timeline.num_usable_blocks.get(e, 0) for e in engines), default=0)
    ax.plot([], [], " ", label=f"capacity {capacity:,} each")
    ax.set_ylabel(f"{role} ({len(engines)}): used blocks")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def has_cached_data(timeline: Timeline) -> bool:
    return any(s.num_cached_blocks for s in timeline.samples)


def _cached_panel(ax, timeline: Timeline) -> None:
    for engine in timeline.engines:
        xs, ys = _steps(timeline.samples_for(engine), timeline.end_t, "num_cached_blocks")
        ax.step(xs, ys, where="post", lw=1.0, label=f"{engine} cached (free, hashed)")
    ax.set_ylabel("cached blocks")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def build_figure(
    timeline: Timeline, verdict: Verdict, title: str = "", deadline_s: float | None = None
):
    """The matplotlib Figure (needs the plot extra: matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvdrain[plot]'") from None
    engines = [e for e in timeline.engines if timeline.samples_for(e)]
    groups = role_groups(engines)
    cached = has_cached_data(timeline)
    ratios = [3] * len(groups) + [1.6] * cached
    if not ratios:  # nothing was observed: one empty panel that says so
        ratios = [1]
    height = max(2.4 * len(groups) + 2.2 * cached + 1, 3.0)
    fig, axes = plt.subplots(
        len(ratios),
        1,
        sharex=True,
        figsize=(11, height),
        gridspec_kw={"height_ratios": ratios},
        squeeze=False,
        dpi=DPI,
    )
    fig.subplots_adjust(
        left=0.07, right=0.76, top=1 - 0.5 / height, bottom=0.6 / height, hspace=0.18
    )
    axes[-1, 0].set_xlim(0, max(timeline.end_t, 1e-3))  # before the labels: they measure it
    for ax, (role, members) in zip(axes[:, 0], groups):
        if len(members) == 1:
            _used_panel(ax, timeline, verdict, members[0], deadline_s)
        else:
            _role_panel(ax, timeline, verdict, role, members, deadline_s)
    if cached:
        _cached_panel(axes[-1, 0], timeline)
    if not engines and not cached:
        axes[0, 0].text(
            0.5,
            0.5,
            "no KV-usage samples",
            ha="center",
            va="center",
            transform=axes[0, 0].transAxes,
        )
    axes[-1, 0].set_xlabel("replay time (s)")
    # The title sits in the top margin (0.5 in, whatever the figure's height). It quotes a
    # file name and a server's words: text, never mathtext ("$...$").
    fig.suptitle(
        title or "kvdrain replay",
        fontsize=11,
        x=0.01,
        y=1 - 0.12 / height,
        ha="left",
        va="top",
        parse_math=False,
    )
    return fig


def write_plot(
    path: Path,
    timeline: Timeline,
    verdict: Verdict,
    title: str = "",
    deadline_s: float | None = None,
) -> None:
    """The PNG (needs the plot extra: matplotlib)."""
    fig = build_figure(timeline, verdict, title, deadline_s)
    import matplotlib.pyplot as plt

    png = io.BytesIO()  # rendered whole, then written: a failed write raises OSError
    fig.savefig(png, format="png", dpi=DPI)
    plt.close(fig)
    path.write_bytes(png.getvalue())


def system_label(settings: dict) -> str:
    """What ran the replay, from the report's settings: 'vLLM 0.32.0' (over HTTP, the
    server and its version), else 'kvdrain, liveness legacy'."""
    engine = settings.get("engine") or {}
    if engine.get("source") != "http server":
        return f"kvdrain, liveness {engine.get('liveness', '?')}"
    versions = [e.get("version") for e in (engine.get("engines") or {}).values()] or [
        engine.get("version")
    ]
    known = sorted({v for v in versions if v is not None})
    label = (
        f"{engine.get('server') or 'server'} {'/'.join(known) if known else '(version unknown)'}"
    )
    return label + (f", liveness {engine['liveness']}" if engine.get("liveness") else "")


def plot_title(trace: str, system: str, clock: str, status: str, exit_code: int) -> str:
    """'pd_idle.jsonl | vLLM 0.32.0 | clock wall | VIOLATION (exit 1)'."""
    return f"{trace} | {system} | clock {clock} | {status.upper()} (exit {exit_code})"
