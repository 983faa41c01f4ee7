"""NCL video biases fitted to the served score (SPEC §5), for `gare-index build/add/remove/biases`.

The search ranks each query's stage-1 candidates by the psi score s_tj (SPEC §4), so the biases it adds must
normalise that score, not the dual-tower cosine. Computing psi for every (queue query, video) pair is
Q x N pairs; because γ is small only each query's top entries carry weight, so the index uses the sparse
form of :func:`gare.sinkhorn_sparse.sinkhorn_biases_sparse`: exact psi on each queue query's stage-1 top K
(the exact top K of the stage-1 vectors, i.e. what the ANN approximates) and the stage-1 cosine elsewhere
("dual" fill; "none" leaves the other entries out). With K >= N this is the dense, exact computation.

The psi scores come from a pair scorer (``(query idx, gallery rows) -> scores``): by default the exact fold
of psi (gare.psi_fold, equal to ``model.score`` to float32 rounding; the tests check it against a fused
reference); any exact psi implementation with that signature plugs in.

Queries: psi needs the un-normalised text embedding t (the gap v̄ - t and the pooling softmax(t·F / temp)
depend on |t|). The checkpoint's queue stores t as trained and a bank of served queries t as served; the unit
rows of banks written before the service kept |t| are scaled to a reference |t| (gare_build.ncl_queues.served_norms,
recorded as ``bank_scale`` in the manifest).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gare import psi_fold as pf
from gare import psi_fold_queries as pfq
from gare import psi_fold_videos as pfv
from gare import psi_fold_weights as pfw
from gare.sinkhorn_sparse import score_candidates, sinkhorn_biases_sparse, stage1_candidates

log = logging.getLogger(__name__)

BIAS_SCORES = ("served", "dual")  # the score the biases are fitted to: psi (what the search ranks by) or the cosine
DEFAULT_BIAS_SCORE = "served"
DEFAULT_BIAS_K = 256  # the service's default number of candidates
DEFAULT_BIAS_FILL = "dual"


def fold_pair_scorer(model: Any, queries: np.ndarray, frames: Any, masks: Any, units: Any, norms: Any,
                     *, consts: Any = None, chunk: int = 1024):
    """Pair scorer over index arrays: (query idx (P,), rows (P,)) -> psi scores (P,) float32 (CPU tensor),
    through the exact fold of psi (gare.psi_fold):
    the queue is folded once and a pair costs a few dot products instead of psi's d x d products.

    ``consts`` (n, W): the index's stored per-video constants (``psi_consts.npy``, a memmap is fine), which the
    caller has checked are valid for ``model.psi`` (``gare_index.psi_consts.fold_status``): each chunk's rows
    are then read. Without them each chunk's distinct rows are folded here (three d x d products per frame,
    with the served v̄ = norm * unit), again in every chunk that meets them: Q x K pairs over a large gallery
    fold each video many times, so the build passes the constants it has just computed. Pairs come in chunks
    of ``chunk``; in queue order (~4 queries of 256 candidates per chunk) each chunk is one product of its
    queries' vectors with its videos' frames."""
    dev = model.device
    fw = pfw.fold_weights(model.psi).to(dev)
    ref_pad = bool(getattr(model.cfg, "reference_padding", False))
    q_all = pfq.fold_queries(torch.as_tensor(np.asarray(queries, dtype=np.float32)).to(dev), fw, model.cfg.temp)
    if consts is not None:
        want = (int(np.asarray(norms).shape[0]), pfv.packed_width(int(frames.shape[1])))
        if tuple(consts.shape) != want:
            raise ValueError(f"psi constants have shape {tuple(consts.shape)}, expected {want}")

    def score(qi: np.ndarray, rows: np.ndarray):
        qi, rows = np.asarray(qi, dtype=np.int64).reshape(-1), np.asarray(rows, dtype=np.int64).reshape(-1)
        out = torch.empty(rows.shape[0], dtype=torch.float32)
        with torch.inference_mode():
            for s in range(0, rows.shape[0], chunk):
                r, qc = rows[s:s + chunk], qi[s:s + chunk]
                uniq, inv = np.unique(r, return_inverse=True)
                vb = np.asarray(units[uniq], dtype=np.float32) * np.asarray(norms[uniq], dtype=np.float32)[:, None]
                if consts is not None:  # stored frames (float16) and constants: nothing folded per chunk
                    v = pfv.VideoConstants(frames=torch.from_numpy(np.asarray(frames[uniq])).to(dev),
                                          packed=torch.from_numpy(np.asarray(consts[uniq], dtype=np.float32)).to(dev),
                                          fingerprint=fw.fingerprint, vbar=torch.from_numpy(vb).to(dev))
                else:
                    fr = torch.from_numpy(np.asarray(frames[uniq], dtype=np.float32)).to(dev)
                    mk = torch.from_numpy(np.asarray(masks[uniq]).astype(bool)).to(dev)
                    v = pfv.fold_videos(fr, mk, fw, vbar=torch.from_numpy(vb).to(dev), reference_padding=ref_pad)
                uq, qinv = np.unique(qc, return_inverse=True)
                if qc.size >= 8 * uq.size:
                    # queue order (each query's candidates together, as score_candidates passes them): every
                    # query of the chunk against the chunk's videos in one product (pf.pair_scores), then each
                    # pair's entry; cheaper than gathering the frames pair by pair
                    counts = np.bincount(qinv)
                    pos = np.empty_like(qinv)
                    pos[np.argsort(qinv, kind="stable")] = np.arange(qinv.size) - np.repeat(np.cumsum(counts) - counts, counts)
                    idx = np.zeros((uq.size, int(counts.max())), dtype=np.int64)
                    idx[qinv, pos] = inv
                    uq_t = torch.from_numpy(uq).to(dev)
                    qs = dataclasses.replace(q_all, u=q_all.u[uq_t], sc=q_all.sc[uq_t])
                    sc = pf.pair_scores(qs, v, torch.from_numpy(idx).to(dev))  # (queries, most candidates)
                    out[s:s + r.shape[0]] = sc[torch.from_numpy(qinv).to(dev), torch.from_numpy(pos).to(dev)].float().cpu()
                else:  # scattered pairs: one (query, video) at a time
                    q = torch.from_numpy(qc).to(dev)
                    qs = dataclasses.replace(q_all, u=q_all.u[q], sc=q_all.sc[q])
                    out[s:s + r.shape[0]] = pf.diagonal_scores(qs, v.select(torch.from_numpy(inv).to(dev))).float().cpu()
        return out

    return score


def served_biases(model: Any, queries: np.ndarray, gamma: float, *, units: Any, norms: Any, frames: Any, masks: Any,
                  stage1: Any | None = None, n_iters: int = 4, k: int = DEFAULT_BIAS_K, fill: str = DEFAULT_BIAS_FILL,
                  scorer: Any = None, device: Any = None, consts: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Video biases (n,) float32 fitted to the psi score of the queue ``queries`` (un-normalised t) and a description.

    ``stage1``: the stage-1 vectors (InvGC-corrected ones when the index has them; default ``units``): the
    candidates are their exact top ``k`` and the fill is their cosine, as the search's stage 1. ``consts``: the
    index's psi constants, valid for model.psi (see :func:`fold_pair_scorer`)."""
    n = int(np.asarray(norms).shape[0])
    t0 = time.time()
    q_raw = np.asarray(queries, dtype=np.float32)
    dev = torch.device(device) if device is not None else model.device
    qn = F.normalize(torch.from_numpy(q_raw), dim=-1)
    g = np.asarray(stage1 if stage1 is not None else units, dtype=np.float32)
    _, rows = stage1_candidates(qn, g, k)
    pair = scorer if scorer is not None else fold_pair_scorer(model, q_raw, frames, masks, units, norms, consts=consts)
    sc = score_candidates(pair, rows)
    _, b, sinfo = sinkhorn_biases_sparse(rows, sc, n, gamma, n_iters, fill=fill, queries=qn.to(dev),
                                         gallery=g, device=dev)
    seconds = time.time() - t0
    log.info("served-score NCL biases for %d videos against %d queries (K=%d, %s fill) in %.1fs", n, q_raw.shape[0],
             int(rows.shape[1]), fill, seconds)
    info = {"score": "served", "scorer": "psi", "form": "dense" if int(rows.shape[1]) >= n else "sparse",
            "k": int(k), "k_used": int(rows.shape[1]), "fill": fill, "n_uncovered": sinfo["n_uncovered"], "psi_pairs": sinfo["n_entries"],
            "seconds": round(seconds, 3)}
    return b.numpy().astype(np.float32), info




