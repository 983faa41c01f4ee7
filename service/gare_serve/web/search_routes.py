"""``POST /v1/search``, ``/v1/search/batch`` and ``/v1/search/image``: parse the body, run the search
(``gare_serve.engine.search_requests``), map its typed errors to HTTP, render the hits and the response.

Text queries go through the result cache and the micro-batcher (``gare_serve.engine.search_requests.search_texts``);
search by example (``video_id``/``video_ids`` in ``/v1/search``, an upload to ``/v1/search/image``) runs
``gare_search.by_example`` in the thread pool. The options a request leaves out (K, ncl) are the served index's
(``gare_serve.engine.served_options``); the routes never read the manifest themselves.
"""

import asyncio
import contextlib
import dataclasses
import json
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, HTTPException, Request, Response, UploadFile
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gare_index.filters import MAX_TEXT as MAX_FILTER_TEXT
from gare_index.filters import FilterError
from gare_index.ncl_ann import Stage1Unavailable
from gare_index.store import IndexVersion
from gare_search import by_example as E
from gare_search import search as S
from gare_serve.engine.search_requests import (
    ExampleAnswer,
    TextAnswer,
    observe_stages,
    request_filter,
    search_by_image,
    search_by_videos,
    search_texts,
)
from gare_serve.engine.served_options import AskedOptions
from gare_serve.engine.state import ServiceState
from gare_serve.settings import Settings
from gare_serve.web.deps import StateDep, require_search
from gare_serve.web.hit_budget import HitBudget
from gare_serve.web.presentation import API_VERSION, fresh_urls, hit_models
from gare_serve.web.schemas import (
    IMAGE_ENCODING,
    IMAGE_ERRORS,
    SEARCH_ERRORS,
    SEARCH_ONE_ERRORS,
    BatchSearchResponse,
    SearchResponse,
    Timings,
    make_request_models,
)

# The image route's form fields: a field given twice is refused; other fields are ignored (the document allows
# them), an array among them too
IMAGE_FORM_FIELDS = ("image", "k", "candidates", "filter")


def ms(seconds: float) -> float:
    """Seconds as the responses' milliseconds (three decimals)."""
    return round(seconds * 1000, 3)


async def text_responses(state: ServiceState, version: IndexVersion, queries: list[str], asked: AskedOptions,
                         t_start: float) -> list[SearchResponse]:
    """The responses to text queries on ``version``: 409 when it cannot serve the options (ncl_stage1)."""
    try:
        answers = await search_texts(state, version, queries, asked)
    except Stage1Unavailable as e:
        raise HTTPException(409, str(e)) from None
    except FilterError as e:  # an unknown field, a wrong type, too deep or too long: the message names it
        raise HTTPException(422, str(e)) from None
    return [await text_response(state, version, a, t_start) for a in answers]


async def text_response(state: ServiceState, version: IndexVersion, a: TextAnswer, t_start: float) -> SearchResponse:
    """One text query's response: its hits rendered (or the result cache's, re-signed), its stage timings."""
    if a.rendered is not None:  # a result-cache answer: its media URLs signed now
        hits = fresh_urls(state, a.rendered)
    else:
        hits = await run_in_threadpool(hit_models, state, version, a.result)
        if a.key is not None:  # kept rendered, so that a repeat needs no metadata read
            state.result_cache.put(a.key, a.result, hits)
    total = time.perf_counter() - t_start
    stage_s = observe_stages(state, a.result, a.batch.queue_s, total)
    opts, res = a.options, a.result
    return SearchResponse(
        query=a.query, index_version=version.name, k=opts.k, candidates=opts.candidates, rerank=opts.rerank,
        ncl=opts.ncl, results=hits, batch_size=a.batch.size, **partial_fields(res),
        timings_ms=Timings(**{k: ms(v) for k, v in stage_s.items()}, total=ms(total),
                           **filter_timings(opts, res, from_cache=a.from_result_cache),
                           cache="result" if a.from_result_cache else "hit" if res.cached else "miss"),
    )


def filter_timings(opts: S.SearchOptions, res: S.QueryResult, *, from_cache: bool = False) -> dict[str, Any]:
    """``filter`` (ms) and ``plan`` of a filtered search's timings (none without a filter; a result-cache answer
    ran no stage: 0 ms, plan "cached"; a sharded answer: every shard chose its own plan, "per-shard")."""
    if opts.filter is None:
        return {}
    plan = getattr(res, "plan", None)
    name = plan.plan if plan is not None else "cached" if from_cache else "per-shard"
    return {"filter": ms(res.timings.get("filter", 0.0)), "plan": name}


