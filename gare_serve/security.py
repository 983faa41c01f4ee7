"""Who may call what: API keys (``Authorization: Bearer <key>`` or ``X-API-Key``) and signed media URLs.

The keys are read with FastAPI's own security dependencies (:class:`HTTPBearer`, :class:`APIKeyHeader`),
so the OpenAPI document declares both schemes; the check itself compares sha256 digests in constant time
(:func:`key_matches`). Admin routes always need a key; search, video and index routes need one when
the server runs with ``require_key_for_search`` (a thumbnail or file URL from a search result carries a
signed token instead, because ``<img>``/``<video>`` elements cannot send headers).
"""

import hmac
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security
from fastapi import Path as PathParam
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from gare_serve.settings import hash_key
from gare_serve.state import ServiceState

# The dependencies are `async def` although none of them awaits: FastAPI runs a plain `def` dependency in the
# thread pool, and a search hop through it costs more than the check itself (a result-cache answer is ~1 ms).

bearer_scheme = HTTPBearer(auto_error=False, description="an API key as a bearer token")
api_key_scheme = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key")


async def get_state(request: Request) -> ServiceState:
    """The running service's state; 503 before the lifespan has loaded it (or after shutdown)."""
    state = request.app.state.gare
    if state is None:
        raise HTTPException(503, "the service is not ready")
    return state


StateDep = Annotated[ServiceState, Depends(get_state)]
VideoId = Annotated[int, PathParam(ge=0, le=2**63 - 1, description="index entry id")]


async def presented_key(
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)] = None,
    header: Annotated[str | None, Security(api_key_scheme)] = None,
) -> str | None:
    """The key the client sent: a bearer token first, else X-API-Key; None when neither is there."""
    if bearer is not None and bearer.credentials.strip():
        return bearer.credentials.strip()
    return header.strip() if header and header.strip() else None


KeyDep = Annotated[str | None, Depends(presented_key)]


def key_matches(hashes: Sequence[str], presented: str) -> bool:
    """Whether the key's sha256 is one of ``hashes``; compared against every one, so the time taken does not
    depend on which matched."""
    h = hash_key(presented)
    ok = False
    for stored in hashes:
        ok |= hmac.compare_digest(h, stored)
    return ok


def authorize_hashes(hashes: Sequence[str], key: str | None, what: str) -> None:
    if not hashes:
        raise HTTPException(403, f"{what} is disabled: the server has no API keys configured (GARE_API_KEYS)")
    if key is None:
        raise HTTPException(
            401, "an API key is required (Authorization: Bearer <key> or X-API-Key)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not key_matches(hashes, key):
        raise HTTPException(403, "invalid API key")


def authorize(state: ServiceState, key: str | None, what: str) -> None:
    authorize_hashes(state.key_hashes, key, what)


async def require_admin(state: StateDep, key: KeyDep) -> None:
    authorize(state, key, "the admin API")


async def require_search(state: StateDep, key: KeyDep) -> None:
    if state.settings.require_key_for_search:
        authorize(state, key, "search")


async def require_media(request: Request, video_id: VideoId, state: StateDep, key: KeyDep) -> None:
    # an API key, or the signed token of a media URL from a search result
    if state.settings.require_key_for_search and not state.check_media_token(video_id, request.query_params.get("token")):
        authorize(state, key, "search")


__all__ = ["get_state", "StateDep", "VideoId", "presented_key", "key_matches", "authorize_hashes", "authorize", "require_admin", "require_search",
           "require_media"]