# ------------------------------------------------------------------ the per-index decision (biases on or off)
@dataclasses.dataclass(frozen=True)
class ValidationScores:
    """The served search's scores of the validation captions, computed once and ranked under any biases: the exact
    stage-1 candidates ``cand`` (a, K) rows, their psi scores ``psi`` (a, K) and ``hit`` (a, K), where the caption's
    true video is among them. A choice among several biases (one per gamma) scores the captions once."""

    cand: torch.Tensor
    psi: torch.Tensor
    hit: torch.Tensor

    def ranks(self, biases: np.ndarray | None, rows: np.ndarray | None = None) -> np.ndarray:
        """Ranks (1 = first) of each caption's true video under psi (+ b_j when ``biases`` is given); a true video
        outside the candidates ranks K + 1. ``rows``: only these captions (positions)."""
        cand, s, hit = self.cand, self.psi, self.hit
        if rows is not None:
            sel = torch.from_numpy(np.asarray(rows, dtype=np.int64))
            cand, s, hit = cand[sel], s[sel], hit[sel]
        if biases is not None:
            s = s + torch.from_numpy(np.asarray(biases, dtype=np.float32))[cand]
        true_s = torch.where(hit, s, torch.full_like(s, -math.inf)).max(dim=1).values  # (a,)
        # rank = 1 + candidates scored strictly higher (ties counted in the caption's favour, as gare.retrieval_metrics)
        rank = 1 + (s > true_s[:, None]).sum(dim=1)
        return torch.where(hit.any(dim=1), rank, torch.full_like(rank, cand.shape[1] + 1)).numpy()


