"""What the ANN tuner tries: its configuration, the ladder of index types and each candidate's knobs.

:class:`TuneConfig` holds the target and budgets; :func:`auto_ladder` the index types tried in order;
:func:`build_candidate` builds one of them, :func:`with_params` re-knobs a built index (IVF ``nprobe``, HNSW
``efSearch``, IVF-PQ ``rescore``), :func:`step_up` raises its knobs one step, and :func:`predict_nprobe` reads the
smallest IVF ``nprobe`` that reaches a recall off one quantiser search (for IVF-Flat the scores inside probed cells
are exact, so an exact top-k item is in the ANN top-K iff its cell is probed).

GPU: the nprobe of an IVF index searched on the GPU stops at ``gare_index.ann.GPU_MAX_K`` (faiss's GPU selection
limit) as well as at ``max_nprobe_frac`` of the cells (:func:`nprobe_cap`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import faiss
import numpy as np

from gare_index.ann import AnnIndex, build_index
from gare_index.ann_gpu import GPU_MAX_K
from gare_index.ann_params import FLAT_MAX, IVFPQ_MIN, AnnParams, coarse_kind, default_nlist, default_nprobe

__all__ = ["TuneConfig", "auto_ladder", "rung_params", "same_rung", "build_candidate", "with_params", "nprobe_cap", "frac_cap",
           "ceiling_nprobe_cap", "step_up", "predict_nprobe", "describe_params"]


@dataclass
class TuneConfig:
    target: float = 0.995  # recall@K of the exact top-k required on the held-out queries
    k: int = 10  # the exact top-k whose recall is measured
    candidates: int = 256  # K: the stage-1 shortlist (the service's default candidates)
    latency_budget_ms: float = 5.0  # p50 of one query per call on one thread
    # Recall first: when nothing meets the target within the budget, the search effort is raised further (past
    # max_ef / max_nprobe_frac, the index types in order, exact flat last on the auto ladder) up to this p50.
    # The ceiling leaves a 1M-row gallery room for IVF probing a large share of its cells or HNSW at a very high
    # efSearch on one core, and exact flat search for galleries a few times smaller (the measured frontiers:
    # bench/results/stage1_frontier.md, stage1_frontier_hnsw.md).
    # At or below latency_budget_ms it is off (the budget is a hard limit, as before).
    latency_ceiling_ms: float = 100.0
    n_queries: int = 1000  # sample queries used in all (half tune, half held out)
    latency_queries: int = 100  # single queries timed for the p50
    index_types: tuple[str, ...] | None = None  # None: auto_ladder(n)
    max_nprobe_frac: float = 0.5  # never probe more than this share of the IVF cells (nor GPU_MAX_K on the GPU)
    max_ef: int = 4096
    ceiling_max_ef: int = 65536  # efSearch cap while raising the effort past the budget (recall first)
    max_rescore: int = 32
    nlist: int | None = None  # ivf / ivfpq cells (None: default_nlist(n))
    train_per_cell: int = 40  # k-means training rows per cell (tuning builds; faiss wants >= 39)
    perturb_noise: float = 0.5  # perturbed-gallery queries: relative offset norm (cos to the source ~0.9)
    seed: int = 0
    use_gpu: bool | None = None  # None: IVF-Flat on the GPU when faiss sees one (faiss-gpu), else CPU
    strict: bool = True  # raise RecallTargetError when the target cannot be met (else met=False)
    # Aim the tuning half at target + margin * (1 - target) (0.999 for 0.995) while the latency budget allows:
    # the held-out half then clears the target with room, and small galleries, where the budget is loose,
    # get the higher recall for free.  When the budget stops short of the aim, a setting whose held-out
    # recall still reaches the target is accepted.
    margin: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        if self.k < 1 or self.candidates < self.k:
            raise ValueError(f"need 1 <= k <= candidates, got k={self.k}, candidates={self.candidates}")
        if self.latency_budget_ms <= 0:
            raise ValueError(f"latency_budget_ms must be > 0, got {self.latency_budget_ms}")
        if not self.latency_ceiling_ms > 0:
            raise ValueError(f"latency_ceiling_ms must be > 0, got {self.latency_ceiling_ms}")
        if self.n_queries < 2 or self.latency_queries < 1:
            raise ValueError(f"n_queries >= 2 and latency_queries >= 1 required, got {self.n_queries}, "
                             f"{self.latency_queries}")


def auto_ladder(n: int, *, gpu: bool = False) -> tuple[str, ...]:
    """Index types tried in order.  CPU: flat below FLAT_MAX (then hnsw if flat is too slow); IVF-Flat (cheap
    to build, supports removal), then fast-scan IVF-PQ with exact re-scoring on the same cells (its build trains
    only the product quantiser, and it supports removal too), then HNSW (the costliest build, and no removal) up to
    IVFPQ_MIN; fast-scan IVF-PQ then HNSW beyond (float vectors stop fitting in RAM).
    ("ivfpq-fs" is ``ivfpq`` with ``fastscan=True``.)  GPU: IVF-Flat on the GPU, then flat."""
    if gpu:
        return ("ivf", "flat")
    if n < FLAT_MAX:
        return ("flat", "hnsw")
    if n < IVFPQ_MIN:
        return ("ivf", "ivfpq-fs", "hnsw")
    return ("ivfpq-fs", "hnsw")


def predict_nprobe(ann: AnnIndex, units_rows_gt: np.ndarray, queries: np.ndarray, gt: np.ndarray,
                target: float) -> int:
    """Smallest nprobe at which the share of exact top-k items whose cell is probed reaches ``target``.

    units_rows_gt: (q * k, d) the vectors of the exact top-k items (row-major in gt order)."""
    inner = faiss.downcast_index(ann.cpu_index)
    nlist = int(inner.nlist)
    cents = inner.quantizer.reconstruct_n(0, nlist)  # (nlist, d) centroids (flat or HNSW quantiser)
    _, cell = faiss.knn(units_rows_gt, cents, 1, metric=faiss.METRIC_INNER_PRODUCT)  # (q*k, 1)
    cell = cell.reshape(gt.shape)
    _, order = faiss.knn(queries, cents, nlist, metric=faiss.METRIC_INNER_PRODUCT)  # (q, nlist) cell order
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(nlist)[None, :].repeat(order.shape[0], 0), axis=1)
    item_rank = np.take_along_axis(rank, cell, axis=1)[gt >= 0]  # rank of each true item's cell
    need = np.sort(item_rank)[min(item_rank.size - 1, max(0, math.ceil(target * item_rank.size) - 1))]
    return int(need) + 1


def describe_params(p: AnnParams) -> str:
    """The knobs that matter for ``p.index_type``, as one short string (reports and messages)."""
    if p.index_type == "flat":
        return "exact"
    if p.index_type == "hnsw":
        return f"M={p.hnsw_m} efC={p.ef_construction} efSearch={p.ef_search}"
    s = f"nlist={p.nlist} nprobe={p.nprobe} coarse={p.coarse}"
    if p.index_type == "ivfpq":
        s += f" pq_m={p.pq_m} {'fastscan 4-bit' if p.fastscan else '8-bit'} rescore x{p.rescore}"
    return s


def rung_params(kind: str, n: int, cfg: TuneConfig, gpu: bool) -> AnnParams:
    """The first knobs of one rung of the ladder (``kind``: flat, ivf, hnsw, ivfpq or ivfpq-fs) over n rows."""
    nlist = int(cfg.nlist or default_nlist(n))
    if kind == "flat":
        p = AnnParams("flat")
    elif kind == "hnsw":
        p = AnnParams("hnsw", ef_search=max(cfg.candidates, 128))
    elif kind == "ivf":  # on the GPU: a flat quantiser, and a first nprobe within faiss's GPU limit
        p = AnnParams("ivf", nlist=nlist, train_per_cell=cfg.train_per_cell, coarse="flat" if gpu else "auto",
                      nprobe=min(default_nprobe(min(nlist, n)), GPU_MAX_K) if gpu else None)
    elif kind in ("ivfpq", "ivfpq-fs"):
        p = AnnParams("ivfpq", nlist=nlist, train_per_cell=cfg.train_per_cell, fastscan=kind == "ivfpq-fs",
                      rescore=4)
    else:
        raise ValueError(f"unknown index type {kind!r} in the tuning ladder (known: flat, ivf, hnsw, ivfpq, "
                         "ivfpq-fs)")
    p = AnnParams.from_dict({**p.to_dict(), "nlist": nlist if p.index_type in ("ivf", "ivfpq") else None})
    if p.index_type in ("ivf", "ivfpq"):
        p = dataclasses.replace(p, nlist=min(nlist, n), coarse=coarse_kind(p, min(nlist, n)))
    return p


def same_rung(a: AnnIndex, p: AnnParams) -> bool:
    """Whether ``a`` is the index rung ``p`` would build (same type, and for IVF the same cells and quantiser kind;
    IVF-PQ also the same code kind): tuning its knobs again would repeat the trials."""
    b = a.params
    if b.index_type != p.index_type:
        return False
    if p.index_type in ("ivf", "ivfpq"):
        same = b.coarse == p.coarse and int(faiss.extract_index_ivf(a.cpu_index).nlist) == p.nlist
        return same and (p.index_type == "ivf" or b.fastscan == p.fastscan)
    return p.index_type != "hnsw" or b.hnsw_m == p.hnsw_m


def build_candidate(kind: str, units: np.ndarray, ids: np.ndarray, cfg: TuneConfig, gpu: bool,
                    built: list[AnnIndex] | None = None) -> tuple[AnnIndex, str | None]:
    """Build one rung of the ladder (``kind``, :func:`rung_params`) over ``units`` with first knobs.

    ``built``: the candidates built before; an IVF one with the same cells lends its trained coarse quantiser
    (``build_index(coarse_from=...)``), so IVF-PQ after IVF-Flat trains only its product quantiser.  Returns the
    index and the type of the candidate whose quantiser it copied (None: trained its own)."""
    n = units.shape[0]
    p = rung_params(kind, n, cfg, gpu)
    donor: AnnIndex | None = None
    if p.index_type in ("ivf", "ivfpq"):
        donor = next((b for b in built or [] if b.params.index_type in ("ivf", "ivfpq")
                      and b.params.coarse == p.coarse and int(faiss.extract_index_ivf(b.cpu_index).nlist) == p.nlist
                      and b.ntotal == n), None)
    index = build_index(units, ids, p, use_gpu=gpu if p.index_type in ("flat", "ivf") else False,
                        coarse_from=None if donor is None else donor.cpu_index)
    lent = None if donor is None else donor.params.index_type
    if p.index_type == "ivfpq":
        a = AnnIndex(index, p, units, vector_ids=None if np.array_equal(ids, np.arange(n)) else ids,
                     use_gpu=False)
    else:
        a = AnnIndex(index, p, use_gpu=gpu if p.index_type in ("flat", "ivf") else False)
    return a, lent


def with_params(a: AnnIndex, p: AnnParams, units: np.ndarray, vec_ids: np.ndarray | None,
                 cfg: TuneConfig) -> AnnIndex:
    """The same faiss index under other query-time knobs (ivfpq re-scores from ``units``)."""
    if p.index_type == "ivfpq":
        return AnnIndex(a.cpu_index, p, units, vector_ids=vec_ids, use_gpu=False)
    if p.index_type == "hnsw":
        return AnnIndex(a.cpu_index, p, use_gpu=False)
    return AnnIndex(a.cpu_index, p, use_gpu=cfg.use_gpu)


def nprobe_cap(a: AnnIndex, cfg: TuneConfig, gpu: bool) -> int:
    """The largest nprobe tried for ``a``: ``max_nprobe_frac`` of its cells, and at most GPU_MAX_K when ``a`` is
    (or, tuning on a GPU, would be) an IVF-Flat index searched on the GPU: faiss's GPU IVF throws above it, and
    ``gare_index.ann.gpu_plan`` keeps such an index on the CPU (or refuses it), so a larger nprobe would not be
    what the GPU serves."""
    cap = frac_cap(a, cfg)
    if a.on_gpu or (gpu and a.params.index_type == "ivf"):
        return min(cap, GPU_MAX_K)
    return cap


def frac_cap(a: AnnIndex, cfg: TuneConfig) -> int:
    """``max_nprobe_frac`` of ``a``'s IVF cells (at least 1)."""
    return max(1, int(cfg.max_nprobe_frac * int(faiss.downcast_index(a.cpu_index).nlist)))


