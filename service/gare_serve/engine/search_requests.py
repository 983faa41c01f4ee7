"""What a search request runs on the served version, for the routes of ``gare_serve.web.search_routes``.

* The request's options against the served version (:func:`request_options`: the pure decisions of
  ``gare_serve.engine.served_options`` on its manifest and the service's bounds).
* Text queries (:func:`search_texts`): refused before the micro-batch when the version cannot serve them
  (``ncl_stage1`` on an index without it), then answered from the result cache
  (``gare_serve.engine.result_cache``) or through the micro-batcher (``gare_serve.engine.batcher``, whose worker
  is ``gare_serve.engine.batch_worker``). Each :class:`TextAnswer` says which, and carries the hits as the route
  rendered them when they came from the cache; the route keeps its rendering there for the next repeat.
* Searches by example (:func:`search_by_videos`, :func:`search_by_image`): ``gare_search.by_example`` (or the
  sharded one) in the thread pool; it has no text to encode, so the micro-batcher has nothing to share.
* :func:`observe_stages`: an answer's per-stage seconds, recorded in the metrics.

Errors are typed and left to the routes to map to HTTP: ``gare_index.ncl_ann.Stage1Unavailable`` (409),
``gare_search.by_example.UnknownExample`` (404) and ``ExampleError`` (422).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool

from gare_index.filters import Filter, compile_filter, schema_of
from gare_index.store import IndexManifest, IndexVersion
from gare_search import search as S
from gare_serve.engine.batch_worker import Job
from gare_serve.engine.batcher import BatchInfo
from gare_serve.engine.result_cache import Key
from gare_serve.engine.served_options import AskedOptions, resolve_options, served_defaults
from gare_serve.engine.state import ServiceState

__all__ = ["ExampleAnswer", "NO_BATCH", "TextAnswer", "observe_stages", "request_filter", "request_options",
           "search_by_image", "search_by_videos", "search_texts"]

NO_BATCH = BatchInfo(size=0, queue_s=0.0, run_s=0.0)  # a result-cache answer: it never entered the micro-batch queue
STAGES = ("encode", "ann", "rerank", "rank")  # a result's stage timings, in the metrics and the response


def request_options(state: ServiceState, version: IndexVersion, asked: AskedOptions) -> S.SearchOptions:
    """:func:`resolve_options` against ``version``'s manifest and the service's bounds; the request's filter compiled
    against the version's fields (``gare_index.filters.FilterError`` naming the problem: the routes' 422)."""
    s = state.settings
    opts = resolve_options(asked, served_defaults(version.manifest), max_candidates=s.max_candidates,
                           default_candidates=s.default_candidates)
    if asked.filter is None:
        return opts
    return dataclasses.replace(opts, filter=request_filter(version, asked.filter),
                               filter_exact_below=s.filter_exact_below)


class Described(Protocol):
    """What a filter is compiled against: anything served with an index manifest (an open version, a shared-engine
    worker's metadata view, a sharded generation's view)."""

    @property
    def manifest(self) -> IndexManifest: ...


def request_filter(version: Described, spec: Mapping[str, Any]) -> Filter:
    """A request's filter compiled against the served version's fields as its manifest records them (``fields``;
    the same for an opened version, a shared-engine worker's metadata view and a sharded generation's view)."""
    return compile_filter(spec, schema_of(getattr(version.manifest, "fields", None)))


@dataclass
class TextAnswer:
    """One text query's answer. ``rendered``: the hits as the route rendered them for an earlier identical query
    (a result-cache answer: ``batch`` is :data:`NO_BATCH`), else None; ``key``: where the route keeps its
    rendering (None: the result cache is off)."""

    query: str
    options: S.SearchOptions
    result: S.QueryResult
    batch: BatchInfo
    rendered: tuple[Any, ...] | None = None
    key: Key | None = None

    @property
    def from_result_cache(self) -> bool:
        return self.batch is NO_BATCH


async def search_texts(state: ServiceState, version: IndexVersion, queries: list[str], asked: AskedOptions) -> list[TextAnswer]:
    """``queries`` searched on ``version`` (which the caller holds) with the same options, answers in order;
    Stage1Unavailable before anything is queued when the version cannot serve the options."""
    opts = request_options(state, version, asked)
    # refused here, before the micro-batch, so it cannot fail other clients' queries
    version.check_stage1(ncl_stage1=opts.ncl_stage1)
    rc = state.result_cache
    variant = state.encoder_variant
    keys = [rc.key(version.name, state.checkpoint_sha or "", variant, q, opts)
            for q in queries] if rc.enabled else [None] * len(queries)
    # whole answers, hits rendered with their metadata: no queue, no stage, no metadata read, no thread hop
    cached = [rc.lookup(k) if k is not None else None for k in keys]
    answers: list[TextAnswer | None] = [
        TextAnswer(q, opts, c[0], NO_BATCH, c[1], k) if c is not None else None
        for q, c, k in zip(queries, cached, keys, strict=True)
    ]
    todo = [i for i, a in enumerate(answers) if a is None]
    if todo:
        done = await state.batcher.submit_many([Job(version, queries[i], opts) for i in todo])
        for i, (res, info) in zip(todo, done, strict=True):
            answers[i] = TextAnswer(queries[i], opts, res, info, None, keys[i])
    return answers  # type: ignore[return-value]


@dataclass
class ExampleAnswer:
    """One search by example's answer and the options it was searched with."""

    options: S.SearchOptions
    result: S.QueryResult


async def search_by_videos(state: ServiceState, version: IndexVersion, ids: list[int], asked: AskedOptions) -> ExampleAnswer:
    """More like these videos: stage 1 with their mean unit vector, rerank by s_vv, no NCL biases (the request's k,
    K and rerank resolved as a text request's)."""
    o = request_options(state, version, asked)
    opts = S.SearchOptions(k=o.k, candidates=o.candidates, rerank=o.rerank, ncl=False, filter=o.filter,
                           filter_exact_below=o.filter_exact_below)
    return ExampleAnswer(opts, await run_in_threadpool(state.search_by_videos, version, ids, opts))


async def search_by_image(state: ServiceState, version: IndexVersion, image: Any, opts: S.SearchOptions) -> ExampleAnswer:
    """A decoded image as the query (stage 1 only): the model's image tower, then the version's ANN."""
    return ExampleAnswer(opts, await run_in_threadpool(state.search_by_image, state.model, version, image, opts))


def observe_stages(state: ServiceState, result: S.QueryResult, queue_s: float, total_s: float) -> dict[str, float]:
    """The answer's seconds per stage (queue, encode, ann, rerank, rank), recorded with ``total_s`` in the
    per-stage metrics; returned without the total. A filtered search also records the filter's seconds (stage
    ``filter``) and its stage-1 plan."""
    stage_s = {"queue": queue_s, **{k: result.timings.get(k, 0.0) for k in STAGES}}
    plan = getattr(result, "plan", None)
    extra = {"filter": result.timings.get("filter", 0.0)} if plan is not None else {}
    state.metrics.observe_stages({**stage_s, **extra, "total": total_s})
    if plan is not None:
        state.metrics.observe_filter_plan(plan.plan)
    return stage_s

