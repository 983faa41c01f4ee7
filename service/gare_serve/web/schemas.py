"""The HTTP API's request and response bodies (pydantic), with the examples the OpenAPI document shows.

Request bodies are built per deployment (:func:`make_request_models`) so that the published bounds (k, K,
query length, batch size) are the configured ones.
"""

import json
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from gare_index.filters import MAX_TEXT as MAX_FILTER_TEXT
from gare_search.by_example import IMAGE_TYPES
from gare_search.search import NCL_DEFAULT
from gare_serve.engine.served_options import AskedOptions
from gare_serve.settings import Settings

EXAMPLE_HIT = {
    "rank": 1,
    "id": 17,
    "score": 0.4132,
    "ann_score": 0.3011,
    "psi_score": 0.4087,
    "bias": 0.0045,
    "start": None,
    "end": None,
    "metadata": {
        "id": 17, "path": "animals/dog_frisbee.mp4", "name": "dog_frisbee.mp4", "size": 1048576, "mtime": 1718000000.0,
        "checksum": "9f2c...", "duration": 12.0, "fps": 25.0, "frames_used": 12, "start": None, "end": None, "status": "ok",
    },
    "thumbnail_url": "/v1/videos/17/thumbnail",
    "video_url": "/v1/videos/17/file",
}
EXAMPLE_TIMINGS = {"queue": 0.4, "encode": 21.3, "ann": 0.9, "rerank": 4.8, "rank": 0.1, "total": 28.2}


class Timings(BaseModel):
    queue: float = Field(description="ms waiting for the micro-batch to start")
    filter: float | None = Field(None, description="ms evaluating the request's filter (null without a filter)")
    plan: str | None = Field(None, description="stage 1 under the filter: exact (every passing video scored), ann (the "
                             "ANN with the filter inside, widened until K pass), ann+exact, empty; null without a filter")
    encode: float = Field(description="ms in the text encoder (for the whole micro-batch)")
    ann: float = Field(description="ms in the ANN search (whole micro-batch)")
    rerank: float = Field(description="ms in the psi rerank (whole micro-batch; 0 when rerank is off)")
    rank: float = Field(0.0, description="ms adding biases and sorting")
    total: float = Field(description="ms from request arrival to response (server side)")
    cache: str = Field("miss", description="result: the whole result came from the result cache (no stage ran); hit: "
                       "the query embedding came from the embedding cache (encode skipped); miss: neither")


class Hit(BaseModel):
    rank: int
    id: int = Field(description="index entry id (a video, or a segment of one)")
    score: float = Field(description="the ranking score: psi score (or cosine when rerank=false) + bias when ncl=true")
    ann_score: float = Field(description="dual-tower cosine from the ANN stage")
    psi_score: float | None = Field(description="GARE pair score s(t, v); null when rerank=false")
    bias: float = Field(description="NCL Sinkhorn video bias b_j (added only when ncl=true)")
    start: float | None = Field(description="segment start in seconds; null for a whole video")
    end: float | None = Field(description="segment end in seconds; null for a whole video")
    metadata: dict[str, Any]
    thumbnail_url: str
    video_url: str


class SearchResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "query": "a dog catches a frisbee", "index_version": "v000003", "k": 10, "candidates": 256, "rerank": True,
        "ncl": True, "results": [EXAMPLE_HIT], "timings_ms": EXAMPLE_TIMINGS, "batch_size": 1,
    }]})
    query: str | None = Field(description="the text query; null for a search by example")
    example: dict[str, Any] | None = Field(None, description="search by example: {kind: videos, ids} or {kind: image, "
                                           "content_type, bytes}; the score is then s_vv or the cosine (no psi, no NCL)")
    index_version: str
    k: int
    candidates: int
    rerank: bool
    ncl: bool
    results: list[Hit]
    timings_ms: Timings
    batch_size: int = Field(description="queries that shared this micro-batch (0: answered from the result cache)")
    partial: bool = Field(False, description="a sharded index (Ray Serve) answered without some of its shards "
                          "(missing_shards): the hits are the best of the shards that answered; always false for one index")
    missing_shards: list[int] = Field(default_factory=list, description="the shards that did not answer (partial)")


class BatchSearchResponse(BaseModel):
    index_version: str
    results: list[SearchResponse]
    timings_ms: dict[str, float] = Field(description="total: ms for the whole request")


