"""What produced a report: kvdrain's version and commit, the date, the host and the device. Runs in: frontend process.

The commit is git's when kvdrain runs from a checkout (with "+dirty" when the tree has
changes), else unknown; the device is what the engines' settings say ran (a serve's own
over --target, "unknown" for an HTTP server, which does not say).
"""

from __future__ import annotations

import datetime
import platform
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def kvdrain_version() -> str:
    """The installed package's version, else pyproject.toml's, else unknown."""
    try:
        return metadata.version("kvdrain")
    except metadata.PackageNotFoundError:
        pass
    try:
        for line in PYPROJECT.read_text().splitlines():
            if line.startswith("version"):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "unknown"


def git_commit(root: Path = ROOT) -> str:
    """HEAD's hash (+dirty with uncommitted changes) when `root` is a git checkout, else unknown."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_of(engine_settings: dict) -> str:
    """'mock runner (virtual clock)', 'torch on cuda', or unknown (an HTTP server)."""
    runner, device = engine_settings.get("runner"), engine_settings.get("device")
    if runner is None:
        return "unknown"
    return f"{runner} runner" + (f" on {device}" if runner != "mock" and device else "")


def stamp(settings: dict) -> dict:
    """The report's "kvdrain" part."""
    return {
        "version": kvdrain_version(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node() or "unknown",
        "python": platform.python_version(),
        "device": device_of(settings.get("engine", {})),
    }
