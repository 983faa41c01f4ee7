"""``POST /v1/search`` and ``POST /v1/search/batch``: route -> micro-batcher -> ``gare_search.search.search_batch``.

Search by example (``video_id``/``video_ids`` in ``/v1/search``, an upload to ``/v1/search/image``) runs
``gare_search.by_example`` in the thread pool: it has no text to encode, so the micro-batcher has nothing to share.
"""

import asyncio
import time
import weakref
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, HTTPException, Response, UploadFile
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gare_index.describe import index_default_candidates, index_ncl_default
from gare_index.ncl_ann import Stage1Unavailable
from gare_search import by_example as E
from gare_search import search as S
from gare_serve.engine.batch_worker import Job
from gare_serve.engine.batcher import BatchInfo
from gare_serve.engine.state import ServiceState
from gare_serve.settings import Settings
from gare_serve.web.deps import StateDep, require_search
from gare_serve.web.presentation import API_VERSION, fresh_urls, hit_models
from gare_serve.web.schemas import (
    IMAGE_ERRORS,
    SEARCH_ERRORS,
    SEARCH_ONE_ERRORS,
    BatchSearchResponse,
    SearchResponse,
    Timings,
    make_request_models,
)

_NO_BATCH = BatchInfo(size=0, queue_s=0.0, run_s=0.0)  # a result-cache answer: it never entered the micro-batch queue


def served_defaults(manifest: Any) -> tuple[int | None, bool]:
    """What a request that leaves them out gets from the served index: its chosen K and its NCL default (issue 28:
    decided at build time on validation captions; else the search's NCL_DEFAULT)."""
    own = index_ncl_default(manifest)
    return index_default_candidates(manifest), S.NCL_DEFAULT if own is None else own[0]


async def run_queries(state: ServiceState, version: Any, queries: list[str], opts: S.SearchOptions,
                      t_start: float) -> list[SearchResponse]:
    try:  # refused here, before the micro-batch, so it cannot fail other clients' queries
        version.check_stage1(ncl_stage1=opts.ncl_stage1)
    except Stage1Unavailable as e:
        raise HTTPException(409, str(e)) from None
    rc = state.result_cache
    variant = state.encoder.variant if state.encoder is not None else ""
    keys = [rc.key(version.name, state.checkpoint_sha or "", variant, q, opts)
            for q in queries] if rc.enabled else [None] * len(queries)
    # whole answers, hits rendered with their metadata: no queue, no stage, no metadata read, no thread hop
    cached = [rc.lookup(k) if k is not None else None for k in keys]
    got: list[tuple[S.QueryResult, BatchInfo]] = [(c[0], _NO_BATCH) if c is not None else None for c in cached]  # type: ignore[misc]
    todo = [i for i, c in enumerate(cached) if c is None]
    if todo:
        done = await state.batcher.submit_many([Job(version, queries[i], opts) for i in todo])
        for i, (res, info) in zip(todo, done, strict=True):
            got[i] = (res, info)
    payload = []
    for i, (q, (res, info)) in enumerate(zip(queries, got, strict=True)):
        c = cached[i]
        if c is not None:
            hits = fresh_urls(state, c[1])
        else:
            hits = await run_in_threadpool(hit_models, state, version, res)
            if keys[i] is not None:
                rc.put(keys[i], res, hits)
        total = time.perf_counter() - t_start
        stage_s = {"queue": info.queue_s, **{k: res.timings.get(k, 0.0) for k in ("encode", "ann", "rerank", "rank")}}
        state.metrics.observe_stages({**stage_s, "total": total})
        payload.append(SearchResponse(
            query=q, index_version=version.name, k=opts.k, candidates=opts.candidates, rerank=opts.rerank,
            ncl=opts.ncl, results=hits, batch_size=info.size, **partial_fields(res),
            timings_ms=Timings(**{k: round(v * 1000, 3) for k, v in stage_s.items()}, total=round(total * 1000, 3),
                               cache="result" if info is _NO_BATCH else "hit" if res.cached else "miss"),
        ))
    return payload


async def run_example(state: ServiceState, version: Any, fn: Any, *args: Any, opts: S.SearchOptions,
                      example: dict[str, Any], t_start: float) -> SearchResponse:
    """One search by example: the same response, limits and per-stage metrics as a text query."""
    try:
        res = await run_in_threadpool(fn, *args, opts)
    except E.UnknownExample as e:
        raise HTTPException(404, str(e)) from None
    except E.ExampleError as e:
        raise HTTPException(422, str(e)) from None
    hits = await run_in_threadpool(hit_models, state, version, res)
    total = time.perf_counter() - t_start
    stage_s = {"queue": 0.0, **{k: res.timings.get(k, 0.0) for k in ("encode", "ann", "rerank", "rank")}}
    state.metrics.observe_stages({**stage_s, "total": total})
    return SearchResponse(
        query=None, example=example, index_version=version.name, k=opts.k, candidates=opts.candidates,
        rerank=opts.rerank and example["kind"] == "videos", ncl=False, results=hits, batch_size=1, **partial_fields(res),
        timings_ms=Timings(**{k: round(v * 1000, 3) for k, v in stage_s.items()}, total=round(total * 1000, 3)),
    )


def partial_fields(res: S.QueryResult) -> dict[str, Any]:
    """``partial`` and ``missing_shards`` of a sharded answer (gare_serve.ray_serve.ingress_state); none for one index, so
    its responses keep their defaults (false, [])."""
    missing = list(getattr(res, "missing_shards", None) or [])
    return {"partial": True, "missing_shards": missing} if missing else {}


