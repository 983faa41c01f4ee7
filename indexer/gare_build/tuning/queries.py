"""The sample queries of stage-1 tuning: the NCL queue, manifest captions, perturbed gallery or a served-query bank.

:func:`sample_queries` gives unit queries from the checkpoint's NCL text queue (embeddings of real training
captions) when present, else caption embeddings from a manifest when given, else perturbed gallery vectors;
:func:`build_sample` adds the matching raw rows psi scores; :func:`bank_queries` reads the distinct served queries
of a query bank (``gare-index tune --from-bank``). The source is recorded with every sample; every source is
subsampled the same way (:func:`pick_rows`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from gare_build.ncl_queues import load_query_bank
from gare_index.ann_eval import perturbed_queries

log = logging.getLogger(__name__)

__all__ = ["pick_rows", "sample_queries", "build_sample", "bank_queries"]


def pick_rows(n_rows: int, n: int, seed: int) -> np.ndarray | None:
    """The rows a sample keeps of an (n_rows, d) source: ``n`` of them, seeded and sorted (None: all of them)."""
    if n_rows <= n:
        return None
    return np.sort(np.random.default_rng(seed).choice(n_rows, size=n, replace=False))


def sample_queries(
    units: np.ndarray,
    *,
    queue: np.ndarray | None = None,
    captions: np.ndarray | None = None,
    n: int = 1000,
    noise: float = 0.5,
    seed: int = 0,
) -> tuple[np.ndarray, str]:
    """(queries (m, d) unit float32, source): the NCL queue, else manifest captions, else perturbed gallery.

    ``queue``: the checkpoint's text queue (rows of real training-caption embeddings; see
    ``gare_build.pipeline.biases.checkpoint_gamma_and_queue``); ``captions``: caption embeddings of a manifest.  At most
    ``n`` rows are used (a seeded sample).  Perturbed gallery vectors are ``perturbed_queries(units, n,
    seed, noise)``: members plus a random offset of relative norm ``noise`` - easier than real captions
    (they sit next to a gallery vector), which the source string says."""
    d = units.shape[1]
    for arr, name in ((queue, "ncl-queue"), (captions, "manifest-captions")):
        if arr is None:
            continue
        arr = np.asarray(arr, dtype=np.float32)
        if arr.shape[0] == 0:
            continue
        arr = arr.reshape(arr.shape[0], -1)
        if arr.shape[1] != d:
            raise ValueError(f"{name} embeddings have d={arr.shape[1]}, the gallery has d={d}")
        rows = pick_rows(arr.shape[0], n, seed)
        if rows is not None:
            arr = arr[rows]
        arr = arr / np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(arr, dtype=np.float32), f"{name} ({arr.shape[0]} queries)"
    if units.shape[0] == 0:
        raise ValueError("cannot sample queries from an empty gallery")
    q = perturbed_queries(units, n, seed=seed, noise=noise)
    return q, f"perturbed-gallery (noise {noise}, {n} queries)"


def build_sample(units: np.ndarray, queue: np.ndarray | None, captions: np.ndarray | None, *, n: int, seed: int
                 ) -> tuple[np.ndarray, str, np.ndarray]:
    """(unit queries, source, the matching raw rows psi scores): the queue, else the captions, else perturbed
    gallery vectors (:func:`sample_queries`)."""
    raw = None
    for arr in (queue, captions):  # sample_queries' order: the queue, then the captions
        if arr is not None and len(arr):
            arr = np.asarray(arr, dtype=np.float32).reshape(len(arr), -1)
            keep = pick_rows(arr.shape[0], n, seed)
            raw = arr if keep is None else arr[keep]
            break
    if raw is not None:
        is_queue = queue is not None and len(queue) > 0
        unit_q, source = sample_queries(units, queue=raw if is_queue else None, captions=None if is_queue else raw,
                                        n=n, seed=seed)
    else:
        unit_q, source = sample_queries(units, n=n, seed=seed)
        raw = unit_q
    return unit_q, source, raw


def bank_queries(path: str | os.PathLike, d: int, *, n: int = 1000, seed: int = 0
                 ) -> tuple[np.ndarray, str, dict[str, Any]]:
    """(unit queries (m, d) float32, query source, the manifest's ``query_bank`` record) from a served-query bank.

    The bank is read as ``gare-index biases --from-traffic`` reads it (:func:`gare_build.ncl_queues.load_query_bank`:
    no pickle, float32 (rows, d), finite, non-zero rows, re-normalised). Repeated queries (the same text gives the
    same embedding) are kept once, so that the tuner's held-out half holds no query of its tuning half; at most
    ``n`` distinct rows are used (a seeded sample, as the other sources). Bank rows are unit vectors: the psi
    coverage and the deviation figure score them with |t| = 1, as they do perturbed-gallery queries."""
    try:
        x, info = load_query_bank(path, d)
    except ValueError as e:
        raise ValueError(str(e).replace("--from-traffic", "--from-bank", 1)) from None
    _, first = np.unique(x, axis=0, return_index=True)
    x = x[np.sort(first)]  # distinct rows, first occurrences in bank order (oldest first)
    distinct = int(x.shape[0])
    if distinct < 2:
        raise ValueError(f"--from-bank {info['file']}: {distinct} distinct queries; the tuner needs at least 2 (half tune, "
                         "half held out)")
    keep = pick_rows(distinct, n, seed)
    q = np.ascontiguousarray(x if keep is None else x[keep], dtype=np.float32)
    m = int(q.shape[0])
    if m < 100:
        log.warning("--from-bank: only %d distinct served queries; the held-out recall (%d queries) is a coarse estimate",
                    m, m - m // 2)
    record = {"file": info["file"], "sha256": info["sha256"], "rows": info["rows"], "distinct": distinct, "used": m,
              "non_unit_rows": info["non_unit_rows"],
              "note": "unit query embeddings served by gare-serve (gare_serve.engine.traffic_bank); psi coverage scores them with |t| = 1"}
    source = f"query-bank ({m} queries; {distinct} distinct of {info['rows']} served)"
    return q, source, record
