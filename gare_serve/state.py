"""What the service holds while it runs: the model, the served index version, the batcher, the caches.

:func:`resolve_checkpoint` checks the checkpoint against the index manifest (sha256) before anything loads;
:class:`ServiceState` is built by the app's lifespan (``gare_serve.app``) and reached by routes through
``gare_serve.security.get_state``. Requests hold a reference to the version they started on
(:class:`VersionHandle`), so a reload swaps versions atomically while requests are in flight.
"""

import asyncio
import contextlib
import logging
import mmap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cachetools import LRUCache
from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from gare.checkpoint import CheckpointError, file_sha256, load_model
from gare.model import resolve_device
from gare_index.store import (
    MANIFEST_FILE,
    VERSIONS_DIR,
    CheckpointRef,
    IndexFormatError,
    IndexManifest,
    IndexMismatchError,
    current_version_name,
    open_index,
    read_manifest,
)
from gare_search import search as S
from gare_serve.batcher import MicroBatcher
from gare_serve.media import MediaSecretError, MediaSigner, resolve_secrets
from gare_serve.metrics import Metrics
from gare_serve.query_cache import QueryCache, make_normalizer
from gare_serve.querybank import QueryBank
from gare_serve.result_cache import ResultCache
from gare_serve.settings import Settings, load_api_key_hashes
from gare_serve.workers import WorkerBoard

log = logging.getLogger("gare.service")

API_VERSION = "v1"

