"""The project's structure, checked from the source: no import circle, layers point one way, the pure core stays pure."""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

import pytest

from tests.module_map import MAP_DOC, documented_map, module_map

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "connector", "replay")
# What each layer may import (DESIGN.md: cli -> replay -> {connector, engine}, connector -> engine).
LAYERS = {
    "engine": {"engine"},
    "connector": {"engine", "connector"},
    "replay": {"engine", "connector", "replay"},
    "cli": {"engine", "connector", "replay", "cli"},
}
MAX_FLAT_REPLAY_MODULES = 6  # the rest of replay/ lives in one subpackage per concern
# The pure ring is a path: everything under engine/core/ (the simulator drives it on a virtual clock).
PURE_RING = "engine.core"
IMPURE = {
    "torch",
    "numpy",
    "zmq",
    "msgpack",
    "time",
    "random",
    "socket",
    "selectors",
    "asyncio",
    "multiprocessing",
    "threading",
    "subprocess",
    "signal",
    "os",
    "io",
    "pathlib",
    "shutil",
    "tempfile",
    "secrets",
    "uuid",
    "datetime",
}


def project_modules() -> dict[str, Path]:
    """Every module of engine/, connector/, replay/ and cli.py, by dotted name (a package by its own)."""
    modules = {"cli": ROOT / "cli.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = project_modules()


def imported_names(module: str) -> set[str]:
    """Every dotted name `module` imports anywhere in it, function-level and TYPE_CHECKING included."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level - 1 packages from this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def owner(name: str) -> str | None:
    """The project module that defines `name` (its longest module prefix); None: not ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        targets = {owner(name) for name in imported_names(module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


GRAPH = import_graph()


def layer(module: str) -> str:
    return module.partition(".")[0]


def shortest_circle(start: str) -> list[str] | None:
    """The shortest import path from `start` back to itself, or None."""
    paths = {start: [start]}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(GRAPH[module]):
            if target == start:
                return paths[module] + [start]
            if target not in paths:
                paths[target] = paths[module] + [target]
                queue.append(target)
    return None


def test_the_scan_sees_the_project():
    assert {"cli", "engine.core.engine_core", "replay.deploy.pd_router", "replay.pipeline"} <= set(
        MODULES
    )
    assert (
        "engine.core.outputs" in GRAPH["engine.core.engine_core"]
    )  # a plain from-import is an edge
    assert owner("replay.verify.timeline.Timeline") == "replay.verify.timeline"
    assert owner("zmq.Socket") is None


def test_no_import_circle():
    circles = {tuple(c) for m in MODULES if (c := shortest_circle(m)) is not None}
    unique = {frozenset(c): c for c in circles}
    assert not unique, "import circles:\n" + "\n".join(" -> ".join(c) for c in unique.values())


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_imports_point_down(name):
    """engine imports nothing above it; connector only engine; replay no cli."""
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        if layer(m) == name
        for t in targets
        if layer(t) not in LAYERS[name]
    )
    assert not upward, f"{name} imports upward:\n" + "\n".join(upward)


# replay/'s rooms, bottom to top: a room imports only rooms below it (imports inside
# functions counted), so no two rooms import each other.
REPLAY_ROOMS = (
    "trace",
    "verify",
    "runtime",
    "openai",
    "metrics",
    "deploy",
    "sim",
    "target",
    "wall",
    "serve",
    "vllm",
    "pipeline",
    "ui",
    "sweep",
    "commands",
)


def replay_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "replay" and len(parts) > 1 else None


def test_every_replay_module_lives_in_a_layered_room():
    rooms = {replay_room(m) for m in MODULES} - {None}
    assert rooms == set(REPLAY_ROOMS), sorted(rooms ^ set(REPLAY_ROOMS))


def test_replay_rooms_import_only_rooms_below_them():
    rank = {room: i for i, room in enumerate(REPLAY_ROOMS)}
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        if replay_room(m)
        for t in targets
        if replay_room(t) and rank[replay_room(t)] > rank[replay_room(m)]
    )
    assert not upward, "replay rooms importing upward:\n" + "\n".join(upward)


# Who may import the terminal libraries: the command line (options and verbs), the live
# view and the printed summary; below them, replay is plain data and functions.
TERMINAL_LIBRARIES = ("click", "rich")
TERMINAL_MODULES = ("cli", "replay.commands", "replay.ui", "replay.verify.report")


def test_only_the_command_line_and_the_views_import_click_or_rich():
    importers = sorted(
        f"{m} imports {name}"
        for m in MODULES
        for name in imported_names(m)
        if name.partition(".")[0] in TERMINAL_LIBRARIES
        and not any(m == t or m.startswith(t + ".") for t in TERMINAL_MODULES)
    )
    assert not importers, "\n".join(importers)


def test_replay_is_subpackages_with_few_flat_modules():
    flat = sorted(p.name for p in (ROOT / "replay").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= MAX_FLAT_REPLAY_MODULES, f"flat modules in replay/: {flat}"


def in_pure_ring(module: str) -> bool:
    return module == PURE_RING or module.startswith(PURE_RING + ".")


def pure_closure() -> set[str]:
    """The pure ring's modules and every project module they import, transitively."""
    seen, todo = set(), [m for m in MODULES if in_pure_ring(m)]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(GRAPH[module])
    return seen


def test_pure_ring_imports_no_torch_zmq_clock_randomness_or_io():
    """engine/core/ and what it imports: no torch, zmq, clock, randomness or I/O."""
    closure = pure_closure()
    assert "engine.core.scheduler" in closure
    impure = sorted(
        f"{m} imports {name}"
        for m in closure
        for name in imported_names(m)
        if owner(name) is None and name.partition(".")[0] in IMPURE
    )
    assert not impure, "\n".join(impure)
    assert all(layer(m) == "engine" for m in closure), sorted(closure)


def test_packages_say_what_they_are_for():
    """Every package's __init__ has a docstring of more than its name."""
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert len(doc.split()) > 4, f"{module}: {doc!r}"


def test_docs_map_every_module_as_the_tree_has_it():
    """docs/architecture.md's map is the generated one (python -m tests.module_map rewrites it)."""
    assert documented_map() == module_map(), (
        "docs/architecture.md's module map is stale: run python -m tests.module_map"
    )


def test_docs_name_replays_rooms_bottom_to_top_as_the_layering_test_has_them():
    """docs/architecture.md lists the rooms as REPLAY_ROOMS has them, in order."""
    text = MAP_DOC.read_text()
    paragraph = text[text.index("Rooms, bottom to top:") :].split("\n\n")[0]
    assert re.findall(r"`(\w+)`", paragraph) == list(REPLAY_ROOMS), paragraph


def test_every_module_says_what_it_is_and_where_it_runs():
    def first_line(path: Path) -> str:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    missing = sorted(m for m, path in MODULES.items() if "Runs in:" not in first_line(path))
    assert not missing, f"first docstring lines without 'Runs in:': {missing}"


def test_each_package_docstring_names_all_its_modules():
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        names = [p.stem for p in path.parent.glob("*.py") if p.name != "__init__.py"]
        names += [p.parent.name for p in path.parent.glob("*/__init__.py")]
        unnamed = sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", doc))
        assert not unnamed, f"{module}'s docstring does not name {unnamed}"


def test_docs_index_every_fast_path_test():
    """Each fast/slow pair's test file is in docs/architecture.md's index of fast paths."""
    text = MAP_DOC.read_text()
    index = text[text.index("## Fast paths and the tests that pin them") :]
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*fast_paths.py"))
    assert files and all(f"`{f}`" in index for f in files), files


# Records of many fields, each built at several sites: only keywords say which value is which.
WIDE_RECORDS = (
    "replay.verify.timeline:RequestRecord",
    "replay.verify.timeline:EngineSample",
    "replay.verify.timeline:Timeline",
    "replay.trace.reader:TraceSummary",
    "replay.trace.inspect:TraceInspection",
    "replay.verify.rules:IdleWindow",
    "replay.verify.rules:Verdict",
    "replay.verify.coverage:WindowCoverage",
    "replay.sim.cost:Calibration",
    "replay.ui.dashboard:ReplayProgress",
    "replay.ui.dashboard:WindowVerdict",
    "connector.worker_proc:ConnectorWorkerConfig",
    "engine.core.outputs:ScheduledRequest",
)


@pytest.mark.parametrize("name", WIDE_RECORDS)
def test_wide_records_take_keywords_only(name):
    import dataclasses
    import importlib

    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    positional = [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only]
    assert not positional, f"{attr} takes {positional} by position"
