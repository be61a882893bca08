"""The live dashboard of a replay or a running serve: a pure render and a LiveView. Runs in: frontend process.

The state objects (replay/ui/dashboard.py) are plain dataclasses fed from StatsSnapshots
(wall clock) or EngineSamples (virtual clock); `render(state)` is a pure function of them. LiveView
renders on the caller's thread only, from `tick()`, at most 4 times a second on a
terminal (so it never races the state it reads and never slows an engine); without a
terminal it prints one `plain_line` a second at most. Both leave a final summary.
"""

from __future__ import annotations

import math
import os
import select
import sys
import time
from collections.abc import Callable, Iterable

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.layout import Layout
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from replay.ui.dashboard import (
    DashboardState,
    EngineView,
    ReplayProgress,
    StartupState,
    WindowVerdict,
)
from replay.verify.timeline import engine_role

NUM_WINDOW_ROWS = 4  # idle windows shown; 80x24 fits header 1 + engines 11 + windows 7 + footer
NUM_MESSAGE_ROWS = 3
COMPACT_ENGINES = 2  # more engines than this: one table row each instead of a panel each
WIDE = 120  # from this many columns the footer adds the latency so far
SPARKS = "▁▂▃▄▅▆▇█"
LOOP_STYLES = {
    "stepping": "bold green",
    "polling": "bold yellow",
    "blocked": "bold cyan",
    "stopped": "bold red",
}
ALARM_KEYS = ("num_expired", "num_failed_recvs")
VERDICT_COLOURS = {"drained": "green", "leak": "red", "undecided": "yellow"}
VERDICT_STYLES = {"drained": "bold green", "leak": "bold red", "undecided": "bold yellow"}


# ---- pure text helpers ---------------------------------------------------------------


def sparkline(values: Iterable[int], width: int) -> str:
    """The last `width` values as bars scaled to their peak; 0 is the lowest bar, any use is higher."""
    points = list(values)[-width:] if width > 0 else []
    peak = max(points, default=0)
    if peak <= 0:
        return SPARKS[0] * len(points)
    return "".join(
        SPARKS[0] if v <= 0 else SPARKS[1 + round((len(SPARKS) - 2) * v / peak)] for v in points
    )


def _rate(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}" if x < 1000 else f"{x / 1000:.1f}k"


def _ms(seconds: float | None) -> str:
    return (
        "-" if seconds is None else f"{1000 * seconds:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"
    )


def _window_counts(windows: list[WindowVerdict]) -> dict[str, int]:
    counts = {"drained": 0, "leak": 0, "undecided": 0}
    for w in windows:
        counts[w.verdict] = counts.get(w.verdict, 0) + 1
    return counts


def num_idle_windows(windows: list[WindowVerdict]) -> int:
    """Idle windows (quiet spells of the whole deployment), each judged once per engine:
    the count the verdict and the report's table use, not engine-windows."""
    return len({round(w.start, 6) for w in windows})


def engine_tallies(windows: list[WindowVerdict]) -> list[tuple[str, dict[str, int]]]:
    """Each engine's verdict counts over the windows, engines in engine_order; past
    COMPACT_ENGINES engines, each role's ('P (4)': its engines' windows together)."""
    engines = sorted({w.engine for w in windows}, key=engine_order)
    if len(engines) <= COMPACT_ENGINES:
        return [(e, _window_counts([w for w in windows if w.engine == e])) for e in engines]
    roles: dict[str, list[str]] = {}
    for engine in engines:
        roles.setdefault(engine_role(engine), []).append(engine)
    return [
        (f"{role} ({len(members)})", _window_counts([w for w in windows if w.engine in members]))
        for role, members in roles.items()
    ]


def window_tally(windows: list[WindowVerdict]) -> str:
    """'idle windows 4: P 4 leak, D 4 drained' (per engine, the verdicts that occur)."""
    parts = [
        f"{engine} " + " ".join(f"{n} {name}" for name, n in counts.items() if n)
        for engine, counts in engine_tallies(windows)
    ]
    return f"idle windows {num_idle_windows(windows)}" + (": " + ", ".join(parts) if parts else "")


