"""Stage-1 tuning of an index version: recall target, psi coverage and the default K.

One entry for ``gare-index build`` / ``add`` (after the ANN is built or grown) and ``gare-index tune`` (on an
existing version, nothing re-encoded; :mod:`gare_build.retune`): :func:`tune_version_ann`

1. samples queries (:mod:`gare_build.tuning.queries`: the checkpoint's NCL text queue when present, else
   caption embeddings of a manifest when given, mixed with ``Stage1Options.spread`` of queries spread over every
   cluster of the gallery (all of them spread without a caption source); or, with ``Stage1Options.bank``
   (``gare-index tune --from-bank``), the served queries of a query bank alone; the source is recorded);
2. meets the recall target (recall@K of the exact cosine top-10, K = the service's default candidates; on a
   mixed sample the lower of the two parts' recalls) within a latency budget with
   :func:`gare_build.tuning.recall.tune_ann`, or, recall first, past the budget up to the latency ceiling
   (``outcome`` records which; RecallTargetError, with the tuner's message, when it cannot below the ceiling);
3. measures, on the same queries, the share of the *exhaustive top-10 of the score served by default* (psi, +
   the NCL biases when the index's default adds them; each row at its served |t|) inside the ANN top-K and the
   exact stage-1 top-K for K up to 2048 (:mod:`gare_build.tuning.coverage`); raises the ANN's search effort until
   it holds what exact search holds, up to the coverage target, within the latency ceiling
   (:func:`raise_for_coverage`); and chooses the index's default K as the smallest K reaching the coverage target
   (99.5%), else the K of the best coverage, the stage then NOT met (:func:`choose_served_k`);
4. records SPEC §4's deviation figure on a sample (:func:`build_deviation`).

The result is the manifest's ``stage1`` entry (docs/index-format.md); the service uses its
``default_candidates`` when a request gives no ``candidates`` (:func:`gare_index.describe.index_default_candidates`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gare.deviation import delta_deviation, deviation_summary
from gare.model import autocast
from gare.psi import masked_mean
from gare_build.tuning.coverage import StoredConsts, ann_coverage, exact_coverage, psi_fold_scorer, psi_truth
from gare_build.tuning.ladder import TuneConfig, auto_ladder, describe_params, step_up, with_params
from gare_build.tuning.measure import p50_ms
from gare_build.tuning.queries import CAPTION_PART, SPREAD_SHARE, bank_queries, build_sample
from gare_build.tuning.recall import tune_ann
from gare_index.ann import AnnIndex
from gare_index.psi_consts import fold_of, fold_status

log = logging.getLogger(__name__)

# gare_train.evaluate.COVERAGE_KS (the offline figure) and the service's most candidates (max_candidates)
COVERAGE_KS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# plain captions whose embeddings give the text tower's typical |t| when neither a queue nor captions do
# (tower_norm): psi scores the sample's made rows at that norm
REFERENCE_CAPTIONS = (
    "a man is talking to the camera", "a woman is cooking in a kitchen", "people are dancing at a party",
    "a dog runs across a field", "a car drives down a city street", "a child plays with a ball",
    "a band plays music on a stage", "a person is typing on a laptop", "two men play basketball",
    "a cat sleeps on a couch", "a news anchor reads the news", "a girl sings a song",
    "waves crash on a beach", "a chef slices vegetables", "a crowd cheers at a football game",
    "a man rides a bicycle",
)
# query x video pairs the psi coverage scores by default: under two minutes on a 2-core CPU at the cost per pair
# bench/results/tune_cost.md measured. A larger gallery gets a seeded subsample of the sample queries (at least
# COVERAGE_MIN_QUERIES), so the step stays bounded where the build grows with n: all 1,000 queries up to 200k
# videos, 200 at 1M.
COVERAGE_PAIRS = 200_000_000
COVERAGE_MIN_QUERIES = 100

__all__ = ["Stage1Options", "COVERAGE_KS", "COVERAGE_PAIRS", "REFERENCE_CAPTIONS", "encode_captions", "tower_norm",
           "coverage_sample", "stored_consts", "choose_served_k", "raise_for_coverage", "tune_version_ann",
           "build_deviation"]


@dataclass
class Stage1Options:
    enabled: bool = True  # False (--no-tune): keep the built ANN and its knobs as they are, record nothing
    recall_target: float = 0.995  # recall@candidates of the exact cosine top-10
    candidates: int = 256  # K the recall target is measured at (the service's default candidates)
    latency_budget_ms: float = 5.0  # single-query p50 on one thread
    # recall first: past the budget, the tuner raises the search effort up to this p50 (TuneConfig.latency_ceiling_ms)
    latency_ceiling_ms: float = 100.0
    spread: float = SPREAD_SHARE  # share of the build's sample spread over the gallery's clusters (0: off)
    n_queries: int = 1000  # sample queries (half tune, half held out; all of them for the coverage)
    # the default K is the smallest K with this share of the psi top-10 (the best measured K when none has it, and
    # the stage is then not met)
    coverage_target: float = 0.995
    coverage_ks: tuple[int, ...] = COVERAGE_KS
    # queries the psi coverage scores against every video: None = all of the sample while queries x videos stays
    # within COVERAGE_PAIRS, else a seeded subsample (coverage_sample)
    coverage_queries: int | None = None
    seed: int = 0
    # served-query bank (gare_serve.engine.traffic_bank: float32 (n, d) .npy of served query embeddings): when given, its distinct
    # rows are the sample queries instead of the queue / captions / perturbed gallery (`gare-index tune --from-bank`)
    bank: str | os.PathLike | None = None

    def validate(self) -> None:
        if not 0.0 < self.recall_target <= 1.0:
            raise ValueError(f"--recall-target must be in (0, 1], got {self.recall_target}")
        if not self.latency_budget_ms > 0:
            raise ValueError(f"--latency-budget-ms must be > 0, got {self.latency_budget_ms}")
        if not self.latency_ceiling_ms > 0:
            raise ValueError(f"--latency-ceiling-ms must be > 0, got {self.latency_ceiling_ms}")
        if not 0.0 <= self.spread < 1.0:
            raise ValueError(f"--tune-spread must be in [0, 1), got {self.spread}")
        if not 0.0 < self.coverage_target <= 1.0:
            raise ValueError(f"coverage target must be in (0, 1], got {self.coverage_target}")
        if self.n_queries < 2:
            raise ValueError(f"--tune-queries must be >= 2, got {self.n_queries}")
        if self.coverage_queries is not None and self.coverage_queries < 1:
            raise ValueError(f"--coverage-queries must be >= 1, got {self.coverage_queries}")


def encode_captions(model: Any, texts: Sequence[str], *, batch: int = 256) -> np.ndarray:
    """Caption texts -> raw text embeddings t (a, d) float32, encoded as ``gare-train eval`` encodes its test
    captions (fp32, batches of 256), so both measure on the same vectors."""
    out = []
    with torch.inference_mode():
        for s in range(0, len(texts), batch):
            with autocast(model.device, "fp32"):
                out.append(model.encode_text(model.tokenize(list(texts[s : s + batch]))).float().cpu())
    if not out:
        return np.zeros((0, model.cfg.embed_dim), np.float32)
    return torch.cat(out).numpy().astype(np.float32)


def tower_norm(model: Any, queue: np.ndarray | None, captions: np.ndarray | None) -> tuple[float, str]:
    """(the text tower's mean |t|, where it comes from): the queue's raw rows, else the captions', else the tower's
    embeddings of REFERENCE_CAPTIONS. The sample rows that have no |t| of their own are scored at this norm."""
    for arr, what in ((queue, "the checkpoint's queue"), (captions, "the tuning captions")):
        if arr is not None and len(arr):
            return float(np.linalg.norm(np.asarray(arr, dtype=np.float32), axis=1).mean()), what
    t = encode_captions(model, list(REFERENCE_CAPTIONS))
    return float(np.linalg.norm(t, axis=1).mean()), f"{len(REFERENCE_CAPTIONS)} reference captions"


def choose_served_k(coverage: dict[int, float], target: float) -> tuple[int, bool]:
    """(the index's default K, whether it holds ``target`` of psi's top-10): the smallest K reaching the target;
    when none does, the smallest K with the best measured coverage (a larger K would cost time and find no more
    of psi's top-10 on the sample): results before milliseconds."""
    ks = sorted(coverage)
    met = [k for k in ks if coverage[k] >= target]
    if met:
        return met[0], True
    best = max(coverage[k] for k in ks)
    return next(k for k in ks if coverage[k] >= best), False


def raise_for_coverage(ann: AnnIndex, queries: np.ndarray, truth: np.ndarray, ks: Sequence[int],
                       exact: dict[int, float], target: float, cfg: TuneConfig, units: Any, ids: np.ndarray,
                       gpu: bool) -> tuple[AnnIndex, dict[int, float], dict[str, Any]]:
    """(the ANN, its coverage per K, the record): the ANN's search effort raised until it holds at K as much of
    psi's top-10 (``truth``) as the exact stage 1 does, up to ``target``.

    The recall tuning sets the effort for the cosine top-10 at the service's K; psi's top-10 reach deeper into the
    cosine ranking, and an ANN tuned for the first ranks loses them at large K (1M entries: 0.95 of psi's top-10 at
    K = 2048 where exact search holds 0.995). K is the smallest measured K at which the exact stage 1 reaches
    ``target``, else the largest; the goal is min(target, exact coverage at K), less half a hit. The effort goes up
    in :func:`gare_build.tuning.ladder.step_up`'s steps (efSearch x2, nprobe x1.5, up to the recall-first caps) while
    one query at K stays within the latency ceiling (the budget when the ceiling is off): results before
    milliseconds, within the ceiling the user set."""
    ks = sorted(ks)
    K = next((k for k in ks if exact[k] >= target), ks[-1])
    goal = min(target, exact[K]) - 0.5 / max(1, truth.size)
    limit = max(cfg.latency_budget_ms, cfg.latency_ceiling_ms)
    vec_ids = None if np.array_equal(ids, np.arange(len(ids))) else ids  # ivfpq re-scoring: id -> row of units
    # the settings of one index share its faiss object, and building one applies its knobs to it: apply ann's
    # before measuring it, and the kept setting's again at the end (a refused step leaves its own there)
    cur = with_params(ann, ann.params, units, vec_ids, cfg)
    cov = ann_coverage(cur, queries, truth, ks)
    rec: dict[str, Any] = {"K": K, "goal": round(min(target, exact[K]), 6), "from": describe_params(ann.params),
                           "steps": []}
    while cov[K] < goal:
        nxt = step_up(cur, cfg, units, vec_ids, gpu, past_budget=True)
        if nxt is None:
            rec["stopped"] = "the index's largest search effort"
            break
        p50 = p50_ms(nxt, queries, K, cfg.latency_queries, gpu)
        step = {"setting": describe_params(nxt.params), "p50_ms_at_K": round(p50, 4)}
        if p50 > limit:
            rec["steps"].append({**step, "refused": f"p50 above the latency limit {limit} ms"})
            rec["stopped"] = f"the latency limit {limit} ms"
            break
        cur, cov = nxt, ann_coverage(nxt, queries, truth, ks)
        rec["steps"].append({**step, f"coverage@{K}": round(cov[K], 6)})
    rec["raised"] = cur.params != ann.params
    rec["to"] = describe_params(cur.params)
    return with_params(cur, cur.params, units, vec_ids, cfg), cov, rec


def coverage_sample(n_queries: int, n_videos: int, requested: int | None = None, *, seed: int = 0) -> np.ndarray:
    """Which of the n_queries sample queries the psi coverage scores (sorted positions): ``requested`` of them (all
    when fewer), or with None all while n_queries x n_videos <= COVERAGE_PAIRS, else max(COVERAGE_MIN_QUERIES,
    COVERAGE_PAIRS // n_videos). A subsample is drawn without replacement, seeded."""
    if requested is not None:
        m = min(int(requested), n_queries)
    elif n_queries * max(n_videos, 1) <= COVERAGE_PAIRS:
        m = n_queries
    else:
        m = min(n_queries, max(COVERAGE_MIN_QUERIES, COVERAGE_PAIRS // max(n_videos, 1)))
    if m >= n_queries:
        return np.arange(n_queries)
    return np.sort(np.random.default_rng([seed, 29]).choice(n_queries, size=m, replace=False))


def stored_consts(version: Any, model: Any) -> StoredConsts | None:
    """An index version's psi constants for the coverage scorer when they are valid for model.psi, else None
    (the scorer then folds the frames itself)."""
    fold = fold_of(model)
    if fold_status(version, fold) is not None:
        return None
    return StoredConsts(version.psi_consts, version.units, version.norms, fold.fingerprint)


def tune_version_ann(
    units: np.ndarray,
    ids: np.ndarray,
    *,
    frames: np.ndarray,
    masks: np.ndarray,
    biases: np.ndarray,
    model: Any,
    queue: np.ndarray | None,
    captions: np.ndarray | None = None,
    ann: AnnIndex | None = None,
    build_s: float = 0.0,
    requested_type: str = "auto",
    options: Stage1Options | None = None,
    progress: bool = False,
    stored: StoredConsts | None = None,
) -> tuple[AnnIndex, dict[str, Any]]:
    """Tune stage 1 of a version and measure its psi coverage: (the AnnIndex to save, manifest["stage1"]).

    units (n, d): the stage-1 vectors (InvGC-corrected when the index has them), ids (n,) in row order; frames,
    masks, biases: the version's arrays (the exhaustive psi + b reference). ``queue``: the checkpoint's text
    queue rows, ``captions``: raw caption embeddings (:func:`encode_captions`) or None. ``ann``: the index
    just built or grown (tuned first, kept when it meets the target); ``requested_type`` other than "auto"
    keeps the tuner to that index type. ``stored``: the version's psi constants (:func:`stored_consts`), which the
    coverage then reads instead of folding every video again. Raises :class:`gare_build.tuning.recall.RecallTargetError` (its message says what
    was reached and what to change) when the target cannot be met within the latency budget."""
    opt = options or Stage1Options()
    opt.validate()
    n = units.shape[0]
    bank_info = None
    parts = None
    norm, norm_from = tower_norm(model, queue, captions)  # the |t| of rows without their own (made rows, old banks)
    if opt.bank is not None:  # served queries replace the build's sample
        unit_q, source, bank_info, raw = bank_queries(opt.bank, units.shape[1], n=opt.n_queries, seed=opt.seed,
                                                      norm=norm)
    else:
        unit_q, source, raw, parts = build_sample(units, queue, captions, n=opt.n_queries, seed=opt.seed,
                                                  spread=opt.spread, norm=norm)
    types = None
    if requested_type not in (None, "auto"):
        types = (requested_type,)
    elif ann is not None and ann.params.index_type not in auto_ladder(n):
        types = (ann.params.index_type,)
    cfg = TuneConfig(target=opt.recall_target, k=10, candidates=max(10, int(opt.candidates)),
                     latency_budget_ms=opt.latency_budget_ms, latency_ceiling_ms=opt.latency_ceiling_ms,
                     n_queries=max(opt.n_queries, unit_q.shape[0]), index_types=types, seed=opt.seed, strict=True)
    t0 = time.perf_counter()
    tuned, res = tune_ann(units, unit_q, ids=ids, query_source=source, config=cfg, ann=ann, build_s=build_s,
                          progress=progress, parts=parts)
    t1 = time.perf_counter()
    pick = coverage_sample(unit_q.shape[0], n, opt.coverage_queries, seed=opt.seed)
    cq, craw = unit_q[pick], raw[pick]
    scorer = psi_fold_scorer(model, frames, masks, biases, ids, cq, craw, stored=stored)
    ks = tuple(k for k in sorted(set(opt.coverage_ks)) if k >= 1)
    truth = psi_truth(cq, scorer, ids, top=10, block=4096, query_batch=max(1, cq.shape[0]), progress=progress)
    exact = exact_coverage(units, ids, cq, truth, ks)
    tuned, coverage, effort = raise_for_coverage(tuned, cq, truth, ks, exact, opt.coverage_target, cfg, units,
                                                 np.asarray(ids, dtype=np.int64), res.device == "cuda")
    t2 = time.perf_counter()
    # the deviation is a figure of real text queries: the caption part of a mixed sample
    deviation = build_deviation(model, raw if parts is None else raw[parts == CAPTION_PART], frames, masks,
                                seed=opt.seed)
    chosen, coverage_met = choose_served_k(coverage, opt.coverage_target)
    coverage_note = (f"psi coverage@{chosen} of the exact psi top-10 = {coverage[chosen]:.4f}"
                     f" {'>=' if coverage_met else '<'} {opt.coverage_target}"
                     + (f" (search effort raised from {effort['from']} to {effort['to']})" if effort["raised"] else ""))
    p50_k = p50_ms(tuned, cq, chosen, cfg.latency_queries, res.device == "cuda")
    if not coverage_met:
        log.warning("stage 1 NOT met: no measured K (up to %d) holds %.1f%% of the exhaustive psi top-10; the index's "
                    "default candidates is K = %d, the best measured (%s)", max(ks), 100 * opt.coverage_target, chosen,
                    coverage_note)
    with_b = bool(np.any(np.asarray(biases) != 0))
    entry = {
        "recall": res.recall,
        "recall_tune": res.recall_tune,
        "recall_target": res.target,
        "recall_k": res.k,
        "recall_at": res.candidates,
        # the stage's verdict: the ANN's recall target and psi's coverage at the default K (what users get)
        "met": bool(res.met and coverage_met),
        "recall_met": res.met,
        "coverage_met": coverage_met,
        "index_type": res.index_type,
        "params": tuned.params.to_dict(),  # the recall tuning's, or the effort raised for psi's coverage
        "setting": describe_params(tuned.params),
        "p50_ms": res.p50_ms,  # the recall tuning's setting at recall_at
        "p50_ms_default_k": round(p50_k, 4),  # the served setting, one query at the default K, one thread
        "latency_budget_ms": res.latency_budget_ms,
        "latency_ceiling_ms": res.latency_ceiling_ms,
        "outcome": res.outcome,
        **({"recall_parts": res.recall_parts} if res.recall_parts else {}),
        **({"budget_best": res.budget_best} if res.budget_best is not None else {}),
        "spread": opt.spread if opt.bank is None else 0.0,
        "device": res.device,
        "query_source": source,
        **({"query_bank": bank_info} if bank_info is not None else {}),
        "n_queries": int(unit_q.shape[0]),
        "n_tune_queries": res.n_tune_queries,
        "n_holdout_queries": res.n_holdout_queries,
        "coverage": {str(k): v for k, v in coverage.items()},
        "coverage_exact": {str(k): v for k, v in exact.items()},  # the exact stage 1's: no search effort passes it
        "coverage_effort": effort,
        "coverage_queries": int(pick.size),  # of the n_queries sample queries (coverage_sample)
        "coverage_top": int(truth.shape[1]),
        "coverage_target": opt.coverage_target,
        "coverage_scorer": ("exhaustive psi (the index's stored psi constants and frames)" if stored is not None else
                            "exhaustive psi (gare.psi_fold over the stored frames)")
                           + (" + the index's NCL biases" if with_b else ""),
        "coverage_norm": {"t": round(norm, 6), "from": norm_from,
                          "note": "psi scores each sample row at its served |t|; rows without one at this mean"},
        "default_candidates": chosen,
        "deviation": deviation,
        "tuning_s": round(t1 - t0, 3),
        "coverage_s": round(t2 - t1, 3),
        "build_s": round(res.build_s, 3),
        "message": f"{res.message}; {coverage_note}" + ("" if coverage_met else " (NOT met)"),
        "trials": [dataclasses.asdict(t) for t in res.trials],
    }
    log.info("stage 1: %s; psi coverage %s (exact stage 1: %s) -> default candidates %s", res.message,
             {k: round(v, 4) for k, v in coverage.items()}, {k: round(v, 4) for k, v in exact.items()}, chosen)
    return tuned, entry


def build_deviation(model: Any, raw_queries: np.ndarray, frames: Any, masks: Any, *, seed: int = 0,
                    n_queries: int = 64, n_videos: int = 256) -> dict[str, Any]:
    """SPEC §4's deviation figure (gare.deviation, the rebuttal's definition) on a sample: up to
    ``n_queries`` of the stage-1 sample queries (un-normalised) x up to ``n_videos`` indexed videos (seeded),
    v̄ as the model defines it (masked mean; all rows for reference_padding checkpoints)."""
    n = int(np.asarray(masks).shape[0])
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n, size=min(n, n_videos), replace=False))
    q = np.asarray(raw_queries, dtype=np.float32)
    q = q[np.sort(rng.choice(q.shape[0], size=min(q.shape[0], n_queries), replace=False))]
    dev = model.device
    fr = torch.from_numpy(np.asarray(frames[rows], dtype=np.float32)).to(dev)
    mk = torch.from_numpy(np.asarray(masks[rows]).astype(bool)).to(dev)
    vb = fr.mean(dim=1) if getattr(model.cfg, "reference_padding", False) else masked_mean(fr, mk)
    out = deviation_summary(delta_deviation(model, torch.from_numpy(q).to(dev), fr, mk, vb))
    out["note"] = "|cos(t+Δ, v̄) - cos(t, v̄)| (the rebuttal's figure) on the stage-1 sample queries x sampled videos"
    return out
