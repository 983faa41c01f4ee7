"""The ANN recall tuner: meet a recall target within a latency budget (:func:`tune_ann`) and its result.

SPEC section 4: stage 1 hands the top-K videos by ``cos(t, v̄_j)`` to psi, so its quality is *recall@K of
the exact cosine top-k* (k = 10, K = the service's default ``candidates``, 256): the share of each
query's exact top-10 that the ANN's top-K contains.  :func:`tune_ann` builds (or takes) an ANN over the
unit gallery vectors, measures that recall on sample queries against exact search
(:mod:`gare_build.tuning.measure`), and raises the query-time knobs or moves to another index type along the
ladder (:mod:`gare_build.tuning.ladder`) until the target holds on *held-out* queries with a single-thread p50
latency within the budget.  When no candidate can, it stops with :class:`RecallTargetError` whose message says
what was reached and what to change (``strict=False`` returns the best result with ``met=False`` instead).

Queries (:func:`gare_build.tuning.queries.sample_queries`) are split into a tuning half (the knobs are chosen
on it) and a held-out half (the reported recall).  For IVF the first nprobe tried is read off the cell ranks
(:func:`gare_build.tuning.ladder.predict_nprobe`), then verified by real searches.

GPU: when faiss sees a GPU (a faiss-gpu build) and ``use_gpu`` is not False, the auto ladder is IVF-Flat
searched on the GPU (``gare_index.ann.build_index`` clones it), its nprobe capped by
:func:`gare_build.tuning.ladder.nprobe_cap`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gare_build.tuning.ladder import (
    TuneConfig,
    auto_ladder,
    build_candidate,
    describe_params,
    frac_cap,
    nprobe_cap,
    predict_nprobe,
    rung_params,
    same_rung,
    step_up,
    with_params,
)
from gare_build.tuning.measure import Timer, exact_topk, p50_ms, recall_of_topk
from gare_build.tuning.queries import pick_rows, sample_queries
from gare_index.ann import AnnIndex
from gare_index.ann_gpu import gpu_available
from gare_index.ann_params import AnnParams

log = logging.getLogger(__name__)

__all__ = ["Trial", "TuneResult", "RecallTargetError", "tune_ann"]


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
    rows = pick_rows(queries.shape[0], cfg.n_queries, cfg.seed)
    if rows is not None:
        queries = queries[rows]
    perm = np.random.default_rng(cfg.seed + 1).permutation(queries.shape[0])
    half = queries.shape[0] // 2
    q_tune, q_hold = queries[perm[:half]], queries[perm[half:]]
    K = min(cfg.candidates, n)
    k = min(cfg.k, n)
    gpu = bool(cfg.use_gpu is not False and gpu_available(cfg.use_gpu))
    timer = Timer()
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
            p50 = p50_ms(a, q_tune, K, cfg.latency_queries, gpu)
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
            # double efSearch until the aim holds; when a doubling breaks the budget, bisect between the last
            # efSearch within it and that one (a setting between may reach the target within the budget)
            ef, lo, hi = max(K, p.ef_search), None, None
            while True:
                a = with_params(a, dataclasses.replace(p, ef_search=ef), units, vec_ids, cfg)
                tr = measure(a, "(bisecting)" if hi is not None else "")
                consider(a, tr)
                if tr.p50_ms > cfg.latency_budget_ms:
                    hi = ef
                elif tr.recall >= goal:
                    return a
                else:
                    lo = ef
                if hi is None:
                    if ef >= cfg.max_ef:
                        return None
                    ef = min(cfg.max_ef, ef * 2)
                    continue
                if lo is None or hi - lo <= max(8, lo // 8):
                    return None
                ef = (lo + hi) // 2
        # ivf / ivfpq: start at the nprobe the cell ranks predict, then raise
        cap = nprobe_cap(a, cfg, gpu)
        gpu_capped = cap < frac_cap(a, cfg)
        with timer:
            pred = predict_nprobe(a, _gather(units, gt_tune_rows), q_tune, gt_tune_rows, goal)
        nprobe = int(min(cap, max(1, pred)))
        rescore = p.rescore
        while True:
            a = with_params(a, dataclasses.replace(p, nprobe=nprobe, rescore=rescore), units, vec_ids, cfg)
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
    candidates: list[AnnIndex] = []  # every index tried, in order (later IVF builds reuse a trained quantiser)
    for item in queue:
        if isinstance(item, AnnIndex):
            a = item
        elif ann is not None and same_rung(ann, rung_params(item, n, cfg, gpu)):
            continue  # the given index is this rung: its knobs were tuned already
        else:
            t0 = time.perf_counter()
            a, lent = build_candidate(item, units, ids, cfg, gpu, built=candidates)
            total_build += time.perf_counter() - t0
            builds.append({"index_type": item, "seconds": time.perf_counter() - t0, "coarse_from": lent})
            if progress:
                print(f"  built {item} in {time.perf_counter() - t0:.1f} s", flush=True)
        candidates.append(a)
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
            chosen = step_up(chosen, cfg, units, vec_ids, gpu)
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
