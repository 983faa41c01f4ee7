"""``GET /v1/index`` (the served version, a search route) and the admin routes: ``POST /v1/admin/reload`` (switch to
CURRENT atomically).

Every admin route goes on :data:`admin_router`: its prefix (:data:`ADMIN_PREFIX`), its tag (``admin``) and its
``require_admin`` dependency are the router's, so a route added there later needs an admin key without saying so.
"""

from fastapi import APIRouter, Depends, HTTPException

from gare_index.describe import describe_biases, public_biases
from gare_serve.engine.reload import ReloadRefused, ReloadUnavailable, reload
from gare_serve.engine.served_options import served_defaults
from gare_serve.web.deps import StateDep, require_admin, require_search
from gare_serve.web.presentation import API_VERSION
from gare_serve.web.schemas import INDEX_ERRORS, ErrorResponse, IndexInfo, ReloadResponse

router = APIRouter()  # /v1/index: a search route
ADMIN_PREFIX = f"/{API_VERSION}/admin"
ADMIN_TAG = "admin"
admin_router = APIRouter(prefix=ADMIN_PREFIX, tags=[ADMIN_TAG], dependencies=[Depends(require_admin)])


@router.get(f"/{API_VERSION}/index", response_model=IndexInfo, tags=["index"], summary="the served index version",
            dependencies=[Depends(require_search)], responses=INDEX_ERRORS)
async def index_info(state: StateDep) -> IndexInfo:
    with state.use_version() as v:
        m = v.manifest
        defaults = served_defaults(m)  # what a search that leaves K or ncl out gets
        return IndexInfo(
            version=v.name, n=v.n, dim=v.dim, max_frames=v.max_frames, index_type=m.index_type,
            created=m.created,
            checkpoint={
                "name": state.checkpoint_path.name if state.checkpoint_path else None,
                "sha256": state.checkpoint_sha, "model_config": None if m.checkpoint is None else m.checkpoint.model_cfg,
            },
            biases=public_biases(m.biases), biases_description=describe_biases(m.biases),
            device=str(state.device), precision=state.precision,
            ncl_default=defaults.ncl, ncl_default_reason=defaults.ncl_reason,
            default_candidates=defaults.candidates or state.settings.default_candidates,
            stage1=None if not m.stage1 else {k: x for k, x in m.stage1.items() if k != "trials"},
        )


@admin_router.post("/reload", response_model=ReloadResponse,
                   responses={**INDEX_ERRORS, 409: {"model": ErrorResponse, "description": "new version built with another checkpoint"}},
                   summary="switch to the index's CURRENT version atomically")
async def admin_reload(state: StateDep) -> ReloadResponse:
    try:
        return ReloadResponse(**(await reload(state)))
    except ReloadRefused as e:
        raise HTTPException(409, str(e)) from None
    except ReloadUnavailable as e:
        raise HTTPException(503, str(e)) from None
