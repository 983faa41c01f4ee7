"""Stage 1 under a filter (:mod:`gare_index.filters`): the plan, chosen per query group from the filter's selectivity.

The filter is evaluated over the version's field columns into a row mask (n,) bool; ``passing`` rows pass. The
version keeps what a filter passes (:mod:`gare_index.filter_cache`), so a repeated filter costs no evaluation.

* ``exact`` -- when few rows pass: the stage-1 score of every passing row (one product (a, d) x (d, passing), no
  ANN), its top K (all of them when ``passing <= K``), which the psi rerank then scores. Exact: equal to an
  exhaustive search of the subset.
* ``ann`` -- otherwise: the ANN with the filter inside it (a faiss ID selector: only passing rows are scored or
  returned). A selective filter leaves few passing rows in the IVF cells or HNSW neighbourhoods the ANN would
  visit, so the search is widened: an IVF search starts at the breadth whose cells hold, on average,
  :data:`WIDEN_MARGIN` x the candidates wanted (passing x nprobe / nlist rows per breadth), then 4x the cells /
  efSearch each round until every query has ``min(K, passing)`` candidates or the search has seen every row; an
  HNSW search still short after :data:`MAX_WIDEN` falls back to the exact plan (``ann+exact``).
* ``empty`` -- no row passes: no candidates.

Which of ``exact`` and ``ann``: exact when ``passing <= K`` or ``passing / n <= exact_below`` (default 2%). In the
benchmark's clustered 1M gallery, below about 2% the filtered top 10 reach past the query's own cluster into
others that an IVF search finds only by scanning most cells, while the exact product over so few rows costs less
than the unfiltered search; above it one widened IVF search finds them (recall and latency per plan, 0.1% to 50%
passing: bench/results/filtered_search_1m.md).

Ranking ties (equal stage-1 scores) are broken by id ascending, as the exact stage 1 of the resident index does.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gare_index.filters import Filter
from gare_index.version_protocol import SearchVersion

log = logging.getLogger(__name__)

FILTER_EXACT_BELOW = 0.02  # selectivity (passing / n) at or below which the whole subset is scored exactly
WIDEN_MARGIN = 4.0  # an IVF search under a filter starts where its cells hold ~4x the candidates wanted
MAX_WIDEN = 64  # the broadest HNSW search under a filter: 64x the efSearch of an unfiltered one
PLANS = ("exact", "ann", "ann+exact", "empty")


@dataclass
class FilterPlan:
    """What stage 1 did for a group of queries under one filter (reported in timings and metrics)."""

    plan: str  # one of PLANS
    passing: int  # rows that pass the filter
    n: int  # rows of the version
    widen: int = 1  # the ANN's breadth multiplier in the last round (ann plans)
    rounds: int = 0  # ANN searches run (ann plans)
    filter_s: float = 0.0  # evaluating the filter (the mask)
    stage1_s: float = 0.0  # the plan's stage 1 (product + top K, or the ANN rounds)
    cached: bool = False  # the filter's rows came from the version's filter cache (not evaluated again)

    @property
    def selectivity(self) -> float:
        return self.passing / self.n if self.n else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "passing": self.passing, "n": self.n, "selectivity": round(self.selectivity, 6),
                "widen": self.widen, "rounds": self.rounds, "filter_ms": round(self.filter_s * 1e3, 3),
                "stage1_ms": round(self.stage1_s * 1e3, 3), "filter_cached": self.cached}


def exact_topk(version: SearchVersion, units: np.ndarray, rows: np.ndarray, k: int, *, ncl_stage1: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """The exact stage 1 over `rows` (m,) int64: units (a, d) unit queries -> (cosines (a, k'), ids (a, k')),
    k' = min(k, m), each row the top k' by cos(t, v̂_j) (+ b_j with `ncl_stage1`), ties by id ascending."""
    a = units.shape[0]
    m = int(rows.size)
    kk = min(int(k), m)
    if kk == 0:
        return np.zeros((a, 0), np.float32), np.zeros((a, 0), np.int64)
    vecs = np.asarray(version.stage1_units[rows], dtype=np.float32).reshape(m, -1)  # (m, d)
    cos = np.asarray(units, dtype=np.float32) @ vecs.T  # (a, m)
    key = cos + np.asarray(version.biases, dtype=np.float32)[rows][None, :] if ncl_stage1 else cos
    ids = np.asarray(version.ids, dtype=np.int64)[rows]
    out_s = np.empty((a, kk), np.float32)
    out_i = np.empty((a, kk), np.int64)
    for r in range(a):
        # argpartition keeps the top kk plus every row tied with the kk-th (ties broken by id below)
        if kk < m:
            thr = np.partition(key[r], m - kk)[m - kk]
            cand = np.flatnonzero(key[r] >= thr)
        else:
            cand = np.arange(m)
        order = cand[np.lexsort((ids[cand], -key[r, cand]))][:kk]
        out_s[r], out_i[r] = cos[r, order], ids[order]
    return out_s, out_i


def first_widen(share: float | None, passing: int, need: int) -> int:
    """The IVF breadth (x nprobe) to start a filtered search at: its cells hold ~passing x share x widen passing
    rows (a filter independent of the vectors), WIDEN_MARGIN x `need` of them; at most every cell. 1 for HNSW
    and flat."""
    if share is None or share >= 1.0 or passing <= 0:
        return 1
    w = math.ceil(WIDEN_MARGIN * need / (passing * share))
    return int(min(max(1, w), math.ceil(1.0 / share)))


def filtered_stage1(version: SearchVersion, units: np.ndarray, candidates: int, f: Filter, *, ncl_stage1: bool,
                    exact_below: float = FILTER_EXACT_BELOW, exclude: np.ndarray | None = None
                    ) -> tuple[list[np.ndarray], list[np.ndarray], FilterPlan]:
    """Stage 1 of the queries `units` (a, d) under filter `f`: per query (cosines, ids) of at most K candidates
    that pass (missing results dropped), and the :class:`FilterPlan` taken. `exclude`: ids that never pass (a
    search by example leaves its own videos out)."""
    if ncl_stage1:
        check = getattr(version, "check_stage1", None)
        if check is not None:
            check(ncl_stage1=True)
    t0 = time.perf_counter()
    fr, cached = version.filter_rows(f)  # kept per version: a repeated filter is not evaluated again
    mask, bits, rows_fn = fr.mask, fr.bits, lambda: fr.rows
    if exclude is not None and np.asarray(exclude).size:
        rows = version.rows(np.asarray(exclude, dtype=np.int64).reshape(-1), missing="mask")
        mask = mask.copy()
        mask[rows[rows >= 0]] = False
        bits = version.id_bitmap(mask)
        rows_fn = lambda: np.flatnonzero(mask)  # noqa: E731 - the excluded subset, made only if the plan reads it
    passing = int(np.count_nonzero(mask)) if mask is not fr.mask else fr.passing
    n = int(mask.shape[0])
    t1 = time.perf_counter()
    a = units.shape[0]
    K = int(candidates)
    if passing == 0:
        plan = FilterPlan("empty", 0, n, filter_s=t1 - t0, cached=cached)
        return [np.zeros(0, np.float32)] * a, [np.zeros(0, np.int64)] * a, plan
    need = min(K, passing)
    share = version.scan_fraction(ncl_stage1=ncl_stage1)
    widen = first_widen(share, passing, need)
    if passing <= K or passing <= exact_below * n:
        s, i = exact_topk(version, units, rows_fn(), K, ncl_stage1=ncl_stage1)
        plan = FilterPlan("exact", passing, n, filter_s=t1 - t0, stage1_s=time.perf_counter() - t1, cached=cached)
        return list(s), list(i), plan
    rounds = 0
    while True:
        s, i, full = version.search_filtered(units, K, mask, ncl_stage1=ncl_stage1, widen=widen, bits=bits)
        rounds += 1
        short = int(((i >= 0).sum(axis=1) < need).sum())
        if short == 0 or full:
            plan = FilterPlan("ann", passing, n, widen, rounds, t1 - t0, time.perf_counter() - t1, cached)
            break
        if widen >= MAX_WIDEN and share is None:
            log.info("filtered ANN: %d of %d queries still short of %d candidates at %dx breadth: exact plan",
                     short, a, need, widen)
            s, i = exact_topk(version, units, rows_fn(), K, ncl_stage1=ncl_stage1)
            plan = FilterPlan("ann+exact", passing, n, widen, rounds, t1 - t0, time.perf_counter() - t1, cached)
            return list(s), list(i), plan
        widen *= 4
    out_s, out_i = [], []
    for r in range(a):
        ok = i[r] >= 0
        out_s.append(s[r][ok])
        out_i.append(i[r][ok])
    return out_s, out_i, plan
