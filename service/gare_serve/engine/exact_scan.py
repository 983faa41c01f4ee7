"""The exact stage-1 scan the recall watch measures against, paced to a share of one core.

:func:`exact_top` ranks every stage-1 vector of a version by the score stage 1 ranks by (``unit · v̂_j``, ``+ b_j``
for the NCL fold), a chunk at a time so that a memory-mapped index stays mapped; :func:`cpu_pacer` makes the scan
sleep between chunks so that it uses at most a set share of its thread's core. Used by the watch over one index
(:mod:`gare_serve.engine.recall_watch`) and by each shard replica's probe (:mod:`gare_serve.ray_serve.shard_replica`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from gare_index.store import IndexVersion

TOP = 10  # the exact top-k whose recall is measured (gare_build.tuning.version_tuning: k = 10)
CHUNK_BYTES = 16 << 20  # stage-1 vectors read per step of the exact scan


class ScanStopped(Exception):
    """Raised by a pacer's step when its ``stop`` event is set: the scan ends without a result."""


def cpu_pacer(cpu_share: float, stop: threading.Event | None = None) -> Callable[[], None]:
    """A step function for a paced scan started now: each call sleeps until this thread's CPU time since now is at
    most ``cpu_share`` of the wall time since now (``stop`` set: it ends the scan instead)."""
    c0, w0, stop = time.thread_time(), time.perf_counter(), stop or threading.Event()

    def step() -> None:
        wait = (time.thread_time() - c0) / cpu_share - (time.perf_counter() - w0)
        if stop.is_set() or (wait > 0 and stop.wait(wait)):
            raise ScanStopped
    return step


def exact_top(version: IndexVersion, unit: np.ndarray, top: int = TOP, *, ncl_stage1: bool = False,
              chunk_rows: int = 65536, step: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, scores) of the exact top-``top`` by ``unit · v̂_j`` (+ ``b_j`` with ``ncl_stage1``) over
    ``version.stage1_units``, best first (ties: the lower row). Reads ``chunk_rows`` rows at a time (a memmap stays
    a memmap: memory is one chunk's scores), scored by numpy's single-threaded einsum; ``step()`` runs after every
    chunk (the watch's pacing)."""
    units = version.stage1_units
    n = int(units.shape[0])
    q = np.ascontiguousarray(unit, dtype=np.float32).reshape(-1)
    biases = np.asarray(version.biases, dtype=np.float32) if ncl_stage1 else None
    top = min(int(top), n)
    best_s = np.zeros(0, np.float32)
    best_r = np.zeros(0, np.int64)
    for s in range(0, n, max(1, int(chunk_rows))):
        e = min(n, s + int(chunk_rows))
        block = np.asarray(units[s:e], dtype=np.float32)
        sc = np.einsum("nd,d->n", block, q)
        if biases is not None:
            sc = sc + biases[s:e]
        keep = np.argpartition(-sc, top - 1)[:top] if e - s > top else np.arange(e - s)
        cs = np.concatenate([best_s, sc[keep]])
        cr = np.concatenate([best_r, keep.astype(np.int64) + s])
        order = np.lexsort((cr, -cs))[:top]
        best_s, best_r = cs[order], cr[order]
        if step is not None:
            step()
    return np.asarray(version.ids, dtype=np.int64)[best_r], best_s.astype(np.float32)


__all__ = ["TOP", "CHUNK_BYTES", "ScanStopped", "cpu_pacer", "exact_top"]
