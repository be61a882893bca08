"""What `kvdrain proxy` runs with (cli.py's proxy command builds it). Runs in: proxy process.

Kept apart from replay/vllm/proxy.py so that cli.py, which every engine process imports
again, loads only this (no aiohttp).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from replay.deploy.placement import ROUTER_POLICIES

MIB = 1 << 20
MAX_IN_FLIGHT = 1024  # requests at one upstream at once; beyond: 503
MAX_BODY_BYTES = 8 * MIB  # a client's body; beyond: 413 (a 1M-token prompt as ids fits)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamTimeouts:
    """How long each step of an exchange with an upstream may take, in seconds. A CPU
    prefill of a long prompt fits first_byte_s; a hung server is given up within total_s."""

    connect_s: float = 10.0
    first_byte_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "first_byte_s", "idle_s", "total_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)!r}")


class ProxyError(ValueError):
    """Options the proxy cannot run with (the CLI's usage error)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyOptions:
    """Where the proxy listens, its upstreams, and its bounds on each."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, printed in the ready line
    api_key: str | None = None  # clients must send 'Authorization: Bearer KEY' on /v1
    upstream_api_key: str | None = None  # sent to every upstream as 'Authorization: Bearer KEY'
    insecure: bool = False  # listen beyond loopback without --api-key
    timeouts: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    health_timeout_s: float = 5.0
    # A connection's request head must be whole this long after it opened or its last
    # answer (aiohttp's keep-alive timeout, as serve --http's): idle ones close then too.
    header_timeout_s: float = 10.0
    max_connections: int | None = None  # None: replay/serve/connections.py connection_cap()
    max_in_flight: int = MAX_IN_FLIGHT
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # a client's body still not whole after this: 408
    max_prefill_answer_bytes: int = MIB  # P's answer, its kv_transfer_params with it
    router: str = "round-robin"  # balance.py's policy
    block_size: int = 16  # the prefix table's block, in prompt tokens (ids) or words (text)

    def __post_init__(self) -> None:
        if self.router not in ROUTER_POLICIES:
            raise ProxyError(f"--router: must be one of {ROUTER_POLICIES}, got {self.router!r}")
        if not self.prefill or not self.decode:
            raise ProxyError("--prefill and --decode: give at least one URL of each")
        for url in self.prefill + self.decode:
            base_url(url)
        if not 0 <= self.port <= 65535:
            raise ProxyError(f"--port: {self.port} is not a port")
        if self.api_key == "":
            raise ProxyError("--api-key: must not be empty")
        if self.max_in_flight < 1 or self.max_body_bytes < 1:
            raise ProxyError("--max-in-flight and --max-body-mib: must be > 0")


def base_url(url: str) -> str:
    """http(s)://HOST:PORT from a server URL (a trailing / or /v1 dropped); else ProxyError.
    A URL's user:password is refused, never echoed: the proxy shows its upstreams' URLs to
    every client (/health, errors), and the key a server wants is --upstream-api-key."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        where = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        raise ProxyError(
            f"{where}: a URL with credentials in it is shown to clients; give the server's "
            f"key with --upstream-api-key instead"
        )
    path = parts.path.rstrip("/")
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or path not in ("", "/v1")
        or parts.query
        or parts.fragment
    ):
        raise ProxyError(f"{url!r}: expected http://HOST:PORT (a vLLM server's address)")
    try:
        _ = parts.port
    except ValueError:
        raise ProxyError(f"{url!r}: the port is not a number") from None
    return f"{parts.scheme}://{parts.netloc}"
