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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from gare_build.tuning.ladder import (
    TuneConfig,
    auto_ladder,
    build_candidate,
    ceiling_nprobe_cap,
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

__all__ = ["OUTCOMES", "Trial", "TuneResult", "RecallTargetError", "tune_ann"]


@dataclass
class Trial:
    """One measured setting (on the tuning queries)."""

    index_type: str
    params: dict[str, Any]
    recall: float  # the lowest recall of the sample's parts (the only part's without parts)
    p50_ms: float
    note: str = ""
    parts: dict[str, float] = field(default_factory=dict)  # part -> recall on its tuning queries (mixed samples)


OUTCOMES = ("within-budget", "above-budget", "not-met")


@dataclass
class TuneResult:
    met: bool
    recall: float  # recall@K of the exact top-k on the held-out queries (the lowest of the parts' recalls)
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
    latency_ceiling_ms: float = 0.0  # the hard p50 limit of recall first (<= the budget: recall first was off)
    # within-budget: the target met within the latency budget; above-budget: not reachable within it, met by
    # raising the effort below the ceiling; not-met: reachable below neither
    outcome: str = "within-budget"
    recall_parts: dict[str, float] = field(default_factory=dict)  # part -> held-out recall (mixed samples)
    # outside "within-budget": the best setting within the budget ({"setting", "recall_tune", "recall",
    # "p50_ms"}; None when none was within it), so a report shows what the budget would have kept
    budget_best: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RecallTargetError(RuntimeError):
    """The target could not be met (within the budget, nor below the ceiling); ``result`` holds the best reached."""

    def __init__(self, result: TuneResult) -> None:
        super().__init__(result.message)
        self.result = result


def _split(m: int, labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(tuning rows, held-out rows) of m sample queries: a seeded permutation, each part halved (the first half of
    a part's rows in permutation order tunes). One part: the permutation's first m // 2 rows tune."""
    perm = np.random.default_rng(seed + 1).permutation(m)
    in_tune = np.zeros(m, dtype=bool)
    for lab in np.unique(labels):
        members = perm[labels[perm] == lab]
        if members.size < 2:
            raise ValueError(f"sample part {lab!r} has {members.size} query; each part needs >= 2 (half tune, "
                             "half held out)")
        in_tune[members[: members.size // 2]] = True
    return perm[in_tune[perm]], perm[~in_tune[perm]]


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
    parts: np.ndarray | None = None,
    builder: Callable[..., tuple[AnnIndex, str | None]] = build_candidate,
) -> tuple[AnnIndex, TuneResult]:
    """Choose and tune stage 1 over ``units`` (n, d) unit float32 rows (a memmap is fine).

    ``queries``: sample queries (m, d) with ``query_source`` naming them (see :func:`sample_queries`);
    None: perturbed gallery vectors.  ``parts`` (m,): a label per query (a mixed sample,
    :func:`gare_build.tuning.queries.build_sample`): each part is halved into tuning and held-out queries, and
    a setting's recall is the lowest of its parts' recalls.  ``ids``: the index ids of the rows (default
    ``arange(n)``). ``ann``: an index already built over these rows (its ``build_s`` seconds): its knobs are tuned
    first, and it is kept if it meets the target; otherwise the ladder ``config.index_types`` /
    :func:`auto_ladder` is built and tuned in order, each rung by ``builder`` (:func:`build_candidate`'s
    arguments and result; a benchmark passes one that keeps the indexes it built for its own measurements).

    Recall first: when no setting meets the target within ``latency_budget_ms``, every index tried is raised
    further (and, on the auto ladder, exact flat search is tried last) up to ``latency_ceiling_ms``; the fastest
    setting meeting the target there is chosen (``outcome`` "above-budget").  Returns (the chosen AnnIndex with
    its tuned params, TuneResult).  Raises RecallTargetError (``strict``) when nothing meets the target below
    the ceiling; with ``strict=False`` it returns the highest-recall setting below the ceiling (within the budget
    when recall first is off) and ``met=False`` instead, or (None, result) when no setting was that fast."""
    cfg = config or TuneConfig()
    n, d = units.shape
    if n == 0:
        raise ValueError("cannot tune an ANN over an empty gallery")
    ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if ids.shape != (n,):
        raise ValueError(f"ids must be ({n},), got {ids.shape}")
    if queries is None:
        queries, query_source = sample_queries(units, n=cfg.n_queries, noise=cfg.perturb_noise, seed=cfg.seed)
        parts = None
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if queries.ndim != 2 or queries.shape[1] != d or queries.shape[0] < 2:
        raise ValueError(f"queries must be (m >= 2, {d}), got {queries.shape}")
    if parts is not None:
        parts = np.asarray(parts).astype(str)
        if parts.shape != (queries.shape[0],):
            raise ValueError(f"parts must be ({queries.shape[0]},), one label per query, got {parts.shape}")
    query_source = query_source or f"caller ({queries.shape[0]} queries)"
    rows = pick_rows(queries.shape[0], cfg.n_queries, cfg.seed)
    if rows is not None:
        queries = queries[rows]
        parts = None if parts is None else parts[rows]
    labels = np.full(queries.shape[0], "sample") if parts is None else parts
    names = None if parts is None else sorted(set(parts.tolist()))
    tune_rows, hold_rows = _split(queries.shape[0], labels, cfg.seed)
    q_tune, q_hold = queries[tune_rows], queries[hold_rows]
    lab_tune, lab_hold = labels[tune_rows], labels[hold_rows]
    K = min(cfg.candidates, n)
    k = min(cfg.k, n)
    gpu = bool(cfg.use_gpu is not False and gpu_available(cfg.use_gpu))
    budget = cfg.latency_budget_ms
    ceiling = max(budget, cfg.latency_ceiling_ms)
    timer = Timer()
    with timer:  # ground truth, in index ids
        _, gt_rows = exact_topk(units, queries, k)
        gt_all = np.where(gt_rows >= 0, ids[np.clip(gt_rows, 0, n - 1)], -1)
        gt_tune, gt_hold = gt_all[tune_rows], gt_all[hold_rows]
        gt_tune_rows = gt_rows[tune_rows]
    vec_ids = None if np.array_equal(ids, np.arange(n)) else ids  # ivfpq re-scoring: id -> row of units
    trials: list[Trial] = []
    ladder = list(cfg.index_types or auto_ladder(n, gpu=gpu))

    def recall_parts(got: np.ndarray, gt: np.ndarray, lab: np.ndarray) -> tuple[float, dict[str, float]]:
        """(the lowest part's recall, {part: recall}; {} without parts)."""
        if names is None:
            return recall_of_topk(got, gt), {}
        each = {nm: recall_of_topk(got[lab == nm], gt[lab == nm]) for nm in names}
        return min(each.values()), each

    def fresh(a: AnnIndex) -> AnnIndex:
        """``a`` with its knobs set on the faiss index again: the settings of one index share it, and building
        an AnnIndex applies its knobs to it, so an earlier setting searched later must be re-applied."""
        return with_params(a, a.params, units, vec_ids, cfg)

    def held_out(a: AnnIndex) -> tuple[float, dict[str, float]]:
        a = fresh(a)
        with timer:
            _, got = a.search(q_hold, K)
            return recall_parts(got, gt_hold, lab_hold)

    def measure(a: AnnIndex, note: str = "") -> Trial:
        with timer:
            _, got = a.search(q_tune, K)
            r, each = recall_parts(got, gt_tune, lab_tune)
            p50 = p50_ms(a, q_tune, K, cfg.latency_queries, gpu)
        tr = Trial(a.params.index_type, a.params.to_dict(), r, p50, note, each)
        trials.append(tr)
        shown = "" if not each else " (" + ", ".join(f"{nm} {v:.4f}" for nm, v in each.items()) + ")"
        log.info("tune %s %s: recall@%d of top-%d %.4f%s, p50 %.2f ms %s", tr.index_type,
                 describe_params(a.params), K, k, r, shown, p50, note)
        if progress:
            print(f"  tune {tr.index_type} {describe_params(a.params)}: recall {r:.4f}{shown}, p50 {p50:.2f} ms {note}",
                  flush=True)
        return tr

    goal = min(1.0, cfg.target + cfg.margin * (1.0 - cfg.target))  # what the tuning half must reach
    # every trial with its index, in order: (trial, ann, past_budget)
    tried: list[tuple[Trial, AnnIndex]] = []

    def tune_one(a: AnnIndex, limit: float, past_budget: bool) -> AnnIndex | None:
        """Raise the knobs of ``a`` until the tuning recall holds the aim or p50 passes ``limit``; the winner or
        None. ``past_budget`` (recall first): the knobs start at ``a``'s and go up to the ceiling caps."""
        p = a.params
        t = p.index_type

        def run(b: AnnIndex, note: str = "") -> Trial:
            tr = measure(b, note + (" (recall first)" if past_budget else ""))
            tried.append((tr, b))
            return tr

        if t == "flat":
            tr = run(a, "exact")
            return a if tr.p50_ms <= limit else None
        if t == "hnsw":
            # double efSearch until the aim holds; when a doubling breaks the limit, bisect between the last
            # efSearch within it and that one (a setting between may reach the target within the limit)
            top = max(cfg.max_ef, cfg.ceiling_max_ef) if past_budget else cfg.max_ef
            ef, lo, hi = (p.ef_search if past_budget else max(K, p.ef_search)), None, None
            while True:
                a = with_params(a, dataclasses.replace(p, ef_search=ef), units, vec_ids, cfg)
                tr = run(a, "(bisecting)" if hi is not None else "")
                if tr.p50_ms > limit:
                    hi = ef
                elif tr.recall >= goal:
                    return a
                else:
                    lo = ef
                if hi is None:
                    if ef >= top:
                        return None
                    ef = min(top, ef * 2)
                    continue
                if lo is None or hi - lo <= max(8, lo // 8):
                    return None
                ef = (lo + hi) // 2
        # ivf / ivfpq: start at the nprobe the cell ranks predict (recall first: where the budget stopped), then raise
        cap = ceiling_nprobe_cap(a, cfg, gpu) if past_budget else nprobe_cap(a, cfg, gpu)
        gpu_capped = cap < (int(faiss.extract_index_ivf(a.cpu_index).nlist) if past_budget else frac_cap(a, cfg))
        if past_budget:
            pred = int(p.nprobe or 1)
        else:
            with timer:
                pred = predict_nprobe(a, _gather(units, gt_tune_rows), q_tune, gt_tune_rows, goal)
        nprobe = int(min(cap, max(1, pred)))
        rescore = p.rescore
        within = False  # a setting of this climb was within the limit
        while True:
            a = with_params(a, dataclasses.replace(p, nprobe=nprobe, rescore=rescore), units, vec_ids, cfg)
            note = "" if past_budget else (f"(cell ranks predict nprobe {pred})" if nprobe == min(cap, pred) else "")
            if gpu_capped and pred > cap:
                note += f" (GPU nprobe limit {cap})"
            tr = run(a, note.strip())
            if tr.p50_ms > limit:
                if not within and nprobe > 1:  # the start is too slow: halve it until one is within the limit
                    nprobe //= 2  # (the best recall within it is then known, and reported when nothing meets the target)
                    continue
                return None
            within = True
            if tr.recall >= goal:
                return a
            if t == "ivfpq" and rescore < cfg.max_rescore:
                rescore *= 2  # the PQ shortlist missed items of probed cells: widen it first
                continue
            if nprobe >= cap:
                return None
            nprobe = int(min(cap, math.ceil(nprobe * 1.5)))

    def settle(a: AnnIndex, limit: float, past_budget: bool) -> tuple[AnnIndex, Trial] | None:
        """Tune ``a`` up to ``limit`` and confirm on the held-out queries: (the setting, its trial) meeting the
        target there, or None."""
        n_before = len(tried)
        chosen = tune_one(a, limit, past_budget)
        if chosen is not None:
            chosen_tr = tried[-1][0]
            # confirm on the held-out queries; one more step up if the tuning half was lucky
            if held_out(chosen)[0] >= cfg.target:
                return chosen, chosen_tr
            log.info("held-out recall < %.4f for %s; trying the next setting", cfg.target, describe_params(chosen.params))
            chosen = step_up(chosen, cfg, units, vec_ids, gpu, past_budget=past_budget)
            if chosen is not None:
                chosen_tr = measure(chosen, "(held-out check failed: stepped up)")
                tried.append((chosen_tr, chosen))
                if chosen_tr.p50_ms <= limit and held_out(chosen)[0] >= cfg.target:
                    return chosen, chosen_tr
        # the aim was out of reach within the limit: keep this index's best setting if it meets the target
        mine = [(tr, b) for tr, b in tried[n_before:] if tr.p50_ms <= limit]
        if mine:
            tr, cand = max(mine, key=lambda tc: (tc[0].recall, -tc[0].p50_ms))
            if tr.recall >= cfg.target and held_out(cand)[0] >= cfg.target:
                return cand, tr
        return None

    total_build = build_s
    builds: list[dict[str, Any]] = [{"index_type": ann.params.index_type, "seconds": build_s, "given": True}] \
        if ann is not None else []

    def build(kind: str, built: list[AnnIndex]) -> AnnIndex:
        nonlocal total_build
        t0 = time.perf_counter()
        a, lent = builder(kind, units, ids, cfg, gpu, built=built)
        total_build += time.perf_counter() - t0
        builds.append({"index_type": kind, "seconds": time.perf_counter() - t0, "coarse_from": lent})
        if progress:
            print(f"  built {kind} in {time.perf_counter() - t0:.1f} s", flush=True)
        return a

    won: tuple[AnnIndex, Trial] | None = None
    queue: list[AnnIndex | str] = ([ann] if ann is not None else []) + ladder
    candidates: list[AnnIndex] = []  # every index tried, in order (later IVF builds reuse a trained quantiser)
    for item in queue:
        if isinstance(item, AnnIndex):
            a = item
        elif ann is not None and same_rung(ann, rung_params(item, n, cfg, gpu)):
            continue  # the given index is this rung: its knobs were tuned already
        else:
            a = build(item, candidates)
        candidates.append(a)
        won = settle(a, budget, False)
        if won is not None:
            break
    outcome = "within-budget" if won is not None else "not-met"
    in_budget = [(tr, b) for tr, b in tried if tr.p50_ms <= budget]
    budget_best = max(in_budget, key=lambda tc: (tc[0].recall, -tc[0].p50_ms)) if in_budget else None
    if won is None and ceiling > budget:
        # recall first: raise every index tried past the budget (from its highest setting), keep the fastest
        # that meets the target (a flat index of the ladder competes: on a small gallery an exact scan can be
        # cheaper than a deep graph search); exact flat search built last, when nothing else does (auto ladder)
        log.info("recall target %s not met within p50 <= %s ms: raising the search effort up to %s ms", cfg.target,
                 budget, ceiling)
        found: list[tuple[AnnIndex, Trial]] = []
        for cand in candidates:
            mine = [b for tr, b in tried if b.cpu_index is cand.cpu_index]
            start = max(mine, key=lambda b: (b.params.ef_search or 0, b.params.nprobe or 0, b.params.rescore or 0),
                        default=cand)
            limit = min([ceiling] + [tr.p50_ms for _, tr in found])  # slower than a found one cannot win
            got = settle(start, limit, True)
            if got is not None:
                found.append(got)
        if not found and cfg.index_types is None and not any(c.params.index_type == "flat" for c in candidates):
            flat = build("flat", candidates)
            candidates.append(flat)
            got = settle(flat, ceiling, True)
            if got is not None:
                found.append(got)
        if found:
            won = min(found, key=lambda at: at[1].p50_ms)
            outcome = "above-budget"
    met = won is not None
    if met:
        final_ann, final_tr = won
    else:
        limit = ceiling if ceiling > budget else budget
        pool = [(tr, b) for tr, b in tried if tr.p50_ms <= limit]
        if pool:
            final_tr, final_ann = max(pool, key=lambda tc: (tc[0].recall, -tc[0].p50_ms))
        else:  # nothing that fast at all: report the fastest trial
            final_tr, final_ann = min(trials, key=lambda t: t.p50_ms), None
    budget_record = None if outcome == "within-budget" or budget_best is None else {
        "setting": f"{budget_best[0].index_type} {describe_params(budget_best[1].params)}",
        "recall_tune": budget_best[0].recall, "recall": held_out(budget_best[1])[0], "p50_ms": budget_best[0].p50_ms}
    if final_ann is not None:  # (last: the knobs of the index it returns are its own)
        final_ann = fresh(final_ann)
        r_hold, hold_parts = held_out(final_ann)
    else:
        r_hold, hold_parts = float("nan"), {}
    knobs = describe_params(AnnParams.from_dict(final_tr.params))
    shown = "" if not hold_parts else " (lowest of the parts' held-out recalls: " + ", ".join(
        f"{nm} {v:.4f}" for nm, v in hold_parts.items()) + ")"
    within = ("none (every setting was slower)" if budget_best is None else
              f"{budget_best[0].index_type} {describe_params(budget_best[1].params)} reached "
              f"{budget_best[0].recall:.4f} at {budget_best[0].p50_ms:.2f} ms")
    if outcome == "within-budget":
        msg = (f"recall@{K} of the exact top-{k} = {r_hold:.4f} >= {cfg.target} on {len(q_hold)} held-out "
               f"queries ({query_source}) with {final_tr.index_type} {knobs}, p50 {final_tr.p50_ms:.2f} ms "
               f"<= {budget} ms{shown}")
    elif outcome == "above-budget":
        msg = (f"recall target {cfg.target} (recall@{K} of the exact top-{k}) not reachable within p50 <= {budget} ms "
               f"(best within it: {within}); recall first: the search effort was raised to {final_tr.index_type} "
               f"{knobs}: recall {r_hold:.4f} >= {cfg.target} on {len(q_hold)} held-out queries ({query_source}) at "
               f"p50 {final_tr.p50_ms:.2f} ms, above the budget and below the latency ceiling {ceiling} ms{shown}")
    else:
        last = "; ".join(f"{t.index_type} {describe_params(AnnParams.from_dict(t.params))}: {t.recall:.4f} at "
                         f"{t.p50_ms:.2f} ms" for t in trials[-6:])
        where = f"p50 <= {budget} ms" + (f" nor below the latency ceiling {ceiling} ms" if ceiling > budget else "")
        reached = (f"{final_tr.index_type} {knobs} reached {final_tr.recall:.4f} (held-out {r_hold:.4f}) at "
                   f"{final_tr.p50_ms:.2f} ms{shown}" if final_ann is not None else "none (every setting was slower)")
        msg = (f"recall target {cfg.target} (recall@{K} of the exact top-{k}) NOT met within {where}: best "
               + (f"below the ceiling {reached}; best within the budget {within}" if ceiling > budget
                  else f"within budget {reached}")
               + f". Last settings tried: {last}. To change: raise the latency budget or the latency ceiling, lower "
               f"the target, raise K (candidates), allow another index type (tried {ladder}), or build on a GPU.")
    result = TuneResult(
        met=met, recall=r_hold, recall_tune=final_tr.recall, k=k, candidates=K, target=cfg.target,
        index_type=final_tr.index_type, params=final_tr.params, p50_ms=final_tr.p50_ms,
        latency_budget_ms=budget, query_source=query_source, n_tune_queries=len(q_tune),
        n_holdout_queries=len(q_hold), tuning_s=timer.total, build_s=total_build,
        device="cuda" if gpu else "cpu", message=msg, trials=trials, builds=builds,
        latency_ceiling_ms=cfg.latency_ceiling_ms, outcome=outcome, recall_parts=hold_parts,
        budget_best=budget_record,
    )
    if outcome == "above-budget":
        log.warning(msg)
    else:
        log.info(msg)
    if not met and cfg.strict:
        raise RecallTargetError(result)
    return final_ann, result  # type: ignore[return-value]


def _gather(units: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """units[rows] for rows (q, k) (-1 -> row 0), sorted reads (memmap friendly): (q * k, d) float32."""
    flat = np.clip(rows.reshape(-1), 0, units.shape[0] - 1)
    uniq, inv = np.unique(flat, return_inverse=True)
    return np.ascontiguousarray(np.asarray(units[uniq], dtype=np.float32)[inv])
