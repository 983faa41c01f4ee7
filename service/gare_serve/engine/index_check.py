"""The served index's files checked against their manifest: before a version takes traffic, and again while it does.

At start and at reload the version is opened with ``open_index(check=...)`` (gare_index.store.file_check): every
file is re-hashed with the fast hash its manifest records while the version opens (at start the check begins
before the model loads, so the two overlap), and a mismatch refuses it (start: :class:`StartupError` naming the
file; reload: the old version keeps serving). :func:`recheck_served` re-hashes the served version's files every
``index_recheck_s``: the arrays and FAISS indexes are memory-mapped, so a file changed in place under the running
server changes what it serves, and the next check reports it (ERROR log, ``gare_index_checks_total{phase="recheck",
result="mismatch"}``, :attr:`ServiceState.index_problems`). ``index_check=off`` skips all of it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from gare_index.store import CheckReport, check_files
from gare_serve.engine.prometheus import Metrics

log = logging.getLogger(__name__)

__all__ = ["count_check", "recheck_served", "recheck_version"]


def count_check(metrics: Metrics, phase: str, report: CheckReport | None, *, ok: bool | None = None) -> None:
    """One check in the metrics: its result by phase (open, reload, recheck) and, when known, its duration."""
    good = report.ok if report is not None else bool(ok)
    metrics.index_checks.labels(phase, "ok" if good else "mismatch").inc()
    if report is not None:
        metrics.index_check_seconds.set(report.seconds)


def _in_version(problem: str) -> str:
    """A problem's file as the manifest names it (``fields/year.values.npy``), without the directories above the
    version's own folder."""
    parts = Path(problem.split(":", 1)[0]).parts
    if "versions" in parts:
        at = len(parts) - 1 - parts[::-1].index("versions")  # .../versions/<name>/<file in the version>
        if len(parts) > at + 2:
            return "/".join(parts[at + 2:])
    return parts[-1] if parts else problem


def bad_files(report: CheckReport) -> str:
    """The bad files as the manifest names them (no directories above the version: this text may reach an HTTP
    client)."""
    return ", ".join(sorted({_in_version(p) for p in report.problems}))


def recheck_version(version: Any) -> CheckReport | None:
    """Re-hash the files of an open version against the manifest it was opened with (one thread: the server keeps
    its cores), the manifest on disk against its seal first; None for a view that is not one index version (the
    Ray ingress's sharded view). An unsealed version's WARNING was given by its open, not repeated here."""
    path = getattr(version, "path", None)
    files = getattr(getattr(version, "manifest", None), "files", None)
    if path is None or not files:
        return None
    return check_files(path, files, threads=1, warn_unsealed=False)


async def recheck_served(state: Any, every_s: float) -> None:
    """Every `every_s` seconds, re-hash the served version's files (until cancelled); a mismatch is logged, counted
    and kept in ``state.index_problems`` (cleared by a check that passes, e.g. after a reload)."""
    while True:
        await asyncio.sleep(every_s)
        handle = state.handle
        if handle is None:
            continue
        handle.acquire()  # not closed by a reload while its files are read
        try:
            name = handle.version.name
            try:
                report = await run_in_threadpool(recheck_version, handle.version)
            except Exception:  # noqa: BLE001 - a check that cannot run must not end the loop
                log.exception("re-checking the files of index version %s failed", name)
                continue
        finally:
            handle.release()
        if report is None:
            continue
        count_check(state.metrics, "recheck", report)
        if report.ok:
            state.index_problems = []
        elif state.handle is handle:
            state.index_problems = list(report.problems)
            log.error("index version %s changed on disk while it is served (its files are memory-mapped, so searches "
                      "read the changed bytes): %s. Restore the files or build a new version and reload; "
                      "gare-index verify names every bad file", name, "; ".join(report.problems))
