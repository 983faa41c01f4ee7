"""InvGC with LocalAdj (SPEC §6; seed invgc-inverse-graph-convolution.txt, eq. 7-9).

    G' = ½ [ norm(G − r_g S^g Ĝ) + norm(G − r_q S^q Q̂) ]

G (n, d): gallery vectors (unit); Ĝ (m_g, d), Q̂ (m_q, d): training videos and training queries (unit; the
checkpoint's NCL queues). S^g[i, j] = cos(g_i, ĝ_j) for the top k% of row i (k = 1: at least one neighbour),
0 elsewhere; likewise S^q against Q̂. "Edge weights minus their mean" (the paper's §4.1): the kept weights of
each matrix are centred on their mean, the dropped ones stay 0. It only moves gallery vectors, so the
corrected vectors go into any ANN index unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DEFAULT_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def n_neighbours(m: int, k_percent: float) -> int:
    return max(1, math.ceil(m * k_percent / 100.0))


def _local_adj_product(G: torch.Tensor, ref: torch.Tensor, k_percent: float, chunk: int) -> torch.Tensor:
    """S ref for the LocalAdj S of G against ref, computed in row chunks: (n, d). Two passes, because the
    centring uses the mean of all kept weights."""
    kk = n_neighbours(ref.shape[0], k_percent)
    total, count = 0.0, 0
    for i in range(0, G.shape[0], chunk):
        vals = (G[i:i + chunk] @ ref.T).topk(kk, dim=1).values
        total += float(vals.sum())
        count += vals.numel()
    mean = total / max(count, 1)
    out = torch.empty_like(G)
    for i in range(0, G.shape[0], chunk):
        top = (G[i:i + chunk] @ ref.T).topk(kk, dim=1)
        w = top.values - mean  # (c, kk)
        out[i:i + chunk] = torch.einsum("ck,ckd->cd", w, ref[top.indices])
    return out


def invgc(
    gallery: torch.Tensor,
    train_videos: torch.Tensor,
    train_queries: torch.Tensor,
    r_g: float,
    r_q: float,
    *,
    k_percent: float = 1.0,
    chunk: int = 4096,
) -> torch.Tensor:
    """gallery (n, d), train_videos (m_g, d), train_queries (m_q, d), all unit rows -> corrected unit rows (n, d).

    Ties at the k-th similarity keep exactly k neighbours (topk) rather than every tied one."""
    G = F.normalize(gallery.float(), dim=-1)
    Gh = F.normalize(train_videos.float(), dim=-1)
    Qh = F.normalize(train_queries.float(), dim=-1)
    a = F.normalize(G - r_g * _local_adj_product(G, Gh, k_percent, chunk), dim=-1)
    b = F.normalize(G - r_q * _local_adj_product(G, Qh, k_percent, chunk), dim=-1)
    # The paper averages the two normalised halves; the ANN stores unit vectors, so normalise once more
    # (a positive rescaling of each row: cosine rankings for a query are unchanged by it).
    return F.normalize(0.5 * (a + b), dim=-1)


def select_r(
    gallery: torch.Tensor,
    train_videos: torch.Tensor,
    train_queries: torch.Tensor,
    evaluate: Callable[[torch.Tensor], float],
    *,
    grid: Iterable[float] = DEFAULT_GRID,
    k_percent: float = 1.0,
) -> dict[str, Any]:
    """Grid search of (r_g, r_q) on a validation gallery: `evaluate(corrected_gallery) -> score` (higher is
    better, e.g. validation t2v R@1). Returns the best pair and every tried value, for the manifest."""
    G = F.normalize(gallery.float(), dim=-1)
    Gh = F.normalize(train_videos.float(), dim=-1)
    Qh = F.normalize(train_queries.float(), dim=-1)
    sg = _local_adj_product(G, Gh, k_percent, 4096)
    sq = _local_adj_product(G, Qh, k_percent, 4096)
    grid = list(grid)
    tried = []
    best = (-math.inf, 0.0, 0.0)
    for r_g in grid:
        for r_q in grid:
            corrected = F.normalize(0.5 * (F.normalize(G - r_g * sg, dim=-1) + F.normalize(G - r_q * sq, dim=-1)), dim=-1)
            score = float(evaluate(corrected))
            tried.append({"r_g": r_g, "r_q": r_q, "score": score})
            # strict > keeps the smallest correction among ties (the grid is ascending)
            if score > best[0]:
                best = (score, r_g, r_q)
    log.info("InvGC selection: r_g=%g r_q=%g (validation score %.3f; r=0: %.3f)", best[1], best[2], best[0], tried[0]["score"])
    return {"r_g": best[1], "r_q": best[2], "score": best[0], "baseline": tried[0]["score"], "k_percent": k_percent, "tried": tried}
