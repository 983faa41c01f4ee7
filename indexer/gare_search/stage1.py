"""Stage 1 of the search: the ANN shortlist of K candidates per query, through the index version.

The version chooses the candidates by the dual-tower cosine ``cos(t, v̄_j)`` (plain ANN) or, with
``ncl_stage1``, by ``cos + b_j`` (the NCL fold of :mod:`gare_index.ncl_ann`); either way the scores returned
are the cosines.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from gare_index.version_protocol import SearchVersion
from gare_search.filtered import FILTER_EXACT_BELOW, FilterPlan, filtered_stage1

log = logging.getLogger(__name__)


class Stage1Choice(Protocol):
    """A query's options as stage 1 reads them (``gare_search.search.SearchOptions``)."""

    @property
    def candidates(self) -> int: ...

    @property
    def ncl_stage1(self) -> bool: ...


def ann_stage(version: SearchVersion, units: np.ndarray, candidates: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 through :meth:`IndexVersion.search`: (cosines (q, K), ids (q, K)); missing results have id -1.

    ``ncl_stage1=True`` picks the candidates by cos + b (the NCL fold); the scores are still the cosines."""
    return version.search(units, int(candidates), ncl_stage1=ncl_stage1)


def valid(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One query's stage-1 row without its missing results (id -1)."""
    ok = ids >= 0
    return scores[ok], ids[ok]


def shortlists(version: SearchVersion, units: np.ndarray, opts: Sequence[Stage1Choice],
               plans: list[FilterPlan | None] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every query's stage-1 shortlist, one ANN call per distinct (K, ncl_stage1): units (a, d) float32 and one
    option set per query (``candidates``, ``ncl_stage1``) -> (cosines, ids) per query, missing results dropped.

    A query whose options carry a ``filter`` (a compiled :class:`gare_index.filters.Filter`) gets only rows that
    pass it, by the plan :func:`gare_search.filtered.filtered_stage1` picks (one call per distinct (K,
    ncl_stage1, filter)); `plans`, when given (a list of a None per query), receives each query's plan."""
    n_q = len(opts)
    ann_s: list[np.ndarray] = [np.zeros(0, np.float32)] * n_q
    ann_i: list[np.ndarray] = [np.zeros(0, np.int64)] * n_q
    by_k: dict[tuple[int, bool], list[int]] = {}
    by_filter: dict[tuple, list[int]] = {}
    for i, o in enumerate(opts):
        f = getattr(o, "filter", None)
        if f is not None:
            below = getattr(o, "filter_exact_below", FILTER_EXACT_BELOW)
            by_filter.setdefault((o.candidates, o.ncl_stage1, f, below), []).append(i)
        else:
            by_k.setdefault((o.candidates, o.ncl_stage1), []).append(i)
    for (k_cand, folded, f, below), members in by_filter.items():
        sc, ids, plan = filtered_stage1(version, units[members], k_cand, f, ncl_stage1=folded, exact_below=below)
        for r, i in enumerate(members):
            ann_s[i], ann_i[i] = sc[r], ids[r]
            if plans is not None:
                plans[i] = plan
    for (k_cand, folded), members in by_k.items():
        sc, ids = ann_stage(version, units[members], k_cand, ncl_stage1=folded)
        for r, i in enumerate(members):
            ann_s[i], ann_i[i] = valid(sc[r], ids[r])
    return ann_s, ann_i