def engine_order(engine_id: str) -> tuple[str, int, str, int]:
    """P before D, then the rest by name, each role's engines by index (P2 before P10),
    within each scraped source (NAME:P before NAME:D): the same order whichever engine
    reported first."""
    source, _, engine = engine_id.rpartition(":")
    role = engine_role(engine)
    index = engine[len(role) :]
    return (source, {"P": 0, "D": 1}.get(role, 2), role, int(index) if index else -1)


def ordered_views(state: DashboardState) -> list[EngineView]:
    return [state.engines[e] for e in sorted(state.engines, key=engine_order)]


def _rate_eta(p: ReplayProgress) -> str:
    """ " 812 req/s ETA 14s" (virtual clock), or "" before a rate is known."""
    if p.rate_per_s is None:
        return ""
    return f" {_rate(p.rate_per_s)} req/s ETA {_ms(p.eta_s)}"


def plain_line(state: DashboardState) -> str:
    """One progress line for logs: time, sends, each engine's used blocks and loop, verdicts."""
    p, startup = state.progress, state.startup
    if startup is not None and startup.ready_s is None:
        ready = ", ".join(f"{e} ready" for e in startup.ready_at)
        return (
            f"{startup.phase} {state.elapsed_s - startup.phase_start_s:.1f}s"
            + (f" ({startup.detail})" if startup.detail else "")
            + (f" | {ready}" if ready else "")
        )
    flight = "" if p is None or p.num_in_flight is None else f" ({p.num_in_flight} in flight)"
    parts = [
        f"t={p.trace_t if p else state.elapsed_s:.1f}s"
        + (f" sent {p.num_sent}/{p.num_total}{flight}{_rate_eta(p)}" if p else "")
    ]
    for view in ordered_views(state):
        c = view.counts
        parts.append(
            f"{view.engine_id} used {c.get('num_used_blocks', 0)}/{c.get('num_usable_blocks', 0)}"
            f" {view.loop_state}"
        )
    parts.append(window_tally(state.windows))
    return " | ".join(parts)


def summary_text(state: DashboardState, max_windows: int | None = None) -> str:
    """The plain final summary: the last line, the idle windows (leaks first, at most
    `max_windows` lines, then a count; None: all), every message."""
    lines = [f"final {plain_line(state)}"]
    windows = sorted(
        state.windows, key=lambda w: (w.verdict == "drained", w.start, engine_order(w.engine))
    )
    shown = windows if max_windows is None else windows[:max_windows]
    for w in shown:
        drain = "never drained" if w.time_to_drain is None else f"drained in {_ms(w.time_to_drain)}"
        lines.append(
            f"  window {w.engine} {w.start:.2f}s +{w.length:.2f}s: "
            f"{w.num_used_at_start} used at start, {drain}: {w.verdict}"
        )
    if len(shown) < len(windows):
        lines.append(
            f"  ... and {len(windows) - len(shown):,} more "
            f"window{'s' if len(windows) - len(shown) != 1 else ''} (--all-windows, --report)"
        )
    lines += [f"  ! {m}" for m in state.messages]
    return "\n".join(lines)


# ---- rich render -----------------------------------------------------------------------


class _Fit:
    """A one-line renderable drawn to whatever width it is given (bars, sparklines)."""

    def __init__(self, draw: Callable[[int], Text]) -> None:
        self.draw = draw

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.draw(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)


def _kv_bar(counts: dict[str, int], width: int) -> Text:
    """used | cached (free, still hashed) | free, in cells proportional to blocks."""
    total = max(counts.get("num_usable_blocks", 0), 1)
    used, cached = counts.get("num_used_blocks", 0), counts.get("num_cached_blocks", 0)
    num_used = min(max(round(width * used / total), 1 if used else 0), width)
    num_cached = min(round(width * (used + cached) / total), width) - num_used
    return Text.assemble(
        ("█" * num_used, "magenta"),
        ("▒" * max(num_cached, 0), "blue"),
        ("░" * (width - num_used - max(num_cached, 0)), "grey37"),
    )