class VideoInfo(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": 17, "index_version": "v000003", "metadata": EXAMPLE_HIT["metadata"],
        "thumbnail_url": "/v1/videos/17/thumbnail", "video_url": "/v1/videos/17/file",
    }]})
    id: int
    index_version: str
    metadata: dict[str, Any]
    thumbnail_url: str
    video_url: str


class IndexInfo(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "version": "v000003", "n": 1000, "dim": 512, "max_frames": 12, "index_type": "flat", "created": "2025-06-01T12:00:00+00:00",
        "checkpoint": {"name": "gare-msrvtt.safetensors", "sha256": "ab12...", "model_config": {"backbone": "ViT-B-32"}},
        "biases": {"gamma": 0.01, "n_iters": 4, "n_queries": 16384, "source": "checkpoint queue"},
        "device": "cpu", "precision": "fp32", "rerank_impl": "fold", "default_candidates": 64,
        "stage1": {"recall": 1.0, "recall_target": 0.995, "recall_at": 256, "index_type": "flat", "p50_ms": 0.4,
                   "coverage": {"32": 0.99, "64": 0.997}, "default_candidates": 64, "query_source": "ncl-queue (1000 queries)"},
    }]})
    version: str
    n: int
    dim: int
    max_frames: int
    index_type: str | None
    created: str | None = None
    checkpoint: dict[str, Any]
    biases: dict[str, Any] | None = None
    biases_description: str | None = Field(None, description="how the NCL biases of this version were computed")
    ncl_default: bool = Field(NCL_DEFAULT, description="the search's default for ncl")
    ncl_default_reason: str = Field(description="why ncl defaults to what it does")
    device: str
    precision: str
    rerank_impl: str = Field("fold", description="the psi rerank the service runs (the fold, its one implementation)")
    default_candidates: int = Field(description="K a search uses when it gives no candidates: the index's chosen K "
                                    "(smallest K holding >= 99.5% of the exhaustive psi top-10), else the setting")
    stage1: dict[str, Any] | None = Field(None, description="the index's stage-1 tuning: recall vs exact search, "
                                          "psi coverage per K, query source, parameters and latency (manifest stage1)")


class ReloadResponse(BaseModel):
    reloaded: bool = Field(description="false when CURRENT already named the served version")
    version: str
    previous: str
    n: int
    workers: int | None = Field(None, description="live worker processes (gare-serve --workers N > 1)")
    workers_on_version: int | None = Field(
        None, description="how many of them serve `version` when the response was sent (all, unless one failed)"
    )


