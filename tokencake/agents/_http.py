"""Connection-pool settings for every HTTP client the SDK makes.

vLLM's API server (uvicorn) closes a keep-alive connection after it has been idle for
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` = 5 s, and httpx keeps an idle connection for 5 s as well. An
agent's next request after a tool call of about 5 s can then be written to a connection the server
is closing at that instant: it fails with ``ReadError`` (or ``RemoteProtocolError``) in
milliseconds, without reaching the engine. Expiring our idle connections well before the server
does removes the race; a fresh loopback connection costs well under a millisecond.
"""

from __future__ import annotations

import httpx

#: Seconds an idle pooled connection is kept: under half of vLLM's 5 s server-side keep-alive.
KEEPALIVE_EXPIRY_S = 2.0


def pool_limits(
    *, max_connections: int | None = 100, max_keepalive_connections: int | None = 20
) -> httpx.Limits:
    """httpx's default pool sizes, with idle connections closed before the server closes them."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
