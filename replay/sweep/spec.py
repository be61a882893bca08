"""A sweep's SPEC: a TOML file of replay options whose list values are the grid's axes. Runs in: frontend process.

Each key is a `kvdrain replay` option (`liveness`, `kv-lease-s`, `--max-requests`; `_`
and `-` alike) or `trace`, the positional; a scalar applies to every cell, a list is an
axis (a list inside an axis is one cell's repeated option). Cells are the axes' product
in the file's order, the first key outermost; every cell runs on the virtual clock.
Relative trace paths are the spec file's. A bad key or value is a SpecError (usage).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TRACE = "trace"
# Options a sweep sets itself, or that need more than the virtual clock.
REFUSED = frozenset(
    (
        "clock", "live", "no-live", "explain", "report", "requests", "plot", "series",
        "target", "metrics", "prometheus", "api-key", "curve-keys", "token", "engine",
    )
)  # fmt: skip
Scalar = str | int | float | bool


class SpecError(ValueError):
    """The spec cannot make a grid (the CLI's exit 2, before any cell runs)."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One replay of the grid: its options in the spec's order."""

    index: int
    options: tuple[tuple[str, Scalar | tuple[Scalar, ...]], ...]

    def argv(self) -> list[str]:
        """`kvdrain replay` arguments, the trace first (the sweep adds clock and report)."""
        values = dict(self.options)
        out = [str(values[TRACE])]
        for key, value in self.options:
            if key != TRACE:
                out += _flag(key, value)
        return out

    def label(self, axes: tuple[str, ...]) -> str:
        values = dict(self.options)
        return " ".join(f"{key}={_short(key, values[key])}" for key in axes)


def _flag(key: str, value: Scalar | tuple[Scalar, ...]) -> list[str]:
    if isinstance(value, tuple):
        return [a for v in value for a in _flag(key, v)]
    if value is True:
        return [f"--{key}"]
    if value is False:
        return [f"--no-{key}"]
    return [f"--{key}", str(value)]


def _short(key: str, value: object) -> str:
    return Path(str(value)).name if key == TRACE else str(value)


@dataclass(frozen=True, slots=True)
class SweepSpec:
    path: Path
    options: tuple[tuple[str, tuple], ...]  # key -> its values (one: not an axis)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(key for key, values in self.options if len(values) > 1)

    def cells(self) -> list[Cell]:
        keys = [key for key, _ in self.options]
        grid = itertools.product(*(values for _, values in self.options))
        return [Cell(i, tuple(zip(keys, combo))) for i, combo in enumerate(grid)]


def load_spec(path: Path, option_names: frozenset[str]) -> SweepSpec:
    """The spec at `path`; option_names: the replay options a key may name."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"{path}: {e}") from None
    options = [(_key(path, k, option_names), _values(path, k, v)) for k, v in raw.items()]
    keys = [k for k, _ in options]
    if len(set(keys)) < len(keys):
        raise SpecError(f"{path}: an option is named twice (`_` and `-` are the same)")
    if TRACE not in keys:
        raise SpecError(f"{path}: no `trace` (a path, or a list of them)")
    options = [(k, _traces(path, v) if k == TRACE else v) for k, v in options]
    return SweepSpec(path, tuple(options))


def _key(path: Path, key: str, option_names: frozenset[str]) -> str:
    name = key.removeprefix("--").replace("_", "-")
    if name in REFUSED:
        raise SpecError(f"{path}: `{key}`: the sweep sets it (every cell is a virtual replay)")
    if name != TRACE and name not in option_names:
        raise SpecError(f"{path}: `{key}` is not a `kvdrain replay` option")
    return name


def _values(path: Path, key: str, value: object) -> tuple:
    values = tuple(value) if isinstance(value, list) else (value,)
    if not values:
        raise SpecError(f"{path}: `{key}`: an empty list has no cell")
    for v in values:
        inner = v if isinstance(v, list) else [v]
        if not all(isinstance(x, (str, int, float, bool)) for x in inner):
            raise SpecError(f"{path}: `{key}`: {v!r} is not a string, number or boolean")
    return tuple(tuple(v) if isinstance(v, list) else v for v in values)


def _traces(path: Path, values: tuple) -> tuple:
    out = []
    for value in values:
        trace = Path(str(value))
        trace = trace if trace.is_absolute() else (path.parent / trace).resolve()
        if not trace.is_file():
            raise SpecError(f"{path}: trace {value!r}: no such file ({trace})")
        out.append(str(trace))
    return tuple(out)
