"""Why the oracle NCL bank can lower t2v R@1 (issue 28, must-have 1): paired bootstrap intervals and the churn.

Fits the dense served-score biases (Sinkhorn on the exhaustive psi scores, as ``bench/ncl_served.py explain``)
to the test captions themselves (the oracle bank) and ranks the same captions, with every caption of every
test video (``--all-captions``: the synth corpus has 3 per video, so 3x the captions of the 1k-A style test
split), and reports for each variant of the candidate causes:

* gamma: the checkpoint's 1 / exp(logit_scale) (the temperature psi was trained with) and smaller ones;
* iterations: NCL's 4 against 50 (converged: the normalisation error ~0);
* the score the biases are fitted on: psi (what is ranked) or the dual-tower cosine;
* the sign: added (NCL eq. 12) or subtracted (a sign error would look like this row);

each with R@1/R@5/R@10, the paired bootstrap 95% interval of the change against psi alone (resampling
captions), and how many captions left / entered the top 1. It also splits every video's summed retrieval
probability into the part from its own captions (the answers, which the oracle bank holds) and the rest
(popularity from other captions: the hubness NCL corrects), and says how much of its variance each explains.

  python -m bench.ncl_oracle --checkpoint CKPT --synth CORPUS --name NAME [--all-captions] [--boot 2000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import RESULTS, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import table

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/sinkhorn*.py",
    "training/gare/retrieval_metrics.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


def _test_set(root: str, all_captions: bool):
    from gare.annotations import RetrievalSet, load_dataset

    rs = load_dataset({"kind": "synth", "root": root}, "test")
    if not all_captions:
        return rs
    data = json.loads((Path(root) / "MSRVTT_data.json").read_text())
    by_vid: dict[str, list[str]] = {}
    for s in data["sentences"]:
        by_vid.setdefault(s["video_id"], []).append(s["caption"])
    caps, cc = [], []
    for j, clip in enumerate(rs.clips):
        for c in by_vid.get(clip.key, []):
            caps.append(c)
            cc.append(j)
    return RetrievalSet(rs.clips, caps, np.asarray(cc, dtype=np.int64), rs.name + "-all-captions")


def _boot(delta: np.ndarray, n_boot: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of a per-caption difference (points), resampling captions."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, delta.size, size=(n_boot, delta.size))
    means = delta[idx].mean(axis=1) * 100.0
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main() -> None:
    if render_requested(RESULTS / "ncl_served/oracle_bench.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--all-captions", action="store_true", help="every caption of each test video (3 per video)")
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.03, 0.01])
    ap.add_argument("--boot", type=int, default=2000)
    add_render_arg(ap, RESULTS / "ncl_served/oracle_bench.json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.checkpoint import load_model
    from gare.encoded_set import encode_set
    from gare.retrieval_metrics import ranks_t2v
    from gare.sinkhorn import sinkhorn_biases_dense
    from gare.sinkhorn_sparse import normalization_error_scores

    run = start(__name__, MEASURES)
    run.add_inputs(args.checkpoint, args.synth)
    model, _ = load_model(args.checkpoint)
    rs = _test_set(args.synth, args.all_captions)
    enc = encode_set(model, rs, batch_size=16, num_workers=1, progress=True)
    t, cc = enc.t.float(), np.asarray(enc.caption_clip)
    fw = pfw.fold_weights(model.psi)
    v = pfv.fold_videos(enc.frames, enc.mask, fw, vbar=enc.vbar.float())
    with torch.inference_mode():
        S = pf.exhaustive(pfq.fold_queries(t, fw, model.cfg.temp), v).double()
    C = (F.normalize(t, dim=-1) @ F.normalize(enc.vbar.float(), dim=-1).T).double()
    g0 = float(1.0 / model.clip.logit_scale.detach().exp())
    n_t, n = S.shape
    r0 = ranks_t2v(S, cc)

    # popularity split: sum_i P(v_j | t_i) = own captions' part + other captions' part
    P = torch.softmax(S / g0, dim=1)
    own = torch.zeros(n, dtype=torch.float64).index_add_(0, torch.from_numpy(cc), P[torch.arange(n_t), torch.from_numpy(cc)])
    col = P.sum(0)
    other = col - own
    share_own, share_other = float(own.var() / col.var()), float(other.var() / col.var())
    cov = float(((own - own.mean()) * (other - other.mean())).mean() * 2 / col.var())

    variants: list[tuple[str, float, int, str, float]] = [(f"gamma {g0:.4g} (model), 4 iters", g0, 4, "psi", 1.0),
                                                          (f"gamma {g0:.4g} (model), 50 iters", g0, 50, "psi", 1.0)]
    for g in args.gammas:
        variants += [(f"gamma {g:.4g}, 4 iters", g, 4, "psi", 1.0), (f"gamma {g:.4g}, 50 iters", g, 50, "psi", 1.0)]
    variants += [(f"gamma {g0:.4g}, 4 iters, fitted on the cosine", g0, 4, "cosine", 1.0),
                 (f"gamma {g0:.4g}, 4 iters, subtracted (wrong sign)", g0, 4, "psi", -1.0)]
    base = {"R1": float(np.mean(r0 == 1) * 100), "R5": float(np.mean(r0 <= 5) * 100), "R10": float(np.mean(r0 <= 10) * 100)}
    rows = [["psi alone", base["R1"], "", "", base["R5"], "", base["R10"], "", "", normalization_error_scores(S, g0)]]
    data: dict[str, Any] = {}
    for label, g, iters, fit_on, sign in variants:
        b = sinkhorn_biases_dense(S if fit_on == "psi" else C, g, iters)[1].double() * sign
        r = ranks_t2v(S + b[None, :], cc)
        out: dict[str, Any] = {"gamma": g, "n_iters": iters, "fitted_on": fit_on, "sign": sign}
        for k in (1, 5, 10):
            d = (r <= k).astype(np.float64) - (r0 <= k).astype(np.float64)
            out[f"R{k}"] = float(np.mean(r <= k) * 100)
            out[f"dR{k}_ci"] = _boot(d, args.boot)
        out["left_top1"] = int(((r0 == 1) & (r > 1)).sum())
        out["entered_top1"] = int(((r0 > 1) & (r == 1)).sum())
        out["norm_err"] = normalization_error_scores(S, g0, b)
        out["bias_spread"] = float(b.std())
        data[label] = out
        ci1, ci5 = out["dR1_ci"], out["dR5_ci"]
        rows.append([label, out["R1"], f"[{ci1[0]:+.1f}, {ci1[1]:+.1f}]", f"{out['left_top1']} / {out['entered_top1']}",
                     out["R5"], f"[{ci5[0]:+.1f}, {ci5[1]:+.1f}]", out["R10"],
                     f"[{out['dR10_ci'][0]:+.1f}, {out['dR10_ci'][1]:+.1f}]", out["bias_spread"], out["norm_err"]])
        print(label, out, flush=True)
    # top-1 margins: how far each caption's winner is ahead of its runner-up, against the biases' spread
    top2 = torch.topk(S, 2, dim=1).values
    margin = (top2[:, 0] - top2[:, 1]).numpy()
    main_row = data[variants[0][0]]
    r1_ci = main_row["dR1_ci"]
    within = r1_ci[0] <= 0.0 <= r1_ci[1]
    body = (
        f"Corpus `{args.synth}`, test videos: {n}, captions: {n_t} ({'every caption of each test video' if args.all_captions else 'one per video'}); "
        f"checkpoint `{args.checkpoint}`; gamma of the model 1 / exp(logit_scale) = {g0:.4g}. The bank is the test "
        f"captions themselves (oracle); the biases are dense (exhaustive psi, gare.psi_fold). Intervals: paired "
        f"bootstrap ({args.boot} resamples of the captions) 95% interval of the change against psi alone, in points.\n\n"
        + table(["ranked by psi + oracle biases", "t2v R@1", "ΔR@1 95% CI", "left / entered top 1", "R@5", "ΔR@5 95% CI",
                 "R@10", "ΔR@10 95% CI", "std of b", "norm err"], rows)
        + f"\nPopularity split at the model's gamma (variance of every video's summed probability sum_i P(v_j|t_i)): its own "
        f"captions' part explains {share_own:.2f}, the other captions' part (hubness) {share_other:.2f}, their covariance "
        f"{cov:+.2f}. Top-1 margin of psi (winner minus runner-up): median {np.median(margin):.4f}, "
        f"{100 * np.mean(margin < main_row['bias_spread']):.0f}% of captions below the std of the oracle biases "
        f"({main_row['bias_spread']:.4f}).\n\n"
        f"Reading: at the model's gamma the oracle changes R@1 by {main_row['R1'] - base['R1']:+.1f} points, 95% interval "
        f"[{r1_ci[0]:+.1f}, {r1_ci[1]:+.1f}]: {'within' if within else 'OUTSIDE'} the interval of no change; "
        f"{main_row['left_top1']} captions left the top 1 and {main_row['entered_top1']} entered it. "
        f"R@5 {main_row['R5'] - base['R5']:+.1f} [{main_row['dR5_ci'][0]:+.1f}, {main_row['dR5_ci'][1]:+.1f}].\n"
    )
    (RESULTS / "ncl_served").mkdir(parents=True, exist_ok=True)
    write_results(f"ncl_served/oracle_{args.name}", f"The oracle NCL bank: {args.name}", body,
                  {"corpus": args.synth, "checkpoint": args.checkpoint, "gamma_model": g0, "n_captions": n_t, "n_videos": n,
                   "psi": base, "rows": data, "popularity_variance_share": {"own": share_own, "other": share_other, "cov": cov},
                   "top1_margin_median": float(np.median(margin)), "oracle_r1_change_within_ci": within,
                   "commit": git_commit()}, run)


if __name__ == "__main__":
    main()
