"""docs/architecture.md's module map, from each module's first docstring line. Runs in: a shell.

`python -m tests.module_map` rewrites the map between its two markers;
tests/test_architecture.py fails when the map differs from the tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import ROOT

PACKAGES = ("engine", "connector", "replay")
MAP_DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- module map: python -m tests.module_map -->"
END = "<!-- end of module map -->"


def summary(path: Path) -> str:
    """A table row's cells from the docstring's first line: what it is | where it runs."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    what, _, runs_in = first.partition("Runs in:")
    return f"{what.strip()} | {runs_in.strip().rstrip('.')}"


def folders() -> list[Path]:
    """Every package folder, parents before children."""
    found = [p.parent for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")]
    return sorted(found, key=lambda p: p.relative_to(ROOT).parts)


def module_map() -> str:
    """The map as the tree has it: a line per package, then a line per module."""
    lines = [
        BEGIN,
        "",
        "| module | what it is | runs in |",
        "|---|---|---|",
        f"| `cli.py` | {summary(ROOT / 'cli.py')} |",
    ]
    for folder in folders():
        lines.append(f"| **`{folder.relative_to(ROOT)}/`** | {summary(folder / '__init__.py')} |")
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py":
                lines.append(f"| `{path.relative_to(ROOT)}` | {summary(path)} |")
    return "\n".join(lines + ["", END])


def documented_map() -> str:
    """The map as docs/architecture.md has it, markers included ("" without them)."""
    text = MAP_DOC.read_text()
    start, end = text.find(BEGIN), text.find(END)
    return text[start : end + len(END)] if start >= 0 and end >= 0 else ""


def write_map() -> None:
    old = documented_map()
    if not old:
        raise SystemExit(f"{MAP_DOC} has no {BEGIN!r} ... {END!r} section")
    MAP_DOC.write_text(MAP_DOC.read_text().replace(old, module_map()))


if __name__ == "__main__":
    write_map()
