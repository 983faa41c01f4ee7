"""The ANN's references and test data: exact top-k search, recall@k, and synthetic clustered vectors and queries."""

from __future__ import annotations

import math

import numpy as np

from gare_index.ann_params import as_f32

__all__ = ["exact_search", "recall_at_k", "clustered_vectors", "perturbed_queries"]


def _normalize_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def clustered_vectors(n: int, d: int, n_clusters: int, seed: int, spread: float = 0.1) -> np.ndarray:
    """(n, d) float32 unit vectors around ``n_clusters`` random unit centres (test and bench data).

    Each vector is ``normalize(centre + spread * g / sqrt(d))`` with g standard normal, so ``spread`` is
    roughly the norm of the offset from the centre before re-normalisation.
    """
    rng = np.random.default_rng(seed)
    centres = _normalize_rows(rng.standard_normal((n_clusters, d)))
    assign = rng.integers(0, n_clusters, size=n)
    x = centres[assign] + spread * rng.standard_normal((n, d)).astype(np.float32) / math.sqrt(d)
    return _normalize_rows(x)


def perturbed_queries(vectors: np.ndarray, n: int, seed: int, noise: float = 0.05) -> np.ndarray:
    """(n, d) unit queries: random members of ``vectors`` perturbed by ``noise * g / sqrt(d)``."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, vectors.shape[0], size=n)
    d = vectors.shape[1]
    q = np.asarray(vectors[rows], dtype=np.float32) + noise * rng.standard_normal((n, d)).astype(
        np.float32
    ) / math.sqrt(d)
    return _normalize_rows(q)


def exact_search(
    vectors: np.ndarray, queries: np.ndarray, k: int, *, block: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force inner-product top-k in numpy: (scores (q, k) float32, row positions (q, k) int64).

    Ties are broken by the lower position; k is capped at len(vectors).
    """
    x = as_f32(vectors)
    q = as_f32(np.atleast_2d(queries))
    n = x.shape[0]
    k_eff = min(k, n)
    scores = np.empty((q.shape[0], k_eff), dtype=np.float32)
    pos = np.empty((q.shape[0], k_eff), dtype=np.int64)
    for s in range(0, q.shape[0], block):
        e = min(q.shape[0], s + block)
        sim = q[s:e] @ x.T
        if k_eff < n:
            part = np.argpartition(-sim, k_eff - 1, axis=1)[:, :k_eff]
        else:
            part = np.broadcast_to(np.arange(n), (e - s, n))
        ps = np.take_along_axis(sim, part, 1)
        order = np.lexsort((part, -ps), axis=1)
        pos[s:e] = np.take_along_axis(part, order, 1)
        scores[s:e] = np.take_along_axis(ps, order, 1)
    return scores, pos


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int) -> float:
    """Mean over queries of |approx top-k ∩ exact top-k| / k (-1 entries never count)."""
    a = np.asarray(approx_ids)[:, :k]
    b = np.asarray(exact_ids)[:, :k]
    if a.shape[0] != b.shape[0]:
        raise ValueError("approx_ids and exact_ids must have the same number of queries")
    if a.shape[0] == 0:
        return float("nan")
    hits = 0
    for ra, rb in zip(a, b, strict=True):
        hits += np.intersect1d(ra[ra >= 0], rb[rb >= 0]).size
    return hits / (a.shape[0] * k)