def _pair_grid(view: EngineView, rows: tuple[tuple[str, str, str, str], ...]) -> Table:
    """Two label/value pairs per row; a value is a count key or a preformatted string. A
    row whose two counts the feeder does not observe is left out; one of them: unknown."""
    grid = Table.grid(padding=(0, 1), expand=True)
    for justify in ("left", "right", "left", "right"):
        grid.add_column(justify=justify, no_wrap=True)
    for a, ka, b, kb in rows:
        if not (_observed(view, ka) or _observed(view, kb)):
            continue
        grid.add_row(Text(a, "dim"), _cell(view, ka), Text(b, "dim"), _cell(view, kb))
    return grid


def _observed(view: EngineView, key: str) -> bool:
    return not key.startswith("num_") or view.is_observed(key)


def _cell(view: EngineView, key: str) -> Text:
    if not key.startswith("num_"):
        return Text(key)
    if not view.is_observed(key):
        return Text("unknown", "dim")
    value = view.counts.get(key, 0)
    return Text(str(value), "bold red" if value and key in ALARM_KEYS else "")


def _queue_grid(view: EngineView) -> Table:
    return _pair_grid(
        view,
        (
            ("waiting", "num_waiting", "skipped", "num_skipped_waiting"),
            ("remote KVs", "num_waiting_for_remote_kvs", "running", "num_running"),
            ("fin-await-free", "num_finished_awaiting_free", "preempted", "num_preemptions"),
            ("cached blocks", "num_cached_blocks", "free", "num_free_blocks"),
        ),
    )


def _connector_grid(view: EngineView) -> Table:
    c = view.counts
    age = _ms(c.get("oldest_send_age_ms", 0) / 1000 if c.get("num_sends_pending", 0) else None)
    return _pair_grid(
        view,
        (
            ("sends pending", "num_sends_pending", "oldest", age),
            ("sent", "num_sent", "expired", "num_expired"),
            ("recvs in flight", "num_recvs_in_flight", "failed", "num_failed_recvs"),
        ),
    )


def kv_figure(view: EngineView) -> str:
    """' 40/127' blocks, ' 40/127 tok' tokens, ' 3.1%' for a pool known only as a fraction."""
    c = view.counts
    used, total = c.get("num_used_blocks", 0), c.get("num_usable_blocks", 0)
    if view.unit == "ppm":
        return f" {100 * used / max(total, 1):.1f}%"
    return f" {used}/{total}" + (" tok" if view.unit == "tokens" else "")


def spark_scale(view: EngineView) -> str:
    """The sparkline's scale: its peak, of the pool, so a full bar says how full."""
    peak, total = max(view.used_history, default=0), view.counts.get("num_usable_blocks", 0)
    if view.unit == "ppm":
        return f" peak {100 * peak / max(total, 1):.1f}%"
    return f" peak {peak}/{total}"


def _loop_text(view: EngineView) -> Text:
    if not view.is_observed("num_steps"):
        return Text.assemble((view.loop_state, "dim"), " steps unknown")
    return Text.assemble(
        (view.loop_state, LOOP_STYLES.get(view.loop_state, "bold")),
        f" {_rate(view.steps_per_s)} steps/s",
        f" {_rate(view.wakeups_per_s)} wake/s",
    )


def _detail_grid(view: EngineView) -> Table:
    c, history = view.counts, list(view.used_history)
    used, scale = kv_figure(view), spark_scale(view)
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    grid.add_row("KV", _Fit(lambda w: _kv_bar(c, w - len(used)) + Text(used, "magenta")))
    grid.add_row(
        "used",
        _Fit(
            lambda w: (
                Text(sparkline(history, max(w - len(scale), 1)), "magenta") + Text(scale, "dim")
            )
        ),
    )
    grid.add_row("loop", _loop_text(view))
    return grid


def _engine_panel(view: EngineView) -> Panel:
    pid = view.counts.get("connector_worker_pid")
    parts = [_queue_grid(view), _detail_grid(view)]
    if view.has_connector:
        parts.append(_connector_grid(view))
    return Panel(
        Group(*parts),
        title=Text(f"engine {view.engine_id}", "bold"),
        title_align="left",
        subtitle=f"worker pid {pid}" if pid else None,
        subtitle_align="right",
    )


_QUEUE_ROWS = (
    ("num_waiting", "num_skipped_waiting"),
    ("num_waiting_for_remote_kvs", "num_running"),
    ("num_finished_awaiting_free", "num_preemptions"),
    ("num_cached_blocks", "num_free_blocks"),
)


