"""Psi coverage of stage 1: the share of an exhaustive scorer's top-10 inside the ANN top-K, and the default K.

:func:`coverage_at_k` measures that share for several K for any ``scorer(queries, ids) -> scores`` callable:
:func:`psi_fold_scorer` (the exact folded psi of :mod:`gare.psi_fold` with the index's NCL biases, what the
search ranks by) or :func:`cosine_scorer` (the dual tower); it is :func:`psi_truth` (the exhaustive top-10, the
costly part) then :func:`ann_coverage` (one ANN search), so a tuner can measure other search efforts against
the same truth, and :func:`exact_coverage` gives the exact stage 1's share, the bound no effort passes.
:func:`choose_candidates` picks the smallest K reaching a target (the index's default candidates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gare import psi_fold_cpu
from gare.psi_fold import exhaustive
from gare.psi_fold_queries import fold_queries
from gare.psi_fold_videos import VideoConstants, fold_videos
from gare.psi_fold_weights import fold_weights
from gare_build.tuning.measure import exact_topk, recall_of_topk
from gare_index.ann import AnnIndex
from gare_index.frame_quant import QuantFrames

__all__ = ["Scorer", "CoverageResult", "StoredConsts", "cosine_scorer", "psi_fold_scorer", "psi_truth", "ann_coverage",
           "exact_coverage", "coverage_at_k", "choose_candidates"]

# scorer(queries (b, d) float32, ids (m,) int64) -> scores (b, m): what the exhaustive ranking sorts by
Scorer = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class CoverageResult:
    coverage: dict[int, float]  # K -> share of the exhaustive top-`top` inside the ANN top-K
    top: int
    n_queries: int
    query_source: str
    chosen_K: int | None = None  # smallest K reaching `target` (choose_candidates), None if none does
    target: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["coverage"] = {str(k): v for k, v in self.coverage.items()}
        return d


def cosine_scorer(units: np.ndarray) -> Scorer:
    """The exact dual-tower scorer: ``scorer(q, ids) = q @ units[ids].T`` (ids are row positions)."""

    def score(q: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return np.asarray(q, dtype=np.float32) @ np.asarray(units[ids], dtype=np.float32).T

    return score


@dataclass(frozen=True)
class StoredConsts:
    """A version's psi constants (gare_index.psi_consts) and the v̄ = norms * units they were folded with, in row
    order: packed (n, 10f + 5f² + 2) float32, units (n, d), norms (n,) (memmaps are fine), and ``fingerprint``, the
    psi weights they were folded with (the manifest's ``psi_fold.fingerprint``): the scorer refuses constants of
    other weights."""

    packed: Any
    units: Any
    norms: Any
    fingerprint: str


# videos per kernel call in the stored-constants scorer: their frames (12 KB each at f = 12, d = 512 float16) stay in
# L2 while every query is scored against them (a run of 512 spills out of it: each pair costs more)
_KERNEL_VIDEOS = 64


def _stored_kernel_arrays(frames: Any, stored: StoredConsts) -> psi_fold_cpu.KernelArrays | None:
    """The arrays as the CPU kernel reads them (memmaps are not copied), or None when numba is missing or the
    frames are not a numpy array (the torch path then scores)."""
    if not psi_fold_cpu.available():
        return None
    if isinstance(frames, QuantFrames):  # int8 frames: the kernel scales frame g of row c by scales[c, g]
        fr, fscale = frames.q, frames.scales
    elif isinstance(frames, np.ndarray):
        fr, fscale = frames, None
    else:
        return None
    return psi_fold_cpu.kernel_arrays(fr, stored.packed, vrows=stored.units, vscale=stored.norms, fscale=fscale)


def psi_fold_scorer(model: Any, frames: np.ndarray, masks: np.ndarray, biases: np.ndarray, ids: np.ndarray,
                    unit_queries: np.ndarray, raw_queries: np.ndarray, *, stored: StoredConsts | None = None) -> Scorer:
    """Exhaustive ``psi(t, video) + b_video`` over gallery ids, with the exact fold of gare.psi_fold.

    frames (n, f, d) float16 (a memmap is fine) or the index's int8 frames (gare_index.frame_quant.QuantFrames, read
    as float32, as the served rerank reads them), masks (n, f), biases (n,), ids (n,) in row order: the index's
    stored arrays. ``unit_queries`` (a, d) are what coverage_at_k passes (and the ANN searches);
    ``raw_queries`` (a, d) the matching rows psi scores (un-normalised caption embeddings; queue rows and
    perturbed gallery vectors are unit already).

    With ``stored`` the videos' constants are the index's (what the served rerank reads, v̄ = norm * unit): a call
    only reads them and scores, with the compiled CPU kernel of the served rerank (:mod:`gare.psi_fold_cpu`) over
    runs of _KERNEL_VIDEOS videos x every query (their frames stay in cache across the queries) on torch's thread
    count: O(a · m · f · d), about three times cheaper per pair than folding and scoring with the torch ops
    (bench/results/tune_cost.md). Without it (or without numba) each call folds its block of videos first (three
    d x d products per frame, v̄ the masked mean of the frames) and scores with the torch ops, which is what an
    index without stored constants needs."""
    ref_pad = bool(getattr(model.cfg, "reference_padding", False))  # the authors' padding: v̄ and psi over all rows
    fold = fold_weights(model.psi).to("cpu")  # the scoring runs on the CPU next to the memmapped frames
    if stored is not None and stored.fingerprint != fold.fingerprint:
        raise ValueError(f"stored psi constants were folded with psi {stored.fingerprint[:12]}, the model's psi is "
                         f"{fold.fingerprint[:12]}: stale constants cannot score the coverage")
    qv = fold_queries(torch.from_numpy(np.ascontiguousarray(raw_queries, dtype=np.float32)), fold, model.cfg.temp)
    ka = _stored_kernel_arrays(frames, stored) if stored is not None else None
    where = {np.ascontiguousarray(unit_queries[i], dtype=np.float32).tobytes(): i for i in range(unit_queries.shape[0])}
    ids = np.asarray(ids, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    b = np.asarray(biases, dtype=np.float32)

    def score(q: np.ndarray, gids: np.ndarray) -> np.ndarray:
        try:
            qi = np.array([where[np.ascontiguousarray(r, dtype=np.float32).tobytes()] for r in q], dtype=np.int64)
        except KeyError:
            raise ValueError("psi_fold_scorer: called with a query that is not one of its sample queries") from None
        rows = order[np.searchsorted(sorted_ids, np.asarray(gids, dtype=np.int64))]
        sub = dataclasses.replace(qv, u=qv.u[torch.from_numpy(qi)], sc=qv.sc[torch.from_numpy(qi)])  # these queries
        if ka is not None:
            s = np.empty((q.shape[0], rows.shape[0]), dtype=np.float32)
            threads = max(1, torch.get_num_threads())
            for j0 in range(0, rows.shape[0], _KERNEL_VIDEOS):
                run = rows[j0 : j0 + _KERNEL_VIDEOS]
                idx = np.ascontiguousarray(np.broadcast_to(run, (q.shape[0], run.shape[0])))  # (a, run) every query
                s[:, j0 : j0 + run.shape[0]] = psi_fold_cpu.scores(sub, ka, idx, threads=threads)
            return s + b[rows][None, :]
        srt = np.argsort(rows, kind="stable")  # sorted reads from the memmap
        fr = np.asarray(frames[rows[srt]])  # float16 as stored; float32 from int8 frames (QuantFrames dequantises)
        fr = torch.from_numpy(fr if fr.dtype == np.float16 else fr.astype(np.float32, copy=False))
        if stored is not None:
            pk = torch.from_numpy(np.asarray(stored.packed[rows[srt]], dtype=np.float32))
            vb = (np.asarray(stored.units[rows[srt]], dtype=np.float32)
                  * np.asarray(stored.norms[rows[srt]], dtype=np.float32)[:, None])  # (m, d) the served v̄
            vc = VideoConstants(frames=fr, packed=pk, fingerprint=fold.fingerprint, vbar=torch.from_numpy(vb))
        else:
            mk = torch.from_numpy(np.asarray(masks[rows[srt]]))
            vc = fold_videos(fr, mk, fold, reference_padding=ref_pad)
        s = np.empty((q.shape[0], rows.shape[0]), dtype=np.float32)
        s[:, srt] = exhaustive(sub, vc).numpy()
        return s + b[rows][None, :]

    return score


def psi_truth(queries: np.ndarray, scorer: Scorer, gallery_ids: np.ndarray, *, top: int = 10, block: int = 65_536,
              query_batch: int = 64, progress: bool = False) -> np.ndarray:
    """(a, top) gallery ids: each query's exhaustive ``scorer`` top-``top``, best first.

    ``scorer(q (b, d), ids (m,)) -> (b, m)`` scores the queries against gallery ids exactly as the exhaustive
    ranking does (the folded psi with biases; :func:`cosine_scorer` for the dual tower); it is called on
    ``gallery_ids`` in blocks of ``block`` ids and ``query_batch`` queries.  Ties at the top-``top`` boundary
    are broken by the lower position in ``gallery_ids``. ``progress``: a progress bar over the gallery's blocks
    on stderr (minutes at 1M)."""
    gallery_ids = np.asarray(gallery_ids, dtype=np.int64)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    nq, n = q.shape[0], gallery_ids.shape[0]
    top = min(top, n)
    truth = np.empty((nq, top), dtype=np.int64)
    bar = tqdm(total=-(-n // block) * -(-nq // query_batch), desc="psi coverage", unit="block", disable=not progress)
    for s in range(0, nq, query_batch):
        e = min(nq, s + query_batch)
        best_s = np.full((e - s, 0), -np.inf, dtype=np.float32)
        best_p = np.zeros((e - s, 0), dtype=np.int64)
        for g in range(0, n, block):
            h = min(n, g + block)
            sc = np.asarray(scorer(q[s:e], gallery_ids[g:h]), dtype=np.float32)
            if sc.shape != (e - s, h - g):
                raise ValueError(f"scorer returned shape {sc.shape}, expected {(e - s, h - g)}")
            cs = np.concatenate([best_s, sc], axis=1)
            cp = np.concatenate([best_p, np.arange(g, h, dtype=np.int64)[None, :].repeat(e - s, 0)], axis=1)
            order = np.lexsort((cp, -cs), axis=1)[:, :top]
            best_s, best_p = np.take_along_axis(cs, order, 1), np.take_along_axis(cp, order, 1)
            bar.update(1)
        truth[s:e] = gallery_ids[best_p]
    bar.close()
    return truth


def ann_coverage(ann: AnnIndex, queries: np.ndarray, truth: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """{K: share of ``truth`` (a, top) inside the ANN top-K} for each K: one search of the largest K."""
    ks = sorted({int(k) for k in ks})
    kmax = min(ks[-1], max(1, ann.ntotal))
    _, got = ann.search(np.ascontiguousarray(queries, dtype=np.float32), kmax)
    return {k: recall_of_topk(got[:, : min(k, kmax)], truth) for k in ks}


def exact_coverage(units: Any, ids: np.ndarray, queries: np.ndarray, truth: np.ndarray,
                   ks: Sequence[int]) -> dict[int, float]:
    """{K: share of ``truth`` inside the *exact* stage-1 top-K} (inner products with ``units`` (n, d), row i has id
    ``ids[i]``): what a perfect ANN would hold, the dual tower's own bound at K. No search effort beats it; a
    larger K does."""
    ks = sorted({int(k) for k in ks})
    _, rows = exact_topk(units, queries, min(ks[-1], units.shape[0]))
    got = np.asarray(ids, dtype=np.int64)[rows]
    return {k: recall_of_topk(got[:, :k], truth) for k in ks}


def coverage_at_k(
    ann: AnnIndex,
    queries: np.ndarray,
    scorer: Scorer,
    gallery_ids: np.ndarray,
    ks: Sequence[int] = (16, 32, 64, 128, 256, 512),
    *,
    top: int = 10,
    block: int = 65_536,
    query_batch: int = 64,
    query_source: str = "",
    target: float | None = None,
    progress: bool = False,
) -> CoverageResult:
    """Share of the exhaustive ``scorer`` top-``top`` (:func:`psi_truth`) found inside the ANN top-K, for each K in
    ``ks`` (:func:`ann_coverage`). With ``target`` the result's ``chosen_K`` is :func:`choose_candidates`."""
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive, got {ks}")
    truth = psi_truth(queries, scorer, gallery_ids, top=top, block=block, query_batch=query_batch, progress=progress)
    res = CoverageResult(ann_coverage(ann, queries, truth, ks), truth.shape[1], truth.shape[0], query_source)
    if target is not None:
        res.target = target
        res.chosen_K = choose_candidates(res, target)
    return res


def choose_candidates(coverage: CoverageResult, target: float = 0.995) -> int | None:
    """The smallest K whose coverage reaches ``target`` (None when none of the measured K does)."""
    for k in sorted(coverage.coverage):
        if coverage.coverage[k] >= target:
            return k
    return None
