"""Switching the served index version: this worker's atomic swap, and the broadcast that moves every worker.

:func:`reload` switches this worker to the index's CURRENT (requests in flight finish on the version they started
on: ``gare_serve.engine.versions.VersionHandle``); with several workers and ``broadcast`` it then bumps the run
directory's reload generation and waits (at most ``reload_wait_s``) for the others, which follow it through
:func:`watch_reloads`. A switch that cannot happen raises a typed error and keeps the old version:
:class:`ReloadRefused` (the new version does not fit this service: another checkpoint, another shape) or
:class:`ReloadUnavailable` (CURRENT unreadable, the version cannot be opened); the admin route maps them to 409
and 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Protocol, runtime_checkable

from starlette.concurrency import run_in_threadpool

from gare_index.store import (
    IndexCheckError,
    IndexFormatError,
    IndexMismatchError,
    current_version_name,
    open_index,
)
from gare_serve.engine.index_check import bad_files, count_check
from gare_serve.engine.startup import StartupError
from gare_serve.engine.state import ServiceState
from gare_serve.engine.versions import VersionHandle, advise_random_access
from gare_serve.engine.worker_board import WorkerBoard

log = logging.getLogger(__name__)

__all__ = ["ReloadCheckFailed", "ReloadError", "ReloadRefused", "ReloadUnavailable", "SelfReloading", "reload",
           "reload_local", "watch_reloads"]


class ReloadError(RuntimeError):
    """The switch did not happen; this worker still serves the version it served (the message says which)."""


class ReloadRefused(ReloadError):
    """The new version cannot be served by this service (built with another checkpoint, or another shape)."""


class ReloadUnavailable(ReloadError):
    """The index's CURRENT cannot be read, or the version it names cannot be opened."""


class ReloadCheckFailed(ReloadUnavailable):
    """The version's files do not match the hashes of its manifest (index_check): altered, corrupted."""


@runtime_checkable
class SelfReloading(Protocol):
    """A state that switches its own way, not to a single index's CURRENT (the Ray ingress of a sharded index:
    to the newest generation, once every shard has opened it). Same result and errors as :func:`reload_local`."""

    async def reload_here(self) -> dict[str, Any]: ...


async def reload(state: ServiceState, broadcast: bool = True) -> dict[str, Any]:
    """Switch this worker to CURRENT; with several workers and ``broadcast``, then every other worker.

    The result reports the switch (``reloaded``, ``version``, ``previous``, ``n``) and, with several workers,
    how many there are and how many serve the new version (``workers``, ``workers_on_version``).
    """
    res = await (state.reload_here() if isinstance(state, SelfReloading) else reload_local(state))
    board = state.board
    if board is None:
        return res
    if broadcast:
        state.generation = await run_in_threadpool(board.bump_generation)
    state.publish_worker()
    if broadcast:
        recs = await board.wait_for_version(res["version"], state.settings.reload_wait_s)
        res["workers"] = len(recs)
        res["workers_on_version"] = sum(r.get("version") == res["version"] for r in recs)
    return res


async def reload_local(state: ServiceState) -> dict[str, Any]:
    """Switch this worker (only) to CURRENT, atomically; see :func:`reload` for the result and the errors."""
    s = state.settings
    reloads = state.metrics.reloads
    async with state.reload_lock:
        old = state.handle
        if old is None:
            raise ReloadUnavailable("the index is not loaded yet")
        try:
            name = await run_in_threadpool(current_version_name, s.index)
        except IndexFormatError as e:
            log.error("reload: %s", e)
            reloads.labels("error").inc()
            raise ReloadUnavailable(f"cannot read the index CURRENT file; still serving {old.version.name}") from None
        if name == old.version.name:
            reloads.labels("unchanged").inc()
            return {"reloaded": False, "version": name, "previous": name, "n": old.version.n}
        try:
            # index_check: every file re-hashed against the manifest before the version takes traffic (the old
            # one serves meanwhile)
            version = await run_in_threadpool(
                lambda: open_index(s.index, expect_checkpoint_sha=state.checkpoint_sha, verify=s.verify_index,
                                   use_gpu=s.use_gpu_ann, mmap_ann=True, check=s.index_check)
            )
        except IndexCheckError as e:
            log.error("reload refused: index version %s failed its file check: %s; still serving %s", name, e,
                      old.version.name)
            reloads.labels("error").inc()
            count_check(state.metrics, "reload", e.report)
            raise ReloadCheckFailed(
                f"index version {name} failed its file check ({bad_files(e.report)}: not as its manifest says); "
                f"still serving {old.version.name}") from None
        except IndexMismatchError as e:
            log.error("reload refused: %s", e)
            reloads.labels("refused").inc()
            raise ReloadRefused(
                f"index version {name} was built with another checkpoint than the one this service runs "
                f"(sha256 {(state.checkpoint_sha or '')[:12]}...); restart the service with that checkpoint. "
                f"Still serving {old.version.name}"
            ) from None
        except IndexFormatError as e:
            log.error("reload failed: %s", e)
            reloads.labels("error").inc()
            raise ReloadUnavailable(
                f"index version {name} could not be opened; still serving {old.version.name}") from None
        if version.check_report is not None:
            count_check(state.metrics, "reload", version.check_report)
        try:
            await run_in_threadpool(state.check_fit, version)
        except StartupError as e:
            version.close()
            reloads.labels("refused").inc()
            raise ReloadRefused(f"{e}; still serving {old.version.name}") from None
        try:
            version = await run_in_threadpool(state.on_device, version)
        except Exception as e:  # noqa: BLE001 - a copy that fails (device error): keep serving the old version
            version.close()
            log.error("reload failed: cannot place index version %s on the device: %s", name, e)
            reloads.labels("error").inc()
            raise ReloadUnavailable(f"index version {name} could not be placed on the device ({e}); still serving "
                                    f"{old.version.name}") from None
        advise_random_access(version)
        state.handle = VersionHandle(version)  # atomic swap: new requests see the new version
        state.result_cache.clear()  # keyed by version name anyway: the old entries could only take room
        state.retire_version(old)  # closed when its last in-flight request finishes
        state.publish_index(version)
        state.index_problems = []  # a re-check's findings were about the version just retired
        reloads.labels("ok").inc()
        log.info("reloaded: now serving %s (%d entries), was %s", version.name, version.n, old.version.name)
        return {"reloaded": True, "version": version.name, "previous": old.version.name, "n": version.n}


async def watch_reloads(state: ServiceState, board: WorkerBoard, poll_s: float = 0.25) -> None:
    """Run :func:`reload` whenever another worker bumps the reload generation (until cancelled)."""
    seen = board.generation()
    while True:
        await asyncio.sleep(poll_s)
        g = board.generation()
        if g == seen:
            continue
        seen = g
        try:
            res = await reload(state, broadcast=False)
            log.info("worker %d: reload generation %d -> %s", os.getpid(), g, res.get("version"))
        except Exception as e:  # noqa: BLE001 - a failed reload keeps the old version; keep watching
            log.error("worker %d: reload generation %d failed: %s", os.getpid(), g, e)
        state.publish_worker(generation=g)
