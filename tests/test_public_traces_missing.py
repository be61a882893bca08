"""A failed `make traces` leaves an empty traces/: the tests that read the public traces
skip, saying why, instead of failing."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.paths import ROOT

READERS = [
    "tests/replay/trace/test_trace.py::test_mooncake_real_trace",
    "tests/replay/trace/test_trace.py::test_azure_real_trace",
]


def test_the_public_trace_tests_skip_on_an_empty_traces_folder(tmp_path):
    (tmp_path / "conversation_trace.jsonl").touch()  # a download that wrote nothing
    env = dict(os.environ, KVDRAIN_TRACES=str(tmp_path))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "-rs",
            *READERS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert done.stdout.count("`make traces` fetches it") == 2, done.stdout
