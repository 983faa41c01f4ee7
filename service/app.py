"""The GARE search service: a FastAPI app over one model and one (reloadable) index version.

``create_app(settings)`` builds the app; nothing heavy happens until its lifespan starts: then the
checkpoint the index names (or ``settings.checkpoint``) is hashed and checked against the manifest,
loaded on the GPU when there is one, and the index's CURRENT version is opened.

Requests hold a reference to the version they started on (:class:`VersionHandle`), so
``POST /v1/admin/reload`` can swap versions atomically while requests are in flight: they finish on
the old version, which is closed when the last of them lets go.

Run it with ``gare-serve --index INDEX`` (service/cli.py) or ``uvicorn --factory service.app:create_app``
(settings from ``GARE_*`` variables).
"""

import asyncio
import contextlib
import hmac
import io
import logging
import mimetypes
import mmap
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from indexer import search as S

from .batcher import BatcherClosed, BatcherOverloaded, MicroBatcher
from .metrics import CONTENT_TYPE_LATEST, Metrics, MetricsMiddleware
from .settings import Settings, SettingsError, load_api_key_hashes

log = logging.getLogger("gare.service")

API_VERSION = "v1"
STATIC_DIR = Path(__file__).parent / "static"


class StartupError(RuntimeError):
    """The service cannot start with these settings (message is meant for the operator)."""


# ============================================================================================ startup
_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def checkpoint_sha256(path: Path) -> str:
    """sha256 of a file, memoised on (path, size, mtime) so the CLI pre-check and the lifespan hash once."""
    from training.checkpoint import file_sha256

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = file_sha256(path)
    return _SHA_CACHE[key]


def resolve_checkpoint(settings: Settings) -> tuple[Path, str, dict[str, Any]]:
    """(checkpoint path, its sha256, the current version's manifest); StartupError with a clear message."""
    from indexer.store import (
        MANIFEST_FILE,
        VERSIONS_DIR,
        IndexFormatError,
        current_version_name,
        read_manifest,
    )

    if settings.index is None:
        raise StartupError("no index given: pass --index INDEX or set GARE_INDEX")
    root = Path(settings.index)
    if not root.is_dir():
        raise StartupError(f"index directory {root} does not exist")
    try:
        name = current_version_name(root)
        manifest = read_manifest(root / VERSIONS_DIR / name)
    except IndexFormatError as e:
        raise StartupError(f"cannot read the index: {e}") from None
    ck = manifest.get("checkpoint") or {}
    want_sha = ck.get("sha256")
    if settings.checkpoint is not None:
        path = Path(settings.checkpoint)
    elif ck.get("path"):
        path = Path(ck["path"])
        if not path.is_absolute():
            path = root / path
    else:
        raise StartupError(
            f"index {root} ({name}) names no checkpoint in {MANIFEST_FILE}; pass --checkpoint / GARE_CHECKPOINT"
        )
    if not path.is_file():
        hint = "" if settings.checkpoint is not None else " (the path recorded in the index manifest; pass --checkpoint if it moved)"
        raise StartupError(f"checkpoint {path} not found{hint}")
    sha = checkpoint_sha256(path)
    if want_sha is None:
        log.warning("index %s (%s) records no checkpoint sha256; serving with %s unverified", root, name, path)
    elif sha != want_sha:
        raise StartupError(
            f"checkpoint {path} has sha256 {sha}, but index {root} ({name}) was built with sha256 {want_sha}"
            f"{' (' + str(ck.get('path')) + ')' if ck.get('path') else ''}: refusing to serve scores from another model; "
            "pass the checkpoint the index was built with, or rebuild the index (gare-index build)"
        )
    return path, sha, manifest


def advise_random_access(version: Any) -> None:
    """Tell the kernel the memmaps are read at random rows (the rerank gathers K scattered videos).

    Without it every page fault reads ahead ~128 KiB around a 12 KiB row: ~10x the I/O on a cold
    page cache, and the cache fills with rows nobody asked for.
    """
    if not hasattr(mmap, "MADV_RANDOM"):
        return
    for name in ("frames", "units", "keys", "values"):
        mm = getattr(getattr(version, name, None), "_mmap", None)
        if mm is not None:
            try:
                mm.madvise(mmap.MADV_RANDOM)
            except (OSError, ValueError):  # pragma: no cover - platform dependent
                pass


