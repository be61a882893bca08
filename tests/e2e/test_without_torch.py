"""kvdrain installed without torch (no `model` extra): the HTTP paths work, the torch runner says what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.paths import EXAMPLE, ROOT
from tests.replay.vllm.test_launch import make_fake_venv

NO_TORCH = """
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def kvdrain_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "no-torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_torch_runner_without_torch_is_a_usage_error_saying_how_to_install_it(tmp_path):
    result = kvdrain_without_torch(tmp_path, "replay", str(EXAMPLE), "--no-live")
    assert result.returncode == 2
    assert "needs torch" in result.stderr and "kvdrain[model]" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_replay_through_launched_vllm_needs_no_torch(tmp_path):
    venv = make_fake_venv(tmp_path / "venv")
    result = kvdrain_without_torch(
        tmp_path,
        "replay",
        str(EXAMPLE),
        "--engine",
        "vllm",
        "--vllm-venv",
        str(venv),
        "--topology",
        "single",
        "--no-live",
        "--speedup",
        "2",
        "--drain-deadline",
        "0.5",
    )  # the fake answers /metrics at once
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_mock_runner_needs_no_torch(tmp_path):
    result = kvdrain_without_torch(
        tmp_path, "replay", str(EXAMPLE), "--runner", "mock", "--no-live", "--clock", "virtual"
    )
    assert result.returncode == 0, result.stdout + result.stderr