class ErrorResponse(BaseModel):
    detail: str


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the body could not be decoded (not UTF-8 JSON, too deeply nested)"},
    401: {"model": ErrorResponse, "description": "missing API key"},
    409: {"model": ErrorResponse, "description": "the index cannot do what was asked (e.g. ncl_stage1 without --ncl-stage1)"},
    403: {"model": ErrorResponse, "description": "invalid API key"},
    404: {"model": ErrorResponse, "description": "unknown id or file gone"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    415: {"model": ErrorResponse, "description": "unsupported image type (JPEG, PNG, WebP or GIF)"},
    422: {"model": ErrorResponse, "description": "invalid input; `detail` says what"},
    503: {"model": ErrorResponse, "description": "busy or not ready"},
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ERRORS a route can answer (tests/robustness/test_robust_hostile.py produces each one on each route)."""
    return {c: ERRORS[c] for c in codes}


# The Content-Types the image part of POST /v1/search/image may declare (OpenAPI multipart `encoding`): any
# other, or none, is a 415 (gare_search.by_example.IMAGE_TYPES).
IMAGE_ENCODING: dict[str, Any] = {"requestBody": {"content": {"multipart/form-data": {"encoding": {
    "image": {"contentType": ", ".join(sorted(IMAGE_TYPES))}}}}}}

SEARCH_ERRORS = errors(400, 401, 403, 409, 413, 422, 503)  # 409: ncl_stage1 on an index without it
SEARCH_ONE_ERRORS = errors(400, 401, 403, 404, 409, 413, 422, 503)  # + 404: an unknown video_id (more like this)
IMAGE_ERRORS = errors(400, 401, 403, 413, 415, 422, 503)  # 415: not JPEG/PNG/WebP/GIF; no ncl_stage1 here
MEDIA_ERRORS = errors(400, 401, 403, 404, 413, 422, 503)  # 404: unknown id or file gone; 422: bad id
INDEX_ERRORS = errors(400, 401, 403, 413, 503)  # 400/413: bad or oversized Content-Length (any route)


FILTER_DESCRIPTION = (
    "only videos whose fields pass this filter (JSON in the style of Chroma's `where` and MongoDB). A field maps to a "
    "value (equality) or to operators: $eq $ne $gt $gte $lt $lte $in $nin $prefix $not; $and / $or take a list of "
    "filters, $not a filter. Fields: the index's own (from the manifest's columns at build time: string, tags, "
    "number, date) and the built-in id, path, folder (the file's directory), duration, mtime (a date), size, fps, "
    "start, end. Dates are ISO 8601 strings or seconds since the epoch; $prefix on folder/path matches whole path "
    "components; a video without a value matches only $ne / $nin. An unknown field, a wrong type, more than 8 "
    "levels or 256 conditions is a 422 naming the problem. Selective filters are searched exactly, broad ones by "
    "the ANN with the filter inside (timings_ms.plan)."
)
FILTER_EXAMPLES: list[dict[str, Any]] = [
    {"channel": "news", "year": {"$gte": 2020}, "tags": {"$in": ["sport"]}},
    {"$or": [{"channel": "news"}, {"duration": {"$lt": 30}}], "folder": {"$prefix": "/videos/2024"}},
    {"published": {"$gte": "2024-03-01"}, "$not": {"tags": "archive"}},
]


def check_filter_shape(v: dict[str, Any]) -> dict[str, Any]:
    """A filter's size before any index is asked (the fields, types and nesting are checked against the served
    index when the search compiles it: gare_index.filters)."""
    n = len(json.dumps(v))
    if n > MAX_FILTER_TEXT:
        raise ValueError(f"filter: too long ({n} characters as JSON, at most {MAX_FILTER_TEXT})")
    return v


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty or blank")
    return v


def integral(v: Any) -> Any:
    """A JSON number with no fraction (``244.0``) as the integer it is: JSON Schema's ``"type": "integer"`` (the
    OpenAPI document's) accepts it, so the server does too; ``244.5``, ``"244"`` and ``true`` stay refused (the
    models are strict)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def integer(**bounds: Any) -> Any:
    """An integer body field type with these bounds (``ge``, ``le``, ``lt``): strict (no strings, no booleans) but
    integral floats accepted (see `integral`). The bounds go on the integer itself, so that the OpenAPI document
    states them as minimum/maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(integral)]
# Not blank, in the OpenAPI document: at least one character that is not white space as ``_not_blank`` strips it
# (Python's ``str.isspace``), listed one by one: ``\S`` means other sets in other regex dialects (ECMA-262's, which
# JSON Schema names and fuzzers follow, counts U+0085 and U+001C-U+001F as text and U+FEFF as space), so a query of
# "\u0085" was valid by the document and refused by the server. tests/service/test_openapi_conformance.py holds the
# class to str.isspace over every code point.
NOT_BLANK_PATTERN = r"[^\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
# Index entry ids are int64: the bound is published as exclusiveMaximum 2**63, which a float states exactly (the
# OpenAPI document carries bounds as floats, and 2**63 - 1 as a float is 2**63: an id one past the range would
# look valid).
ID_LIMIT = 2**63


def _drop_default(schema: dict[str, Any]) -> None:
    # an optional field whose absence means "not given": JSON null is refused, so no `"default": null` either
    schema.pop("default", None)


def _query_schema(schema: dict[str, Any]) -> None:
    _drop_default(schema)
    schema["pattern"] = NOT_BLANK_PATTERN


# Exactly one kind of query in a /v1/search body (what SearchRequest._one_kind enforces).
ONE_QUERY_KIND = [{"required": ["query"]}, {"required": ["video_id"]}, {"required": ["video_ids"]}]


def make_request_models(settings: Settings) -> tuple[type[BaseModel], type[BaseModel]]:
    """Request bodies with this deployment's limits, so the OpenAPI document states the real bounds."""
    max_k, max_K, default_K = settings.max_k, settings.max_candidates, settings.default_candidates
    max_q, max_batch = settings.max_query_chars, settings.max_batch_queries
    QueryText = Annotated[str, StringConstraints(min_length=1, max_length=max_q)]
    QueryStr = Annotated[QueryText, Field(json_schema_extra={"pattern": NOT_BLANK_PATTERN})]

    class _Options(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        k: integer(ge=1, le=max_k) = Field(10, description="results to return")  # type: ignore[valid-type]
        candidates: integer(ge=1, le=max_K) | None = Field(  # type: ignore[valid-type]
            None,
            description=f"K, the ANN shortlist the rerank scores (>= k; default: the index's chosen K (GET /v1/index "
            f"default_candidates), else {default_K}; k when k is larger)",
        )
        rerank: bool = Field(True, description="score the K candidates with psi (false: dual-tower cosine only)")
        ncl: bool | None = Field(None, description="add the NCL Sinkhorn video biases to the score (default: the "
                                 "index's own default, decided at build time on validation captions, else "
                                 f"{str(NCL_DEFAULT).lower()}; GET /v1/index ncl_default says which and why)")
        ncl_stage1: bool = Field(
            False, description="choose the K candidates with the biases too (cos + b folded into the ANN; needs an "
            "index built with --ncl-stage1; implies ncl)",
        )
        filter: dict[str, Any] | None = Field(
            None, description=FILTER_DESCRIPTION, examples=FILTER_EXAMPLES,
        )

        @field_validator("filter")
        @classmethod
        def _filter_shape(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
            # the fields and their types are the served index's: checked when the search compiles the filter
            return v if v is None else check_filter_shape(v)

        @model_validator(mode="after")
        def _k_le_K(self):
            # candidates None: resolved against the served index's own default K (engine.served_options)
            if self.candidates is not None and self.candidates < self.k:
                raise ValueError(f"candidates ({self.candidates}) must be >= k ({self.k})")
            return self

        def asked(self) -> AskedOptions:
            """The options as sent; what is left out (candidates, ncl) the served index decides
            (``gare_serve.engine.served_options.resolve_options``)."""
            return AskedOptions(k=self.k, candidates=self.candidates, rerank=self.rerank, ncl=self.ncl,
                                ncl_stage1=self.ncl_stage1, filter=self.filter)

    class SearchRequest(_Options):
        model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"oneOf": ONE_QUERY_KIND, "examples": [
            {"query": "a dog catches a frisbee", "k": 10},
            {"query": "a red circle rises, then two blue squares slide to the left", "k": 20, "candidates": 512, "rerank": True, "ncl": False},
            {"query": "a goal in the last minute", "k": 10, "filter": FILTER_EXAMPLES[0]},
        ]})
        # Each kind is optional but never null (the schema's types say so): left out means "not this kind".
        query: QueryText = Field(  # type: ignore[assignment]
            None, description=f"the text to search for (1..{max_q} characters, not blank)", json_schema_extra=_query_schema)
        # ids are int64 in the index (as the path parameter VideoId): a larger number is a 422, not a 500
        video_id: integer(ge=0, lt=ID_LIMIT) = Field(  # type: ignore[assignment, valid-type]
            None, description="instead of query: more like this indexed video", json_schema_extra=_drop_default)
        video_ids: list[integer(ge=0, lt=ID_LIMIT)] = Field(  # type: ignore[assignment, valid-type]
            None, min_length=1, max_length=max_batch,
            description=f"instead of query: more like these 1..{max_batch} videos (their mean unit vector)",
            json_schema_extra=_drop_default)

        @field_validator("query", "video_id", "video_ids", mode="before")
        @classmethod
        def _not_null(cls, v: Any) -> Any:
            if v is None:  # only an explicit null reaches a validator (a left-out field keeps its default)
                raise ValueError("must not be null (leave the field out instead)")
            return v

        @field_validator("query")
        @classmethod
        def _blank(cls, v: str | None) -> str | None:
            return v if v is None else _not_blank(v)

        @model_validator(mode="after")
        def _one_kind(self):
            given = [n for n in ("query", "video_id", "video_ids") if getattr(self, n) is not None]
            if len(given) != 1:
                raise ValueError(f"give exactly one of query, video_id, video_ids (got {given or 'none'})")
            return self

        def example_ids(self) -> list[int] | None:
            if self.video_id is not None:
                return [self.video_id]
            return list(self.video_ids) if self.video_ids is not None else None

    class BatchSearchRequest(_Options):
        model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
            {"queries": ["a dog catches a frisbee", "a man is cooking"], "k": 5},
        ]})
        queries: list[QueryStr] = Field(min_length=1, max_length=max_batch, description=f"1..{max_batch} query texts")

        @field_validator("queries")
        @classmethod
        def _blank(cls, v: list[str]) -> list[str]:
            for i, q in enumerate(v):
                if not q.strip():
                    raise ValueError(f"query {i} must not be empty or blank")
            return v

    return SearchRequest, BatchSearchRequest