class VersionHandle:
    """Reference-counted owner of one open IndexVersion; closed once retired and unused."""

    def __init__(self, version: Any) -> None:
        self.version = version
        self._refs = 0
        self._retired = False
        self._closed = False
        self._lock = threading.Lock()

    def acquire(self) -> "VersionHandle":
        with self._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            close = self._retired and self._refs == 0 and not self._closed
            if close:
                self._closed = True
        if close:
            self._close()

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            close = self._refs == 0 and not self._closed
            if close:
                self._closed = True
        if close:
            self._close()

    @property
    def refs(self) -> int:
        return self._refs

    @property
    def closed(self) -> bool:
        return self._closed

    def _close(self) -> None:
        try:
            self.version.close()
            log.info("closed index version %s", self.version.name)
        except Exception:  # noqa: BLE001 - closing must never fail a request
            log.exception("closing index version %s failed", getattr(self.version, "name", "?"))


class ThumbnailCache:
    """A small thread-safe LRU of JPEG bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[Any, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> bytes | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key: Any, value: bytes) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)


@dataclass
class Job:
    version: Any
    query: str
    options: S.SearchOptions


class ServiceState:
    """Everything the lifespan loads: settings, model, current version, batcher, metrics."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.key_hashes = load_api_key_hashes(settings)
        self.model: Any = None
        self.device: Any = None
        self.precision = "fp32"
        self.checkpoint_path: Path | None = None
        self.checkpoint_sha: str | None = None
        self.handle: VersionHandle | None = None
        self.reload_lock = asyncio.Lock()
        self.thumbs = ThumbnailCache(settings.thumbnail_cache_size)
        self.query_bank: Any = None  # service.querybank.QueryBank when GARE_QUERY_BANK_SIZE > 0
        self.batcher: MicroBatcher[Job, S.QueryResult] = MicroBatcher(
            self._process,
            max_batch=settings.batch_max_size,
            max_wait_s=settings.batch_max_wait_ms / 1000.0,
            max_queue=settings.batch_queue_size,
            name="gare-search",
            on_batch=metrics.batch_size.observe,
        )
        self.started = time.time()
        # Signs short-lived media URLs (thumbnail, file) handed out in search results, so that <img> and
        # <video> elements, which cannot send an API key header, work when search needs a key.
        self._media_secret = secrets.token_bytes(32)

    def media_token(self, video_id: int, ttl_s: int = 3600) -> str:
        exp = int(time.time()) + ttl_s
        mac = hmac.new(self._media_secret, f"{video_id}:{exp}".encode(), "sha256").hexdigest()[:32]
        return f"{exp}.{mac}"

    def check_media_token(self, video_id: int, token: str | None) -> bool:
        if not token or "." not in token:
            return False
        exp_s, _, mac = token.partition(".")
        if not exp_s.isdigit() or int(exp_s) < time.time():
            return False
        want = hmac.new(self._media_secret, f"{video_id}:{exp_s}".encode(), "sha256").hexdigest()[:32]
        return hmac.compare_digest(mac, want)

    def media_urls(self, video_id: int) -> tuple[str, str]:
        """(thumbnail_url, video_url); signed when search needs a key."""
        base = f"/{API_VERSION}/videos/{video_id}"
        q = f"?token={self.media_token(video_id)}" if self.settings.require_key_for_search else ""
        return f"{base}/thumbnail{q}", f"{base}/file{q}"

    # -------------------------------------------------------------- loading
    def load(self) -> None:
        import torch

        from indexer.store import IndexFormatError, open_index
        from training.checkpoint import CheckpointError, load_model
        from training.model import resolve_device

        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        path, sha, _ = resolve_checkpoint(s)
        try:
            self.device = resolve_device(s.device)
        except RuntimeError as e:
            raise StartupError(f"device {s.device!r}: {e}") from None
        try:
            self.precision = S.resolve_precision(s.precision, self.device)
        except ValueError as e:
            raise StartupError(str(e)) from None
        try:
            model, _ = load_model(path, self.device)
        except (CheckpointError, OSError) as e:
            raise StartupError(f"cannot load checkpoint {path}: {e}") from None
        self.model, self.checkpoint_path, self.checkpoint_sha = model, path, sha
        try:
            version = open_index(s.index, expect_checkpoint_sha=sha, verify=s.verify_index, use_gpu=s.use_gpu_ann)
        except IndexFormatError as e:
            raise StartupError(f"cannot open the index: {e}") from None
        self._check_fit(version)
        advise_random_access(version)
        self.handle = VersionHandle(version)
        self._publish(version)
        if s.query_bank_size:
            from .querybank import QueryBank

            if s.query_bank_path is None:
                raise StartupError("query_bank_size is set but query_bank_path is not (GARE_QUERY_BANK_PATH)")
            self.query_bank = QueryBank(s.query_bank_size, model.cfg.embed_dim, s.query_bank_path, s.query_bank_flush_every)
        log.info(
            "serving index %s version %s (%d entries, %s) with %s on %s (%s)",
            s.index, version.name, version.n, version.manifest.get("index_type"), path.name, self.device, self.precision,
        )

    def _check_fit(self, version: Any) -> None:
        cfg = self.model.cfg
        if version.n and (version.dim != cfg.embed_dim or version.max_frames != cfg.max_frames):
            raise StartupError(
                f"index version {version.name} has dim={version.dim}, max_frames={version.max_frames}; "
                f"the model has embed_dim={cfg.embed_dim}, max_frames={cfg.max_frames}"
            )

    def _publish(self, version: Any) -> None:
        self.metrics.set_index(
            version.name, str(version.manifest.get("index_type")), (self.checkpoint_sha or "")[:12], version.n
        )

    def close(self) -> None:
        if self.handle is not None:
            self.handle.retire()
        if self.query_bank is not None:
            try:
                self.query_bank.flush()
            except OSError as e:
                log.error("could not write the query bank to %s: %s", self.query_bank.path, e)

    # -------------------------------------------------------------- versions
    @contextlib.contextmanager
    def use_version(self):
        h = self.handle
        if h is None:
            raise HTTPException(503, "the index is not loaded yet")
        h.acquire()
        try:
            yield h.version
        finally:
            h.release()

    async def reload(self) -> dict[str, Any]:
        from indexer.store import IndexFormatError, IndexMismatchError, current_version_name, open_index

        s = self.settings
        async with self.reload_lock:
            old = self.handle
            assert old is not None
            try:
                name = await run_in_threadpool(current_version_name, s.index)
            except IndexFormatError as e:
                log.error("reload: %s", e)
                self.metrics.reloads.labels("error").inc()
                raise HTTPException(503, f"cannot read the index CURRENT file; still serving {old.version.name}") from None
            if name == old.version.name:
                self.metrics.reloads.labels("unchanged").inc()
                return {"reloaded": False, "version": name, "previous": name, "n": old.version.n}
            try:
                version = await run_in_threadpool(
                    lambda: open_index(s.index, expect_checkpoint_sha=self.checkpoint_sha, verify=s.verify_index, use_gpu=s.use_gpu_ann)
                )
            except IndexMismatchError as e:
                log.error("reload refused: %s", e)
                self.metrics.reloads.labels("refused").inc()
                raise HTTPException(
                    409,
                    f"index version {name} was built with another checkpoint than the one this service runs "
                    f"(sha256 {(self.checkpoint_sha or '')[:12]}...); restart the service with that checkpoint. "
                    f"Still serving {old.version.name}",
                ) from None
            except IndexFormatError as e:
                log.error("reload failed: %s", e)
                self.metrics.reloads.labels("error").inc()
                raise HTTPException(503, f"index version {name} could not be opened; still serving {old.version.name}") from None
            try:
                self._check_fit(version)
            except StartupError as e:
                version.close()
                self.metrics.reloads.labels("refused").inc()
                raise HTTPException(409, f"{e}; still serving {old.version.name}") from None
            advise_random_access(version)
            self.handle = VersionHandle(version)  # atomic swap: new requests see the new version
            old.retire()  # closed when its last in-flight request finishes
            self._publish(version)
            self.metrics.reloads.labels("ok").inc()
            log.info("reloaded: now serving %s (%d entries), was %s", version.name, version.n, old.version.name)
            return {"reloaded": True, "version": version.name, "previous": old.version.name, "n": version.n}

    # -------------------------------------------------------------- the batch worker (one thread)
    def _process(self, jobs: Sequence[Job]) -> list[S.QueryResult]:
        out: list[S.QueryResult | None] = [None] * len(jobs)
        groups: dict[int, list[int]] = {}
        for i, j in enumerate(jobs):
            groups.setdefault(id(j.version), []).append(i)
        for members in groups.values():
            version = jobs[members[0]].version
            res = S.search_batch(
                self.model,
                version,
                [jobs[i].query for i in members],
                [jobs[i].options for i in members],
                precision=self.precision,
                rerank_impl=self.settings.rerank_impl,
                on_units=self.query_bank.push if self.query_bank is not None else None,
            )
            for i, r in zip(members, res, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    # -------------------------------------------------------------- presentation
    def display_path(self, version: Any, path: str | None) -> str | None:
        """A path for clients: relative to the library root when known, else the file name only."""
        if not path:
            return None
        p = Path(path)
        roots = []
        if self.settings.library_root is not None:
            roots.append(Path(self.settings.library_root))
        for key in ("library_root", "videos_root", "source_root"):
            v = version.manifest.get(key)
            if isinstance(v, str) and v:
                roots.append(Path(v))
        for r in roots:
            try:
                rel = p.resolve().relative_to(r.resolve())
            except (ValueError, OSError):
                continue
            return rel.as_posix()
        return p.name

    def public_metadata(self, version: Any, row: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in row.items() if k != "path"}
        out["path"] = self.display_path(version, row.get("path"))
        out["name"] = Path(row["path"]).name if row.get("path") else None
        return out

    def check_key(self, presented: str | None) -> bool:
        if not presented:
            return False
        h = hashlib_sha256(presented)
        ok = False
        for stored in self.key_hashes:  # compare against every key: timing does not depend on which matched
            ok |= hmac.compare_digest(h, stored)
        return ok


def hashlib_sha256(s: str) -> str:
    import hashlib

    return hashlib.sha256(s.encode("utf-8")).hexdigest()


# ============================================================================================ API models
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
    encode: float = Field(description="ms in the text encoder (for the whole micro-batch)")
    ann: float = Field(description="ms in the ANN search (whole micro-batch)")
    rerank: float = Field(description="ms in the psi rerank (whole micro-batch; 0 when rerank is off)")
    rank: float = Field(0.0, description="ms adding biases and sorting")
    total: float = Field(description="ms from request arrival to response (server side)")


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
    query: str
    index_version: str
    k: int
    candidates: int
    rerank: bool
    ncl: bool
    results: list[Hit]
    timings_ms: Timings
    batch_size: int = Field(description="queries that shared this micro-batch")


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
        "device": "cpu", "precision": "fp32", "rerank_impl": "fused",
    }]})
    version: str
    n: int
    dim: int
    max_frames: int
    index_type: str | None
    created: str | None = None
    checkpoint: dict[str, Any]
    biases: dict[str, Any] | None = None
    device: str
    precision: str
    rerank_impl: str


