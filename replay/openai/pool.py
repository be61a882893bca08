"""The connection pool of kvdrain's HTTP clients (the replay's, the proxy's upstreams): idle connections dropped before a server's keep-alive ends them. Runs in: the proxy process and the frontend process.

vLLM's server (uvicorn) closes a keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
5 s by default; aiohttp keeps an idle one for 15 s. A request sent on a connection the
server is closing at that moment fails with "Server disconnected" before the server read
it (measured: 4 of 32 requests of a P/D replay whose bursts were about 5 s apart). Such
a request cannot be retried blindly (a prefill that did run leaves its KV held for a
decode that never comes), so no connection is reused after IDLE_S: for any server whose
keep-alive is longer, the server's close and the client's reuse never meet.
"""

from __future__ import annotations

import aiohttp

IDLE_S = 2.0  # well inside uvicorn's 5 s keep-alive


def connector() -> aiohttp.TCPConnector:
    """An unlimited pool that reuses no connection idle for IDLE_S or more."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_S)