def _engine_height(view: EngineView) -> int:
    queue = sum(1 for row in _QUEUE_ROWS if any(view.is_observed(k) for k in row))
    return queue + 3 + (3 if view.has_connector else 0) + 2  # queue + detail + connector + border


def _engine_table(views: list[EngineView]) -> Panel:
    """One row per engine, P's then D's (a rule between roles): for many engines (4p4d)
    at 80 columns. Counts a server does not expose show as '?'."""
    table = Table(
        box=box.SIMPLE_HEAD, padding=(0, 1), expand=True, show_edge=False, header_style="dim"
    )
    for name, justify in (
        ("engine", "left"),
        ("loop", "left"),
        ("KV", "left"),
        ("used", "right"),
        ("wait", "right"),
        ("run", "right"),
        ("rKV", "right"),
        ("faf", "right"),
        ("steps/s", "right"),
    ):
        table.add_column(
            name,
            justify=justify,
            no_wrap=True,
            ratio=1 if name == "KV" else None,
            min_width=6 if name == "KV" else None,
        )
    role = None
    for view in views:
        if role is not None and engine_role(view.engine_id.rpartition(":")[2]) != role:
            table.add_section()
        role = engine_role(view.engine_id.rpartition(":")[2])
        counts = view.counts
        steps = _rate(view.steps_per_s) if view.is_observed("num_steps") else "?"
        table.add_row(
            Text(view.engine_id, "bold"),
            Text(view.loop_state, LOOP_STYLES.get(view.loop_state, "dim")),
            _Fit(lambda width, c=counts: _kv_bar(c, width)),
            kv_figure(view).strip(),
            *(
                _short_cell(view, k)
                for k in (
                    "num_waiting",
                    "num_running",
                    "num_waiting_for_remote_kvs",
                    "num_finished_awaiting_free",
                )
            ),
            steps,
        )
    return Panel(
        table,
        title=Text(f"engines ({len(views)})", "bold"),
        title_align="left",
        subtitle="rKV: waiting for remote KVs  faf: finished, awaiting free",
        subtitle_align="right",
    )


def _short_cell(view: EngineView, key: str) -> Text:
    cell = _cell(view, key)
    return Text("?", "dim") if cell.plain == "unknown" else cell


def _engines_height(views: list[EngineView]) -> int:
    """The engines region: a panel each, or past COMPACT_ENGINES one table row each."""
    if len(views) > COMPACT_ENGINES:
        roles = {engine_role(v.engine_id.rpartition(":")[2]) for v in views}
        return (
            len(views) + len(roles) - 1 + 4
        )  # rows, a rule between roles, head and its rule, border
    return max((_engine_height(v) for v in views), default=3)


def _render_header(state: DashboardState) -> Table:
    p, startup = state.progress, state.startup
    info = [state.server] if state.server else []
    info += [f"clock {p.clock}", f"liveness {p.liveness or 'unknown'}"] if p else []
    if p and p.clock == "wall":
        info.append(f"speed ×{p.speedup:g}")
    if startup is not None and startup.ready_s is not None:
        info.append(f"ready in {startup.ready_s:.1f}s")
    if state.quit_key:
        info.append("q quits")
    grid = Table.grid(expand=True, padding=(0, 1))
    # The title (the trace's name) keeps its width; the facts on the right give way.
    grid.add_column(no_wrap=True, min_width=len(state.title))
    grid.add_column(no_wrap=True, justify="right", overflow="ellipsis", ratio=1)
    facts = Text("  ".join(info + [f"elapsed {state.elapsed_s:.1f}s"]))  # a server's: not markup
    grid.add_row(Text(state.title, "bold"), facts)
    grid.style = "on grey23"
    return grid


def chart(values: list[int], width: int, height: int) -> list[str]:
    """The last `width` values as columns `height` rows tall (eighths of a row), scaled
    to their peak; the rows top first. Any use shows at least an eighth."""
    points = values[-width:] if width > 0 else []
    peak = max(points, default=0)
    rows = []
    for row in range(height - 1, -1, -1):
        line = []
        for v in points:
            eighths = 0 if peak <= 0 or v <= 0 else max(round(8 * height * v / peak), 1)
            fill = min(max(eighths - 8 * row, 0), 8)
            line.append(" " if fill == 0 else SPARKS[fill - 1])
        rows.append("".join(line))
    return rows


