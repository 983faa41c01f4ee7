"""Who may call what: the API key schemes (``Authorization: Bearer <key>`` or ``X-API-Key``), the key roles and
the key check.

The keys are read with FastAPI's own security schemes (:data:`bearer_scheme`, :data:`api_key_scheme`), so the
OpenAPI document declares both; the check compares sha256 digests in constant time (:func:`key_matches`).
A key has a role (``gare_serve.settings.KeyRoles``): a search key calls the search, video and index routes, an admin
key those and the admin routes. Admin routes always need an admin key (a search key gets 403 naming the role
needed); search, video and index routes need a key of either role when the server runs with
``require_key_for_search`` (a thumbnail or file URL from a search result carries a signed token instead,
``gare_serve.media.signing``, because ``<img>``/``<video>`` elements cannot send headers), and so does ``/metrics``
when ``metrics_require_key`` says so. The dependencies that apply these rules to routes are in ``gare_serve.web.deps``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Literal

from fastapi import HTTPException
from fastapi.security import APIKeyHeader, HTTPBearer

from gare_serve.settings import KeyRoles, hash_key

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


_ROLE_SETTINGS = {"admin": "GARE_ADMIN_KEYS", "search": "GARE_SEARCH_KEYS or GARE_ADMIN_KEYS"}


def authorize(keys: KeyRoles, key: str | None, role: Literal["search", "admin"], what: str) -> None:
    """Let the request through when ``key`` is a key of ``role`` (an admin key holds both roles).

    403 when no key of that role is configured, 401 when none was presented, 403 when the key is a search key and
    ``role`` is admin (the message names the role needed, never the key), 403 when it is no configured key.
    The presented key's digest is compared with every configured one, whichever matches.
    """
    if not keys.for_role(role):
        raise HTTPException(403, f"{what} is disabled: the server has no API keys configured with the {role} role "
                                 f"({_ROLE_SETTINGS[role]})")
    if key is None:
        raise HTTPException(
            401, "an API key is required (Authorization: Bearer <key> or X-API-Key)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    is_admin = key_matches(keys.admin, key)
    is_search = key_matches(keys.search, key)
    if is_admin or (role == "search" and is_search):
        return
    if is_search:
        raise HTTPException(403, f"{what} needs an admin key (GARE_ADMIN_KEYS); the key presented is a search key")
    raise HTTPException(403, "invalid API key")


__all__ = ["bearer_scheme", "api_key_scheme", "key_matches", "authorize"]