@contextlib.contextmanager
def example_errors() -> Iterator[None]:
    """A search by example's typed errors as HTTP: 404 for an unknown example video, 422 for an example that
    cannot be searched."""
    try:
        yield
    except E.UnknownExample as e:
        raise HTTPException(404, str(e)) from None
    except (E.ExampleError, FilterError) as e:
        raise HTTPException(422, str(e)) from None


async def example_response(state: ServiceState, version: IndexVersion, a: ExampleAnswer, example: dict[str, Any],
                           t_start: float) -> SearchResponse:
    """The response to one search by example: the same body, limits and per-stage metrics as a text query's."""
    opts, res = a.options, a.result
    hits = await run_in_threadpool(hit_models, state, version, res)
    total = time.perf_counter() - t_start
    stage_s = observe_stages(state, res, 0.0, total)
    return SearchResponse(
        query=None, example=example, index_version=version.name, k=opts.k, candidates=opts.candidates,
        rerank=opts.rerank and example["kind"] == "videos", ncl=False, results=hits, batch_size=1, **partial_fields(res),
        timings_ms=Timings(**{k: ms(v) for k, v in stage_s.items()}, total=ms(total), **filter_timings(opts, res)),
    )


def parse_filter_text(text: str) -> Any:
    """The image route's ``filter`` form field (JSON text) decoded; FilterError (422) when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise FilterError(f"filter: not valid JSON ({e})") from None


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


class DecodeSlots:
    """One worker's image decode slots: ``concurrency`` uploads decoded and encoded at once, at most ``queue`` more
    waiting for a slot; one more is answered 503 with Retry-After (no bytes of it read)."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.sem = asyncio.Semaphore(concurrency)
        self.limit = concurrency + queue
        self.held = 0  # uploads decoding or waiting in this worker

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        if self.held >= self.limit:
            raise HTTPException(503, f"too many images are being decoded ({self.held}: image_decode_concurrency + "
                                     f"image_decode_queue); retry shortly", headers={"Retry-After": "1"})
        self.held += 1
        try:
            async with self.sem:
                yield
        finally:
            self.held -= 1