def validation_scores(model: Any, queries: np.ndarray, true_rows: np.ndarray, *, units: Any, norms: Any, frames: Any,
                      masks: Any, stage1: Any | None = None, k: int = DEFAULT_BIAS_K,
                      consts: Any = None) -> ValidationScores:
    """The served search's scores of validation captions: stage 1 = the exact top ``k`` of the stage-1 vectors by
    cosine (what the ANN approximates), then the psi score of those candidates (the fold, as :func:`served_biases`).
    ``queries`` (a, d) raw t; ``true_rows`` (a,) gallery rows."""
    q_raw = np.asarray(queries, dtype=np.float32)
    rows_true = np.asarray(true_rows, dtype=np.int64).reshape(-1)
    if q_raw.shape[0] != rows_true.shape[0]:
        raise ValueError(f"{q_raw.shape[0]} validation captions but {rows_true.shape[0]} true videos")
    g = np.asarray(stage1 if stage1 is not None else units, dtype=np.float32)
    _, cand = stage1_candidates(F.normalize(torch.from_numpy(q_raw), dim=-1), g, k)  # (a, K) rows
    sc = score_candidates(fold_pair_scorer(model, q_raw, frames, masks, units, norms, consts=consts), cand)
    return ValidationScores(cand, sc, cand == torch.from_numpy(rows_true)[:, None])


