"""Measuring an ANN for the tuner: the exact top-k (ground truth), recall of a top-K, single-query latency.

The tuner's criterion (SPEC section 4) is *recall@K of the exact cosine top-k*: :func:`exact_topk` is the
ground truth, :func:`recall_of_topk` the share of it an ANN's top-K holds, :func:`p50_ms` what one request
costs the service (one query per call on one thread).
"""

from __future__ import annotations

import time

import faiss
import numpy as np

from gare_index.ann import AnnIndex

__all__ = ["Timer", "exact_topk", "recall_of_topk", "p50_ms"]


def exact_topk(units: np.ndarray, queries: np.ndarray, k: int, *, block: int = 262_144) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k over ``units`` (a memmap is fine; read ``block`` rows at a time):
    (scores (q, k) float32, rows (q, k) int64), faiss BLAS kernels, merged with a result heap."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    n = units.shape[0]
    k = min(k, n)
    heap = faiss.ResultHeap(q.shape[0], k, keep_max=True)
    for s in range(0, n, block):
        e = min(n, s + block)
        dist, rows = faiss.knn(q, np.ascontiguousarray(units[s:e], dtype=np.float32), min(k, e - s),
                         metric=faiss.METRIC_INNER_PRODUCT)
        heap.add_result(dist, rows + s)
    heap.finalize()
    return heap.D, heap.I


def recall_of_topk(ann_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    """Share of the exact top-k (exact_ids (q, k)) found anywhere in the ANN rows (ann_ids (q, K))."""
    ann_ids, exact_ids = np.asarray(ann_ids), np.asarray(exact_ids)
    if ann_ids.shape[0] != exact_ids.shape[0]:
        raise ValueError(f"{ann_ids.shape[0]} ANN rows for {exact_ids.shape[0]} queries")
    if exact_ids.size == 0:
        return float("nan")
    hits = (ann_ids[:, :, None] == exact_ids[:, None, :]) & (exact_ids[:, None, :] >= 0)
    return float(hits.any(axis=1).sum() / (exact_ids >= 0).sum())


class Timer:
    """Accumulated wall time of every ``with`` block run under it (the tuner's measuring time)."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> Timer:
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._t


def p50_ms(ann: AnnIndex, queries: np.ndarray, K: int, n: int, gpu: bool) -> float:
    """p50 milliseconds of ``n`` single-query searches of ``ann`` (one thread on the CPU)."""
    threads = faiss.omp_get_max_threads()
    if not gpu:
        faiss.omp_set_num_threads(1)  # one request = one thread: what a search costs the service
    try:
        ann.search(queries[:1], K)  # warm-up
        lat = []
        for i in range(min(n, queries.shape[0])):
            t0 = time.perf_counter()
            ann.search(queries[i : i + 1], K)
            lat.append(time.perf_counter() - t0)
    finally:
        faiss.omp_set_num_threads(threads)
    return 1000.0 * float(np.median(lat))
