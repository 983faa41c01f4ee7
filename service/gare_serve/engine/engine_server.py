"""The shared engine: one process per device that holds the model, the query encoder and the served index version,
and searches for every HTTP worker of a ``gare-serve`` (``engine=shared``).

:class:`EngineState` is the in-process :class:`gare_serve.engine.state.ServiceState` (same load, same micro-batcher,
batch worker, query cache, query bank, recall watch, index following and reload), plus the versions it keeps for
workers that still render with an older one. :class:`EngineServer` answers the workers over the Unix socket of
``gare_serve.engine.engine_wire``; its micro-batcher takes the queries of every worker, so one batch holds queries of
several workers (``gare_engine_batch_workers``, ``gare_engine_mixed_batches_total``). :func:`run_engine` is the
process's main (started and restarted by the supervisor: ``gare_serve.processes.engine_process``).

Versions. The engine follows the index's CURRENT (``index_poll_s``) and switches on a worker's admin reload; each
answer names the version the engine now serves, and the workers follow it (``gare_serve.engine.remote_state``). A
request names the version it started on (its options were resolved and its hits are rendered with that version's
manifest and metadata); the engine searches exactly that version, or answers :class:`EngineVersionGone` when it no
longer holds it. After a switch the previous version is kept ``retain_s`` seconds for the requests of workers that
have not switched yet, so no answer mixes two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gare_search import search as S
from gare_serve.engine.batch_worker import Job
from gare_serve.engine.engine_wire import (
    EngineVersionGone,
    engine_address,
    mark_engine_ready,
    portable_error,
    prove_and_check,
    read_engine_key,
    read_message,
    write_message,
)
from gare_serve.engine.follow import follow_current
from gare_serve.engine.index_check import recheck_served
from gare_serve.engine.prometheus import Metrics, mark_worker_dead
from gare_serve.engine.recall_watch import start_recall_watch
from gare_serve.engine.reload import reload_local
from gare_serve.engine.startup import StartupError
from gare_serve.engine.state import ServiceState
from gare_serve.engine.versions import VersionHandle
from gare_serve.heap_trim import trim_when_grown
from gare_serve.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["EngineServer", "EngineState", "engine_settings", "run_engine"]

STARTUP_FAILURE = 3  # uvicorn's exit status for a process that failed to start: the supervisor stops, not restarts


def engine_settings(settings: Settings, torch_threads: int | None, workers: int = 1) -> Settings:
    """The engine's own settings from the workers' ones: it is the in-process engine (no run directory of its own,
    no result cache: whole results are the workers' business), with ``torch_threads`` threads and a queue bound of
    ``batch_queue_size`` per worker (what each worker's own queue held in process)."""
    return settings.model_copy(update={"engine": "in_process", "run_dir": None, "result_cache_entries": 0,
                                       "torch_threads": torch_threads or settings.torch_threads,
                                       "batch_queue_size": settings.batch_queue_size * max(1, workers)})


class EngineState(ServiceState):
    """The in-process state, keeping each replaced version ``retain_s`` seconds for the workers still on it."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        super().__init__(settings, metrics)
        # a worker learns of a switch from the next answer or within its engine poll; its requests started before
        # that still name the old version
        self.retain_s = max(5.0, settings.reload_wait_s + 1.0)
        self.retained: dict[str, tuple[VersionHandle, float]] = {}

    def retire_version(self, old: VersionHandle) -> None:
        old.acquire()  # our reference keeps it open after retire(); released by expire_retained
        old.retire()
        previous = self.retained.pop(old.version.name, None)
        if previous is not None:  # pragma: no cover - a version served twice in a row
            previous[0].release()
        self.retained[old.version.name] = (old, time.monotonic() + self.retain_s)

    def expire_retained(self, now: float | None = None) -> list[str]:
        """Release the kept versions whose time is up (each closes when its last search finishes); their names."""
        now = time.monotonic() if now is None else now
        gone = [name for name, (_, until) in self.retained.items() if until <= now]
        for name in gone:
            self.retained.pop(name)[0].release()
        return gone

    def acquire_named(self, name: str) -> VersionHandle:
        """The handle of version ``name`` (the served one or a kept one), acquired: release it when done.
        EngineVersionGone when the engine holds no such version."""
        h = self.handle
        if h is not None and h.version.name == name:
            return h.acquire()
        kept = self.retained.get(name)
        if kept is not None:
            return kept[0].acquire()
        now = h.version.name if h is not None else None
        raise EngineVersionGone(f"the search engine no longer holds index version {name} (it serves {now}); "
                                "retry: this worker switches to it")

    def run_jobs(self, jobs: Sequence[Job]) -> list[S.QueryResult]:
        origins = {j.origin for j in jobs}
        self.metrics.engine_batch_workers.observe(len(origins))
        if len(origins) > 1:
            self.metrics.engine_mixed_batches.inc()
        return super().run_jobs(jobs)

    def describe(self) -> dict[str, Any]:
        """What a worker needs to know of the engine: its process, model, encoder and served version."""
        h = self.handle
        return {
            "pid": os.getpid(), "version": h.version.name if h is not None else None,
            "n": h.version.n if h is not None else 0, "device": str(self.device), "precision": self.precision,
            "encoder_kind": self.encoder.kind if self.encoder is not None else None,
            "encoder_variant": self.encoder_variant, "model_cfg": self.model_cfg, "text_clean": self.text_clean,
            "checkpoint_path": str(self.checkpoint_path) if self.checkpoint_path else None,
            "checkpoint_sha": self.checkpoint_sha, "query_bank": self.query_bank is not None,
            "queued": self.batcher.queued, "queries": self.batcher.items, "batches": self.batcher.batches,
            "started": self.started, "stage1": self.stage1,
        }


class EngineServer:
    """Answers the workers' requests on the engine's Unix socket (one connection per worker, many requests in
    flight on each; see ``gare_serve.engine.engine_wire``)."""

    def __init__(self, state: EngineState, address: Path, key: bytes) -> None:
        self.state = state
        self.address = Path(address)
        self.key = key
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.address.unlink()  # the socket of an engine that died
        self.server = await asyncio.start_unix_server(self.connection, path=str(self.address))
        os.chmod(self.address, 0o600)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
        for t in list(self.tasks):
            t.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.address.unlink()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        try:
            await asyncio.wait_for(prove_and_check(reader, writer, self.key), 10)
            while True:
                rid, op, args = await read_message(reader)
                task = asyncio.get_running_loop().create_task(self.answer(writer, lock, rid, op, args))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                log.warning("engine: a connection ended: %s", e)
        finally:
            writer.close()

    async def answer(self, writer: asyncio.StreamWriter, lock: asyncio.Lock, rid: int, op: str, args: tuple) -> None:
        try:
            reply = (rid, True, await self.dispatch(op, args))
        except Exception as e:  # noqa: BLE001 - every error goes back to the worker that asked
            reply = (rid, False, portable_error(e))
        async with lock:
            try:
                write_message(writer, reply)
                await writer.drain()
            except (ConnectionError, OSError):  # the worker went away; nothing to tell it
                pass

    async def dispatch(self, op: str, args: tuple) -> Any:
        state, loop = self.state, asyncio.get_running_loop()
        state.metrics.engine_requests.labels(op).inc()
        if op in ("hello", "status"):
            return state.describe()
        if op == "reload":
            return await reload_local(state)
        if op == "texts":
            origin, name, queries = args
            h = state.acquire_named(name)
            try:
                done = await state.batcher.submit_many([Job(h.version, q, o, origin) for q, o in queries])
            finally:
                h.release()
            for _, info in done:
                state.metrics.engine_queue.observe(info.queue_s)
            return state.handle.version.name if state.handle else name, done
        if op == "videos":
            name, ids, opts = args
            h = state.acquire_named(name)
            try:
                return await loop.run_in_executor(None, state.search_by_videos, h.version, ids, opts)
            finally:
                h.release()
        if op == "image":
            name, image, opts = args
            h = state.acquire_named(name)
            try:
                return await loop.run_in_executor(None, state.search_by_image, state.model, h.version, image, opts)
            finally:
                h.release()
        raise ValueError(f"engine: unknown request {op!r}")


async def serve_engine(state: EngineState, address: Path, key: bytes) -> None:
    """Serve until SIGTERM: the micro-batcher, the recall watch, the index following, the socket."""
    s = state.settings
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    state.batcher.start()
    recall_watch = start_recall_watch(state)
    tasks = [loop.create_task(expire_loop(state), name="gare-engine-retained")]
    if s.index_poll_s > 0:
        tasks.append(loop.create_task(follow_current(state, s.index_poll_s), name="gare-engine-follow"))
    if s.index_check and s.index_recheck_s > 0:
        tasks.append(loop.create_task(recheck_served(state, s.index_recheck_s), name="gare-engine-index-recheck"))
    if s.heap_trim_s > 0:  # its answers to the workers are large too (gare_serve.heap_trim)
        tasks.append(loop.create_task(trim_when_grown(s.heap_trim_s), name="gare-engine-heap-trim"))
    server = EngineServer(state, address, key)
    await server.start()
    mark_engine_ready(address.parent)
    log.info("engine %d: serving %s on %s (socket %s)", os.getpid(),
             state.handle.version.name if state.handle else None, state.device, address)
    try:
        await stop.wait()
    finally:
        log.info("engine %d: stopping", os.getpid())
        await server.stop()
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await state.batcher.stop()
        if recall_watch is not None:
            await loop.run_in_executor(None, recall_watch.stop)


async def expire_loop(state: EngineState, every_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        for name in state.expire_retained():
            log.info("engine: released index version %s (kept for workers still on it)", name)


def run_engine(settings: Settings, run_dir: str | os.PathLike) -> int:
    """The engine process: load, serve on ``run_dir``'s socket until SIGTERM; the exit status (3: could not start)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the supervisor stops us last
    metrics = Metrics()
    metrics.engine_starts.inc()
    state = EngineState(settings, metrics)
    try:
        address, key = engine_address(run_dir), read_engine_key(run_dir)
        state.load()
    except (StartupError, OSError, ValueError) as e:
        log.error("the gare-serve engine cannot start: %s", e)
        state.close()
        mark_worker_dead()
        return STARTUP_FAILURE
    try:
        asyncio.run(serve_engine(state, address, key))
    finally:
        state.close()
        mark_worker_dead()
    return 0
