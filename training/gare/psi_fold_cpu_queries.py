"""The query side of psi's fold as one compiled CPU call: `fold_query_rows`.

`gare.psi_fold_queries.fold_queries` in torch is ~12 ops; for the one query of a request their dispatch, not
the (d, 2d + 3) product, was most of the fold with cold caches (bench/results/rerank_floor.md). Here one
numba function streams the query map once (four of its rows per pass, the output row staying in L1) and
writes the vectors and scalars directly. numba compiles it on first use (`warm_up`, with the rerank's kernel).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gare.build_once import once


def _build() -> Any:
    import numba

    fm = {"reassoc", "contract"}  # lets LLVM vectorise the sums, as the rerank's kernel

    @numba.njit(fastmath=fm, nogil=True, cache=False, boundscheck=False)
    def fold_rows(t, qmap, u, sc):
        """The query side of the fold (gare.psi_fold_queries.fold_queries) for a few queries in one call: t (a, d)
        f32; qmap (d, 2d + 3) f32 = [Rᵀ | Sᵀ | k2 | m0 | m1]; writes u (a, 3, d) = [t, u1, u2] and sc (a, 7) =
        [|t|², |Ct|², Σt, t·k2, t·m0, t·m1, 0]. y = t qmap streams qmap's rows once, four at a time (y stays
        in L1); one call instead of ~12 torch ops, whose dispatch was most of a one-query fold."""
        a, d = t.shape
        n = qmap.shape[1]
        y = np.empty(n, np.float32)
        for i in range(a):
            for j in range(n):
                y[j] = np.float32(0.0)
            k = 0
            while k + 4 <= d:
                t0, t1, t2, t3 = t[i, k], t[i, k + 1], t[i, k + 2], t[i, k + 3]
                for j in range(n):
                    y[j] += t0 * qmap[k, j] + t1 * qmap[k + 1, j] + t2 * qmap[k + 2, j] + t3 * qmap[k + 3, j]
                k += 4
            while k < d:
                tk = t[i, k]
                for j in range(n):
                    y[j] += tk * qmap[k, j]
                k += 1
            tt = np.float32(0.0)
            ts = np.float32(0.0)
            for k in range(d):
                x = t[i, k]
                u[i, 0, k] = x
                u[i, 1, k] = y[k]
                u[i, 2, k] = y[d + k]
                tt += x * x
                ts += x
            mean = ts / np.float32(d)
            ctt = np.float32(0.0)
            for k in range(d):
                ct = t[i, k] - mean
                ctt += ct * ct
            sc[i, 0], sc[i, 1], sc[i, 2] = tt, ctt, ts
            sc[i, 3], sc[i, 4], sc[i, 5], sc[i, 6] = y[2 * d], y[2 * d + 1], y[2 * d + 2], np.float32(0.0)

    return fold_rows


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