def _json(model: BaseModel) -> Response:
    """The response body straight from the model we built (and so validated): FastAPI would otherwise dump it,
    validate the dump against response_model and serialise it again, which costs more than a result-cache
    answer itself. response_model stays on the routes for the OpenAPI document."""
    return Response(model.model_dump_json(), media_type="application/json")


def make_router(settings: Settings) -> APIRouter:
    """The search routes, with this deployment's request bounds in their bodies (and so in the OpenAPI)."""
    SearchRequest, BatchSearchRequest = make_request_models(settings)
    # each route lists exactly the errors it can answer (tests/robustness/test_robust_hostile.py produces each)
    router = APIRouter(tags=["search"], dependencies=[Depends(require_search)])

    @router.post(f"/{API_VERSION}/search", response_model=SearchResponse, responses=SEARCH_ONE_ERRORS, summary="search the index with one text query")
    async def search_one(body: SearchRequest, state: StateDep) -> Response:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            ids = body.example_ids()
            if ids is not None:  # more like this: stage 1 with the videos' mean v̂, rerank by s_vv
                opts = body.options(*served_defaults(version.manifest))
                opts = S.SearchOptions(k=opts.k, candidates=opts.candidates, rerank=opts.rerank, ncl=False)
                return _json(await run_example(state, version, state.search_by_videos, version, ids, opts=opts,
                                               example={"kind": "videos", "ids": ids}, t_start=t_start))
            res = await run_queries(state, version, [body.query], body.options(*served_defaults(version.manifest)),
                                    t_start)
            return _json(res[0])

    max_k, max_K, default_K = settings.max_k, settings.max_candidates, settings.default_candidates
    slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()

    def image_slots() -> asyncio.Semaphore:
        """This worker's image decode+encode slots (settings.image_decode_concurrency), one semaphore per event
        loop (an asyncio.Semaphore is bound to the loop it first waits on; tests run one app in several loops)."""
        loop = asyncio.get_running_loop()
        sem = slots.get(loop)
        if sem is None:
            sem = slots[loop] = asyncio.Semaphore(settings.image_decode_concurrency)
        return sem

    @router.post(f"/{API_VERSION}/search/image", response_model=SearchResponse, responses=IMAGE_ERRORS,
                 summary="search by an image (multipart field `image`: JPEG, PNG, WebP or GIF); stage 1 only")
    async def search_image(
        state: StateDep,
        image: Annotated[UploadFile, File(description=f"the image (at most {settings.max_image_bytes} bytes, "
                                                      f"{settings.max_image_pixels} pixels, long side at most "
                                                      f"{settings.max_image_aspect:g} x the short side)")],
        k: Annotated[int, Form(ge=1, le=max_k)] = 10,
        candidates: Annotated[int | None, Form(ge=1, le=max_K)] = None,
    ) -> Response:
        t_start = time.perf_counter()
        K = candidates if candidates is not None else min(max_K, max(default_K, k))
        if K < k:
            raise HTTPException(422, f"candidates ({K}) must be >= k ({k})")
        kind = E.image_type(image.content_type)
        if kind is None:
            raise HTTPException(415, f"image type {image.content_type!r} is not accepted; send one of {sorted(E.IMAGE_TYPES)}")
        # At most image_decode_concurrency uploads are read, decoded and encoded at once in this worker; the
        # others wait here holding only their spooled upload (no bytes read, no pixels decoded).
        async with image_slots():
            data = await image.read(settings.max_image_bytes + 1)
            if len(data) > settings.max_image_bytes:
                raise HTTPException(413, f"image is larger than {settings.max_image_bytes} bytes")
            if not data:
                raise HTTPException(422, "the image file is empty")
            if state.model is None:  # not ready (the lifespan has not loaded the model): nothing to decode for
                raise HTTPException(503, "the model is not loaded yet")
            try:  # reduced while decoded to a short side of at most 2 x the model's input side
                pil = await run_in_threadpool(E.decode_image, data, kind, max_pixels=settings.max_image_pixels,
                                              max_aspect=settings.max_image_aspect, image_size=state.model.cfg.image_size)
            except E.UnsupportedImageType as e:
                raise HTTPException(415, str(e)) from None
            except E.ExampleError as e:
                raise HTTPException(422, str(e)) from None
            nbytes = len(data)
            del data  # the upload's bytes are not needed for the search
            opts = S.SearchOptions(k=k, candidates=K, rerank=False, ncl=False)
            with state.use_version() as version:
                return _json(await run_example(state, version, state.search_by_image, state.model, version, pil, opts=opts,
                                               example={"kind": "image", "content_type": kind, "bytes": nbytes},
                                               t_start=t_start))

    @router.post(f"/{API_VERSION}/search/batch", response_model=BatchSearchResponse, responses=SEARCH_ERRORS,
                 summary="many queries in one request (shared options)")
    async def search_batch(body: BatchSearchRequest, state: StateDep) -> Response:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            res = await run_queries(state, version, list(body.queries),
                                    body.options(*served_defaults(version.manifest)), t_start)
            return _json(BatchSearchResponse(
                index_version=version.name, results=res,
                timings_ms={"total": round((time.perf_counter() - t_start) * 1000, 3)},
            ))

    return router
