"""`gare-train eval`: the table (dual-tower, + psi, + NCL, + psi + NCL(dual), + psi + NCL(served)), NCL
normalisation errors, the SPEC §4 deviation figures and the stage-1 coverage curve, for one checkpoint on
one retrieval set.

NCL rows: t2v adds video biases fitted with the checkpoint's text queue as queries; v2t adds text biases
fitted with its video queue (the queued v̄) as queries against the test captions, on the dual-tower cosine
(a per-video bias cannot reorder one video's captions). The queue holds no frames, so psi scores of queue
videos do not exist and the "+ psi + NCL" v2t cells are left empty.

NCL(dual): video biases fitted to the dual-tower cosine of the checkpoint's text queue (what `+ NCL` adds to
the cosine). NCL(served): biases fitted to the psi score of the queue queries, the score the search ranks by
(SPEC §5): dense (every queue query x every video) when Q x N <= SERVED_DENSE_MAX_PAIRS, else the
sparse form (exact psi on each queue query's dual-tower top SERVED_K, the cosine elsewhere)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gare.deviation import REBUTTAL_DELTA, delta_deviation
from gare.encoded_set import EncodedSet
from gare.model import GARE
from gare.retrieval_metrics import format_table, retrieval_metrics
from gare.sinkhorn import normalization_error, served_score_matrix, sinkhorn_biases, sinkhorn_biases_dense
from gare.sinkhorn_sparse import (
    normalization_error_scores,
    pair_scorer_from_matrix,
    score_candidates,
    sinkhorn_biases_sparse,
    stage1_candidates,
)

log = logging.getLogger(__name__)

COVERAGE_KS = (16, 32, 64, 128, 256, 512, 1024)
SERVED_DENSE_MAX_PAIRS = 1 << 22  # above this many (queue query, video) pairs the served biases are sparse
SERVED_K = 256  # the service's default number of stage-1 candidates




def coverage_at_k(psi_scores: torch.Tensor, dual_scores: torch.Tensor, ks=COVERAGE_KS, top: int = 10) -> dict[int, float]:
    """Share of the exhaustive psi top-`top` found inside the dual-tower top-K, averaged over queries."""
    n = psi_scores.shape[1]
    top = min(top, n)
    psi_top = psi_scores.topk(top, dim=1).indices  # (a, top)
    out = {}
    for k in ks:
        kk = min(k, n)
        dual_top = dual_scores.topk(kk, dim=1).indices  # (a, kk)
        hit = (psi_top.unsqueeze(-1) == dual_top.unsqueeze(1)).any(-1).float()  # (a, top)
        out[k] = float(hit.mean())
    return out


@torch.no_grad()
def served_biases_encoded(
    model: GARE, enc: EncodedSet, queue: torch.Tensor, gamma: float, *, n_iters: int = 4, block: int = 128,
    dense_max_pairs: int = SERVED_DENSE_MAX_PAIRS, k: int = SERVED_K,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """NCL video biases fitted to the psi score of the (un-normalised) queue texts against the encoded videos."""
    dev = model.device
    q = queue.to(dev).float()
    frames, mask, vbar = enc.frames.to(dev), enc.mask.to(dev), enc.vbar.to(dev)

    def matrix(qi: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        qi_t, r_t = torch.as_tensor(qi, device=dev), torch.as_tensor(rows, device=dev)
        return model.score(q[qi_t], frames[r_t], mask[r_t], vbar=vbar[r_t], block_texts=block, block_videos=block)

    n_q, n = q.shape[0], vbar.shape[0]
    t0 = time.perf_counter()
    if n_q * n <= dense_max_pairs:
        _, b = sinkhorn_biases_dense(served_score_matrix(matrix, n_q, n, chunk=max(block, 256)), gamma, n_iters)
        info: dict[str, Any] = {"form": "dense", "pairs": n_q * n}
    else:
        qn, vn = F.normalize(q, dim=-1), F.normalize(vbar, dim=-1)
        _, rows = stage1_candidates(qn, vn, k)
        sc = score_candidates(pair_scorer_from_matrix(matrix), rows)
        _, b, info = sinkhorn_biases_sparse(rows, sc, n, gamma, n_iters, fill="dual", queries=qn, gallery=vn)
        info = {"form": "sparse", **info, "pairs": int(info["n_entries"])}
    info["seconds"] = time.perf_counter() - t0
    return b, info


@torch.no_grad()
def evaluate_encoded(
    model: GARE, enc: EncodedSet, queue: torch.Tensor | None, *, n_iters: int = 4, block: int = 128,
    video_queue: torch.Tensor | None = None,
) -> dict[str, Any]:
    dev = model.device
    gamma = float(1.0 / model.clip.logit_scale.exp())
    t, vbar = enc.t.to(dev), enc.vbar.to(dev)
    tn, vn = F.normalize(t, dim=-1), F.normalize(vbar, dim=-1)
    t0 = time.perf_counter()
    dual = tn @ vn.T
    t_dual = time.perf_counter() - t0
    t0 = time.perf_counter()
    psi = model.score(t, enc.frames.to(dev), enc.mask.to(dev), vbar=vbar, block_texts=block, block_videos=block)
    t_psi = time.perf_counter() - t0

    rows: dict[str, dict[str, Any]] = {}
    rows["dual-tower"] = retrieval_metrics(dual.cpu(), enc.caption_clip)
    rows["+ psi"] = retrieval_metrics(psi.cpu(), enc.caption_clip)
    ncl: dict[str, Any] = {"queue": 0}
    if queue is not None and len(queue):
        qn = F.normalize(queue.to(dev).float(), dim=-1)
        _, b = sinkhorn_biases(qn, vn, gamma, n_iters)
        b = b.to(dev)
        rows["+ NCL"] = retrieval_metrics((dual + b).cpu(), enc.caption_clip)
        rows["+ psi + NCL(dual)"] = retrieval_metrics((psi + b).cpu(), enc.caption_clip)
        b_served, served_info = served_biases_encoded(model, enc, queue, gamma, n_iters=n_iters, block=block)
        rows["+ psi + NCL(served)"] = retrieval_metrics((psi + b_served.to(dev)).cpu(), enc.caption_clip)
        psi_cpu = psi.cpu()
        # v2t: the queries are videos, so the biases belong to the texts, fitted with the video queue
        if video_queue is not None and len(video_queue):
            vq = F.normalize(video_queue.to(dev).float(), dim=-1)
            _, a_txt = sinkhorn_biases(vq, tn, gamma, n_iters)
            rows["+ NCL"]["v2t"] = retrieval_metrics((dual + a_txt.to(dev)[:, None]).cpu(), enc.caption_clip)["v2t"]
        else:
            rows["+ NCL"]["v2t"] = {k: float("nan") for k in rows["+ NCL"]["v2t"]}
        rows["+ psi + NCL(dual)"]["v2t"] = {k: float("nan") for k in rows["+ psi + NCL(dual)"]["v2t"]}
        rows["+ psi + NCL(served)"]["v2t"] = {k: float("nan") for k in rows["+ psi + NCL(served)"]["v2t"]}
        ncl = {
            "queue": int(len(queue)),
            "gamma": gamma,
            "norm_err_queue_before": normalization_error(qn, vn, gamma),
            "norm_err_queue_after": normalization_error(qn, vn, gamma, b.cpu()),
            "norm_err_test_before": normalization_error(tn, vn, gamma),
            "norm_err_test_after": normalization_error(tn, vn, gamma, b.cpu()),
            # the score each psi row ranks by, on the test captions (NCL eq. 5)
            "norm_err_test_psi": normalization_error_scores(psi_cpu, gamma),
            "norm_err_test_psi_dual": normalization_error_scores(psi_cpu, gamma, b.cpu()),
            "norm_err_test_psi_served": normalization_error_scores(psi_cpu, gamma, b_served),
            "served": served_info,
        }
    dev_abs = (psi - dual).abs().flatten().cpu()
    delta_abs = delta_deviation(model, t, enc.frames, enc.mask, vbar, block=block).flatten()
    deviation = {
        # SPEC §4 / the rebuttal: the effect of Δ alone, the same video vector (v̄) on both sides
        "delta_mean_abs": float(delta_abs.mean()),
        # numpy: torch.quantile refuses inputs above 16M elements (a 5k x 5k evaluation already is one)
        "delta_p95_abs": float(np.percentile(delta_abs.numpy(), 95)),
        "delta_note": "|cos(t+Δ, v̄) - cos(t, v̄)| over every (text, video) pair (the rebuttal's figure)",
        # the older figure, kept labelled: Δ and the text-conditioned pooling together
        "mean_abs": float(dev_abs.mean()),
        "p95_abs": float(np.percentile(dev_abs.numpy(), 95)),
        "note": "|cos(t+Δ, p) - cos(t, v̄)| over every (text, video) pair: Δ and the pooling together",
    }
    return {
        "n_captions": int(t.shape[0]),
        "n_videos": int(vbar.shape[0]),
        "skipped_videos": enc.failed,
        "rows": rows,
        "ncl": ncl,
        "deviation": deviation,
        "coverage_top10_in_dual_topK": coverage_at_k(psi, dual),
        "scoring_seconds": {"dual": t_dual, "psi_exhaustive": t_psi},
    }


def write_report(result: dict[str, Any], out_dir: str | Path, title: str = "GARE evaluation") -> dict[str, Path]:
    """result.json, result.md (tables) and coverage.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "result.json", "md": out_dir / "result.md", "plot": out_dir / "coverage.png"}
    paths["json"].write_text(json.dumps(result, indent=2, default=str))
    table_rows = {}
    for name, m in result["rows"].items():
        table_rows[name] = {"t2v": m["t2v"], "v2t": m["v2t"]}
    lines = [f"# {title}", "", f"{result['n_captions']} captions, {result['n_videos']} videos"
             f" ({len(result['skipped_videos'])} skipped).", "", format_table(table_rows), ""]
    ncl = result["ncl"]
    if ncl.get("queue"):
        lines += ["NCL normalisation error (eq. 5, t2v) before -> after the biases:", "",
                  "| queries | before | after |", "|---|---|---|",
                  f"| training queue ({ncl['queue']}) | {ncl['norm_err_queue_before']:.4f} | {ncl['norm_err_queue_after']:.4f} |",
                  f"| test captions | {ncl['norm_err_test_before']:.4f} | {ncl['norm_err_test_after']:.4f} |", ""]
        if "norm_err_test_psi" in ncl:
            sv = ncl.get("served") or {}
            lines += ["NCL normalisation error on the test captions of the score each psi row ranks by:", "",
                      "| + psi | + psi + NCL(dual) | + psi + NCL(served) |", "|---|---|---|",
                      f"| {ncl['norm_err_test_psi']:.4f} | {ncl['norm_err_test_psi_dual']:.4f} | "
                      f"{ncl['norm_err_test_psi_served']:.4f} |", "",
                      f"NCL(dual): biases fitted to the dual-tower cosine of the queue; NCL(served): fitted to the psi "
                      f"score of the queue ({sv.get('form')} form, {sv.get('pairs')} psi pairs, "
                      f"{sv.get('seconds', 0.0):.1f} s).", ""]
    dv = result["deviation"]
    if ncl.get("queue"):
        lines += ["NCL v2t: text biases fitted with the checkpoint's video queue on the dual-tower cosine; "
                  "'+ psi + NCL' has no v2t (the queue holds no frames, so psi cannot score queued videos).", ""]
    if "delta_mean_abs" in dv:
        lines += [f"Deviation |cos(t+Δ, v̄) − cos(t, v̄)| (Δ alone, as the rebuttal): mean {dv['delta_mean_abs']:.4f}, "
                  f"95th percentile {dv['delta_p95_abs']:.4f} (authors: {REBUTTAL_DELTA['text']}).", ""]
    lines += [f"Deviation |cos(t+Δ, p) − cos(t, v̄)| (Δ and the pooling together; not the rebuttal's figure): "
              f"mean {dv['mean_abs']:.4f}, 95th percentile {dv['p95_abs']:.4f}.", "",
              "Share of the exhaustive psi top-10 inside the dual-tower top-K:", "",
              "| K | " + " | ".join(str(k) for k in result["coverage_top10_in_dual_topK"]) + " |",
              "|---|" + "---|" * len(result["coverage_top10_in_dual_topK"]),
              "| coverage | " + " | ".join(f"{v:.3f}" for v in result["coverage_top10_in_dual_topK"].values()) + " |", ""]
    paths["md"].write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cov = result["coverage_top10_in_dual_topK"]
    ks = [int(k) for k in cov]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(ks, list(cov.values()), marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K (dual-tower candidates)")
    ax.set_ylabel("psi top-10 inside top-K")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.99, ls="--", c="grey", lw=0.8)
    ax.set_title(f"Stage-1 coverage ({result['n_videos']} videos)")
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=120)
    plt.close(fig)
    return paths
