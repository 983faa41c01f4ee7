"""Several worker processes behind one port: the shared state that keeps them in step.

``gare-serve --workers N`` (N > 1) runs N uvicorn worker processes (``gare_serve.cli``). Each loads its own
model and opens the index itself; the index arrays are memory-mapped read-only (``gare_index.store``), so the
N workers share one copy through the page cache. What they must agree on goes through a small run
directory (``GARE_RUN_DIR``, created by the CLI) of atomically replaced files:

- ``workers/<pid>.json``: what each live worker serves (``{"pid", "version", "ready", "generation"}``),
  written after loading and after every reload, removed at shutdown. ``/readyz`` is 200 only when the
  expected number of live workers are ready and all serve the same version (:meth:`WorkerBoard.all_ready`).
- ``reload.gen``: a counter. ``POST /v1/admin/reload`` reloads the worker that got the request, then bumps
  the counter; every other worker polls it (``gare_serve.engine.reload.watch_reloads``, every ``poll_s``) and runs
  the same reload. Each worker swaps its version atomically (``gare_serve.engine.reload.reload``: in-flight
  requests finish on the version they started on). The admin response waits (bounded) until every live
  worker reports the new version and says how many do.

Prometheus metrics across workers use prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
emptied by the CLI at start; ``mark_process_dead`` at each worker's exit; see ``gare_serve.engine.prometheus``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERATION_FILE = "reload.gen"
WORKERS_DIR = "workers"

__all__ = ["WorkerBoard", "usable_cores", "GENERATION_FILE", "WORKERS_DIR"]


def usable_cores() -> int:
    """Cores this process may run on (cgroup/affinity aware where the OS says so), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - alive, another user
        return True
    return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class WorkerBoard:
    """The run directory shared by the workers of one ``gare-serve`` (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, expected: int) -> None:
        if expected < 1:
            raise ValueError(f"expected workers must be >= 1, got {expected}")
        self.root = Path(run_dir)
        self.expected = int(expected)
        (self.root / WORKERS_DIR).mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()

    # ---------------------------------------------------------------- reload generation
    def generation(self) -> int:
        try:
            return int((self.root / GENERATION_FILE).read_text(encoding="utf-8").strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def bump_generation(self) -> int:
        """Increment the reload counter (under an flock: two admins reloading at once both count)."""
        with open(self.root / ".gen.lock", "a+") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                g = self.generation() + 1
                _write_atomic(self.root / GENERATION_FILE, f"{g}\n")
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)
        return g

    # ---------------------------------------------------------------- worker states
    def publish(self, version: str | None, ready: bool, generation: int) -> None:
        rec = {"pid": self.pid, "version": version, "ready": bool(ready), "generation": generation, "time": time.time()}
        _write_atomic(self.root / WORKERS_DIR / f"{self.pid}.json", json.dumps(rec))

    def withdraw(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / WORKERS_DIR / f"{self.pid}.json").unlink()

    def workers(self) -> list[dict[str, Any]]:
        """The records of live workers (files of dead pids are ignored: a crashed worker is not ready)."""
        out = []
        for p in sorted((self.root / WORKERS_DIR).glob("*.json")):
            try:
                rec = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # being replaced or removed right now
            if isinstance(rec, dict) and isinstance(rec.get("pid"), int) and _pid_alive(rec["pid"]):
                out.append(rec)
        return out

    def all_ready(self) -> tuple[bool, list[dict[str, Any]]]:
        """(every expected worker is live, ready and on one version; the live workers' records)."""
        recs = self.workers()
        ready = [r for r in recs if r.get("ready")]
        versions = {r.get("version") for r in ready}
        return len(ready) >= self.expected and len(versions) == 1, recs

    async def wait_for_version(self, version: str, timeout_s: float) -> list[dict[str, Any]]:
        """Wait until every live worker reports ``version`` (or the timeout); the last records seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            recs = self.workers()
            if all(r.get("version") == version for r in recs) and len(recs) >= self.expected:
                return recs
            if time.monotonic() >= deadline:
                return recs
            await asyncio.sleep(0.05)
