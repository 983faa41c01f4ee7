"""Who may call what: the API key schemes (``Authorization: Bearer <key>`` or ``X-API-Key``) and the key check.

The keys are read with FastAPI's own security schemes (:data:`bearer_scheme`, :data:`api_key_scheme`), so the
OpenAPI document declares both; the check compares sha256 digests in constant time (:func:`key_matches`).
Admin routes always need a key; search, video and index routes need one when the server runs with
``require_key_for_search`` (a thumbnail or file URL from a search result carries a signed token instead,
``gare_serve.media.signing``, because ``<img>``/``<video>`` elements cannot send headers). The dependencies that apply
these rules to routes are in ``gare_serve.web.deps``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from fastapi import HTTPException
from fastapi.security import APIKeyHeader, HTTPBearer

from gare_serve.settings import hash_key

bearer_scheme = HTTPBearer(auto_error=False, description="an API key as a bearer token")
api_key_scheme = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key")


def key_matches(hashes: Sequence[str], presented: str) -> bool:
    """Whether the key's sha256 is one of ``hashes``; compared against every one, so the time taken does not
    depend on which matched."""
    h = hash_key(presented)
    ok = False
    for stored in hashes:
        ok |= hmac.compare_digest(h, stored)
    return ok


def authorize_hashes(hashes: Sequence[str], key: str | None, what: str) -> None:
    """403 when no key is configured for ``what``, 401 when none was presented, 403 when it is not one of them."""
    if not hashes:
        raise HTTPException(403, f"{what} is disabled: the server has no API keys configured (GARE_API_KEYS)")
    if key is None:
        raise HTTPException(
            401, "an API key is required (Authorization: Bearer <key> or X-API-Key)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not key_matches(hashes, key):
        raise HTTPException(403, "invalid API key")


__all__ = ["bearer_scheme", "api_key_scheme", "key_matches", "authorize_hashes"]
