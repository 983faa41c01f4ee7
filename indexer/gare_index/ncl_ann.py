"""The NCL fold of stage 1 (SPEC §5, ``gare-index build --ncl-stage1``; see docs/postprocessing.md).

A second inner-product index ``ann_ncl.faiss`` over ``[v̂_j ; b_j / c]`` (v̂ = the stage-1 vectors) is
searched with ``[t̂ ; c]``, so its inner product is ``cos(t, v̂_j) + b_j`` exactly
(:func:`gare.sinkhorn.fold_biases`). This module builds that index and describes its rows; reading it
is :meth:`gare_index.store.IndexVersion.search` with ``ncl_stage1=True`` (the single way into stage 1), which
returns the stage-1 cosines (folded score minus b_j) so that ranking adds b_j exactly once.

Layer: below ``gare_index.store`` (the index format imports this module, never the other way round).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gare.sinkhorn import fold_biases
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams, choose_index_type, default_nlist

NCL_ANN_FILE = "ann_ncl.faiss"
DEFAULT_FOLD_C = 1.0


class Stage1Unavailable(ValueError):
    """The request asked for a stage-1 variant the index does not have (no ann_ncl.faiss)."""


# ------------------------------------------------------------------------------------------ folded NCL stage 1
class FoldedRows:
    """Row access to [v̂_j ; b_j / c] without materialising it (ivfpq re-scoring of the folded index)."""

    def __init__(self, stage1: np.ndarray, biases: np.ndarray, c: float = DEFAULT_FOLD_C) -> None:
        self.stage1, self.biases, self.c = stage1, np.asarray(biases, dtype=np.float32), float(c)
        self.shape = (int(stage1.shape[0]), int(stage1.shape[1]) + 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: Any) -> np.ndarray:
        return fold_biases(np.asarray(self.stage1[rows], dtype=np.float32), self.biases[rows], self.c)


def ncl_ann_params(main: Mapping[str, Any] | None, d: int, index_type: str | None = None) -> dict[str, Any]:
    """ANN params of the folded index: the main index's type and knobs (pq_m re-chosen when it does not divide d+1)."""
    p = dict(main or {})
    if index_type is not None:
        p["index_type"] = index_type
    p.setdefault("index_type", "flat")
    if p["index_type"] == "ivfpq" and p.get("pq_m") and (d + 1) % int(p["pq_m"]):
        p["pq_m"] = None
    if p["index_type"] not in ("flat", "ivf", "hnsw", "ivfpq"):
        p["index_type"] = choose_index_type(0)
    return AnnParams.from_dict(p).to_dict()


def build_ncl_ann(stage1: np.ndarray, biases: np.ndarray, ids: np.ndarray, params: Mapping[str, Any],
                  c: float = DEFAULT_FOLD_C, chunk: int = 65536) -> Any:
    """The folded inner-product index over [v̂_j ; b_j / c] with the video ids (an AnnIndex)."""
    n, d = int(stage1.shape[0]), int(stage1.shape[1])
    p = AnnParams.from_dict(dict(params))
    if p.index_type in ("ivf", "ivfpq") and n == 0:
        p = AnnParams("flat")
    b = np.asarray(biases, dtype=np.float32)
    ids = np.asarray(ids, dtype=np.int64)

    def fold(rows: Any) -> np.ndarray:
        return fold_biases(np.asarray(stage1[rows], dtype=np.float32), b[rows], c)

    if n <= chunk:
        first = np.arange(n)
    elif p.index_type in ("ivf", "ivfpq"):
        # train the quantiser on a seeded sample (as build_index would), then add the rest in chunks
        nlist = int(p.nlist or default_nlist(n))
        p = AnnParams.from_dict({**p.to_dict(), "nlist": nlist})
        first = np.sort(np.random.default_rng(1234).choice(n, size=min(n, max(64 * nlist, 16_384)), replace=False))
    else:
        first = np.arange(chunk)
    folded = fold(first) if n else np.zeros((0, d + 1), np.float32)
    ann = AnnIndex(build_index(folded, ids[first], p, use_gpu=False), p)
    if first.size < n:
        rest = np.setdiff1d(np.arange(n), first)
        for s in range(0, rest.size, chunk):
            r = rest[s:s + chunk]
            ann.add(fold(r), ids[r])
    # ivfpq re-scores its shortlist exactly from the folded rows (computed on the fly, never stored)
    return AnnIndex(ann.cpu_index, p, FoldedRows(stage1, b, c), vector_ids=ids)


# ------------------------------------------------------------------------------------------ reference (tests/bench)
def exact_ncl_topk(stage1: np.ndarray, biases: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force reference: top k by cos + b (ties by id), (scores, ids)."""
    s = np.asarray(queries, np.float32) @ np.asarray(stage1, np.float32).T + np.asarray(biases, np.float32)[None, :]
    order = np.stack([np.lexsort((ids, -row))[:k] for row in s])
    return np.take_along_axis(s, order, 1), np.asarray(ids)[order]



__all__ = ["NCL_ANN_FILE", "DEFAULT_FOLD_C", "Stage1Unavailable", "FoldedRows", "ncl_ann_params", "build_ncl_ann",
           "exact_ncl_topk"]