class ReloadResponse(BaseModel):
    reloaded: bool = Field(description="false when CURRENT already named the served version")
    version: str
    previous: str
    n: int


class ErrorResponse(BaseModel):
    detail: str


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the body could not be decoded (not UTF-8 JSON, too deeply nested)"},
    401: {"model": ErrorResponse, "description": "missing API key"},
    409: {"model": ErrorResponse, "description": "the index cannot do what was asked (e.g. ncl_stage1 without --ncl-stage1)"},
    403: {"model": ErrorResponse, "description": "invalid API key"},
    404: {"model": ErrorResponse, "description": "unknown id or file gone"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    422: {"model": ErrorResponse, "description": "invalid input; `detail` says what"},
    503: {"model": ErrorResponse, "description": "busy or not ready"},
}


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty or blank")
    return v


def make_request_models(settings: Settings) -> tuple[type[BaseModel], type[BaseModel]]:
    """Request bodies with this deployment's limits, so the OpenAPI document states the real bounds."""
    max_k, max_K, default_K = settings.max_k, settings.max_candidates, settings.default_candidates
    max_q, max_batch = settings.max_query_chars, settings.max_batch_queries
    QueryStr = Annotated[str, StringConstraints(min_length=1, max_length=max_q)]

    class _Options(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        k: int = Field(10, ge=1, le=max_k, description="results to return")
        candidates: int | None = Field(
            None, ge=1, le=max_K,
            description=f"K, the ANN shortlist the rerank scores (>= k; default {default_K}, or k when k is larger)",
        )
        rerank: bool = Field(True, description="score the K candidates with psi (false: dual-tower cosine only)")
        ncl: bool = Field(True, description="add the NCL Sinkhorn video biases")
        ncl_stage1: bool = Field(
            False, description="choose the K candidates with the biases too (cos + b folded into the ANN; needs an "
            "index built with --ncl-stage1; implies ncl)",
        )

        @model_validator(mode="after")
        def _k_le_K(self):
            if self.candidates is None:
                self.candidates = min(max_K, max(default_K, self.k))
            if self.candidates < self.k:
                raise ValueError(f"candidates ({self.candidates}) must be >= k ({self.k})")
            return self

        def options(self) -> S.SearchOptions:
            return S.SearchOptions(k=self.k, candidates=int(self.candidates or default_K), rerank=self.rerank,
                                   ncl=self.ncl or self.ncl_stage1, ncl_stage1=self.ncl_stage1)

    class SearchRequest(_Options):
        model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
            {"query": "a dog catches a frisbee", "k": 10},
            {"query": "a red circle rises, then two blue squares slide to the left", "k": 20, "candidates": 512, "rerank": True, "ncl": False},
        ]})
        query: QueryStr = Field(description=f"the text to search for (1..{max_q} characters, not blank)")

        @field_validator("query")
        @classmethod
        def _blank(cls, v: str) -> str:
            return _not_blank(v)

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


