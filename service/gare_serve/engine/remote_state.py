"""An HTTP worker of a shared engine (``engine=shared``): the service state without the model and without the index's
vectors or ANN; every search goes to the engine process (``gare_serve.engine.engine_server``).

:class:`EngineClientState` is a :class:`gare_serve.engine.state.ServiceState` for the routes: the same settings,
keys, media signer, result cache, run-directory board and metrics, and a served "version" that is a
:class:`MetadataVersion` (the version's manifest and metadata rows: what the routes resolve options with and render
hits with). What it takes from the engine at start (``gare_serve.engine.engine_link.wait_for_engine``): the
checkpoint and its sha, the device, precision and text encoder variant, the model config (the image upload's size),
the served version's name. Its ``batcher`` is a :class:`RemoteBatcher`: a request's text queries travel to the engine
in one message and the engine's micro-batcher batches them with the other workers' queries; searches by example
travel the same way. The query embedding cache, the query bank and the recall watch live in the engine (one for
all workers); whole results stay cached here, in front of the engine (a repeat needs no call at all).

Versions. A request holds the worker's version view and names it to the engine, which searches exactly that version
(:class:`gare_serve.engine.engine_wire.EngineVersionGone`, a 503, when it no longer holds it), so options, hits and
metadata always come from one version. The worker follows the engine's version: every answer names the version the
engine now serves, :func:`follow_engine` asks every ``ENGINE_POLL_S``, and an admin reload goes to the engine first
(:meth:`EngineClientState.reload_here`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from gare.model_protocols import SearchModel
from gare.text_clean import cleaner
from gare_index.ncl_ann import Stage1Unavailable
from gare_index.store import (
    ANN_NCL_FILE,
    VERSIONS_DIR,
    IndexFormatError,
    read_manifest,
)
from gare_index.store.meta_rows import MetaRows
from gare_search import search as S
from gare_serve.engine.batch_worker import Job
from gare_serve.engine.batcher import BatcherClosed, BatchInfo
from gare_serve.engine.engine_link import EngineLink, wait_for_engine
from gare_serve.engine.engine_wire import EngineUnavailable, EngineVersionGone
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.result_cache import ResultCache
from gare_serve.engine.startup import StartupError
from gare_serve.engine.state import ServiceState
from gare_serve.engine.versions import VersionHandle
from gare_serve.settings import Settings

if TYPE_CHECKING:  # for the annotation only (the image is searched by the engine process)
    from PIL import Image

log = logging.getLogger(__name__)

__all__ = ["ENGINE_POLL_S", "EngineClientState", "MetadataVersion", "RemoteBatcher", "follow_engine"]

ENGINE_POLL_S = 0.5  # how often a worker asks the engine which version it serves (and whether it is up)


class MetadataVersion:
    """One index version as an HTTP worker needs it: name, manifest, sizes, metadata rows and file paths (the
    version's meta.sqlite, read-only); no arrays, no ANN. The same answers as ``gare_index.store.IndexVersion``'s."""

    def __init__(self, root: str | os.PathLike, name: str) -> None:
        self.root = Path(root)
        self.name = name
        self.path = self.root / VERSIONS_DIR / name
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.n, self.dim, self.max_frames = int(m.n), int(m.dim), int(m.max_frames)
        self._ncl_stage1 = ANN_NCL_FILE in (m.files or {})
        self._meta = MetaRows(self.path, name)  # meta.sqlite, read as IndexVersion reads it

    def check_stage1(self, *, ncl_stage1: bool) -> None:
        if ncl_stage1 and not self._ncl_stage1:
            raise Stage1Unavailable(f"index version {self.name} was built without --ncl-stage1 (no {ANN_NCL_FILE}); "
                                    "ncl_stage1 is not available")

    def metadata(self, ids: Sequence[int] | np.ndarray) -> list[dict]:
        return self._meta.metadata(ids)

    def path_of(self, video_id: int) -> Path | None:
        return self._meta.path_of(video_id)

    def close(self) -> None:
        self._meta.close()


class RemoteBatcher:
    """Stands where the in-process micro-batcher stands (``gare_serve.engine.search_requests.search_texts`` submits
    to it): a request's queries go to the engine in one message; the engine's micro-batcher batches them with every
    other worker's. Each answer's BatchInfo is the engine's (its batch size, its queue wait plus the transport)."""

    def __init__(self, state: EngineClientState) -> None:
        self.state = state
        self._running = False
        self.items = 0
        self.batches = 0

    def start(self) -> None:
        self.state.link.loop = asyncio.get_running_loop()
        self._running = True

    async def stop(self) -> None:
        self._running = False
        await self.state.link.close()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def queued(self) -> int:
        return 0

    async def submit_many(self, items: Sequence[Job]) -> list[tuple[S.QueryResult, BatchInfo]]:
        if not self._running:
            raise BatcherClosed("the engine link is not running")
        if not items:
            return []
        name = items[0].version.name
        if any(j.version.name != name for j in items):
            raise ValueError("one request's queries are searched on one version")
        t0 = time.perf_counter()
        served, done = await self.state.call("texts", os.getpid(), name, [(j.query, j.options) for j in items])
        rtt = time.perf_counter() - t0
        self.state.notice_version(served)
        self.items += len(items)
        self.batches += 1
        out = []
        for res, info in done:  # the transport's share of the round trip is waiting too: counted as queue time
            extra = max(0.0, rtt - info.queue_s - info.run_s)
            out.append((res, BatchInfo(info.size, info.queue_s + extra, info.run_s)))
        return out


class EngineClientState(ServiceState):
    """The state of an HTTP worker whose searches run in the shared engine (see the module docstring)."""

    runs_searches = False

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        super().__init__(settings, metrics)
        if settings.run_dir is None:
            raise StartupError("engine=shared needs gare-serve's run directory (its supervisor starts the engine): "
                               "start the service with gare-serve, or set engine=in_process")
        self.link = EngineLink(settings.run_dir, timeout_s=settings.engine_timeout_s, metrics=metrics)
        self.batcher = RemoteBatcher(self)  # type: ignore[assignment]  # the engine batches
        self._variant = ""
        self._following: asyncio.Task | None = None

    # -------------------------------------------------------------- loading
    def load(self) -> None:
        s = self.settings
        self.load_media_secret()
        try:
            info = wait_for_engine(s.run_dir, s.worker_healthcheck_s)
        except EngineUnavailable as e:
            raise StartupError(str(e)) from None
        self.link.info = info
        self.checkpoint_path = Path(info["checkpoint_path"]) if info.get("checkpoint_path") else None
        self.checkpoint_sha, self.device, self.precision = info["checkpoint_sha"], info["device"], info["precision"]
        self.model_cfg, self._variant = info["model_cfg"], info["encoder_variant"]
        try:
            view = self.open_view(info["version"])
        except IndexFormatError as e:
            raise StartupError(f"cannot read index version {info['version']}: {e}") from None
        self.handle = VersionHandle(view)
        self.publish_index(view)
        # whole results keyed by the text as the engine's tokenizer sees it (as its query cache keys them), by the
        # cleaning's name: building the tokenizer here would import open_clip, seconds of CPU in every worker
        normalize = cleaner(info.get("text_clean"))
        self.result_cache = ResultCache(
            0 if info.get("query_bank") else s.result_cache_entries, s.result_cache_bytes, normalize=normalize,
            metrics=self.metrics.result_cache,
        )
        log.info("worker %d: searching through the engine (pid %s, %s, text encoder %s), index %s version %s, "
                 "result cache %s", os.getpid(), info["pid"], info["device"], info.get("encoder_kind"), s.index,
                 view.name, "on" if self.result_cache.enabled else "off")
        self.publish_worker()

    def open_view(self, name: str) -> MetadataVersion:
        return MetadataVersion(self.settings.index, name)

    @property
    def encoder_variant(self) -> str:
        return self._variant

    # -------------------------------------------------------------- searches (in the engine)
    async def call(self, op: str, *args: Any) -> Any:
        """The engine's answer; on EngineVersionGone this worker moves to the engine's version at once."""
        try:
            return await self.link.call(op, *args)
        except EngineVersionGone:
            self.notice_version(None)
            raise

    def search_by_videos(self, version: MetadataVersion, ids: Sequence[int], opts: S.SearchOptions) -> S.QueryResult:
        return self.call_threadsafe("videos", version.name, list(ids), opts)

    def search_by_image(self, model: SearchModel | None, version: MetadataVersion, image: Image.Image, opts: S.SearchOptions) -> S.QueryResult:
        return self.call_threadsafe("image", version.name, image, opts)

    def call_threadsafe(self, op: str, *args: Any) -> Any:
        loop = self.link.loop
        if loop is None:
            raise EngineUnavailable("the search engine link is not started")
        return asyncio.run_coroutine_threadsafe(self.call(op, *args), loop).result()

    # -------------------------------------------------------------- versions
    def notice_version(self, name: str | None) -> None:
        """The engine serves ``name`` (None: ask it): follow it in the background unless already there."""
        h = self.handle
        if name is not None and h is not None and h.version.name == name:
            return
        if self._following is not None and not self._following.done():
            return
        self._following = asyncio.get_running_loop().create_task(self.check_engine(name))

    async def check_engine(self, name: str | None = None) -> None:
        """Follow the engine's version (``name``, else the one it reports now); a failure keeps the current one."""
        try:
            if name is None:
                name = (await self.link.call("status", timeout_s=min(5.0, self.link.timeout_s)))["version"]
            await self.follow_version(name)
        except EngineUnavailable:
            pass  # down or restarting: the next poll tries again
        except Exception:  # noqa: BLE001 - following must never stop
            log.exception("worker %d: following the engine's version %s failed", os.getpid(), name)

    async def follow_version(self, name: str) -> bool:
        """Render with version ``name`` from now on (requests in flight finish on theirs); whether it switched."""
        async with self.reload_lock:
            old = self.handle
            if old is None or old.version.name == name:
                return False
            view = await run_in_threadpool(self.open_view, name)
            self.handle = VersionHandle(view)
            self.result_cache.clear()
            old.retire()
            self.publish_index(view)
            self.publish_worker()
            log.info("worker %d: now rendering index version %s (the engine's; was %s)", os.getpid(), name,
                     old.version.name)
            return True

    async def reload_here(self) -> dict[str, Any]:
        """An admin reload: the engine switches to CURRENT (``gare_serve.engine.reload.reload_local``'s result and
        errors), then this worker follows it."""
        res = await self.link.call("reload")
        await self.follow_version(res["version"])
        return res

    # -------------------------------------------------------------- reports
    async def engine_report(self) -> dict[str, Any]:
        try:
            info = await self.link.call("status", timeout_s=min(5.0, self.link.timeout_s))
        except EngineUnavailable as e:
            return {"mode": "shared", "up": False, "detail": str(e)}
        return {"mode": "shared", "up": True, "pid": info["pid"], "version": info["version"],
                "device": info["device"], "queued": info["queued"], "stage1": info.get("stage1")}


async def follow_engine(state: EngineClientState, poll_s: float) -> None:
    """Follow the engine's served version (until cancelled); one question every ``poll_s`` seconds."""
    while True:
        await asyncio.sleep(poll_s)
        await state.check_engine()
