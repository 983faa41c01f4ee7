"""Operations: ``/healthz`` (liveness), ``/readyz`` (model and index loaded), ``/metrics``, the search page and
the API docs page (``/docs``: Swagger UI 5, which reads FastAPI's OpenAPI 3.1, from the files the
``fastapi-offline`` package ships; no CDN)."""

from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from gare_serve.engine.prometheus import CONTENT_TYPE_LATEST
from gare_serve.web.deps import KeyDep
from gare_serve.web.schemas import ErrorResponse
from gare_serve.web.security import authorize

STATIC_DIR = Path(__file__).resolve().parent / "static"
DOCS_ASSETS = "/docs/assets"  # URL of the Swagger UI files (gare_serve.app mounts DOCS_ASSET_DIR there)
DOCS_ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"  # swagger-ui-bundle.js, swagger-ui.css, favicon.png

# The page loads everything from this server, and its start-up code is a file, not an inline script: the
# service's content-security policy (script-src 'self', gare_serve.web.middleware) applies here as on every page.
_DOCS_HTML = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>GARE search API</title>
<link rel="stylesheet" href="{DOCS_ASSETS}/swagger-ui.css">
<link rel="icon" type="image/png" href="{DOCS_ASSETS}/favicon.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{DOCS_ASSETS}/swagger-ui-bundle.js"></script>
<script src="/static/docs.js"></script>
</body>
</html>
"""

router = APIRouter()


@router.get("/healthz", tags=["ops"], summary="liveness (and, with a shared engine, whether it answered last)")
async def healthz(request: Request) -> dict[str, Any]:
    state = request.app.state.gare
    link = getattr(state, "link", None)  # engine=shared: what the last call saw (no call here: liveness is cheap)
    if link is None:
        return {"status": "ok"}
    return {"status": "ok", "engine": {"up": link.up, "pid": (link.info or {}).get("pid")}}


@router.get("/readyz", tags=["ops"], summary="readiness: model and index loaded (in every worker; a shared engine answers)",
            responses={503: {"model": ErrorResponse}})
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state.gare
    if state is None or state.handle is None or not state.batcher.running:
        return JSONResponse({"status": "not ready", "detail": "model or index not loaded"}, status_code=503)
    body: dict[str, Any] = {"status": "ready", "index_version": state.handle.version.name, "n": state.handle.version.n}
    if getattr(state, "stage1", None) is not None:  # a CUDA model: the resident copy and its measured stage 1
        body["stage1"] = state.stage1
    engine = await state.engine_report()
    if engine is not None:  # engine=shared: the engine must answer too
        body["engine"] = engine
        if not engine["up"]:
            return JSONResponse({**body, "status": "not ready", "detail": engine["detail"]}, status_code=503)
    if state.board is not None:
        # several workers: ready only when every one of them is up and they all serve one version
        ok, recs = state.board.all_ready()
        body["workers"] = [{"pid": r["pid"], "version": r.get("version"), "ready": r.get("ready")} for r in recs]
        body["expected_workers"] = state.board.expected
        if not ok:
            return JSONResponse({**body, "status": "not ready",
                                 "detail": f"{len(recs)} of {state.board.expected} workers up, or not all on one version"},
                                status_code=503)
    return JSONResponse(body)


@router.get("/metrics", tags=["ops"],
            summary="Prometheus metrics (needs a search or admin key when search does: metrics_require_key)",
            response_class=Response, responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
async def prometheus_metrics(request: Request, key: KeyDep) -> Response:
    if request.app.state.settings.metrics_need_key():  # the keys read at create_app: answers before the lifespan too
        # any valid key: a scraper needs no admin role (settings.metrics_require_key says why)
        authorize(request.app.state.keys, key, "search", "metrics")
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/docs", include_in_schema=False)
async def docs_page() -> HTMLResponse:
    return HTMLResponse(_DOCS_HTML, headers={"Cache-Control": "no-cache"})
