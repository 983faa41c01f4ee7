"""What the service holds while it runs: the model, its query encoder, the served index version, the caches.

:class:`ServiceState` is built by the app's lifespan (``gare_serve.app``) and reached by routes through
``gare_serve.web.deps.StateDep``. :meth:`ServiceState.load` checks the checkpoint against the index manifest
(``gare_serve.engine.startup``), loads the model and the query text encoder (``gare_search.text_encoder``), opens the
index's CURRENT version (``gare_serve.engine.versions``) and builds the caches; its micro-batcher hands each
batch of queued queries to the batch worker (``gare_serve.engine.batch_worker``) with what :meth:`ServiceState.batch_search`
holds, and ``gare_serve.engine.reload`` switches versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from fastapi import HTTPException

from gare.checkpoint import CheckpointError, load_model
from gare.model import GARE, resolve_device
from gare.text_clean import clean_name
from gare_index.resident import ResidentTooLarge
from gare_index.resident_version import load_resident
from gare_index.store import (
    VERSIONS_DIR,
    BackgroundCheck,
    IndexCheckError,
    IndexFormatError,
    IndexVersion,
    current_version_name,
    open_index,
    read_manifest,
)
from gare_index.version_protocol import SearchVersion
from gare_search import by_example as E
from gare_search import rerank
from gare_search import search as S
from gare_search.text_encoder import (
    QueryEncoder,
    TextEncoderError,
    load_query_encoder,
    query_tokenizer,
    resolve_encoder,
)
from gare_serve.engine.batch_worker import BatchSearch, Job, run_batch
from gare_serve.engine.batcher import MicroBatcher
from gare_serve.engine.index_check import count_check
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.query_cache import QueryCache, make_normalizer
from gare_serve.engine.recall_watch import RecallWatch
from gare_serve.engine.result_cache import ResultCache
from gare_serve.engine.startup import StartupError, resolve_checkpoint, warm_index
from gare_serve.engine.traffic_bank import QueryBank
from gare_serve.engine.versions import VersionHandle, advise_random_access
from gare_serve.engine.worker_board import WorkerBoard
from gare_serve.media.signing import MediaSecretError, MediaSigner, resolve_secrets
from gare_serve.media.thumbnails import ThumbnailCache
from gare_serve.settings import Settings, load_key_roles

log = logging.getLogger(__name__)

__all__ = ["ServiceState"]


class ServiceState:
    """Everything the lifespan loads: settings, model, query encoder, current version, batcher, caches."""

    # this process runs the searches itself (False: an HTTP worker of a shared engine, gare_serve.engine.remote_state)
    runs_searches = True

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.keys = load_key_roles(settings)  # sha256 digests per role (gare_serve.web.security.authorize)
        self.model: GARE | None = None
        self.model_cfg: Any = None  # the model's gare.config.ModelConfig (image size for uploads), set by load()
        self.device: Any = None
        self.precision = "fp32"
        # where the psi rerank runs and its threads: passed to every search this state runs
        self.rerank_settings = rerank.RerankSettings(device=settings.rerank_device)
        self.encoder: QueryEncoder | None = None  # the query text tower (settings.text_encoder), built in load()
        self.checkpoint_path: Path | None = None
        self.checkpoint_sha: str | None = None
        self.handle: VersionHandle | None = None
        self._pending_check: BackgroundCheck | None = None  # the served version's file check, while load() runs
        # what the last periodic re-check of the served version's files found (empty: they match, or not checked)
        self.index_problems: list[str] = []
        # where the served version lives and its stage 1 (on_device: the resident copy's measured choice), for /readyz
        self.stage1: dict[str, Any] | None = None
        self.reload_lock = asyncio.Lock()
        self.thumbs = ThumbnailCache(settings.thumbnail_cache_size)
        self.query_bank: QueryBank | None = None  # when GARE_QUERY_BANK_SIZE > 0
        self.recall_watch: RecallWatch | None = None  # when GARE_RECALL_SAMPLE_RATE > 0 (set by the lifespan)
        self.query_cache: QueryCache | None = None  # built in load() (needs the tokenizer's normaliser)
        self.text_clean = "identity"  # how the tokenizer cleans a text (gare.text_clean), set in load()
        self.result_cache = ResultCache(0)  # built in load(); off until then
        # Several workers behind one port (gare-serve --workers N): their shared run directory.
        self.board: WorkerBoard | None = (
            WorkerBoard(settings.run_dir, settings.workers or 1) if settings.run_dir is not None else None
        )
        self.generation = self.board.generation() if self.board is not None else 0
        self.batcher: MicroBatcher[Job, S.QueryResult] = MicroBatcher(
            self.run_jobs,
            max_batch=settings.batch_max_size,
            max_wait_s=settings.batch_max_wait_ms / 1000.0,
            max_queue=settings.batch_queue_size,
            name="gare-search",
            on_batch=metrics.batch_size.observe,
        )
        self.started = time.time()
        # Signs short-lived media URLs (thumbnail, file) handed out in search results, so that <img> and
        # <video> elements, which cannot send an API key header, work when search needs a key: one secret
        # per deployment (gare_serve.media.signing), resolved in load(); unsigned URLs need none.
        self.media = MediaSigner.ephemeral(settings.media_token_ttl_s)

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
        # the served version's files are re-hashed on background threads while the checkpoint is hashed and the
        # model loads; open_served waits for the verdict (gare_serve.engine.index_check)
        self._pending_check = self.start_index_check()
        try:
            path, sha = self.resolve_checkpoint()
            self.load_model_and_index(path, sha)
        except BaseException:
            if self._pending_check is not None:
                self._pending_check.cancel()
            raise
        finally:
            self._pending_check = None

    def load_model_and_index(self, path: Path, sha: str) -> None:
        """load() once the checkpoint is resolved: the model, its query encoder, the served version, the caches."""
        s = self.settings
        self.load_media_secret()
        try:
            self.device = resolve_device(s.device)
        except RuntimeError as e:
            raise StartupError(f"device {s.device!r}: {e}") from None
        try:  # the tower and its precision, "auto" in either resolved for this device
            text_kind, self.precision = resolve_encoder(s.text_encoder, self.device, s.precision)
        except ValueError as e:
            raise StartupError(str(e)) from None
        try:
            model, _ = load_model(path, self.device)
        except (CheckpointError, OSError) as e:
            raise StartupError(f"cannot load checkpoint {path}: {e}") from None
        self.model, self.checkpoint_path, self.checkpoint_sha = model, path, sha
        self.model_cfg = model.cfg
        try:
            self.encoder = load_query_encoder(model, text_kind, self.device, self.precision,
                                              rows=s.text_batch_rows, scheme=s.text_batching,
                                              cuda_graph=s.text_cuda_graph)
        except TextEncoderError as e:
            raise StartupError(str(e)) from None
        # the query-embedding cache keys a text as the tokenizer sees it; the workers' result caches too, by name
        tokenizer = query_tokenizer(model)
        self.text_clean = clean_name(tokenizer)
        self.query_cache = QueryCache(
            s.query_cache_entries, s.query_cache_bytes, normalize=make_normalizer(tokenizer),
            metrics=self.metrics.query_cache,
        )
        version = self.open_served(sha)
        self.check_fit(version)
        version = self.on_device(version)
        advise_random_access(version)
        # "cpu" on a GPU model compiles the CPU kernel too: now, not in the first request
        rerank.warm_up(self.device, self.rerank_settings)
        self.handle = VersionHandle(version)
        self.publish_index(version)
        if s.query_bank_size:
            if s.query_bank_path is None:
                raise StartupError("query_bank_size is set but query_bank_path is not (GARE_QUERY_BANK_PATH)")
            self.query_bank = QueryBank(s.query_bank_size, model.cfg.embed_dim, s.query_bank_path,
                                        s.query_bank_flush_every)
        # whole results: off while the query bank records traffic (a cached answer would not reach the bank)
        self.result_cache = ResultCache(
            0 if self.query_bank is not None else s.result_cache_entries, s.result_cache_bytes,
            normalize=self.query_cache.normalize, metrics=self.metrics.result_cache,
        )
        log.info(
            "serving index %s version %s (%d entries, %s) with %s on %s (%s, text encoder %s, query cache %s, "
            "result cache %s)", s.index, version.name, version.n, version.manifest.index_type, path.name, self.device,
            self.precision, self.encoder.describe(), "on" if self.query_cache.enabled else "off",
            "on" if self.result_cache.enabled else "off",
        )
        self.publish_worker()

    def load_media_secret(self) -> None:
        """When search needs a key, media URLs are signed: every worker and replica needs the same secret."""
        s = self.settings
        if s.require_key_for_search:
            try:
                self.media = MediaSigner(resolve_secrets(
                    secret=s.media_secret, secret_file=s.media_secret_file, previous=s.media_secret_previous,
                    index_dir=s.index), s.media_token_ttl_s)
            except MediaSecretError as e:
                raise StartupError(str(e)) from None

    def resolve_checkpoint(self) -> tuple[Path, str]:
        """(checkpoint path, its sha256) for the served index; a subclass serving another kind of index (the Ray
        ingress over a sharded one, gare_serve.ray_serve.ingress_state) resolves it there."""
        path, sha, _ = resolve_checkpoint(self.settings)
        return path, sha

    def start_index_check(self) -> BackgroundCheck | None:
        """The file check of CURRENT's version, started now on background threads (None: index_check off, or
        verify_index, whose sha256 re-hash makes it redundant, or no single index version to check)."""
        s = self.settings
        if not s.index_check or s.verify_index or s.index is None:
            return None
        try:
            vdir = Path(s.index) / VERSIONS_DIR / current_version_name(s.index)
            return BackgroundCheck(vdir, read_manifest(vdir).files)
        except IndexFormatError:  # not one index version (a sharded index), or unreadable: open_served says why
            return None

    def open_served(self, sha: str) -> Any:
        """The index's CURRENT version, opened for serving once its files match their manifest (index_check);
        StartupError when it cannot be."""
        s = self.settings
        check = getattr(self, "_pending_check", None) or s.index_check
        try:
            # mmap_ann: the FAISS index is mapped read-only like the arrays, one copy for all workers
            version = open_index(s.index, expect_checkpoint_sha=sha, verify=s.verify_index, use_gpu=s.use_gpu_ann,
                                 mmap_ann=True, check=check)
        except IndexCheckError as e:
            count_check(self.metrics, "open", e.report)
            # the bad files last: log lines and tests that keep the end of a long message keep them
            raise StartupError(
                f"index {s.index}: version {e.report.path.name} failed its file check, refusing to serve it (restore "
                f"the files or build a new version; gare-index verify names every bad file): {e}") from None
        except IndexFormatError as e:
            raise StartupError(f"cannot open the index: {e}") from None
        if version.check_report is not None:
            count_check(self.metrics, "open", version.check_report)
        return version

    def check_fit(self, version: IndexVersion) -> None:
        """StartupError when ``version`` does not fit the model; else get it ready for the rerank (the fold's
        constants computed in memory now, with one WARNING, when the version stores no valid ones)."""
        cfg = self.model.cfg
        if version.n and (version.dim != cfg.embed_dim or version.max_frames != cfg.max_frames):
            raise StartupError(
                f"index version {version.name} has dim={version.dim}, max_frames={version.max_frames}; "
                f"the model has embed_dim={cfg.embed_dim}, max_frames={cfg.max_frames}"
            )
        rerank.prepare(self.model, version)
        warm_index(version, self.settings.warm_index_bytes)  # the first searches after a load: no disk read per page

    def on_device(self, version: SearchVersion) -> SearchVersion:
        """The version to serve: on a CUDA model (``gpu_index`` auto), its device-resident copy
        (:func:`gare_index.resident_version.load_resident`: stage 1 and the rerank's rows in GPU memory, stage 1 chosen
        by measurement), on ``gpu_index_devices`` when named (``cpu`` too: a host copy with torch's exact stage 1);
        the version itself when the copy does not fit (one WARNING naming the bytes), on a CPU model without named
        devices, or for a view that is not one index version (the Ray ingress's sharded view)."""
        s = self.settings
        named = [d.strip() for d in s.gpu_index_devices.split(",") if d.strip()]
        on_cuda = self.device is not None and torch.device(self.device).type == "cuda"
        if s.gpu_index == "off" or not (on_cuda or named) or not isinstance(version, IndexVersion):
            return version
        devices = named or [str(self.device)]
        try:
            served = load_resident(version, self.model, k=s.default_candidates, devices=devices,
                                   cap_bytes=s.gpu_index_max_bytes,
                                   method=None if s.stage1_method == "auto" else s.stage1_method)
        except ResidentTooLarge as e:
            log.warning("%s", e)
            self.stage1 = {"resident": False, "reason": str(e)}
            return version
        self.stage1 = {"resident": True, "devices": devices, **served.decision.as_dict()}
        return served

    def publish_index(self, version: IndexVersion) -> None:
        """The served version in the metrics (gare_index_info)."""
        self.metrics.set_index(
            version.name, str(version.manifest.index_type), (self.checkpoint_sha or "")[:12], version.n
        )

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

    def retire_version(self, old: VersionHandle) -> None:
        """A reload replaced ``old``: it closes when its last in-flight request finishes (the shared engine keeps
        it a while longer for the workers still on it: gare_serve.engine.engine_server)."""
        old.retire()

    @property
    def encoder_variant(self) -> str:
        """What makes this service's query embeddings (a result-cache key part): the encoder's variant."""
        return self.encoder.variant if self.encoder is not None else ""

    async def engine_report(self) -> dict[str, Any] | None:
        """The shared engine this worker searches through, as /readyz shows it; None: searches run in process."""
        return None

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

    # -------------------------------------------------------------- searches
    def batch_search(self) -> BatchSearch:
        """What the batch worker searches a batch with, as this state holds it now (the model and caches that
        load() built, the recall watch the lifespan may have added since)."""
        if self.model is None or self.encoder is None:
            raise RuntimeError("the model is not loaded")
        return BatchSearch(
            model=self.model, encoder=self.encoder, search_batch=self.search_batch,
            checkpoint_sha=self.checkpoint_sha or "", query_cache=self.query_cache, query_bank=self.query_bank,
            recall_watch=self.recall_watch,
        )

    def run_jobs(self, jobs: Sequence[Job]) -> list[S.QueryResult]:
        """The micro-batcher's work on one batch (in its worker thread): ``gare_serve.engine.batch_worker``."""
        return run_batch(self.batch_search(), jobs)

    # What the routes and the batch worker run on the served version: gare_search's over one index here (looked
    # up at each call); the Ray ingress (gare_serve.ray_serve.ingress_state) runs the same signatures over a sharded index.
    def search_batch(self, *args: Any, **kw: Any) -> list[S.QueryResult]:
        return S.search_batch(*args, rerank_settings=self.rerank_settings, **kw)

    def search_by_videos(self, *args: Any) -> S.QueryResult:
        return E.search_by_videos(*args)

    def search_by_image(self, *args: Any) -> S.QueryResult:
        return E.search_by_image(*args)

    # -------------------------------------------------------------- versions
    @contextlib.contextmanager
    def use_version(self) -> Iterator[Any]:
        """The served version, held (not closed by a reload) until the block ends; 503 before it is loaded."""
        h = self.handle
        if h is None:
            raise HTTPException(503, "the index is not loaded yet")
        h.acquire()
        try:
            yield h.version
        finally:
            h.release()
