"""Who may reach an HTTP front (serve --http, the proxy): loopback, or a bearer key. Runs in: frontend process.

vLLM's `--api-key` rule: every /v1 route wants `Authorization: Bearer KEY` (a 401 with an
OpenAI-style body otherwise), /health and /metrics stay open. A front listening beyond
loopback must have a key, or be told `--insecure` (warned about at start); the refusal
comes before anything starts.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

GUARDED_PREFIX = "/v1"


class CredentialError(ValueError):
    """An HTTP front beyond loopback with no key and no --insecure: one line, exit 2."""


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; a name, a wildcard or any other address is not provably local."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_http_listen(
    host: str, api_key: str | None, insecure: bool, flag: str = "--http"
) -> list[str]:
    """Refuse (CredentialError) a front beyond loopback without an API key; the warnings to print."""
    if is_loopback_host(host) or api_key is not None:
        return []
    where = f"[{host}]" if ":" in host and not host.startswith("[") else host
    if not insecure:
        raise CredentialError(
            f"{flag} {where}: listens beyond this machine with no credential: give "
            f"--api-key KEY (clients send 'Authorization: Bearer KEY') or, "
            f"knowingly, --insecure"
        )
    return [
        f"WARNING: --insecure: HTTP on {where} accepts requests from anyone who can "
        f"reach it, with no credential"
    ]


def carries_key(authorization: str, api_key: str) -> bool:
    """Whether an Authorization header is `Bearer <api_key>` (compared in constant time)."""
    scheme, _, token = authorization.partition(" ")
    # aiohttp keeps a header's bytes that are not UTF-8 as surrogates: compare bytes
    given = token.encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())


def bearer_middleware(api_key: str | None):
    """An aiohttp middleware answering 401 on a /v1 route without the key (none: all open)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key is not None and request.path.startswith(GUARDED_PREFIX):
            if not carries_key(request.headers.get("Authorization", ""), api_key):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return guard
