"""Every worker and replica follows the index's CURRENT by itself.

``gare-index build``/``add``/``remove`` end by replacing ``INDEX/CURRENT`` atomically. Each serving process
(every worker of every ``gare-serve``, every compose replica) polls that file every ``index_poll_s`` seconds
and, when it names another version, runs the same atomic switch as ``POST /v1/admin/reload`` (in-flight
requests finish on the version they started on; ``gare_serve.engine.reload.reload``). So after a build
finishes, every process answers from the new version within ``index_poll_s`` plus the time to open it,
with nobody having to reach each replica behind a proxy. The admin route stays as the immediate path.

A version built with another checkpoint is refused (409 in the admin route): the process keeps serving what
it serves, logs the refusal once, and does not retry that version on every poll.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from gare_index.store import IndexFormatError, current_version_name
from gare_serve.engine.reload import ReloadCheckFailed, ReloadError, ReloadRefused, reload
from gare_serve.engine.state import ServiceState

log = logging.getLogger(__name__)

__all__ = ["follow_current"]


async def follow_current(state: ServiceState, poll_s: float) -> None:
    """Switch ``state`` to CURRENT whenever it changes (until cancelled); one poll every ``poll_s`` seconds."""
    refused: str | None = None
    unreadable = False
    while True:
        await asyncio.sleep(poll_s)
        handle = state.handle
        if handle is None:
            continue
        try:
            name = await run_in_threadpool(current_version_name, state.settings.index)
        except IndexFormatError as e:  # e.g. CURRENT being written by hand, or the index volume gone
            if not unreadable:
                log.warning("following the index: cannot read CURRENT (%s); still serving %s", e, handle.version.name)
            unreadable = True
            continue
        unreadable = False
        if name == handle.version.name or name == refused:
            continue
        try:
            res = await reload(state, broadcast=False)
        except ReloadRefused as e:  # built with another checkpoint: never served by this process
            refused = name
            log.error("following the index: %s", e)
            continue
        except ReloadCheckFailed as e:  # re-hashing it every poll would give the same answer at the same cost
            refused = name
            log.error("following the index: %s (not retried until CURRENT changes; after restoring the files, "
                      "POST /v1/admin/reload)", e)
            continue
        except ReloadError as e:
            log.error("following the index: %s", e)
            continue
        except Exception:  # noqa: BLE001 - a failed switch keeps the old version; keep following
            log.exception("following the index: switching to %s failed", name)
            continue
        if res.get("reloaded"):
            log.info("following the index: now serving %s (was %s)", res["version"], res.get("previous"))
