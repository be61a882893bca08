"""The header in which kvdrain's proxy names each completion's way, and its reading. Runs in: the proxy process and the frontend process.

Every completion's answer through `kvdrain proxy` (replay/vllm/proxy.py), streamed or
not, errors included, names in ROUTE_HEADER the upstreams it went to, P then D, by the
names its /health gives them; the HTTP replay client (replay/target/client.py) reads it into
the request's stages, so each engine is judged in its own idle windows.
"""

from __future__ import annotations

ROUTE_HEADER = "X-Kvdrain-Route"  # "P0,D1": the upstreams a completion went to, in order


def route_headers(route: tuple[str, ...]) -> dict[str, str]:
    """ROUTE_HEADER naming a completion's way (none for another request)."""
    return {ROUTE_HEADER: ",".join(route)} if route else {}


def parse_route(value: str | None) -> tuple[str, ...]:
    """The upstreams a ROUTE_HEADER names, in order; () when absent or not one."""
    names = tuple(name.strip() for name in (value or "").split(","))
    return names if all(name and name.isprintable() and len(name) <= 64 for name in names) else ()