def validation_ranks(model: Any, queries: np.ndarray, true_rows: np.ndarray, biases: np.ndarray, *, units: Any,
                     norms: Any, frames: Any, masks: Any, stage1: Any | None = None, k: int = DEFAULT_BIAS_K,
                     consts: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Ranks (1 = first) of each validation caption's true video under the served search with psi alone and with
    psi + biases (:func:`validation_scores`, ranked by :meth:`ValidationScores.ranks`)."""
    vs = validation_scores(model, queries, true_rows, units=units, norms=norms, frames=frames, masks=masks,
                           stage1=stage1, k=k, consts=consts)
    return vs.ranks(None), vs.ranks(biases)


def ncl_decision(ranks_psi: np.ndarray, ranks_biased: np.ndarray, validation: str) -> dict[str, Any]:
    """Whether the biases are on by default for an index, with the numbers and a sentence saying why.

    On only when the validation captions can tell: psi + biases keeps t2v R@1 and R@5 at least as high as psi
    alone, neither change's 95% interval reaches below 0, and at least one lies wholly above 0. A set that cannot
    tell (an interval that includes a loss, or both only [0, 0]) leaves them off: the biases trade some videos for
    others, and the default must not rest on noise."""
    n = int(ranks_psi.size)

    def recalls(r: np.ndarray) -> dict[str, float]:
        return {f"R{k}": round(float(100.0 * np.mean(r <= k)), 4) if n else 0.0 for k in (1, 5, 10)}

    a, b = recalls(ranks_psi), recalls(ranks_biased)
    ci = {f"dR{k}": paired_interval(ranks_psi <= k, ranks_biased <= k) for k in (1, 5)}
    not_lower = bool(n) and b["R1"] >= a["R1"] and b["R5"] >= a["R5"]
    no_loss = all(lo >= 0 for lo, _ in ci.values())
    a_gain = any(lo > 0 for lo, _ in ci.values())
    on = not_lower and no_loss and a_gain
    nums = (f"R@1 {b['R1']:.1f} vs {a['R1']:.1f}, R@5 {b['R5']:.1f} vs {a['R5']:.1f}, R@10 {b['R10']:.1f} vs "
            f"{a['R10']:.1f} (psi + biases vs psi alone) on {n} validation captions ({validation}); 95% intervals of "
            f"the change: R@1 [{ci['dR1'][0]:+.1f}, {ci['dR1'][1]:+.1f}], R@5 [{ci['dR5'][0]:+.1f}, {ci['dR5'][1]:+.1f}]")
    if on:
        reason = f"NCL biases on by default for this index: psi + biases raised t2v recall beyond the noise of these captions: {nums}"
    elif not not_lower:
        reason = f"NCL biases off by default for this index: psi + biases lowered t2v R@1 or R@5: {nums}"
    else:
        reason = (f"NCL biases off by default for this index: these captions cannot tell psi + biases from psi alone "
                  f"(an interval includes a loss, or none lies above 0): {nums}")
    if not n:
        reason = f"NCL biases off by default for this index: no validation caption matched an indexed video ({validation})"
    return {"on": on, "reason": reason, "validation": validation, "n_captions": n, "psi": a, "psi_biases": b,
            "intervals": ci, "rule": "on iff R@1 and R@5 of psi + biases >= psi alone, both 95% intervals of the "
            "change >= 0 at their lower end and at least one > 0"}


def paired_interval(hit_a: np.ndarray, hit_b: np.ndarray, n_boot: int = 1000, seed: int = 0) -> list[float]:
    """Seeded paired bootstrap 95% interval (points) of mean(hit_b - hit_a), resampling the captions."""
    d = np.asarray(hit_b, dtype=np.float64) - np.asarray(hit_a, dtype=np.float64)
    if not d.size:
        return [0.0, 0.0]
    means = d[np.random.default_rng(seed).integers(0, d.size, size=(n_boot, d.size))].mean(axis=1) * 100.0
    return [round(float(np.percentile(means, 2.5)), 3), round(float(np.percentile(means, 97.5)), 3)]
