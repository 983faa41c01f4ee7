"""NCL's Sinkhorn biases of the served score in sparse form: exact scores on each query's stage-1 candidates only.

:func:`sinkhorn_biases_sparse` runs Fig. 4 of NCL on the (Q, K) served scores of each queue query's candidates
(:func:`stage1_candidates`, :func:`score_candidates`) instead of the dense (Q, N) matrix of
:func:`gare.sinkhorn.sinkhorn_biases_dense`; the conventions are :mod:`gare.sinkhorn`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gare.sinkhorn import (
    DEFAULT_BLOCK_ELEMS,
    MatrixScorer,
    as_tensor,
    biases_from_logs,
    check_inputs,
    chunk_ranges,
    drop_empty,
    effective_chunk,
    sinkhorn_blocks,
    with_progress,
)

PairScorer = Callable[[np.ndarray, np.ndarray], Tensor]
"""``scorer(query_idx (P,), gallery_rows (P,)) -> (P,)`` served scores of P (query, video) pairs."""

SPARSE_FILLS = ("dual", "none")


@torch.no_grad()
def stage1_candidates(queries: Tensor | np.ndarray, gallery: Tensor | np.ndarray, k: int, *, chunk: int = 65536,
                      block_elems: int | None = DEFAULT_BLOCK_ELEMS) -> tuple[Tensor, Tensor]:
    """Exact stage 1: each query's top-k gallery rows by inner product (cosine for unit rows), chunked.

    Returns ``(scores (Q, k') float32, rows (Q, k') int64)`` sorted by score desc, ``k' = min(k, N)``.  An ANN
    answer (the service's stage 1) may be passed to :func:`sinkhorn_biases_sparse` instead."""
    check_inputs(queries, gallery, 1.0)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    q = as_tensor(queries).float()
    n_q, n = q.shape[0], gallery.shape[0]
    kk = min(k, n)
    best_s = torch.full((n_q, 0), -math.inf)
    best_r = torch.zeros((n_q, 0), dtype=torch.int64)
    for s, e in chunk_ranges(n, effective_chunk(chunk, n_q, block_elems)):
        blk = q @ as_tensor(gallery[s:e], q.device).float().T
        cat_s = torch.cat([best_s, blk], dim=1)
        cat_r = torch.cat([best_r, torch.arange(s, e).expand(n_q, -1)], dim=1)
        top = cat_s.topk(min(kk, cat_s.shape[1]), dim=1)
        best_s, best_r = top.values, cat_r.gather(1, top.indices)
    return best_s.cpu(), best_r.cpu()


@torch.no_grad()
def score_candidates(scorer: PairScorer, rows: Tensor | np.ndarray, *, chunk: int = 65536,
                     progress: bool = False) -> Tensor:
    """Served scores of every query's candidates: rows (Q, K) int64 (-1 = no candidate) -> (Q, K) float32 CPU,
    nan where there is no candidate.  ``scorer`` receives the valid pairs in chunks of ``chunk``."""
    r = torch.as_tensor(np.asarray(rows)).long()
    out = torch.full(r.shape, math.nan, dtype=torch.float32)
    qi, kj = torch.nonzero(r >= 0, as_tuple=True)
    n_chunks = (qi.numel() + chunk - 1) // chunk
    for s, e in with_progress(chunk_ranges(qi.numel(), chunk), progress, n_chunks, "served scores (candidates)"):
        v = torch.as_tensor(scorer(qi[s:e].numpy(), r[qi[s:e], kj[s:e]].numpy())).float().cpu().reshape(-1)
        if v.numel() != e - s:
            raise ValueError(f"scorer returned {v.numel()} scores for {e - s} pairs")
        out[qi[s:e], kj[s:e]] = v
    return out


def pair_scorer_from_matrix(scorer: MatrixScorer) -> PairScorer:
    """A pair scorer from a matrix scorer: the pairs of each query are scored by one (1, k) matrix call."""

    def pairs(qi: np.ndarray, rows: np.ndarray) -> Tensor:
        qi, rows = np.asarray(qi).reshape(-1), np.asarray(rows).reshape(-1)
        out = torch.empty(qi.shape[0], dtype=torch.float32)
        order = np.argsort(qi, kind="stable")
        uq, start = np.unique(qi[order], return_index=True)
        ends = np.append(start[1:], order.size)
        for q, s, e in zip(uq, start, ends, strict=True):
            sel = order[s:e]
            out[torch.from_numpy(sel)] = torch.as_tensor(scorer(np.array([q]), rows[sel])).float().cpu().reshape(-1)
        return out

    return pairs


def _segment_lse(vals: Tensor, idx: Tensor, size: int) -> Tensor:
    """logsumexp of vals grouped by idx -> (size,) float64; -inf for an empty group."""
    m = torch.full((size,), -math.inf, dtype=torch.float64).scatter_reduce(0, idx, vals, "amax", include_self=True)
    mf = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    tot = torch.zeros(size, dtype=torch.float64).index_add_(0, idx, torch.exp(vals - mf[idx]))
    return mf + torch.log(tot)


@torch.no_grad()
def sinkhorn_biases_sparse(
    rows: Tensor | np.ndarray,
    scores: Tensor | np.ndarray,
    n_gallery: int,
    gamma: float,
    n_iters: int = 4,
    *,
    fill: str = "dual",
    queries: Tensor | np.ndarray | None = None,
    gallery: Tensor | np.ndarray | None = None,
    chunk: int = 65536,
    block_elems: int | None = DEFAULT_BLOCK_ELEMS,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Fig. 4 on a sparse served-score matrix: exact scores on each queue query's stage-1 candidates.

    ``rows`` (Q, K) int64 gallery rows of each query's candidates (-1 = none; no repeats within a row),
    ``scores`` (Q, K) their served scores (e.g. :func:`score_candidates`).  Every other entry is
    * ``fill="dual"``: the dual-tower score ``queries @ gallery.T`` (unit rows; chunked like
      :func:`sinkhorn_biases`; a candidate's exact score replaces its cosine).  Equals the dense served
      matrix wherever the scorer's value is known, and exactly it when every row is a candidate.
    * ``fill="none"``: absent (M_ij = 0).  Costs nothing beyond the candidates' scores.  A video that is no
      queue query's candidate has an empty column (beta = 1 / 0): it gets the largest finite bias (it is
      the most under-represented kind of video, which is also what ``fill="dual"`` gives such a column).
    Returns ``(a (Q,), b (N,), info)``; ``info`` has ``fill``, ``n_entries`` and ``n_uncovered``.
    """
    if fill not in SPARSE_FILLS:
        raise ValueError(f"fill must be one of {SPARSE_FILLS}, got {fill!r}")
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    r = torch.as_tensor(np.asarray(rows)).long().cpu()
    v = torch.as_tensor(np.asarray(scores)).double().cpu()
    if r.ndim != 2 or r.shape != v.shape:
        raise ValueError(f"rows and scores must both be (Q, K), got {tuple(r.shape)} and {tuple(v.shape)}")
    if r.shape[0] == 0:
        raise ValueError("at least one query is needed")
    if bool((r >= n_gallery).any()) or bool((r < -1).any()):
        raise ValueError(f"candidate rows must be in [-1, {n_gallery}), got {int(r.min())}..{int(r.max())}")
    ok = r >= 0
    if bool(torch.isnan(v[ok]).any()):
        raise ValueError("a candidate has no score (nan)")
    srt = torch.sort(torch.where(ok, r, torch.full_like(r, -1)), dim=1).values
    if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
        raise ValueError("a query lists the same candidate twice")
    n_q = r.shape[0]
    qi, kj = torch.nonzero(ok, as_tuple=True)
    ci = r[qi, kj]
    inv_g = 1.0 / gamma
    info: dict[str, Any] = {"fill": fill, "n_entries": int(qi.numel()), "n_queries": n_q, "k": int(r.shape[1])}
    covered = torch.zeros(n_gallery, dtype=torch.bool)
    covered[ci] = True
    info["n_uncovered"] = int((~covered).sum())
    if n_gallery == 0:
        return torch.zeros(n_q, dtype=torch.float32), torch.zeros(0, dtype=torch.float32), info
    if fill == "none":
        L = v[qi, kj] * inv_g  # (E,) float64 logits of the present entries
        log_beta = -_segment_lse(L, ci, n_gallery)
        log_alpha = torch.zeros(n_q, dtype=torch.float64)
        for _ in range(n_iters):
            log_alpha = -_segment_lse(L + drop_empty(log_beta)[ci], qi, n_q)
            log_beta = -_segment_lse(L + drop_empty(log_alpha)[qi], ci, n_gallery)
        a, b = biases_from_logs(log_alpha, log_beta, gamma)
    else:
        if queries is None or gallery is None:
            raise ValueError('fill="dual" needs the unit queries and gallery rows (queries=, gallery=)')
        check_inputs(queries, gallery, gamma)
        if queries.shape[0] != n_q or gallery.shape[0] != n_gallery:
            raise ValueError(f"queries/gallery have {queries.shape[0]}/{gallery.shape[0]} rows for a "
                             f"({n_q}, {n_gallery}) problem")
        q_t = as_tensor(queries)
        dev = torch.device(device) if device is not None else q_t.device
        q = q_t.to(dev, torch.float32)
        # the exact entries sorted by column, so a gallery chunk's entries are one contiguous slice
        order = torch.argsort(ci, stable=True)
        e_q, e_c, e_v = qi[order].to(dev), ci[order], v[qi, kj][order].float().to(dev)
        bounds = e_c.contiguous()
        e_c = e_c.to(dev)

        def block(s: int, e: int) -> Tensor:
            g = as_tensor(gallery[s:e], dev).to(torch.float32)
            L = q @ g.T
            lo, hi = (int(x) for x in torch.searchsorted(bounds, torch.tensor([s, e])))
            L[e_q[lo:hi], e_c[lo:hi] - s] = e_v[lo:hi]
            return L * inv_g

        ch = effective_chunk(chunk, n_q, block_elems)
        a, b = sinkhorn_blocks(block, n_q, n_gallery, gamma, n_iters, ch, dev, progress)
    bad = ~torch.isfinite(b)
    if bool(bad.any()):
        fin = b[~bad]
        b[bad] = fin.max() if fin.numel() else 0.0
    return a, b, info


def normalization_error_scores(S: Tensor, gamma: float, b: Tensor | None = None) -> float:
    """NCL eq. 5 (same convention as :func:`normalization_error`) of an explicit (Q, N) score matrix,
    e.g. the psi scores of the test captions: ``mean_j |1 - (N / Q) sum_i softmax_j((S_ij + b_j) / gamma)|``."""
    S = torch.as_tensor(S).double()
    if S.ndim != 2 or S.shape[0] == 0:
        raise ValueError(f"S must be a non-empty 2-D matrix, got shape {tuple(S.shape)}")
    if S.shape[1] == 0:
        return 0.0
    if b is not None:
        b = torch.as_tensor(b).double().reshape(-1).to(S.device)
        if b.shape[0] != S.shape[1]:
            raise ValueError(f"b has {b.shape[0]} entries for a gallery of {S.shape[1]}")
        S = S + b[None, :]
    P = torch.softmax(S / gamma, dim=1)
    r = P.sum(0) * (S.shape[1] / S.shape[0])
    return float(torch.mean(torch.abs(1.0 - r)))