def make_router(settings: Settings) -> APIRouter:
    """The search routes, with this deployment's request bounds in their bodies (and so in the OpenAPI)."""
    SearchRequest, BatchSearchRequest = make_request_models(settings)
    # each route lists exactly the errors it can answer (tests/robustness/test_robust_hostile.py produces each)
    router = APIRouter(tags=["search"], dependencies=[Depends(require_search)])

    @router.post(f"/{API_VERSION}/search", response_model=SearchResponse, responses=SEARCH_ONE_ERRORS, summary="search the index with one text query")
    async def search_one(body: SearchRequest, state: StateDep) -> Response:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            async with hits_in_flight(version, 1, body.k):
                ids = body.example_ids()
                if ids is not None:  # more like this: stage 1 with the videos' mean v̂, rerank by s_vv
                    with example_errors():
                        a = await search_by_videos(state, version, ids, body.asked())
                    return _json(await example_response(state, version, a, {"kind": "videos", "ids": ids}, t_start))
                res = await text_responses(state, version, [body.query], body.asked(), t_start)
                return _json(res[0])

    max_k, max_K, default_K = settings.max_k, settings.max_candidates, settings.default_candidates
    slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DecodeSlots] = weakref.WeakKeyDictionary()
    budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HitBudget] = weakref.WeakKeyDictionary()

    def hits_in_flight(version: IndexVersion, queries: int, k: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Room in this worker's hit budget (``inflight_hits``) for a request's answer: ``queries`` x its k (at
        most the index's entries), held from its search until its JSON is made (gare_serve.web.hit_budget)."""
        loop = asyncio.get_running_loop()
        budget = budgets.get(loop)
        if budget is None:
            budget = budgets[loop] = HitBudget(settings.inflight_hits)
        return budget.hold(queries * min(k, max(1, version.n)))

    def image_slots() -> DecodeSlots:
        """This worker's image decode+encode slots, one set per event loop (an asyncio.Semaphore is bound to the
        loop it first waits on; tests run one app in several loops)."""
        loop = asyncio.get_running_loop()
        got = slots.get(loop)
        if got is None:
            got = slots[loop] = DecodeSlots(settings.image_decode_concurrency, settings.image_decode_queue)
        return got

    @router.post(f"/{API_VERSION}/search/image", response_model=SearchResponse, responses=IMAGE_ERRORS,
                 summary="search by an image (multipart field `image`: JPEG, PNG, WebP or GIF); stage 1 only",
                 openapi_extra=IMAGE_ENCODING)
    async def search_image(
        state: StateDep,
        request: Request,
        image: Annotated[UploadFile, File(description=f"the image (at most {settings.max_image_bytes} bytes, "
                                                      f"{settings.max_image_pixels} pixels, long side at most "
                                                      f"{settings.max_image_aspect:g} x the short side); its part's "
                                                      f"Content-Type one of {', '.join(sorted(E.IMAGE_TYPES))}",
                                          json_schema_extra={"minLength": 1})],
        k: Annotated[int, Form(ge=1, le=max_k)] = 10,
        # left out: the default K; never empty or null (a form has no null), so the schema says integer
        candidates: Annotated[int, Form(ge=1, le=max_K, description="K (>= k; default: max(k, the index's "
                                                                    "default))")] = None,  # type: ignore[assignment]
        # left out: no filter; a form has no null, so the schema says string
        filter: Annotated[str, Form(max_length=MAX_FILTER_TEXT, description="a filter object as JSON text "
                                    "(the `filter` of POST /v1/search)")] = None,  # type: ignore[assignment]
    ) -> Response:
        t_start = time.perf_counter()
        # A field given twice is refused: the form parser keeps one of the values (an array is not the integer
        # or string the OpenAPI document promises), and which one the client meant is not ours to guess.
        form = await request.form()  # parsed already for the parameters above: the same object, cached
        repeated = sorted(name for name in IMAGE_FORM_FIELDS if len(form.getlist(name)) > 1)
        if repeated:
            raise HTTPException(422, f"form field(s) given more than once: {', '.join(repeated)}")
        K = candidates if candidates is not None else min(max_K, max(default_K, k))
        if K < k:
            raise HTTPException(422, f"candidates ({K}) must be >= k ({k})")
        kind = E.image_type(image.content_type)
        if kind is None:
            raise HTTPException(415, f"image type {image.content_type!r} is not accepted; send one of {sorted(E.IMAGE_TYPES)}")
        # At most image_decode_concurrency uploads are read, decoded and encoded at once in this worker; at most
        # image_decode_queue others wait here holding only their spooled upload (no bytes read, no pixels
        # decoded); past that a 503 with Retry-After.
        async with image_slots().hold():
            data = await image.read(settings.max_image_bytes + 1)
            if len(data) > settings.max_image_bytes:
                raise HTTPException(413, f"image is larger than {settings.max_image_bytes} bytes")
            if not data:
                raise HTTPException(422, "the image file is empty")
            if state.model_cfg is None:  # not ready (the lifespan has not loaded the model): nothing to decode for
                raise HTTPException(503, "the model is not loaded yet")
            try:  # reduced while decoded to a short side of at most 2 x the model's input side
                pil = await run_in_threadpool(E.decode_image, data, kind, max_pixels=settings.max_image_pixels,
                                              max_aspect=settings.max_image_aspect, image_size=state.model_cfg.image_size,
                                              budget_s=settings.image_decode_budget_s)
            except E.UnsupportedImageType as e:
                raise HTTPException(415, str(e)) from None
            except E.ExampleError as e:
                raise HTTPException(422, str(e)) from None
            nbytes = len(data)
            del data  # the upload's bytes are not needed for the search
            opts = S.SearchOptions(k=k, candidates=K, rerank=False, ncl=False)
            with state.use_version() as version:
                with example_errors():
                    if filter is not None:
                        opts = dataclasses.replace(opts, filter=request_filter(version, parse_filter_text(filter)),
                                                   filter_exact_below=settings.filter_exact_below)
                    async with hits_in_flight(version, 1, k):
                        a = await search_by_image(state, version, pil, opts)
                        return _json(await example_response(
                            state, version, a, {"kind": "image", "content_type": kind, "bytes": nbytes}, t_start))

    @router.post(f"/{API_VERSION}/search/batch", response_model=BatchSearchResponse, responses=SEARCH_ERRORS,
                 summary="many queries in one request (shared options)")
    async def search_batch(body: BatchSearchRequest, state: StateDep) -> Response:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            async with hits_in_flight(version, len(body.queries), body.k):
                res = await text_responses(state, version, list(body.queries), body.asked(), t_start)
                return _json(BatchSearchResponse(
                    index_version=version.name, results=res, timings_ms={"total": ms(time.perf_counter() - t_start)},
                ))

    return router
