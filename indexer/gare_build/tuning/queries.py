"""The sample queries of stage-1 tuning: the NCL queue, manifest captions, perturbed gallery or a served-query bank.

:func:`sample_queries` gives unit queries from the checkpoint's NCL text queue (embeddings of real training
captions) when present, else caption embeddings from a manifest when given, else perturbed gallery vectors;
:func:`build_sample` mixes them with queries spread over the whole gallery (:func:`spread_queries`: one source
row per cell of a farthest-point cover of the gallery, every region as likely as any other, not only the popular ones a training
queue holds) and adds the matching raw rows psi scores, each row labelled with its part (the tuner measures
recall on each part and keeps the lower); :func:`bank_queries` reads the distinct served queries of a query bank
(``gare-index tune --from-bank``), which replace the mix. The source is recorded with every sample; every source
is subsampled the same way (:func:`pick_rows`).

Every sample has two forms: unit rows, which stage 1 searches with, and the raw rows psi scores. psi is not
scale-invariant (q = v̄ - t; the pooling softmax(t·F / temp)), so a raw row must carry the |t| a served query has:
caption rows are the tower's raw t, bank rows are t as served, and the rows made here (spread and perturbed
queries, unit by construction) are scaled to the text tower's mean |t| (``norm``:
:func:`gare_build.tuning.version_tuning.tower_norm`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import faiss
import numpy as np

from gare_build.ncl_queues import load_query_bank, served_norms
from gare_build.tuning.measure import exact_topk
from gare_index.ann_eval import perturbed_queries

log = logging.getLogger(__name__)

__all__ = ["SPREAD_SHARE", "CAPTION_PART", "SPREAD_PART", "pick_rows", "sample_queries", "spread_queries", "build_sample",
           "bank_queries"]

SPREAD_SHARE = 0.5  # share of the build's sample spread over the gallery (the rest: the queue / captions)
CAPTION_PART, SPREAD_PART = "captions", "spread"  # the part labels of a mixed sample
ROWS_PER_CLUSTER = 40  # subsampled gallery rows per cell of the spread sample's cover
OFFSET_CAPTIONS = 256  # caption rows whose offset from their nearest gallery vector the spread queries reuse


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


def spread_queries(units: np.ndarray, n: int, *, captions: np.ndarray | None = None, noise: float = 0.5,
                   seed: int = 0) -> tuple[np.ndarray, str]:
    """(queries (n, d) unit float32, source): ``n`` queries spread evenly over the regions of the gallery.

    A seeded subsample of ROWS_PER_CLUSTER * c rows of ``units`` (N, d), c = min(n, N // ROWS_PER_CLUSTER), is
    covered by c cells: a farthest-point cover (each next centre the row farthest, by cosine, from the centres so
    far) and every row in the cell of its nearest centre. Each query takes a member of one cell, the cells visited
    in a seeded order so that every one is used before any is used twice. The cover follows the gallery's extent,
    not its density (k-means would give a topic holding 80% of the rows 80% of its clusters): a topic of ten
    videos is about as likely as one of a hundred thousand, as users' queries are and a training queue's popular
    captions are not.

    The member is then moved as a caption sits from its nearest video: with ``captions`` (unit rows of the
    caption part), by the offset ``caption - nearest gallery vector`` of a random one of up to OFFSET_CAPTIONS
    of them (their exact top-1), which carries the modality gap and the captions' distance from the gallery
    over to every region; without, by isotropic noise of relative norm ``noise`` (as :func:`perturbed_queries`)."""
    units_n, d = units.shape
    if units_n == 0 or n < 1:
        raise ValueError(f"spread queries need a non-empty gallery and n >= 1, got {units_n} rows, n={n}")
    rng = np.random.default_rng([seed, 41])
    c = int(max(1, min(n, units_n // ROWS_PER_CLUSTER)))
    pool = np.sort(rng.choice(units_n, size=min(units_n, ROWS_PER_CLUSTER * c), replace=False))
    xp = np.ascontiguousarray(np.asarray(units[pool], dtype=np.float32))  # (p, d) the covered subsample
    centres = [int(rng.integers(xp.shape[0]))]
    closest = xp @ xp[centres[0]]  # (p,) each row's highest cosine to a centre so far
    for _ in range(1, c):
        nxt = int(np.argmin(closest))  # the row farthest from every centre
        centres.append(nxt)
        np.maximum(closest, xp @ xp[nxt], out=closest)
    _, cell = faiss.knn(xp, xp[centres], 1, metric=faiss.METRIC_INNER_PRODUCT)  # (p, 1) nearest centre
    cell = cell[:, 0]
    members = [m for m in (np.flatnonzero(cell == j) for j in range(c)) if m.size]
    order = rng.permutation(len(members))
    src = np.empty(n, dtype=np.int64)
    for i in range(n):  # cell order[i % cells]: each cell once before any twice
        m = members[order[i % len(members)]]
        src[i] = m[rng.integers(m.size)]
    base = xp[src]  # (n, d)
    if captions is not None and len(captions):
        cap = np.asarray(captions, dtype=np.float32).reshape(len(captions), -1)
        keep = pick_rows(cap.shape[0], OFFSET_CAPTIONS, seed)
        cap = cap if keep is None else cap[keep]
        _, top1 = exact_topk(units, cap, 1)
        uniq, inv = np.unique(top1[:, 0], return_inverse=True)  # sorted reads (memmap friendly)
        offsets = cap - np.asarray(units[uniq], dtype=np.float32)[inv]  # (m, d) caption - its nearest video
        q = base + offsets[rng.integers(offsets.shape[0], size=n)]
        how = f"caption offsets of {offsets.shape[0]} captions"
    else:
        q = base + noise * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
        how = f"noise {noise}"
    q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(q, dtype=np.float32), f"spread-gallery ({n} queries over {len(members)} cells, {how})"


def build_sample(units: np.ndarray, queue: np.ndarray | None, captions: np.ndarray | None, *, n: int, seed: int,
                 spread: float = SPREAD_SHARE, norm: float | None = None
                 ) -> tuple[np.ndarray, str, np.ndarray, np.ndarray | None]:
    """(unit queries (m, d), source, the matching raw rows psi scores (m, d), part labels (m,) or None).

    The caption part is the queue, else the captions, else nothing (:func:`sample_queries`' order); ``spread``
    of the ``n`` queries (rounded; 0 turns it off) are :func:`spread_queries` over the gallery, the caption part
    takes up to the rest. The labels are CAPTION_PART / SPREAD_PART, None when the sample has one part only (no
    caption source: all ``n`` queries are spread; ``spread`` 0: the caption part alone, or perturbed gallery
    vectors without one, as before the mix).

    Raw rows: the caption part's rows as given (the tower's t); the rows made here are unit vectors scaled to
    ``norm``, the tower's mean |t| (:func:`gare_build.tuning.version_tuning.tower_norm`; None: left at |t| = 1)."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread share must be in [0, 1), got {spread}")
    raw = None
    for arr in (queue, captions):  # sample_queries' order: the queue, then the captions
        if arr is not None and len(arr):
            arr = np.asarray(arr, dtype=np.float32).reshape(len(arr), -1)
            keep = pick_rows(arr.shape[0], max(1, n - int(round(spread * n))), seed)
            raw = arr if keep is None else arr[keep]
            break
    n_spread = int(round(spread * n))
    if raw is None:
        if spread <= 0.0:
            unit_q, source = sample_queries(units, n=n, seed=seed)
        else:
            unit_q, source = spread_queries(units, n, seed=seed)
        return unit_q, source, _scaled(unit_q, norm), None
    is_queue = queue is not None and len(queue) > 0
    unit_c, source = sample_queries(units, queue=raw if is_queue else None, captions=None if is_queue else raw,
                                    n=raw.shape[0], seed=seed)
    if n_spread < 1:
        return unit_c, source, raw, None
    unit_s, s_source = spread_queries(units, n_spread, captions=unit_c, seed=seed)
    unit_q = np.concatenate([unit_c, unit_s])
    raw_q = np.concatenate([raw, _scaled(unit_s, norm)])
    parts = np.array([CAPTION_PART] * unit_c.shape[0] + [SPREAD_PART] * n_spread)
    return unit_q, f"{source} + {s_source}", raw_q, parts


def _scaled(unit_q: np.ndarray, norm: float | None) -> np.ndarray:
    """The raw rows psi scores for unit rows made here: scaled to ``norm`` (None: left at |t| = 1)."""
    return unit_q if norm is None else np.ascontiguousarray(unit_q * np.float32(norm))


def bank_queries(path: str | os.PathLike, d: int, *, n: int = 1000, seed: int = 0, norm: float | None = None
                 ) -> tuple[np.ndarray, str, dict[str, Any], np.ndarray]:
    """(unit queries (m, d) float32, query source, the manifest's ``query_bank`` record, raw rows (m, d)) from a
    served-query bank.

    The bank is read as ``gare-index biases --from-traffic`` reads it (:func:`gare_build.ncl_queues.load_query_bank`:
    no pickle, float32 (rows, d), finite, non-zero rows). Its rows are t as served, which psi scores as they are;
    the unit rows of a bank written before the service kept |t| are scaled to the bank's own served |t|, else to
    ``norm`` (:func:`gare_build.ncl_queues.served_norms`). Repeated queries (the same text gives the same embedding)
    are kept once, so that the tuner's held-out half holds no query of its tuning half; at most ``n`` distinct rows
    are used (a seeded sample, as the other sources)."""
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
    raw = np.ascontiguousarray(x if keep is None else x[keep], dtype=np.float32)
    raw, ninfo = served_norms(raw, norm)
    q = np.ascontiguousarray(raw / np.linalg.norm(raw, axis=1, keepdims=True), dtype=np.float32)
    m = int(q.shape[0])
    if m < 100:
        log.warning("--from-bank: only %d distinct served queries; the held-out recall (%d queries) is a coarse estimate",
                    m, m - m // 2)
    record = {"file": info["file"], "sha256": info["sha256"], "rows": info["rows"], "distinct": distinct, "used": m,
              "unit_rows": ninfo["unit_rows"], **{k: v for k, v in ninfo.items() if k != "unit_rows"},
              "note": "query embeddings served by gare-serve (gare_serve.engine.traffic_bank): stage 1 searches their "
                      "directions, psi scores them at their served |t|"}
    source = f"query-bank ({m} queries; {distinct} distinct of {info['rows']} served)"
    return q, source, record, raw
