"""The usage plot (--plot PNG) and its data (--series CSV). Runs in: frontend process.

One panel per engine for used KV blocks (the line that matters, on its own axis, with
the pool's capacity when it is in range and each idle window's drain deadline), and
one panel below for cached (free, still hashed) blocks of every engine. Idle windows
are shaded by verdict, leaks labelled with the blocks held; expected windows the run did
not observe are hatched. Time runs from 0 (the replay's origin): samples taken before
it (a serve's stats during the lead-in) are clipped to 0. Legends sit right of the axes.
A panel with no data is left out: an engine without samples, and the cached panel when
no engine ever had a cached block (vLLM does not export the count). The title names
what was replayed against: kvdrain and its liveness policy, or the server and version.
"""
from __future__ import annotations

import csv
from dataclasses import asdict, fields
from pathlib import Path

from replay.verify.rules import Verdict
from replay.verify.timeline import EngineSample, Timeline

WINDOW_COLOURS = {"drained": "tab:green", "leak": "tab:red", "undecided": "tab:orange"}
CAPACITY_IN_RANGE = 4.0  # capacity drawn when at most this many times the peak


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


def _shade(ax, verdict: Verdict, engine: str, deadline_s: float | None, top: float) -> None:
    for w in (w for w in verdict.windows if w.engine == engine):
        ax.axvspan(max(w.start, 0.0), w.end, color=WINDOW_COLOURS.get(w.verdict, "grey"),
                   alpha=0.13, lw=0)
        if deadline_s is not None and w.start + deadline_s < w.end:
            ax.axvline(w.start + deadline_s, color="grey", ls=":", lw=0.8)
        if w.verdict == "leak":
            ax.annotate(f"leak: {w.num_blocks_held:,} held", (max(w.start, 0.0), top),
                        xytext=(2, -2), textcoords="offset points", va="top", fontsize=8,
                        color="tab:red")


def _hatch_missed(ax, verdict: Verdict, end_t: float) -> None:
    for c in (c for c in verdict.coverage if c.state == "missed"):
        ax.axvspan(max(c.start, 0.0), end_t if c.end is None else c.end, fill=False,
                   hatch="//", edgecolor="grey", lw=0)


def _used_panel(ax, timeline: Timeline, verdict: Verdict, engine: str,
                deadline_s: float | None) -> None:
    samples = timeline.samples_for(engine)
    xs, ys = _steps(samples, timeline.end_t, "num_used_blocks")
    ax.step(xs, ys, where="post", color="tab:purple", lw=1.4, label="used blocks")
    peak, capacity = max(ys, default=0), timeline.num_blocks.get(engine, 0)
    top = max(peak * 1.15, 1.0)
    if capacity and capacity <= CAPACITY_IN_RANGE * max(peak, 1):
        ax.axhline(capacity, color="black", ls="--", lw=0.9, label=f"capacity {capacity:,}")
        top = capacity * 1.08
    else:
        ax.plot([], [], " ", label=f"capacity {capacity:,} (off scale)")
    ax.set_ylim(0, top)
    _shade(ax, verdict, engine, deadline_s, top)
    _hatch_missed(ax, verdict, timeline.end_t)
    if deadline_s is not None:
        ax.plot([], [], color="grey", ls=":", lw=0.8, label=f"drain deadline {deadline_s:g} s")
    present = {w.verdict for w in verdict.windows if w.engine == engine}
    for name, colour in WINDOW_COLOURS.items():
        if name in present:
            ax.fill_between([], [], color=colour, alpha=0.25, label=f"idle window: {name}")
    if any(c.state == "missed" for c in verdict.coverage):
        ax.fill_between([], [], facecolor="none", hatch="//", edgecolor="grey",
                        label="expected window not observed")
    ax.set_ylabel(f"{engine}: used blocks")
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


def write_plot(path: Path, timeline: Timeline, verdict: Verdict, title: str = "",
               deadline_s: float | None = None) -> None:
    """The PNG (needs the plot extra: matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvdrain[plot]'") from None
    engines = [e for e in timeline.engines if timeline.samples_for(e)]
    cached = has_cached_data(timeline)
    ratios = [3] * len(engines) + [1.6] * cached
    if not ratios:  # nothing was observed: one empty panel that says so
        ratios = [1]
    height = max(2.4 * len(engines) + 2.2 * cached + 1, 3.0)
    fig, axes = plt.subplots(len(ratios), 1, sharex=True, figsize=(11, height),
                             gridspec_kw={"height_ratios": ratios}, squeeze=False)
    for ax, engine in zip(axes[:, 0], engines):
        _used_panel(ax, timeline, verdict, engine, deadline_s)
    if cached:
        _cached_panel(axes[-1, 0], timeline)
    if not engines and not cached:
        axes[0, 0].text(0.5, 0.5, "no KV-usage samples", ha="center", va="center",
                        transform=axes[0, 0].transAxes)
    axes[-1, 0].set_xlim(0, max(timeline.end_t, 1e-3))
    axes[-1, 0].set_xlabel("replay time (s)")
    fig.suptitle(title or "kvdrain replay", fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def system_label(settings: dict) -> str:
    """What ran the replay, from the report's settings: 'vLLM 0.32.0' (over HTTP, the
    server and its version), else 'kvdrain, liveness legacy'."""
    engine = settings.get("engine") or {}
    if engine.get("source") != "http server":
        return f"kvdrain, liveness {engine.get('liveness', '?')}"
    versions = [e.get("version") for e in (engine.get("engines") or {}).values()] or [engine.get("version")]
    known = sorted({v for v in versions if v is not None})
    label = f"{engine.get('server') or 'server'} {'/'.join(known) if known else '(version unknown)'}"
    return label + (f", liveness {engine['liveness']}" if engine.get("liveness") else "")


def plot_title(trace: str, system: str, clock: str, status: str, exit_code: int) -> str:
    """'pd_idle.jsonl | vLLM 0.32.0 | clock wall | VIOLATION (exit 1)'."""
    return f"{trace} | {system} | clock {clock} | {status.upper()} (exit {exit_code})"
