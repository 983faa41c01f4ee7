"""Build-time tuning of stage 1: meet a recall target within a latency budget, and measure coverage.

SPEC section 4: stage 1 hands the top-K videos by ``cos(t, v̄_j)`` to psi, so its quality is *recall@K of
the exact cosine top-k* (k = 10, K = the service's default ``candidates``, 256): the share of each
query's exact top-10 that the ANN's top-K contains.  :func:`tune_ann` builds (or takes) an ANN over the
unit gallery vectors, measures that recall on sample queries against exact search, and raises the
query-time knobs (IVF ``nprobe``, HNSW ``efSearch``, IVF-PQ ``rescore``) or moves to another index type
until the target holds on *held-out* queries with a single-thread p50 latency within the budget.  When no
candidate can, it stops with :class:`RecallTargetError` whose message says what was reached and what to
change (``strict=False`` returns the best result with ``met=False`` instead).

Queries (:func:`sample_queries`): the checkpoint's NCL text queue (embeddings of real training captions)
when present, else caption embeddings from a manifest when given, else perturbed gallery vectors; the
source is recorded in the result.  They are split into a tuning half (the knobs are chosen on it) and a
held-out half (the reported recall).

IVF shortcut: for IVF-Flat the scores inside probed cells are exact, so an exact top-k item is in the ANN
top-K (K >= k) iff its cell is probed.  The smallest nprobe that reaches the target is therefore read off
one quantiser search (the rank of each true item's cell in its query's cell order) instead of a sweep;
it is then verified by real searches.

:func:`coverage_at_k` measures the share of an exhaustive scorer's top-10 (the folded psi with biases,
later; any ``scorer(queries, ids) -> scores`` callable) inside the ANN top-K for several K, and
:func:`choose_candidates` picks the smallest K reaching a target.

GPU: when faiss sees a GPU (a faiss-gpu build) and ``use_gpu`` is not False, the auto ladder is IVF-Flat
searched on the GPU (``gare_index.ann.build_index`` clones it).  The nprobe search of an index searched on the GPU
stops at ``gare_index.ann.GPU_MAX_K`` (2,048, faiss's GPU selection limit) as well as at ``max_nprobe_frac`` of
the cells, so the tuner never picks an nprobe the GPU cannot run (a target that needs more moves on to the next
index type, flat on the GPU).  CAGRA is NOT implemented yet: :func:`cagra_available` only reports whether the
installed wheel has it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from gare_index import ann as _ann
from gare_index.ann import (
    FLAT_MAX,
    IVFPQ_MIN,
    AnnIndex,
    AnnParams,
    _gpu_available,
    build_index,
    coarse_kind,
    default_nlist,
    default_nprobe,
    perturbed_queries,
)

log = logging.getLogger(__name__)

__all__ = [
    "TuneConfig",
    "TuneResult",
    "Trial",
    "RecallTargetError",
    "CoverageResult",
    "Scorer",
    "sample_queries",
    "exact_topk",
    "recall_of_topk",
    "tune_ann",
    "auto_ladder",
    "coverage_at_k",
    "choose_candidates",
    "cosine_scorer",
    "cagra_available",
    "describe_params",
]

# scorer(queries (b, d) float32, ids (m,) int64) -> scores (b, m): what the exhaustive ranking sorts by
Scorer = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class TuneConfig:
    target: float = 0.995  # recall@K of the exact top-k required on the held-out queries
    k: int = 10  # the exact top-k whose recall is measured
    candidates: int = 256  # K: the stage-1 shortlist (the service's default candidates)
    latency_budget_ms: float = 5.0  # p50 of one query per call on one thread
    n_queries: int = 1000  # sample queries used in all (half tune, half held out)
    latency_queries: int = 100  # single queries timed for the p50
    index_types: tuple[str, ...] | None = None  # None: auto_ladder(n)
    max_nprobe_frac: float = 0.5  # never probe more than this share of the IVF cells (nor GPU_MAX_K on the GPU)
    max_ef: int = 4096
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
        if self.n_queries < 2 or self.latency_queries < 1:
            raise ValueError(f"n_queries >= 2 and latency_queries >= 1 required, got {self.n_queries}, "
                             f"{self.latency_queries}")


@dataclass
class Trial:
    """One measured setting (on the tuning queries)."""

    index_type: str
    params: dict[str, Any]
    recall: float
    p50_ms: float
    note: str = ""


@dataclass
class TuneResult:
    met: bool
    recall: float  # recall@K of the exact top-k on the held-out queries
    recall_tune: float  # the same on the tuning queries
    k: int
    candidates: int  # K
    target: float
    index_type: str
    params: dict[str, Any]  # AnnParams.to_dict() of the chosen index
    p50_ms: float  # single query, one thread (GPU: one query per call on the GPU)
    latency_budget_ms: float
    query_source: str
    n_tune_queries: int
    n_holdout_queries: int
    tuning_s: float  # measuring: ground truth, recall and latency searches (excludes index builds)
    build_s: float  # building the index(es) tried, training included
    device: str  # "cpu" or "cuda"
    message: str
    trials: list[Trial] = field(default_factory=list)
    builds: list[dict[str, Any]] = field(default_factory=list)  # {"index_type", "seconds"} per index built

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RecallTargetError(RuntimeError):
    """The target could not be met within the budget; ``result`` holds the best setting reached."""

    def __init__(self, result: TuneResult) -> None:
        super().__init__(result.message)
        self.result = result


# --------------------------------------------------------------------------------------------- queries
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
    ``gare_build.build.checkpoint_gamma_and_queue``); ``captions``: caption embeddings of a manifest.  At most
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
        if arr.shape[0] > n:
            rows = np.sort(np.random.default_rng(seed).choice(arr.shape[0], size=n, replace=False))
            arr = arr[rows]
        arr = arr / np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(arr, dtype=np.float32), f"{name} ({arr.shape[0]} queries)"
    if units.shape[0] == 0:
        raise ValueError("cannot sample queries from an empty gallery")
    q = perturbed_queries(units, n, seed=seed, noise=noise)
    return q, f"perturbed-gallery (noise {noise}, {n} queries)"


# ------------------------------------------------------------------------------------------ exact search
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


# ----------------------------------------------------------------------------------------------- ladder
def cagra_available() -> bool:
    """Whether faiss has a GPU and the CAGRA index (faiss-gpu built with cuVS).  Not used yet."""
    return bool(hasattr(faiss, "GpuIndexCagra") and _gpu_available(None))


def auto_ladder(n: int, *, gpu: bool = False) -> tuple[str, ...]:
    """Index types tried in order.  CPU: flat below FLAT_MAX (then hnsw if flat is too slow); IVF-Flat (cheap
    to build, supports removal), then HNSW, then fast-scan IVF-PQ with exact re-scoring up to IVFPQ_MIN;
    fast-scan IVF-PQ then HNSW beyond (float vectors stop fitting in RAM).
    ("ivfpq-fs" is ``ivfpq`` with ``fastscan=True``.)  GPU: IVF-Flat on the GPU, then flat."""
    if gpu:
        return ("ivf", "flat")
    if n < FLAT_MAX:
        return ("flat", "hnsw")
    if n < IVFPQ_MIN:
        return ("ivf", "hnsw", "ivfpq-fs")
    return ("ivfpq-fs", "hnsw")


class _Timer:
    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> _Timer:
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._t


def _p50_ms(ann: AnnIndex, queries: np.ndarray, K: int, n: int, gpu: bool) -> float:
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


def _nprobe_for(ann: AnnIndex, units_rows_gt: np.ndarray, queries: np.ndarray, gt: np.ndarray,
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


def tune_ann(
    units: np.ndarray,
    queries: np.ndarray | None = None,
    *,
    ids: np.ndarray | None = None,
    query_source: str | None = None,
    config: TuneConfig | None = None,
    ann: AnnIndex | None = None,
    build_s: float = 0.0,
    progress: bool = False,
) -> tuple[AnnIndex, TuneResult]:
    """Choose and tune stage 1 over ``units`` (n, d) unit float32 rows (a memmap is fine).

    ``queries``: sample queries (m, d) with ``query_source`` naming them (see :func:`sample_queries`);
    None: perturbed gallery vectors.  ``ids``: the index ids of the rows (default ``arange(n)``).
    ``ann``: an index already built over these rows (its ``build_s`` seconds): its knobs are tuned first,
    and it is kept if it meets the target; otherwise the ladder ``config.index_types`` / :func:`auto_ladder`
    is built and tuned in order.  Returns (the chosen AnnIndex with its tuned params, TuneResult).
    Raises RecallTargetError (``strict``) when nothing meets the target within the latency budget; with
    ``strict=False`` it returns the best setting within the budget and ``met=False`` instead, or
    (None, result) when no setting was within the budget at all."""
    cfg = config or TuneConfig()
    n, d = units.shape
    if n == 0:
        raise ValueError("cannot tune an ANN over an empty gallery")
    ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if ids.shape != (n,):
        raise ValueError(f"ids must be ({n},), got {ids.shape}")
    if queries is None:
        queries, query_source = sample_queries(units, n=cfg.n_queries, noise=cfg.perturb_noise, seed=cfg.seed)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if queries.ndim != 2 or queries.shape[1] != d or queries.shape[0] < 2:
        raise ValueError(f"queries must be (m >= 2, {d}), got {queries.shape}")
    query_source = query_source or f"caller ({queries.shape[0]} queries)"
    if queries.shape[0] > cfg.n_queries:
        rows = np.sort(np.random.default_rng(cfg.seed).choice(queries.shape[0], cfg.n_queries, replace=False))
        queries = queries[rows]
    perm = np.random.default_rng(cfg.seed + 1).permutation(queries.shape[0])
    half = queries.shape[0] // 2
    q_tune, q_hold = queries[perm[:half]], queries[perm[half:]]
    K = min(cfg.candidates, n)
    k = min(cfg.k, n)
    gpu = bool(cfg.use_gpu is not False and _gpu_available(cfg.use_gpu))
    timer = _Timer()
    with timer:  # ground truth, in index ids
        _, gt_rows = exact_topk(units, queries, k)
        gt_all = np.where(gt_rows >= 0, ids[np.clip(gt_rows, 0, n - 1)], -1)
        gt_tune, gt_hold = gt_all[perm[:half]], gt_all[perm[half:]]
        gt_tune_rows = gt_rows[perm[:half]]
    vec_ids = None if np.array_equal(ids, np.arange(n)) else ids  # ivfpq re-scoring: id -> row of units
    trials: list[Trial] = []
    ladder = list(cfg.index_types or auto_ladder(n, gpu=gpu))
    best: tuple[float, float, AnnIndex, Trial] | None = None  # (recall, -p50, ann, trial)

    def measure(a: AnnIndex, note: str = "") -> Trial:
        with timer:
            _, got = a.search(q_tune, K)
            r = recall_of_topk(got, gt_tune)
            p50 = _p50_ms(a, q_tune, K, cfg.latency_queries, gpu)
        tr = Trial(a.params.index_type, a.params.to_dict(), r, p50, note)
        trials.append(tr)
        log.info("tune %s %s: recall@%d of top-%d %.4f, p50 %.2f ms %s", tr.index_type,
                 describe_params(a.params), K, k, r, p50, note)
        if progress:
            print(f"  tune {tr.index_type} {describe_params(a.params)}: recall {r:.4f}, p50 {p50:.2f} ms {note}", flush=True)
        return tr

    within: list[tuple[Trial, AnnIndex]] = []  # every trial within the latency budget, with its index

    def consider(a: AnnIndex, tr: Trial) -> None:
        nonlocal best
        if tr.p50_ms > cfg.latency_budget_ms:
            return
        within.append((tr, a))
        if best is None or (tr.recall, -tr.p50_ms) > (best[0], best[1]):
            best = (tr.recall, -tr.p50_ms, a, tr)

    goal = min(1.0, cfg.target + cfg.margin * (1.0 - cfg.target))  # what the tuning half must reach

    def tune_one(a: AnnIndex) -> AnnIndex | None:
        """Raise the knobs of ``a`` until the tuning recall holds or the budget breaks; the winner or None."""
        p = a.params
        t = p.index_type
        if t == "flat":
            tr = measure(a, "exact")
            consider(a, tr)
            return a if tr.p50_ms <= cfg.latency_budget_ms else None
        if t == "hnsw":
            ef = max(K, p.ef_search)
            while True:
                a = _with_params(a, dataclasses.replace(p, ef_search=ef), units, vec_ids, cfg)
                tr = measure(a)
                consider(a, tr)
                if tr.p50_ms > cfg.latency_budget_ms:
                    return None
                if tr.recall >= goal:
                    return a
                if ef >= cfg.max_ef:
                    return None
                ef = min(cfg.max_ef, ef * 2)
        # ivf / ivfpq: start at the nprobe the cell ranks predict, then raise
        cap = _nprobe_cap(a, cfg, gpu)
        gpu_capped = cap < _frac_cap(a, cfg)
        with timer:
            pred = _nprobe_for(a, _gather(units, gt_tune_rows), q_tune, gt_tune_rows, goal)
        nprobe = int(min(cap, max(1, pred)))
        rescore = p.rescore
        while True:
            a = _with_params(a, dataclasses.replace(p, nprobe=nprobe, rescore=rescore), units, vec_ids, cfg)
            note = f"(cell ranks predict nprobe {pred})" if nprobe == min(cap, pred) else ""
            if gpu_capped and pred > cap:
                note += f" (GPU nprobe limit {cap})"
            tr = measure(a, note.strip())
            consider(a, tr)
            if tr.p50_ms > cfg.latency_budget_ms:
                return None
            if tr.recall >= goal:
                return a
            if t == "ivfpq" and rescore < cfg.max_rescore:
                rescore *= 2  # the PQ shortlist missed items of probed cells: widen it first
                continue
            if nprobe >= cap:
                return None
            nprobe = int(min(cap, math.ceil(nprobe * 1.5)))

    total_build = build_s
    builds: list[dict[str, Any]] = [{"index_type": ann.params.index_type, "seconds": build_s, "given": True}] \
        if ann is not None else []
    chosen: AnnIndex | None = None
    chosen_tr: Trial | None = None
    queue: list[AnnIndex | str] = ([ann] if ann is not None else []) + ladder
    for item in queue:
        if isinstance(item, AnnIndex):
            a = item
        else:
            t0 = time.perf_counter()
            a = _build(item, units, ids, cfg, gpu)
            total_build += time.perf_counter() - t0
            builds.append({"index_type": item, "seconds": time.perf_counter() - t0})
            if progress:
                print(f"  built {item} in {time.perf_counter() - t0:.1f} s", flush=True)
        n_before = len(within)
        chosen = tune_one(a)
        chosen_tr = trials[-1] if chosen is not None else None
        if chosen is not None:
            # confirm on the held-out queries; one more step up if the tuning half was lucky
            with timer:
                _, got = chosen.search(q_hold, K)
                r_hold = recall_of_topk(got, gt_hold)
            if r_hold >= cfg.target:
                break
            log.info("held-out recall %.4f < %.4f for %s; trying the next setting", r_hold, cfg.target,
                     describe_params(chosen.params))
            chosen = _step_up(chosen, cfg, units, vec_ids, gpu)
            if chosen is not None:
                chosen_tr = measure(chosen, "(held-out check failed: stepped up)")
                consider(chosen, chosen_tr)
                if chosen_tr.p50_ms <= cfg.latency_budget_ms:
                    with timer:
                        _, got = chosen.search(q_hold, K)
                        r_hold = recall_of_topk(got, gt_hold)
                    if r_hold >= cfg.target:
                        break
            chosen = None
        # the aim was out of reach within the budget: keep this type's best setting if it meets the target
        mine = within[n_before:]
        if mine:
            tr, cand = max(mine, key=lambda tc: (tc[0].recall, -tc[0].p50_ms))
            with timer:
                _, got = cand.search(q_hold, K)
                r_hold = recall_of_topk(got, gt_hold)
            if tr.recall >= cfg.target and r_hold >= cfg.target:
                chosen, chosen_tr = cand, tr
                break
    met = chosen is not None
    if not met:
        if best is None:  # nothing within the latency budget at all: report the fastest trial
            fastest = min(trials, key=lambda t: t.p50_ms)
            final_ann, final_tr = None, fastest
        else:
            final_ann, final_tr = best[2], best[3]
    else:
        final_ann, final_tr = chosen, chosen_tr
    if final_ann is not None:
        with timer:
            _, got = final_ann.search(q_hold, K)
            r_hold = recall_of_topk(got, gt_hold)
    else:
        r_hold = float("nan")
    knobs = describe_params(AnnParams.from_dict(final_tr.params))
    if met:
        msg = (f"recall@{K} of the exact top-{k} = {r_hold:.4f} >= {cfg.target} on {len(q_hold)} held-out "
               f"queries ({query_source}) with {final_tr.index_type} {knobs}, p50 {final_tr.p50_ms:.2f} ms "
               f"<= {cfg.latency_budget_ms} ms")
    else:
        tried = "; ".join(f"{t.index_type} {describe_params(AnnParams.from_dict(t.params))}: {t.recall:.4f} at "
                          f"{t.p50_ms:.2f} ms" for t in trials[-6:])
        msg = (f"recall target {cfg.target} (recall@{K} of the exact top-{k}) NOT met within p50 <= "
               f"{cfg.latency_budget_ms} ms: best within budget "
               + (f"{final_tr.index_type} {knobs} reached {final_tr.recall:.4f} (held-out {r_hold:.4f}) at "
                  f"{final_tr.p50_ms:.2f} ms" if best is not None else "none (every setting was slower)")
               + f". Last settings tried: {tried}. To change: raise the latency budget, lower the target, "
               f"raise K (candidates), allow another index type (tried {ladder}), or build on a GPU.")
    result = TuneResult(
        met=met, recall=r_hold, recall_tune=final_tr.recall, k=k, candidates=K, target=cfg.target,
        index_type=final_tr.index_type, params=final_tr.params, p50_ms=final_tr.p50_ms,
        latency_budget_ms=cfg.latency_budget_ms, query_source=query_source, n_tune_queries=len(q_tune),
        n_holdout_queries=len(q_hold), tuning_s=timer.total, build_s=total_build,
        device="cuda" if gpu else "cpu", message=msg, trials=trials, builds=builds,
    )
    log.info(msg)
    if not met and cfg.strict:
        raise RecallTargetError(result)
    return (final_ann if final_ann is not None else chosen), result  # type: ignore[return-value]


def _gather(units: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """units[rows] for rows (q, k) (-1 -> row 0), sorted reads (memmap friendly): (q * k, d) float32."""
    flat = np.clip(rows.reshape(-1), 0, units.shape[0] - 1)
    uniq, inv = np.unique(flat, return_inverse=True)
    return np.ascontiguousarray(np.asarray(units[uniq], dtype=np.float32)[inv])


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


def _build(kind: str, units: np.ndarray, ids: np.ndarray, cfg: TuneConfig, gpu: bool) -> AnnIndex:
    n = units.shape[0]
    nlist = int(cfg.nlist or default_nlist(n))
    if kind == "flat":
        p = AnnParams("flat")
    elif kind == "hnsw":
        p = AnnParams("hnsw", ef_search=max(cfg.candidates, 128))
    elif kind == "ivf":  # on the GPU: a flat quantiser, and a first nprobe within faiss's GPU limit
        p = AnnParams("ivf", nlist=nlist, train_per_cell=cfg.train_per_cell, coarse="flat" if gpu else "auto",
                      nprobe=min(default_nprobe(min(nlist, n)), _ann.GPU_MAX_K) if gpu else None)
    elif kind in ("ivfpq", "ivfpq-fs"):
        p = AnnParams("ivfpq", nlist=nlist, train_per_cell=cfg.train_per_cell, fastscan=kind == "ivfpq-fs",
                      rescore=4)
    else:
        raise ValueError(f"unknown index type {kind!r} in the tuning ladder (known: flat, ivf, hnsw, ivfpq, "
                         "ivfpq-fs)")
    p = AnnParams.from_dict({**p.to_dict(), "nlist": nlist if p.index_type in ("ivf", "ivfpq") else None})
    if p.index_type in ("ivf", "ivfpq"):
        p = dataclasses.replace(p, coarse=coarse_kind(p, min(nlist, n)))
    index = build_index(units, ids, p, use_gpu=gpu if p.index_type in ("flat", "ivf") else False)
    if p.index_type == "ivfpq":
        a = AnnIndex(index, p, units, vector_ids=None if np.array_equal(ids, np.arange(n)) else ids,
                     use_gpu=False)
    else:
        a = AnnIndex(index, p, use_gpu=gpu if p.index_type in ("flat", "ivf") else False)
    return a


def _with_params(a: AnnIndex, p: AnnParams, units: np.ndarray, vec_ids: np.ndarray | None,
                 cfg: TuneConfig) -> AnnIndex:
    """The same faiss index under other query-time knobs (ivfpq re-scores from ``units``)."""
    if p.index_type == "ivfpq":
        return AnnIndex(a.cpu_index, p, units, vector_ids=vec_ids, use_gpu=False)
    if p.index_type == "hnsw":
        return AnnIndex(a.cpu_index, p, use_gpu=False)
    return AnnIndex(a.cpu_index, p, use_gpu=cfg.use_gpu)


def _nprobe_cap(a: AnnIndex, cfg: TuneConfig, gpu: bool) -> int:
    """The largest nprobe tried for ``a``: ``max_nprobe_frac`` of its cells, and at most GPU_MAX_K when ``a`` is
    (or, tuning on a GPU, would be) an IVF-Flat index searched on the GPU: faiss's GPU IVF throws above it, and
    ``gare_index.ann.gpu_plan`` keeps such an index on the CPU (or refuses it), so a larger nprobe would not be
    what the GPU serves."""
    cap = _frac_cap(a, cfg)
    if a.on_gpu or (gpu and a.params.index_type == "ivf"):
        return min(cap, _ann.GPU_MAX_K)
    return cap


def _frac_cap(a: AnnIndex, cfg: TuneConfig) -> int:
    return max(1, int(cfg.max_nprobe_frac * int(faiss.downcast_index(a.cpu_index).nlist)))


def _step_up(a: AnnIndex, cfg: TuneConfig, units: np.ndarray, vec_ids: np.ndarray | None,
             gpu: bool = False) -> AnnIndex | None:
    p = a.params
    if p.index_type == "hnsw":
        if p.ef_search >= cfg.max_ef:
            return None
        pp = dataclasses.replace(p, ef_search=min(cfg.max_ef, p.ef_search * 2))
        return AnnIndex(a.cpu_index, pp, use_gpu=False)
    if p.index_type in ("ivf", "ivfpq"):
        cap = _nprobe_cap(a, cfg, gpu)
        if (p.nprobe or 0) >= cap:
            return None
        pp = dataclasses.replace(p, nprobe=int(min(cap, math.ceil((p.nprobe or 1) * 1.5))))
        return _with_params(a, pp, units, vec_ids, cfg)
    return None


# ---------------------------------------------------------------------------------------------- coverage
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
) -> CoverageResult:
    """Share of the exhaustive ``scorer`` top-``top`` found inside the ANN top-K, for each K in ``ks``.

    ``scorer(q (b, d), ids (m,)) -> (b, m)`` scores the queries against gallery ids exactly as the exhaustive
    ranking does (the folded psi with biases; :func:`cosine_scorer` for the dual tower); it is called on
    ``gallery_ids`` in blocks of ``block`` ids and ``query_batch`` queries.  Ties at the top-``top`` boundary
    are broken by the lower position in ``gallery_ids``.  With ``target`` the result's ``chosen_K`` is
    :func:`choose_candidates`."""
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive, got {ks}")
    gallery_ids = np.asarray(gallery_ids, dtype=np.int64)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    nq, n = q.shape[0], gallery_ids.shape[0]
    top = min(top, n)
    truth = np.empty((nq, top), dtype=np.int64)
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
        truth[s:e] = gallery_ids[best_p]
    kmax = min(ks[-1], max(1, ann.ntotal))
    _, got = ann.search(q, kmax)
    cov = {k: recall_of_topk(got[:, : min(k, kmax)], truth) for k in ks}
    res = CoverageResult(cov, top, nq, query_source)
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