def ceiling_nprobe_cap(a: AnnIndex, cfg: TuneConfig, gpu: bool) -> int:
    """The largest nprobe tried past the latency budget (recall first): every cell, and at most GPU_MAX_K where
    :func:`nprobe_cap` applies it (an IVF-Flat index searched on the GPU)."""
    cap = int(faiss.downcast_index(a.cpu_index).nlist)
    if a.on_gpu or (gpu and a.params.index_type == "ivf"):
        return min(cap, GPU_MAX_K)
    return cap


def step_up(a: AnnIndex, cfg: TuneConfig, units: np.ndarray, vec_ids: np.ndarray | None,
             gpu: bool = False, *, past_budget: bool = False) -> AnnIndex | None:
    """``a`` one step up (efSearch x2, nprobe x1.5 within :func:`nprobe_cap`), or None at the top. ``past_budget``
    (recall first): up to ``cfg.ceiling_max_ef`` and :func:`ceiling_nprobe_cap` instead."""
    p = a.params
    if p.index_type == "hnsw":
        top = max(cfg.max_ef, cfg.ceiling_max_ef) if past_budget else cfg.max_ef
        if p.ef_search >= top:
            return None
        pp = dataclasses.replace(p, ef_search=min(top, p.ef_search * 2))
        return AnnIndex(a.cpu_index, pp, use_gpu=False)
    if p.index_type in ("ivf", "ivfpq"):
        cap = ceiling_nprobe_cap(a, cfg, gpu) if past_budget else nprobe_cap(a, cfg, gpu)
        if (p.nprobe or 0) >= cap:
            return None
        pp = dataclasses.replace(p, nprobe=int(min(cap, math.ceil((p.nprobe or 1) * 1.5))))
        return with_params(a, pp, units, vec_ids, cfg)
    return None
