"""Operations: ``/healthz`` (liveness), ``/readyz`` (model and index loaded), ``/metrics`` and the search page."""

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from ..metrics import CONTENT_TYPE_LATEST
from ..schemas import ErrorResponse

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"

router = APIRouter()


@router.get("/healthz", tags=["ops"], summary="liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["ops"], summary="readiness: model and index loaded (in every worker)",
            responses={503: {"model": ErrorResponse}})
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state.gare
    if state is None or state.handle is None or not state.batcher.running:
        return JSONResponse({"status": "not ready", "detail": "model or index not loaded"}, status_code=503)
    body = {"status": "ready", "index_version": state.handle.version.name, "n": state.handle.version.n}
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


@router.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response)
async def prometheus_metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})
