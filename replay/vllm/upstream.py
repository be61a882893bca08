"""A vLLM server behind `kvdrain proxy`, each exchange with it bounded. Runs in: proxy process.

Every exchange is bounded step by step (UpstreamTimeouts): the connection within
connect_s; the answer's head within first_byte_s of sending (a non-streamed answer's head
comes with its end: P's one token); each later read within idle_s of the one before;
the whole exchange within total_s. A step that runs out is an UpstreamTimedOut (504),
remembered for /health for RECENT_TIMEOUT_S; a server that cannot be reached or breaks
its answer off is Unreachable (502).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from replay.vllm.proxy_options import UpstreamTimeouts

RECENT_TIMEOUT_S = 60.0  # /health says an upstream timed out this long after it did

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    """One vLLM server behind the proxy: its name (P, D, or P0, P1, ...) and base URL."""

    name: str
    url: str  # scheme://host:port, no trailing slash


class UpstreamError(Exception):
    """An exchange with an upstream that failed; `status` is the client's answer."""

    status = 502

    def __init__(self, upstream: Upstream, role: str, said: str, route: tuple[str, ...]) -> None:
        super().__init__(f"{role} server {upstream.name} ({upstream.url}) {said}")
        self.upstream = upstream
        self.role = role  # "prefill" or "decode"
        self.said = said
        self.route = route  # the completion's way so far (empty: not a completion)


class Unreachable(UpstreamError):
    """An upstream that could not be reached or broke its answer off (502)."""

    def __init__(
        self, upstream: Upstream, role: str, cause: BaseException, route: tuple[str, ...] = ()
    ) -> None:
        self.cause = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        super().__init__(upstream, role, f"is unreachable: {self.cause}", route)


class UpstreamTimedOut(UpstreamError):
    """An upstream that let a step of an exchange run past its timeout (504)."""

    status = 504

    def __init__(self, upstream: Upstream, role: str, what: str, route: tuple[str, ...]) -> None:
        super().__init__(upstream, role, f"timed out: {what}", route)


class Exchange:
    """The clock of one exchange with an upstream: each step within its own limit and what
    is left of total_s; how it ended, for /metrics."""

    def __init__(
        self,
        upstream: Upstream,
        stage: str,
        timeouts: UpstreamTimeouts,
        route: tuple[str, ...] = (),
        role: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.stage = stage  # /metrics' label: prefill, decode, models, version, tokenize
        self.role = role or stage  # who the upstream is in messages: prefill or decode
        self.timeouts = timeouts
        self.route = route
        self.started = time.monotonic()
        self.status: int | None = None  # the answer's, once its head came
        self.failure: str | None = None  # "timeout", "unreachable" or "broken"

    @property
    def outcome(self) -> str:
        """/metrics' status label: the answer's status, or how the exchange failed."""
        return self.failure or str(self.status)

    async def step(self, awaitable: Awaitable[T], limit_s: float, waiting_for: str) -> T:
        """The awaitable's result; UpstreamTimedOut past limit_s or the exchange's total_s,
        Unreachable for any other client error."""
        left = self.started + self.timeouts.total_s - time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, min(limit_s, left))):
                return await awaitable
        except aiohttp.ConnectionTimeoutError:
            raise self.timed_out(f"no connection within {self.timeouts.connect_s:g} s") from None
        except aiohttp.ClientError as e:
            self.failure = "unreachable" if self.status is None else "broken"
            raise Unreachable(self.upstream, self.role, e, self.route) from None
        except TimeoutError:
            if limit_s < left:
                raise self.timed_out(f"{waiting_for} within {limit_s:g} s") from None
            raise self.timed_out(f"its answer took more than {self.timeouts.total_s:g} s") from None

    def timed_out(self, what: str) -> UpstreamTimedOut:
        self.failure = "timeout"
        return UpstreamTimedOut(self.upstream, self.role, what, self.route)


class TimeoutLog:
    """Each upstream's latest timeout, for /health while it is recent."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, str]] = {}  # name -> (monotonic time, message)

    def note(self, error: UpstreamTimedOut) -> None:
        self.latest[error.upstream.name] = (time.monotonic(), str(error))

    def recent(self, name: str) -> str | None:
        """The upstream's timeout within RECENT_TIMEOUT_S, with how long ago (None: none)."""
        at, message = self.latest.get(name, (None, ""))
        if at is None or (ago := time.monotonic() - at) > RECENT_TIMEOUT_S:
            return None
        return f"{message} ({ago:.0f} s ago)"