LEGEND = (
    Text.assemble(
        "\n",
        ("KV bar ", "dim"),
        ("█", "magenta"),
        " used  ",
        ("▒", "blue"),
        " cached (free, still hashed)  ",
        ("░", "grey37"),
        " free",
        no_wrap=False,
    ),
    Text(
        "skipped: skipped_waiting  remote KVs: WAITING_FOR_REMOTE_KVS  fin-await-free: "
        "finished, blocks held for the connector",
        "dim",
    ),
)
HISTORY_MIN_ROWS = 6  # a history chart's least height (with its border and scale)
TALL_LOWER_ROWS = 18  # below this many rows, the lower region is all idle windows


class _HistoryPanel:
    """Each engine's used blocks over its last HISTORY_LEN reports, side by side, as tall
    as the region, with the scale (peak of the pool) in each title."""

    def __init__(self, views: list[EngineView]) -> None:
        self.views = views

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or HISTORY_MIN_ROWS
        grid = Table.grid(expand=True, padding=(0, 1))
        for _ in self.views:
            grid.add_column(ratio=1)
        width = max((options.max_width - 3 * len(self.views)) // max(len(self.views), 1), 1)
        grid.add_row(
            *(
                Panel(
                    Text(
                        "\n".join(chart(list(v.used_history), width - 2, max(height - 2, 1))),
                        "magenta",
                        no_wrap=True,
                    ),
                    title=f"{v.engine_id} used, last {len(v.used_history)} reports",
                    subtitle=spark_scale(v).strip(),
                    title_align="left",
                    subtitle_align="right",
                    height=height,
                )
                for v in self.views
            )
        )
        yield grid


class _WindowsPanel:
    """The last idle windows, as many as the region's height allows (NUM_WINDOW_ROWS unbounded)."""

    def __init__(self, windows: list[WindowVerdict]) -> None:
        self.windows = windows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        num_rows = NUM_WINDOW_ROWS if options.height is None else max(options.height - 3, 0)
        table = Table(expand=True, box=None, padding=(0, 1), header_style="dim")
        for name, justify in (
            ("engine", "left"),
            ("start", "right"),
            ("length", "right"),
            ("used at start", "right"),
            ("held", "right"),
            ("drain", "right"),
            ("verdict", "left"),
        ):
            table.add_column(name, justify=justify, no_wrap=True)
        for w in self.windows[-num_rows:] if num_rows else []:
            drain = Text("never", "red") if w.time_to_drain is None else Text(_ms(w.time_to_drain))
            held = str(w.num_blocks_held) if w.time_to_drain is None else "0"
            table.add_row(
                w.engine,
                f"{w.start:.2f}s",
                f"{w.length:.2f}s",
                str(w.num_used_at_start),
                held,
                drain,
                Text(w.verdict, VERDICT_STYLES.get(w.verdict, "")),
            )
        spare = num_rows - min(len(self.windows), num_rows)
        body = (
            Group(table, *LEGEND)
            if options.height is not None and spare >= len(LEGEND) + 1
            else table
        )
        title = f"idle windows {num_idle_windows(self.windows)}"
        for engine, counts in engine_tallies(self.windows):
            title += f"  {engine}:" + "".join(
                f" [{VERDICT_COLOURS[name]}]{n} {name}[/]" for name, n in counts.items() if n
            )
        yield Panel(body, title=title, title_align="left", height=options.height)


class _LowerPanel:
    """Below the engines: on a short screen the idle windows; on a tall one history charts
    above the windows (the windows keep what they need, at least NUM_WINDOW_ROWS)."""

    def __init__(self, state: DashboardState, views: list[EngineView]) -> None:
        self.state, self.views = state, views

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height
        windows = _WindowsPanel(self.state.windows)
        if height is None or height < TALL_LOWER_ROWS or not self.views:
            yield from windows.__rich_console__(console, options)
            return
        windows_rows = min(
            max(len(self.state.windows), NUM_WINDOW_ROWS) + 3, height - HISTORY_MIN_ROWS
        )
        layout = Layout()
        layout.split_column(
            Layout(_HistoryPanel(self.views), name="history"),
            Layout(windows, name="windows", size=windows_rows),
        )
        yield from layout.__rich_console__(console, options)


def _footer_line(head: str, p: ReplayProgress, width: int) -> Text:
    """The progress head (the latency so far only from WIDE columns), then a bar of the rest."""
    if width < WIDE and "  ttft" in head:
        head = head[: head.index("  ttft")]
    head = head[:width]
    room = max(width - len(head) - 1, 0)
    done = round(room * min(p.num_sent / max(p.num_total, 1), 1.0))
    return Text.assemble(
        head, " " if room else "", ("━" * done, "magenta"), ("━" * (room - done), "grey23")
    )


def _render_footer(state: DashboardState) -> Group:
    p = state.progress
    lines: list = []
    if p is not None:
        if p.clock == "virtual":
            head = f"simulated {p.num_sent}/{p.num_total}  trace {p.trace_t:.1f}s{_rate_eta(p)}"
        else:
            flight = "" if p.num_in_flight is None else f" ({p.num_in_flight} in flight)"
            head = (
                f"sent {p.num_sent}/{p.num_total}{flight}  trace {p.trace_t:.1f}/{p.duration_s:.1f}s"
                f"  late p50 {_ms(p.lateness_percentile_s(50))} p99 {_ms(p.lateness_percentile_s(99))}"
            )
        ttft = p.ttft_percentile_s(50)
        if ttft is not None:
            head += f"  ttft p50 {_ms(ttft)} p99 {_ms(p.ttft_percentile_s(99))}"
        lines.append(_Fit(lambda w, head=head, p=p: _footer_line(head, p, w)))
    lines += [
        Text(f"! {m}", "bold red", no_wrap=True, overflow="ellipsis")
        for m in state.messages[-NUM_MESSAGE_ROWS:]
    ]
    return Group(*lines)


def render(state: DashboardState) -> Layout:
    """The whole dashboard: regions "header", "engines", "windows", "footer"."""
    views = ordered_views(state)
    engines = Layout(name="engines", size=_engines_height(views))
    startup = state.startup
    if startup is not None and (startup.ready_s is None or not views):
        engines.size = max(engines.size, 4 + max(len(startup.engines), len(startup.ready_at)))
        engines.update(_startup_panel(startup, state.elapsed_s))
    elif len(views) > COMPACT_ENGINES:
        engines.update(_engine_table(views))
    elif views:
        engines.split_row(*(Layout(_engine_panel(v), name=f"engine:{v.engine_id}") for v in views))
    elif state.progress is not None and state.progress.clock == "virtual":
        engines.update(
            Panel(
                Text(
                    "virtual clock: engines run in-process; blocks and windows show at the end",
                    "dim",
                    overflow="ellipsis",
                )
            )
        )
    else:
        engines.update(Panel(Text("waiting for the first stats…", "dim")))
    footer_size = (1 if state.progress else 0) + min(len(state.messages), NUM_MESSAGE_ROWS)
    layout = Layout(name="root")
    layout.split_column(
        Layout(_render_header(state), name="header", size=1),
        engines,
        Layout(_LowerPanel(state, views), name="windows", minimum_size=3),
        Layout(_render_footer(state), name="footer", size=max(footer_size, 1)),
    )
    return layout


def _startup_panel(startup: StartupState, now_s: float) -> Panel:
    """The phase with its ticking clock, and each engine: ready in N s, or still starting."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    if startup.ready_s is None:
        phase = Text.assemble(
            (startup.phase, "bold yellow"), f"  {now_s - startup.phase_start_s:.1f}s"
        )
        grid.add_row(phase, Text(startup.detail, "dim"))
    else:
        grid.add_row(Text(f"ready in {startup.ready_s:.1f}s", "bold green"), "")
    for engine in [*startup.engines, *(e for e in startup.ready_at if e not in startup.engines)]:
        at = startup.ready_at.get(engine)
        grid.add_row(
            Text(f"  engine {engine}", "bold"),
            Text("starting…", "yellow") if at is None else Text(f"ready in {at:.2f}s", "green"),
        )
    return Panel(grid, title=Text("start-up", "bold"), title_align="left")


# ---- keys ------------------------------------------------------------------------------


class KeyReader:
    """Keys typed on the terminal while a live view runs: cbreak mode (no Enter, no echo)
    from __enter__ to __exit__, which restores the terminal's settings whatever ends the
    run. A no-op where stdin is not a terminal."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = sys.stdin.fileno() if fd is None else fd
        self._saved: list | None = None

    @staticmethod
    def available() -> bool:
        try:
            return sys.stdin is not None and sys.stdin.isatty()
        except (AttributeError, ValueError):
            return False

    def __enter__(self) -> KeyReader:
        import termios
        import tty

        self._saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        return self

    def read(self) -> str:
        """What was typed since the last read, without waiting."""
        text = ""
        while select.select([self.fd], [], [], 0)[0]:
            chunk = os.read(self.fd, 64)
            if not chunk:
                break
            text += chunk.decode(errors="replace")
        return text

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None


# ---- the view --------------------------------------------------------------------------


class LiveView:
    """Shows `state` while the frontend runs: a rich Live on a terminal, plain lines otherwise.

    Call `tick()` from the frontend's loop after updating the state; it renders only
    when due (4/s on a terminal, `plain_interval_s` otherwise), so it costs nothing else.
    Where stdin is a terminal it also reads keys then: `q` sets `quit_requested`, which
    the caller's loop honours (the terminal's settings come back in __exit__).
    """

    def __init__(
        self,
        state: DashboardState,
        console: Console | None = None,
        plain_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_window_lines: int | None = 10,
        read_keys: bool | None = None,
    ) -> None:
        self.state, self.console, self.clock = state, console or Console(), clock
        self.max_window_lines = max_window_lines
        self.is_live = self.console.is_terminal
        self.interval_s = 0.25 if self.is_live else plain_interval_s
        self._last_t = -math.inf
        self._num_messages_printed = 0
        self._num_startup_lines = 0
        self.keys = (
            KeyReader() if (KeyReader.available() if read_keys is None else read_keys) else None
        )
        self.quit_requested = False
        # auto_refresh=False: rich's refresh thread would render while the frontend
        # mutates the state; tick() refreshes on the frontend's thread instead.
        self._live = (
            Live(
                console=self.console,
                refresh_per_second=4,
                auto_refresh=False,
                transient=False,
                get_renderable=lambda: render(self.state),
            )
            if self.is_live
            else None
        )

    def __enter__(self) -> LiveView:
        if self.keys is not None:
            self.keys.__enter__()
            self.state.quit_key = True
        try:
            if self._live is not None:
                self._live.start(refresh=True)
        except BaseException:
            self._restore_keys()
            raise
        return self

    def tick(self, force: bool = False) -> None:
        """Redraw (terminal) or print a plain line (no terminal) if one is due."""
        if self._live is None:
            self._print_new_startup_lines()  # at once: a phase is news
        now = self.clock()
        if not force and now - self._last_t < self.interval_s:
            return
        self._last_t = now
        if self.keys is not None and "q" in self.keys.read().lower():
            self.quit_requested = True
        if self._live is not None:
            self._live.refresh()
            return
        self._print_new_messages()
        self._print(plain_line(self.state))

    def _print_new_startup_lines(self) -> None:
        lines = self.state.startup.lines if self.state.startup is not None else []
        for line in lines[self._num_startup_lines :]:
            self._print(line)
        self._num_startup_lines = len(lines)

    def _print_new_messages(self) -> None:
        for message in self.state.messages[self._num_messages_printed :]:
            self._print(f"! {message}")
        self._num_messages_printed = len(self.state.messages)

    def _print(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def _restore_keys(self) -> None:
        if self.keys is not None:
            self.keys.__exit__()
            self.state.quit_key = False

    def __exit__(self, *exc: object) -> None:
        try:
            if self._live is not None:  # the last frame stays on screen (transient=False)
                self._live.refresh()
                self._live.stop()
                return
            self._print_new_startup_lines()
            self._print(summary_text(self.state, self.max_window_lines))
        finally:
            self._restore_keys()
