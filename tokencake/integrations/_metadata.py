"""``with_metadata``: a request's ``extra_body`` plus its session's TokenCake fields.

Frameworks that let a hook change each request's settings (LangChain middleware, Pydantic AI
capabilities) carry the metadata in ``extra_body`` instead of a wrapped transport, so it works with
whatever client the user built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokencake as tc


def with_metadata(extra_body: Any, session: tc.Session) -> dict[str, Any]:
    """``extra_body`` plus ``session``'s next-turn fields; keys the caller already set are kept.

    Advances the session's turn, so call it once per request.
    """
    fields = session.request_metadata()
    body: dict[str, Any] = dict(extra_body) if isinstance(extra_body, Mapping) else {}
    kv = body.get("kv_transfer_params")
    kv = dict(kv) if isinstance(kv, Mapping) else {}
    for key, value in fields["kv_transfer_params"].items():
        kv.setdefault(key, value)
    body["kv_transfer_params"] = kv
    body.setdefault("priority", fields["priority"])
    return body
