"""The routes' FastAPI dependencies: the running state, the presented API key, a video id, and the access checks.

One module, as the FastAPI full-stack template's ``api/deps.py``: routes declare ``state: StateDep``,
``key: KeyDep``, ``video_id: VideoId`` and ``dependencies=[Depends(require_search)]`` (or ``require_media``); admin
routes go on ``gare_serve.web.admin_routes.admin_router``, which applies ``require_admin`` to every route on it. The key
check itself (roles included) is ``gare_serve.web.security``.

The dependencies are ``async def`` although none of them awaits: FastAPI runs a plain ``def`` dependency in the
thread pool, and a hop through it costs more than the check itself, a noticeable share of a result-cache answer
(``bench/results/serve_http.md``: the client-side latency of those answers).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials

from gare_serve.engine.state import ServiceState
from gare_serve.web.security import api_key_scheme, authorize, bearer_scheme

__all__ = ["get_state", "StateDep", "VideoId", "presented_key", "KeyDep", "require_admin", "require_search",
           "require_media"]


async def get_state(request: Request) -> ServiceState:
    """The running service's state; 503 before the lifespan has loaded it (or after shutdown)."""
    state = request.app.state.gare
    if state is None:
        raise HTTPException(503, "the service is not ready")
    return state


StateDep = Annotated[ServiceState, Depends(get_state)]
# int64 ids: `lt` 2**63 (the OpenAPI document carries bounds as floats, which state 2**63 exactly, not 2**63 - 1)
VideoId = Annotated[int, PathParam(ge=0, lt=2**63, description="index entry id")]


async def presented_key(
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)] = None,
    header: Annotated[str | None, Security(api_key_scheme)] = None,
) -> str | None:
    """The key the client sent: a bearer token first, else X-API-Key; None when neither is there."""
    if bearer is not None and bearer.credentials.strip():
        return bearer.credentials.strip()
    return header.strip() if header and header.strip() else None


KeyDep = Annotated[str | None, Depends(presented_key)]


async def require_admin(state: StateDep, key: KeyDep) -> None:
    """An admin key (``admin_keys``, or the deprecated ``api_keys``); a search key is refused with 403."""
    authorize(state.keys, key, "admin", "the admin API")


async def require_search(state: StateDep, key: KeyDep) -> None:
    """A search or an admin key when ``require_key_for_search``; open otherwise."""
    if state.settings.require_key_for_search:
        authorize(state.keys, key, "search", "search")


async def require_media(request: Request, video_id: VideoId, state: StateDep, key: KeyDep) -> None:
    # a search or admin key, or the signed token of a media URL from a search result
    if state.settings.require_key_for_search and not state.media.verify(video_id, request.query_params.get("token")):
        authorize(state.keys, key, "search", "search")
