"""Stage 1 of the search: the ANN shortlist of K candidates per query, through the index version.

The version chooses the candidates by the dual-tower cosine ``cos(t, v̄_j)`` (plain ANN) or, with
``ncl_stage1``, by ``cos + b_j`` (the NCL fold of :mod:`gare_index.ncl_ann`); either way the scores returned
are the cosines.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def ann_stage(version: Any, units: np.ndarray, candidates: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 through :meth:`IndexVersion.search`: (cosines (q, K), ids (q, K)); missing results have id -1.

    ``ncl_stage1=True`` picks the candidates by cos + b (the NCL fold); the scores are still the cosines."""
    return version.search(units, int(candidates), ncl_stage1=ncl_stage1)


def valid(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One query's stage-1 row without its missing results (id -1)."""
    ok = ids >= 0
    return scores[ok], ids[ok]
