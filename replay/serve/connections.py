"""The HTTP front's connection guard: a cap on open connections, a quiet event loop and server log. Runs in: frontend process.

kvdrain proxy guards its connections with it too (replay/vllm/proxy.py).

Nothing a peer does prints a traceback: loop errors and aiohttp's own (a malformed
request) are one line per kind per 10 s. A peer that opens connections and never
finishes a request (slowloris) must not keep others out, nor run the process out of
file descriptors (then every accept fails and asyncio logs a traceback for each). So
every connection is tracked, oldest first, with whether it is handling a request; at
the cap a newcomer evicts the oldest connection that is not (a half-open or idle
keep-alive one), or, when every one is busy, is answered 503 with vLLM's error body
and closed. The cap defaults to what the process's file-descriptor limit leaves after
the engines' own (connection_cap). The request head's timeout is aiohttp's keep-alive
timeout (server.py), which also covers a connection that never sends a whole head;
the body's is server.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import sys
import time
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web

from replay.verify.text import printable

RESERVED_FDS = 128  # the engines' sockets and pipes, the run dir, logs
BACKLOG = 128  # listen backlog: asyncio accepts up to this many before any is admitted
MAX_CONNECTIONS = 4096
QUIET_PERIOD_S = 10.0  # one line per kind of loop error per period
REFUSED_LINGER_S = 1.0  # a refused connection is read from this long, then closed
SERVE = "kvdrain serve --http"  # how the lines on stderr begin


def connection_cap() -> int:
    """The default cap: what the file-descriptor limit leaves, at most MAX_CONNECTIONS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft - RESERVED_FDS - BACKLOG))


def refusal(status: int, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 response with vLLM's error body, for a connection never handed on."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class ConnectionGuard:
    """Every open connection (transport -> busy handling a request), oldest first."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.open: dict[asyncio.BaseTransport, bool] = {}
        self.num_evicted = 0
        self.num_refused = 0

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for loop.create_server over aiohttp's (`make`)."""
        return lambda: _Tracked(self, make())

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Make room for a new connection; False (it was answered 503 and closed) if none."""
        if len(self.open) >= self.max_connections:
            idle = next((t for t, busy in self.open.items() if not busy), None)
            if idle is None:
                self.num_refused += 1
                return False
            del self.open[idle]
            idle.abort()
            self.num_evicted += 1
        self.open[transport] = False
        return True

    def set_busy(self, transport: asyncio.BaseTransport | None, busy: bool) -> None:
        if transport in self.open:
            self.open[transport] = busy

    def forget(self, transport: asyncio.BaseTransport) -> None:
        self.open.pop(transport, None)


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, seen by the guard first."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard.admit(transport):
            self.transport = transport
            self.inner.connection_made(transport)
            return
        # Refused: answer, stop writing, and read what the peer sent until it closes (a
        # socket closed with unread data resets the connection before the answer is read).
        transport.write(
            refusal(
                503,
                f"too many connections (the cap is {self.guard.max_connections})",
                "ServiceUnavailableError",
            )
        )
        transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.transport is not None else None

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.forget(self.transport)
            self.inner.connection_lost(exc)


class _QuietHandler(logging.Handler):
    """One line per kind of record per QUIET_PERIOD_S on stderr, never a traceback."""

    def __init__(self, who: str) -> None:
        super().__init__()
        self.quiet = _Quiet(who)

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        detail = str(error).splitlines()[0] if error is not None and str(error) else ""
        self.quiet.say(f"{record.getMessage()}: {type(error).__name__ if error else ''}", detail)


def quiet_logger(who: str = SERVE) -> logging.Logger:
    """The logger aiohttp's server gets: a malformed request from a client is one line
    per kind per period (aiohttp logs each with its traceback), begun with `who`."""
    logger = logging.getLogger(f"kvdrain.http.server.{who}")
    if not logger.handlers:
        logger.addHandler(_QuietHandler(who))
        logger.propagate = False
    return logger


class _Quiet:
    """Prints one line per kind per QUIET_PERIOD_S, with how many it held back."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.last: dict[str, tuple[float, int]] = {}  # kind -> (printed at, held back since)

    def say(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        printed_at, held = self.last.get(kind, (-QUIET_PERIOD_S, 0))
        if now - printed_at < QUIET_PERIOD_S:
            self.last[kind] = (printed_at, held + 1)
            return
        more = f" ({held} more like it held back)" if held else ""
        said = printable(f"{kind} {detail}", 400)
        print(f"{self.who}: {said}{more}", file=sys.stderr, flush=True)
        self.last[kind] = (now, 0)


class QuietLoopErrors:
    """An event-loop exception handler that prints one line per kind of error per
    QUIET_PERIOD_S (with how many it held back), never a traceback per failed accept."""

    def __init__(self, who: str = SERVE) -> None:
        self.quiet = _Quiet(who)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        kind = f"{context.get('message', 'error')}: {type(error).__name__ if error else ''}"
        self.quiet.say(kind, str(error or ""))


class GuardedSite(web.TCPSite):
    """aiohttp's TCP site with every connection admitted by a ConnectionGuard first
    (TCPSite.start as aiohttp 3.12-3.14 writes it, with the guard's protocol factory)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(runner, host, port)
        self.guard, self.sock = guard, sock

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        factory = self.guard.factory(self._runner.server)
        if self.sock is not None:  # bound earlier (listen()): an address in use failed then
            self._server = await loop.create_server(factory, sock=self.sock, backlog=BACKLOG)
        else:
            self._server = await loop.create_server(
                factory, self._host, self._port, backlog=BACKLOG
            )