class StartupError(RuntimeError):
    """The service cannot start with these settings (message is meant for the operator)."""


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def checkpoint_sha256(path: Path) -> str:
    """sha256 of a file, memoised on (path, size, mtime) so the CLI pre-check and the lifespan hash once."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = file_sha256(path)
    return _SHA_CACHE[key]


def resolve_checkpoint(settings: Settings) -> tuple[Path, str, IndexManifest]:
    """(checkpoint path, its sha256, the current version's manifest); StartupError with a clear message."""
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
    ck = manifest.checkpoint or CheckpointRef()
    want_sha = ck.sha256
    if settings.checkpoint is not None:
        path = Path(settings.checkpoint)
    elif ck.path:
        path = Path(ck.path)
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
            f"{' (' + str(ck.path) + ')' if ck.path else ''}: refusing to serve scores from another model; "
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
    """A small thread-safe LRU of JPEG bytes (cachetools' LRUCache behind a lock); size 0 caches nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: LRUCache[Any, bytes] | None = LRUCache(maxsize=size) if size > 0 else None
        self._lock = threading.Lock()

    def get(self, key: Any) -> bytes | None:
        if self._d is None:
            return None
        with self._lock:
            return self._d.get(key)

    def put(self, key: Any, value: bytes) -> None:
        if self._d is None:
            return
        with self._lock:
            self._d[key] = value


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
        self.rerank_impl = "fold"  # resolved from settings.rerank_impl in load()
        self.checkpoint_path: Path | None = None
        self.checkpoint_sha: str | None = None
        self.handle: VersionHandle | None = None
        self.reload_lock = asyncio.Lock()
        self.thumbs = ThumbnailCache(settings.thumbnail_cache_size)
        self.query_bank: Any = None  # gare_serve.querybank.QueryBank when GARE_QUERY_BANK_SIZE > 0
        self.recall_watch: Any = None  # gare_serve.recall_watch.RecallWatch when GARE_RECALL_SAMPLE_RATE > 0 (lifespan)
        self.query_cache: QueryCache | None = None  # built in load() (needs the tokenizer's normaliser)
        self.result_cache = ResultCache(0)  # built in load(); off until then
        self.text_encoder = "fp32"  # the text tower that runs (settings.text_encoder; fp32 = the model's own)
        self._tower: Any = None  # gare.text_quant encoder for int8 / onnx / onnx-int8, else None
        self.cache_variant = "fp32"  # cache key part: the tower and precision that made an embedding
        # Several workers behind one port (gare-serve --workers N): their shared run directory.
        self.board: WorkerBoard | None = (
            WorkerBoard(settings.run_dir, settings.workers or 1) if settings.run_dir is not None else None
        )
        self.generation = self.board.generation() if self.board is not None else 0
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
        # <video> elements, which cannot send an API key header, work when search needs a key: one secret
        # per deployment (gare_serve.media), resolved in load(); unsigned URLs need none.
        self.media = MediaSigner.ephemeral(settings.media_token_ttl_s)

    def media_token(self, video_id: int) -> str:
        return self.media.token(video_id)

    def check_media_token(self, video_id: int, token: str | None) -> bool:
        return self.media.verify(video_id, token)

    def media_urls(self, video_id: int) -> tuple[str, str]:
        """(thumbnail_url, video_url); signed when search needs a key."""
        base = f"/{API_VERSION}/videos/{video_id}"
        q = f"?token={self.media_token(video_id)}" if self.settings.require_key_for_search else ""
        return f"{base}/thumbnail{q}", f"{base}/file{q}"

    # -------------------------------------------------------------- loading
    def load(self) -> None:
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
            try:  # FAISS (OpenMP) gets the same bound: N workers x threads <= the cores
                import faiss

                faiss.omp_set_num_threads(s.torch_threads)
            except (ImportError, AttributeError):  # pragma: no cover - faiss is a dependency
                pass
        path, sha, _ = resolve_checkpoint(s)
        if s.require_key_for_search:  # media URLs are signed: every worker and replica needs the same secret
            try:
                self.media = MediaSigner(resolve_secrets(
                    secret=s.media_secret, secret_file=s.media_secret_file, previous=s.media_secret_previous,
                    index_dir=s.index), s.media_token_ttl_s)
            except MediaSecretError as e:
                raise StartupError(str(e)) from None
        try:
            self.device = resolve_device(s.device)
        except RuntimeError as e:
            raise StartupError(f"device {s.device!r}: {e}") from None
        try:
            self.precision = S.resolve_precision(s.precision, self.device)
        except ValueError as e:
            raise StartupError(str(e)) from None
        self.rerank_impl = S.resolve_rerank_impl(s.rerank_impl, self.device)  # "auto" -> the measured fastest path (fold today)
        try:
            model, _ = load_model(path, self.device)
        except (CheckpointError, OSError) as e:
            raise StartupError(f"cannot load checkpoint {path}: {e}") from None
        self.model, self.checkpoint_path, self.checkpoint_sha = model, path, sha
        self._load_text_encoder(model)
        try:
            # mmap_ann: the FAISS index is mapped read-only like the arrays, one copy for all workers
            version = open_index(s.index, expect_checkpoint_sha=sha, verify=s.verify_index, use_gpu=s.use_gpu_ann, mmap_ann=True)
        except IndexFormatError as e:
            raise StartupError(f"cannot open the index: {e}") from None
        self._check_fit(version)
        advise_random_access(version)
        S.warm_up_rerank(self.rerank_impl, self.device)  # compile the CPU rerank kernel now, not in the first request
        self.handle = VersionHandle(version)
        self._publish(version)
        if s.query_bank_size:
            if s.query_bank_path is None:
                raise StartupError("query_bank_size is set but query_bank_path is not (GARE_QUERY_BANK_PATH)")
            self.query_bank = QueryBank(s.query_bank_size, model.cfg.embed_dim, s.query_bank_path, s.query_bank_flush_every)
        # whole results: off while the query bank records traffic (a cached answer would not reach the bank)
        self.result_cache = ResultCache(
            0 if self.query_bank is not None else s.result_cache_entries, s.result_cache_bytes,
            normalize=self.query_cache.normalize if self.query_cache is not None else str,
            metrics=self.metrics.result_cache,
        )
        log.info(
            "serving index %s version %s (%d entries, %s) with %s on %s (%s, text encoder %s, query cache %s, result cache %s)",
            s.index, version.name, version.n, version.manifest.index_type, path.name, self.device, self.precision,
            self.text_encoder, "on" if self.query_cache is not None and self.query_cache.enabled else "off",
            "on" if self.result_cache.enabled else "off",
        )
        self.publish_worker()

    def _load_text_encoder(self, model: Any) -> None:
        """The text tower (settings.text_encoder) and the query-embedding cache in front of it."""
        s = self.settings
        kind = s.text_encoder
        if kind == "auto":  # the measured defaults (gare.text_quant) at fp32; the model's own tower otherwise
            from gare.text_quant import DEFAULT_CPU_TEXT_ENCODER, DEFAULT_CUDA_TEXT_ENCODER

            by_device = {"cpu": DEFAULT_CPU_TEXT_ENCODER, "cuda": DEFAULT_CUDA_TEXT_ENCODER}
            kind = by_device.get(self.device.type, "fp32") if self.precision == "fp32" else "fp32"
        if kind != "fp32":
            from gare.text_quant import CUDA_TEXT_ENCODERS, build_text_encoder

            needs = "cuda" if kind in CUDA_TEXT_ENCODERS else "cpu"
            if self.device.type != needs:
                raise StartupError(
                    f"text_encoder={kind!r} is a {needs.upper()} option; the service runs on {self.device} "
                    + ("(use fp16/bf16 or fp32 there)" if self.device.type == "cuda" else "(use int8, onnx, onnx-int8 or fp32 there)")
                )
            if self.precision != "fp32":
                raise StartupError(f"text_encoder={kind!r} runs its own arithmetic; use it with precision fp32/auto, not {self.precision}")
            try:
                self._tower = build_text_encoder(model, kind, threads=torch.get_num_threads())
            except (ImportError, ValueError, RuntimeError) as e:
                raise StartupError(f"cannot build the {kind} text encoder: {e}") from None
        self.text_encoder = kind
        # fp32 means the model's own encoder, run at self.precision (fp16/bf16 under autocast on CUDA).
        self.cache_variant = kind if kind != "fp32" else self.precision
        self.query_cache = QueryCache(
            s.query_cache_entries, s.query_cache_bytes,
            normalize=make_normalizer(getattr(model, "_tokenizer", None) or self._tokenizer(model)),
            metrics=self.metrics.query_cache,
        )

    @staticmethod
    def _tokenizer(model: Any) -> Any:
        model.tokenize(["warm up"])  # builds model._tokenizer (open_clip's, whose clean_fn is the key normaliser)
        return getattr(model, "_tokenizer", None)

    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        """Texts -> t (a, d) float32 on the model's device, by the configured tower (no cache).

        The offline call with the same tower (``S.search(..., tower=build_text_encoder(model, kind))``): the
        same bits, and a text's bits do not depend on the micro-batch it came in (issue 24)."""
        return S.encode_queries(self.model, texts, self.precision, tower=self._tower)

    def publish_worker(self, generation: int | None = None) -> None:
        """Tell the other workers (run directory) what this one serves."""
        if self.board is None:
            return
        if generation is not None:
            self.generation = generation
        h = self.handle
        try:
            self.board.publish(h.version.name if h is not None else None, h is not None, self.generation)
        except OSError as e:  # pragma: no cover - the run directory vanished
            log.error("cannot publish this worker's state in %s: %s", self.board.root, e)

    def _check_fit(self, version: Any) -> None:
        cfg = self.model.cfg
        if version.n and (version.dim != cfg.embed_dim or version.max_frames != cfg.max_frames):
            raise StartupError(
                f"index version {version.name} has dim={version.dim}, max_frames={version.max_frames}; "
                f"the model has embed_dim={cfg.embed_dim}, max_frames={cfg.max_frames}"
            )
        if self.rerank_impl == "fold":
            S.fold_usable(self.model, version)  # logs now (not at the first search) when the index needs an upgrade

    def _publish(self, version: Any) -> None:
        self.metrics.set_index(
            version.name, str(version.manifest.index_type), (self.checkpoint_sha or "")[:12], version.n
        )

    def close(self) -> None:
        if self.board is not None:
            self.board.withdraw()
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

    async def reload(self, broadcast: bool = True) -> dict[str, Any]:
        """Switch this worker to CURRENT; with several workers and ``broadcast``, then every other worker.

        The response waits (at most ``reload_wait_s``) for the other workers and reports how many serve
        the new version (``workers``, ``workers_on_version``).
        """
        res = await self._reload_local()
        if self.board is None:
            return res
        if broadcast:
            self.generation = await run_in_threadpool(self.board.bump_generation)
        self.publish_worker()
        if broadcast:
            recs = await self.board.wait_for_version(res["version"], self.settings.reload_wait_s)
            res["workers"] = len(recs)
            res["workers_on_version"] = sum(r.get("version") == res["version"] for r in recs)
        return res

    async def _reload_local(self) -> dict[str, Any]:
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
                    lambda: open_index(s.index, expect_checkpoint_sha=self.checkpoint_sha, verify=s.verify_index,
                                       use_gpu=s.use_gpu_ann, mmap_ann=True)
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
            self.result_cache.clear()  # keyed by version name anyway: the old entries could only take room
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
        cache = self.query_cache
        for members in groups.values():
            version = jobs[members[0]].version
            flags: list[bool] = []

            def encode(texts: list[str], flags: list[bool] = flags) -> torch.Tensor:
                # distinct misses go through the tower once; hits skip it (key: checkpoint sha + variant + text)
                if cache is None or not cache.enabled:
                    flags.extend([False] * len(texts))
                    return self.encode_texts(texts)
                t, hit = cache.encode(texts, self.checkpoint_sha or "", self.encode_texts, variant=self.cache_variant)
                flags.extend(hit)
                return t

            watch = self.recall_watch  # samples this batch's stage-1 lists for an exact re-run (gare_serve.recall_watch)
            res = S.search_batch(
                self.model,
                version if watch is None else watch.wrap(version),
                [jobs[i].query for i in members],
                [jobs[i].options for i in members],
                precision=self.precision,
                rerank_impl=self.rerank_impl,
                on_units=self.query_bank.push if self.query_bank is not None else None,
                encoder=encode,
            )
            for i, r, hit in zip(members, res, flags, strict=True):
                if hit:  # this query's embedding came from the cache: it cost no encoder time
                    r.timings = {**r.timings, "encode": 0.0}
                    r.cached = True
                out[i] = r
        return out  # type: ignore[return-value]

    # -------------------------------------------------------------- presentation
    def display_path(self, version: Any, path: str | None) -> str | None:
        """A path for clients: relative to the library root when known, else the file name only."""
        if not path:
            return None
        p = Path(path)
        roots = []
        if self.settings.library_root is not None:  # the manifest records no library root (docs/index-format.md)
            roots.append(Path(self.settings.library_root))
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


__all__ = ["API_VERSION", "StartupError", "checkpoint_sha256", "resolve_checkpoint", "advise_random_access",
           "VersionHandle", "ThumbnailCache", "Job", "ServiceState"]
