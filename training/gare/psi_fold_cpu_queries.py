"""The query side of psi's fold as one compiled CPU call: `fold_query_rows`.

`gare.psi_fold_queries.fold_queries` in torch is ~12 ops; for the one query of a request their dispatch, not
the (d, 2d + 3) product, was most of the fold with cold caches (bench/results/rerank_floor.md). Here one
numba function streams the query map once (four of its rows per pass, the output row staying in L1) and
writes the vectors and scalars directly (`gare.psi_fold_cpu_kernel.fold_rows`). numba compiles it on first use
(`warm_up`, with the rerank's kernel) in the first process; later ones load it from numba's on-disk cache.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gare.build_once import once


def _build() -> Any:
    from gare import psi_fold_cpu_kernel  # here, not at the top: it imports numba, which only a fold needs

    return psi_fold_cpu_kernel.fold_rows


_kernel = once(_build)  # the compiled kernel, built on first use


def fold_query_rows(t: np.ndarray, query_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The query side of the fold for a few queries in one compiled call: t (a, d) float32, query_map
    (d, 2d + 3) float32 (`gare.psi_fold_weights.PsiFold.query_map`) -> u (a, 3, d) = [t, u1, u2] and sc (a, 7)
    = [|t|², |Ct|², Σt, t·k2, t·m0, t·m1, 0], equal to `gare.psi_fold_queries.fold_queries` to float32
    rounding (a different summation order)."""
    t = np.ascontiguousarray(t, dtype=np.float32)
    qm = np.ascontiguousarray(query_map, dtype=np.float32)
    if t.ndim != 2 or qm.ndim != 2 or qm.shape != (t.shape[1], 2 * t.shape[1] + 3):
        raise ValueError(f"t (a, d) and query_map (d, 2d + 3) do not match: {t.shape}, {qm.shape}")
    a, d = t.shape
    u = np.empty((a, 3, d), np.float32)
    sc = np.empty((a, 7), np.float32)
    _kernel()(t, qm, u, sc)
    return u, sc


def warm_up() -> float:
    """Compile `fold_query_rows` so that no request pays for it; seconds spent."""
    t0 = time.perf_counter()
    fold_query_rows(np.zeros((1, 4), np.float32), np.zeros((4, 11), np.float32))
    return time.perf_counter() - t0
