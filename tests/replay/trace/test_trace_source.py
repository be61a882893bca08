"""Trace paths that are not plain files, and files that change under a replay (replay/trace/source.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

import replay.trace.source as source
from replay.trace.reader import TraceError, TraceRequest, read_trace, validate_trace
from replay.trace.source import watch_trace
from tests.paths import ROOT

EXAMPLE = ROOT / "examples" / "pd_idle.jsonl"


def _lines(n: int, prefix: str = "r") -> str:
    return "".join(
        json.dumps(
            {"t": round(0.01 * i, 3), "id": f"{prefix}{i}", "prompt_len": 16, "max_tokens": 2}
        )
        + "\n"
        for i in range(n)
    )


def _pipe_path(data: bytes) -> tuple[str, threading.Thread]:
    """A path naming the read end of a pipe that a thread fills with `data`."""
    read_fd, write_fd = os.pipe()

    def write() -> None:
        with os.fdopen(write_fd, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return f"/proc/self/fd/{read_fd}", writer


def test_a_pipe_is_read_once_and_every_pass_reads_the_same_bytes():
    path, writer = _pipe_path(EXAMPLE.read_bytes())
    summary = validate_trace(path)
    records = list(read_trace(path))
    writer.join(5)
    assert summary.num_requests == 32 == sum(isinstance(r, TraceRequest) for r in records)
    assert summary.sha256 == validate_trace(EXAMPLE).sha256


def test_a_fifo_without_a_writer_is_an_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "WRITER_WAIT_S", 0.2)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(
        TraceError, match=r"fifo: file: a FIFO that sent nothing at all \(no writer\?\)"
    ):
        validate_trace(fifo)


def test_a_fifo_with_a_writer_is_copied_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(_lines(5).encode())

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    watch_trace(fifo)
    writer.join(5)
    assert validate_trace(fifo).num_requests == 5 and len(list(read_trace(fifo))) == 5


def test_a_device_is_refused_at_once():
    with pytest.raises(
        TraceError, match="/dev/zero: file: a character device, not a trace file or a pipe"
    ):
        validate_trace("/dev/zero")


def test_a_trace_rewritten_between_passes_is_named_as_changed(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(_lines(20))
    watch_trace(path)
    assert validate_trace(path).num_requests == 20
    path.write_text(_lines(3, "x"))
    with pytest.raises(
        TraceError,
        match=r"trace.jsonl: file: changed from 1,[0-9]{3} to [0-9]+ bytes "
        r"while the replay was reading it",
    ):
        list(read_trace(path))


def test_a_trace_rewritten_during_a_pass_is_named_not_a_line_it_no_longer_has(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(_lines(20_000))
    watch_trace(path)
    records = read_trace(path)
    for _ in range(10):
        next(records)
    path.write_text('{"t": 0, "id": "half a line')  # truncated in place, then rewritten
    with pytest.raises(TraceError, match="changed from .* while the replay was reading it"):
        list(records)


def test_a_rewrite_that_keeps_size_and_time_is_caught_by_the_digest(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(_lines(5, "a"))
    st = path.stat()
    watch_trace(path)
    validate_trace(path)
    path.write_text(_lines(5, "b"))  # the same length
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(TraceError, match="rewritten while the replay was reading it"):
        list(read_trace(path))


def test_an_unwatched_file_may_change_between_reads(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(_lines(4))
    assert validate_trace(path).num_requests == 4
    path.write_text(_lines(6))
    assert validate_trace(path).num_requests == 6


def test_a_replay_of_a_process_substitution_verifies():
    """`kvdrain replay <(cat trace)`: the trace arrives on an inherited pipe."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "replay",
            f"/dev/fd/{read_fd}",
            "--clock",
            "virtual",
            "--no-live",
        ],
        cwd=ROOT,
        pass_fds=(read_fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    os.close(read_fd)
    try:
        with os.fdopen(write_fd, "wb") as f:
            f.write(EXAMPLE.read_bytes())
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out
    assert "VERIFIED" in out