# ============================================================================================ middleware
class BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for request bodies over `max_bytes` (declared Content-Length or counted while streaming)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes or declared < 0:
                    await self._reject(send, declared)
                    return
        seen = 0
        started = False
        rejected = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen, started, rejected
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    # Answer now: the framework would turn any exception raised while it reads the body
                    # into its own 400; whatever the app sends after this is dropped.
                    if not started and not rejected:
                        rejected = True
                        await self._reject(send, seen)
                    raise BodyTooLarge
            return msg

        async def tracking_send(msg: dict[str, Any]) -> None:
            nonlocal started
            if rejected:
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            pass

    async def _reject(self, send: Any, size: int) -> None:
        detail = (
            f"request body too large (limit {self.max_bytes} bytes)" if size >= 0 else "invalid Content-Length header"
        )
        code = 413 if size >= 0 else 400
        resp = JSONResponse({"detail": detail}, status_code=code)
        await send({"type": "http.response.start", "status": code, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


class SecurityHeadersMiddleware:
    CSP = (
        "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; style-src 'self'; script-src 'self'; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    )

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                headers = list(msg.get("headers", []))
                names = {k.lower() for k, _ in headers}
                extra = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                         (b"content-security-policy", self.CSP.encode())]
                headers += [(k, v) for k, v in extra if k not in names]
                msg = {**msg, "headers": headers}
            await send(msg)

        await self.app(scope, receive, send_wrapper)


# ============================================================================================ errors
def _readable(errors: Sequence[dict[str, Any]]) -> str:
    parts = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        etype = e.get("type", "")
        if etype == "json_invalid":
            err = (e.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"malformed JSON body ({err})")
            continue
        if etype == "missing" and not loc:
            parts.append("a JSON request body is required")
            continue
        msg = str(e.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if etype == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = [
            {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": _readable(exc.errors()), "errors": errs}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404 and detail == "Not Found":
            detail = "not found"
        if exc.status_code == 405:
            detail = "method not allowed"
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(BatcherOverloaded)
    async def _busy(request: Request, exc: BatcherOverloaded) -> JSONResponse:
        return JSONResponse({"detail": "the server is busy; retry shortly"}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(BatcherClosed)
    async def _closed(request: Request, exc: BatcherClosed) -> JSONResponse:
        return JSONResponse({"detail": "the server is shutting down"}, status_code=503)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"detail": "internal server error"}, status_code=500)


# ============================================================================================ the app
def create_app(settings: Settings | None = None, **overrides: Any) -> FastAPI:
    """Build the app (cheap: the model and index load in the lifespan)."""
    if settings is None:
        from .settings import load_settings

        settings = load_settings(**overrides)
    elif overrides:
        settings = settings.model_copy(update=overrides)
    metrics = Metrics()
    # API keys are read now so that a bad key file fails at once, not in the middle of serving.
    try:
        load_api_key_hashes(settings)
    except SettingsError as e:
        raise StartupError(str(e)) from None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServiceState(settings, metrics)
        try:
            await run_in_threadpool(state.load)
        except StartupError as e:
            log.error("gare-serve cannot start: %s", e)
            raise
        app.state.gare = state
        state.batcher.start()
        try:
            yield
        finally:
            await state.batcher.stop()
            state.close()
            app.state.gare = None

    app = FastAPI(
        title="GARE search",
        version="1.0",
        summary="Text-to-video search: dual-tower ANN, GARE psi rerank and NCL biases",
        description=(
            "Two-stage text-to-video retrieval. `POST /v1/search` encodes the query, takes the ANN top-K by "
            "dual-tower cosine, re-scores them with GARE's psi (pair-specific increment Δ) and adds the NCL "
            "Sinkhorn video biases. Admin routes need an API key (`Authorization: Bearer <key>` or `X-API-Key`); "
            "search needs one when the server is started with `require_key_for_search`."
        ),
        lifespan=lifespan,
        openapi_tags=[
            {"name": "search", "description": "text-to-video search"},
            {"name": "videos", "description": "metadata, thumbnails and files of indexed videos"},
            {"name": "index", "description": "the served index version"},
            {"name": "admin", "description": "operations (API key required)"},
            {"name": "ops", "description": "health and metrics"},
        ],
    )
    app.state.gare = None
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)

    SearchRequest, BatchSearchRequest = make_request_models(settings)

    # ------------------------------------------------------------------ dependencies
    def get_state(request: Request) -> ServiceState:
        state = request.app.state.gare
        if state is None:
            raise HTTPException(503, "the service is not ready")
        return state

    def presented_key(request: Request) -> str | None:
        auth = request.headers.get("authorization")
        if auth:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                return value.strip()
        key = request.headers.get("x-api-key")
        return key.strip() if key and key.strip() else None

    def _authorize(request: Request, state: ServiceState, what: str) -> None:
        key = presented_key(request)
        if not state.key_hashes:
            raise HTTPException(403, f"{what} is disabled: the server has no API keys configured (GARE_API_KEYS)")
        if key is None:
            raise HTTPException(
                401, "an API key is required (Authorization: Bearer <key> or X-API-Key)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not state.check_key(key):
            raise HTTPException(403, "invalid API key")

    def require_admin(request: Request, state: ServiceState = Depends(get_state)) -> None:
        _authorize(request, state, "the admin API")

    def require_search(request: Request, state: ServiceState = Depends(get_state)) -> None:
        if settings.require_key_for_search:
            _authorize(request, state, "search")

    VideoId = Annotated[int, PathParam(ge=0, le=2**63 - 1, description="index entry id")]

    def require_media(request: Request, video_id: VideoId, state: ServiceState = Depends(get_state)) -> None:
        # an API key, or the signed token of a media URL from a search result
        if settings.require_key_for_search and not state.check_media_token(video_id, request.query_params.get("token")):
            _authorize(request, state, "search")

    StateDep = Annotated[ServiceState, Depends(get_state)]

    # ------------------------------------------------------------------ helpers
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

    async def _run_queries(state: ServiceState, version: Any, queries: list[str], opts: S.SearchOptions, t_start: float):
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

    # ------------------------------------------------------------------ search
    @app.post(f"/{API_VERSION}/search", response_model=SearchResponse, tags=["search"], responses=ERRORS,
              dependencies=[Depends(require_search)], summary="search the index with one text query")
    async def search_one(body: SearchRequest, state: StateDep) -> SearchResponse:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            return (await _run_queries(state, version, [body.query], body.options(), t_start))[0]

    @app.post(f"/{API_VERSION}/search/batch", response_model=BatchSearchResponse, tags=["search"], responses=ERRORS,
              dependencies=[Depends(require_search)], summary="many queries in one request (shared options)")
    async def search_batch(body: BatchSearchRequest, state: StateDep) -> BatchSearchResponse:  # type: ignore[valid-type]
        t_start = time.perf_counter()
        with state.use_version() as version:
            res = await _run_queries(state, version, list(body.queries), body.options(), t_start)
            return BatchSearchResponse(
                index_version=version.name, results=res,
                timings_ms={"total": round((time.perf_counter() - t_start) * 1000, 3)},
            )

    # ------------------------------------------------------------------ videos
    def _metadata_or_404(version: Any, video_id: int) -> dict[str, Any]:
        try:
            return version.metadata([video_id])[0]
        except KeyError:
            raise HTTPException(404, f"no video with id {video_id} in index version {version.name}") from None

    def _file_or_404(state: ServiceState, version: Any, video_id: int) -> tuple[Path, dict[str, Any]]:
        meta = _metadata_or_404(version, video_id)
        p = version.path_of(video_id)  # from SQLite, never from the client
        if p is None:
            raise HTTPException(404, f"no video with id {video_id}")
        p = Path(p)
        if settings.library_root is not None:
            try:
                p.resolve().relative_to(Path(settings.library_root).resolve())
            except (ValueError, OSError):
                log.warning("video %d: %s is outside library_root; not served", video_id, p)
                raise HTTPException(404, f"the file of video {video_id} is not available") from None
        if not p.is_file():
            raise HTTPException(404, f"the file of video {video_id} is no longer available")
        return p, meta

    @app.get(f"/{API_VERSION}/videos/{{video_id}}", response_model=VideoInfo, tags=["videos"], responses=ERRORS,
             dependencies=[Depends(require_search)], summary="metadata of one index entry")
    async def video_info(video_id: VideoId, state: StateDep) -> VideoInfo:
        with state.use_version() as version:
            meta = await run_in_threadpool(_metadata_or_404, version, video_id)
            thumb, video = state.media_urls(video_id)
            return VideoInfo(
                id=video_id, index_version=version.name, metadata=state.public_metadata(version, meta),
                thumbnail_url=thumb, video_url=video,
            )

    def _make_thumbnail(path: Path, meta: dict[str, Any], width: int) -> bytes:
        import decord
        from PIL import Image

        vr = decord.VideoReader(str(path), num_threads=1)
        n = len(vr)
        if n == 0:
            raise ValueError("no frames")
        fps = float(vr.get_avg_fps()) or 1.0
        start = meta.get("start") or 0.0
        end = meta.get("end") if meta.get("end") is not None else n / fps
        t = start + max(0.0, (end - start)) / 2.0  # the middle of the entry's window
        idx = int(min(n - 1, max(0, round(t * fps))))
        img = Image.fromarray(vr[idx].asnumpy()).convert("RGB")
        if img.width > width:
            img = img.resize((width, max(1, round(img.height * width / img.width))), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=82)
        return buf.getvalue()

    @app.get(f"/{API_VERSION}/videos/{{video_id}}/thumbnail", tags=["videos"], dependencies=[Depends(require_media)],
             responses={**ERRORS, 200: {"content": {"image/jpeg": {}}, "description": "a JPEG frame of the entry"}},
             response_class=Response, summary="a JPEG thumbnail (middle frame of the entry), cached")
    async def video_thumbnail(video_id: VideoId, request: Request, state: StateDep) -> Response:
        with state.use_version() as version:
            path, meta = await run_in_threadpool(_file_or_404, state, version, video_id)
            st = path.stat()
            key = (str(path), st.st_size, st.st_mtime_ns, meta.get("start"), meta.get("end"), settings.thumbnail_width)
            etag = '"' + hashlib_sha256(repr(key))[:32] + '"'
            headers = {"ETag": etag, "Cache-Control": "private, max-age=3600"}
            if request.headers.get("if-none-match") == etag:
                return Response(status_code=304, headers=headers)
            data = state.thumbs.get(key)
            state.metrics.thumb_cache.labels("hit" if data is not None else "miss").inc()
            if data is None:
                try:
                    data = await run_in_threadpool(_make_thumbnail, path, meta, settings.thumbnail_width)
                except Exception as e:  # noqa: BLE001 - decoder errors of every kind
                    log.warning("thumbnail of video %d failed: %s", video_id, e)
                    raise HTTPException(422, f"video {video_id} could not be decoded for a thumbnail") from None
                state.thumbs.put(key, data)
            return Response(data, media_type="image/jpeg", headers=headers)

    @app.get(f"/{API_VERSION}/videos/{{video_id}}/file", tags=["videos"], dependencies=[Depends(require_media)],
             responses={**ERRORS, 200: {"description": "the whole file"}, 206: {"description": "a byte range"},
                        416: {"description": "range not satisfiable"}},
             response_class=FileResponse, summary="the video file (HTTP range requests supported)")
    async def video_file(video_id: VideoId, state: StateDep) -> FileResponse:
        with state.use_version() as version:
            path, _ = await run_in_threadpool(_file_or_404, state, version, video_id)
            media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            if not media.startswith("video/"):
                media = "video/mp4" if path.suffix.lower() in (".mp4", ".m4v") else media
            return FileResponse(path, media_type=media, content_disposition_type="inline", filename=path.name,
                                headers={"Cache-Control": "private, max-age=3600"})

    # ------------------------------------------------------------------ index and admin
    @app.get(f"/{API_VERSION}/index", response_model=IndexInfo, tags=["index"], summary="the served index version",
             dependencies=[Depends(require_search)], responses=ERRORS)
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
                biases=m.get("biases"), device=str(state.device), precision=state.precision,
                rerank_impl=settings.rerank_impl,
            )

    @app.post(f"/{API_VERSION}/admin/reload", response_model=ReloadResponse, tags=["admin"],
              responses={**ERRORS, 409: {"model": ErrorResponse, "description": "new version built with another checkpoint"}},
              dependencies=[Depends(require_admin)], summary="switch to the index's CURRENT version atomically")
    async def admin_reload(state: StateDep) -> ReloadResponse:
        return ReloadResponse(**(await state.reload()))

    # ------------------------------------------------------------------ ops
    @app.get("/healthz", tags=["ops"], summary="liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="readiness: model and index loaded",
             responses={503: {"model": ErrorResponse}})
    async def readyz(request: Request) -> JSONResponse:
        state = request.app.state.gare
        if state is None or state.handle is None or not state.batcher.running:
            return JSONResponse({"status": "not ready", "detail": "model or index not loaded"}, status_code=503)
        return JSONResponse({"status": "ready", "index_version": state.handle.version.name, "n": state.handle.version.n})

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ the page
    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    # ------------------------------------------------------------------ middleware (last added = outermost)
    origins = settings.cors_origin_list()
    if origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "X-API-Key", "Content-Type", "Range"],
            expose_headers=["Content-Range", "Accept-Ranges", "Content-Length"], max_age=600,
        )
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


__all__ = ["create_app", "StartupError", "resolve_checkpoint", "ServiceState", "VersionHandle"]
