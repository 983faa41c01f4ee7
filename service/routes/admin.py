"""``GET /v1/index`` (the served version) and ``POST /v1/admin/reload`` (switch to CURRENT atomically)."""

from fastapi import APIRouter, Depends

from indexer.served_biases import describe as describe_biases
from indexer.stage1_tune import STAGE1_KEY, index_default_candidates

from ..schemas import INDEX_ERRORS, ErrorResponse, IndexInfo, ReloadResponse
from ..security import StateDep, require_admin, require_search
from ..state import API_VERSION

router = APIRouter()


@router.get(f"/{API_VERSION}/index", response_model=IndexInfo, tags=["index"], summary="the served index version",
            dependencies=[Depends(require_search)], responses=INDEX_ERRORS)
async def index_info(state: StateDep) -> IndexInfo:
    with state.use_version() as v:
        m = v.manifest
        ck = m.get("checkpoint") or {}
        return IndexInfo(
            version=v.name, n=v.n, dim=v.dim, max_frames=v.max_frames, index_type=m.get("index_type"),
            created=m.get("created"),
            checkpoint={
                "name": state.checkpoint_path.name if state.checkpoint_path else None,
                "sha256": state.checkpoint_sha, "model_config": ck.get("model_config"),
            },
            biases=m.get("biases"), biases_description=describe_biases(m.get("biases")),
            device=str(state.device), precision=state.precision,
            rerank_impl=state.settings.rerank_impl,
            default_candidates=index_default_candidates(m) or state.settings.default_candidates,
            stage1=None if not m.get(STAGE1_KEY) else {k: x for k, x in m[STAGE1_KEY].items() if k != "trials"},
        )


@router.post(f"/{API_VERSION}/admin/reload", response_model=ReloadResponse, tags=["admin"],
             responses={**INDEX_ERRORS, 409: {"model": ErrorResponse, "description": "new version built with another checkpoint"}},
             dependencies=[Depends(require_admin)], summary="switch to the index's CURRENT version atomically")
async def admin_reload(state: StateDep) -> ReloadResponse:
    return ReloadResponse(**(await state.reload()))
