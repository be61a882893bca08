"""A trace path as every pass over it opens it: a pipe read once, a file that must not change. Runs in: frontend process.

A replay reads its trace several times (the format, the validating pass, the forecast, the
run). A pipe, a FIFO or a socket (`replay <(cat trace)`) can be read only once, so the
first open copies it into an unlinked temporary file (at most MAX_COPY_BYTES; a writer
silent for WRITER_WAIT_S, or none at all, is an error, never a hang) and every later
open reads that copy. A character or block device (/dev/zero) or a directory is refused
at once. Under watch_trace, a regular file's later passes must find the file as the
first found it (device, inode, size, modification time, checked at every open, every
CHECK_EVERY_LINES lines and at the end of a pass; and the same sha256 over every full
pass), so a trace rewritten mid-run is named as such, never as a bad line of a file that
no longer has it. The copies and fingerprints are this process's, one per path: a
replay runs once per process; watch_trace takes a file's fingerprint afresh and keeps a
pipe's copy (the pipe itself can be read only once).
"""

from __future__ import annotations

import os
import select
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAX_COPY_BYTES = 4 << 30  # a pipe's bytes kept on disk, at most
WRITER_WAIT_S = 30.0  # a pipe or FIFO that sends nothing this long: no writer, or a stuck one
CHECK_EVERY_LINES = 4096  # how often a pass looks for a change of the file under it
_CHUNK = 1 << 20


class TraceError(ValueError):
    """A trace that cannot be read; the message says where and why (replay/trace/reader.py
    raises it too)."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies a regular file's bytes without reading them."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> Fingerprint:
        return Fingerprint(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(slots=True)
class _Watched:
    """A regular file under watch_trace: its first fingerprint and full-pass digest."""

    fingerprint: Fingerprint
    sha256: str | None = None


_COPIES: dict[str, BinaryIO] = {}  # a non-regular path -> the unlinked copy of its bytes
_WATCHED: dict[str, _Watched] = {}


def watch_trace(path: str | Path) -> None:
    """From now on every pass over `path` reads the bytes it has now: a pipe is copied
    now, a regular file must stay as it is (check_unchanged); a device is refused."""
    key = str(path)
    st = _stat(key)
    if stat.S_ISREG(st.st_mode):
        _WATCHED[key] = _Watched(Fingerprint.of(st))
        return
    if key not in _COPIES:  # a pipe already copied (read once before the run) keeps its copy
        _COPIES[key] = _copy(key, st)


def open_trace(path: str | Path) -> BinaryIO:
    """The trace's bytes, from the start, in a file of its own."""
    key = str(path)
    copy = _COPIES.get(key)
    if copy is None:
        st = _stat(key)
        if stat.S_ISREG(st.st_mode):
            check_unchanged(key)
            return open(key, "rb")
        copy = _COPIES[key] = _copy(key, st)
    return open(f"/proc/self/fd/{copy.fileno()}", "rb")  # its own offset, the same bytes


def check_unchanged(path: str | Path) -> None:
    """TraceError if a watched file is not as watch_trace found it."""
    key = str(path)
    watched = _WATCHED.get(key)
    if watched is None:
        return
    try:
        now = Fingerprint.of(os.stat(key))
    except OSError as e:
        raise TraceError(
            f"{key}: file: gone while the replay was reading it ({e.strerror})"
        ) from None
    if now != watched.fingerprint:
        raise TraceError(
            f"{key}: file: {_change(watched.fingerprint, now)} while the replay "
            f"was reading it: its passes would read different traces; "
            f"replay a copy that nothing writes to"
        )


def check_digest(path: str | Path, sha256: str) -> None:
    """A full pass read bytes whose digest is sha256: the first one's for a watched file."""
    watched = _WATCHED.get(str(path))
    if watched is None:
        return
    if watched.sha256 is None:
        watched.sha256 = sha256
    elif watched.sha256 != sha256:
        raise TraceError(
            f"{path}: file: rewritten while the replay was reading it (its "
            f"bytes differ from the first pass's, its size and time do not); "
            f"replay a copy that nothing writes to"
        )


def _change(old: Fingerprint, new: Fingerprint) -> str:
    if (old.device, old.inode) != (new.device, new.inode):
        return "replaced by another file"
    if old.size != new.size:
        return f"changed from {old.size:,} to {new.size:,} bytes"
    return "modified"


def _stat(key: str) -> os.stat_result:
    try:
        st = os.stat(key)
    except OSError as e:
        raise TraceError(f"{key}: file: cannot read it ({e.strerror})") from None
    kind = _REFUSED.get(stat.S_IFMT(st.st_mode))
    if kind is not None:
        raise TraceError(f"{key}: file: {kind}, not a trace file or a pipe")
    return st


_REFUSED = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def _copy(key: str, st: os.stat_result) -> BinaryIO:
    """Read a pipe, FIFO or socket to its end into an unlinked temporary file, bounded in
    size and in how long it may stay silent."""
    kind = (
        "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "stream"
    )
    try:
        fd = os.open(key, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer opens at once
    except OSError as e:
        raise TraceError(f"{key}: file: cannot read it ({e.strerror})") from None
    copy = tempfile.TemporaryFile(prefix="kvdrain-trace-")
    try:
        _drain(key, kind, fd, copy)
    except BaseException:
        copy.close()
        raise
    finally:
        os.close(fd)
    copy.flush()
    return copy


def _drain(key: str, kind: str, fd: int, copy: BinaryIO) -> None:
    size = 0
    while True:
        if not select.select([fd], [], [], WRITER_WAIT_S)[0]:
            what = (
                "nothing at all (no writer?)" if size == 0 else f"nothing more after {size:,} bytes"
            )
            raise TraceError(f"{key}: file: a {kind} that sent {what} for {WRITER_WAIT_S:g} s")
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            continue
        if not chunk:
            return
        size += len(chunk)
        if size > MAX_COPY_BYTES:
            raise TraceError(
                f"{key}: file: a {kind} of more than {MAX_COPY_BYTES:,} bytes, "
                f"more than the reader keeps of one; write the trace to a file"
            )
        copy.write(chunk)
