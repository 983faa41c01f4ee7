"""``POST /v1/search`` and ``POST /v1/search/batch``: route -> micro-batcher -> ``indexer.search.search_batch``."""

import time
from typing import Any

from fastapi import APIRouter, Depends, HTTPException
from starlette.concurrency import run_in_threadpool

from indexer import search as S
from indexer.stage1_tune import index_default_candidates

from ..schemas import ERRORS, BatchSearchResponse, Hit, SearchResponse, Timings, make_request_models
from ..security import StateDep, require_search
from ..settings import Settings
from ..state import API_VERSION, Job, ServiceState


def _hit_models(state: ServiceState, version: Any, res: S.QueryResult) -> list[Hit]:
    if not res.hits:
        return []
    rows = version.metadata([h.id for h in res.hits])
    out = []
    for r, (h, m) in enumerate(zip(res.hits, rows, strict=True), start=1):
        thumb, video = state.media_urls(h.id)
        out.append(Hit(
            rank=r, id=h.id, score=h.score, ann_score=h.ann_score, psi_score=h.psi_score, bias=h.bias,
            start=m.get("start"), end=m.get("end"), metadata=state.public_metadata(version, m),
            thumbnail_url=thumb, video_url=video,
        ))
    return out


async def run_queries(state: ServiceState, version: Any, queries: list[str], opts: S.SearchOptions,
                      t_start: float) -> list[SearchResponse]:
    try:  # refused here, before the micro-batch, so it cannot fail other clients' queries
        version.check_stage1(ncl_stage1=opts.ncl_stage1)
    except S.Stage1Unavailable as e:
        raise HTTPException(409, str(e)) from None
    jobs = [Job(version, q, opts) for q in queries]
    results = await state.batcher.submit_many(jobs)
    payload = []
    for q, (res, info) in zip(queries, results, strict=True):
        hits = await run_in_threadpool(_hit_models, state, version, res)
        total = time.perf_counter() - t_start
        stage_s = {"queue": info.queue_s, **{k: res.timings.get(k, 0.0) for k in ("encode", "ann", "rerank", "rank")}}
        state.metrics.observe_stages({**stage_s, "total": total})
        payload.append(SearchResponse(
            query=q, index_version=version.name, k=opts.k, candidates=opts.candidates, rerank=opts.rerank,
            ncl=opts.ncl, results=hits, batch_size=info.size,
            timings_ms=Timings(**{k: round(v * 1000, 3) for k, v in stage_s.items()}, total=round(total * 1000, 3)),
        ))
    return payload


def make_router(settings: Settings) -> APIRouter:
    """The search routes, with this deployment's request bounds in their bodies (and so in the OpenAPI)."""
    SearchRequest, BatchSearchRequest = make_request_models(settings)
    router = APIRouter(tags=["search"], dependencies=[Depends(require_search)], responses=ERRORS)

    @router.post(f"/{API_VERSION}/search", response_model=SearchResponse, summary="search the index with one text query")
    async def search_one(body: SearchRequest, state: StateDep) -> SearchResponse:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            return (await run_queries(state, version, [body.query], body.options(index_default_candidates(version.manifest)),
                                       t_start))[0]

    @router.post(f"/{API_VERSION}/search/batch", response_model=BatchSearchResponse,
                 summary="many queries in one request (shared options)")
    async def search_batch(body: BatchSearchRequest, state: StateDep) -> BatchSearchResponse:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            res = await run_queries(state, version, list(body.queries),
                                    body.options(index_default_candidates(version.manifest)), t_start)
            return BatchSearchResponse(
                index_version=version.name, results=res,
                timings_ms={"total": round((time.perf_counter() - t_start) * 1000, 3)},
            )

    return router
