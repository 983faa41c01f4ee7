"""Every NCL configuration on one corpus in one generated table, with bootstrap intervals (issue 28, must-have 5).

For each checkpoint given (e.g. the plain benchmark model and its NCL-trained twin, ``ncl_train``), on every
caption of every test video of a synth corpus:

* t2v: psi alone (biases off) and psi + the video biases (on) fitted, as the index fits them (Sinkhorn on the
  psi score, here dense: the exhaustive folded psi of every queue query x test video, what the sparse form at
  K >= N equals), to the **stale** queue (the checkpoint's pushed training embeddings) or the **fresh** queue
  (the training captions the checkpoint names, re-encoded by its final text tower:
  ``gare_build.ncl_queues.training_captions``, as ``gare-index build --bias-queue fresh``), at the model's gamma
  (1 / exp(logit_scale)) and at ``--gamma2``;
* v2t: psi alone and psi + text biases fitted to the dual-tower cosine of the checkpoint's stale video queue
  (the queue stores v̄ only, so psi cannot score it; no fresh video queue here: it would re-encode every
  training video).

R@1/R@5/R@10 with 95% bootstrap intervals over captions (t2v) or videos (v2t), and the paired interval of the
change against psi alone.

  python -m bench.ncl_table --checkpoints plain=CKPT ncl=CKPT2 --synth CORPUS --name NAME [--gamma2 0.01]
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from bench.harness import RESULTS, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import table
from bench.ncl_oracle import _test_set

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/ncl_queues.py",
    "indexer/gare_build/tuning/version_tuning.py",
    "training/gare/sinkhorn*.py",
    "training/gare/retrieval_metrics.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


N_ITERS = 4


def _ci(x: np.ndarray, n_boot: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(x) * 100 (resampling the entries of x)."""
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1) * 100.0
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _recalls(r: np.ndarray, r0: np.ndarray | None, n_boot: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in (1, 5, 10):
        hit = (r <= k).astype(np.float64)
        out[f"R{k}"] = float(hit.mean() * 100)
        out[f"R{k}_ci"] = _ci(hit, n_boot)
        if r0 is not None:
            out[f"dR{k}_ci"] = _ci(hit - (r0 <= k).astype(np.float64), n_boot)
    return out


def _fmt(m: dict[str, Any], k: int) -> str:
    lo, hi = m[f"R{k}_ci"]
    s = f"{m[f'R{k}']:.1f} [{lo:.1f}, {hi:.1f}]"
    if f"dR{k}_ci" in m:
        a, b = m[f"dR{k}_ci"]
        s += f" (Δ [{a:+.1f}, {b:+.1f}])"
    return s


def run_model(label: str, ckpt_path: str, args: argparse.Namespace) -> tuple[list[list[Any]], dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.checkpoint import load_model
    from gare.encoded_set import encode_set
    from gare.retrieval_metrics import ranks_t2v, ranks_v2t
    from gare.sinkhorn import sinkhorn_biases, sinkhorn_biases_dense
    from gare_build.ncl_queues import fresh_rows, training_captions
    from gare_build.tuning.version_tuning import encode_captions

    model, ck = load_model(ckpt_path)
    rs = _test_set(args.synth, True)
    enc = encode_set(model, rs, batch_size=16, num_workers=1, progress=True)
    t, cc = enc.t.float(), np.asarray(enc.caption_clip)
    fw = pfw.fold_weights(model.psi)
    v = pfv.fold_videos(enc.frames, enc.mask, fw, vbar=enc.vbar.float())

    def psi(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return pf.exhaustive(pfq.fold_queries(x, fw, model.cfg.temp), v).double()

    S = psi(t)
    g0 = float(1.0 / model.clip.logit_scale.detach().exp())
    texts, info = training_captions(ck)
    size = int((ck.train_args or {}).get("queue_size") or 16384)
    fresh = torch.from_numpy(encode_captions(model, [texts[i] for i in fresh_rows(len(texts), size)]))
    queues = {"stale": ck.queues["text"].float(), "fresh": fresh}
    r0 = ranks_t2v(S, cc)
    rows: list[list[Any]] = []
    data: dict[str, Any] = {"gamma_model": g0, "fresh_captions": info["captions"], "n_fresh": int(fresh.shape[0]),
                            "n_stale": int(queues["stale"].shape[0]), "t2v": {}, "v2t": {}}
    base = _recalls(r0, None, args.boot)
    data["t2v"]["off"] = base
    rows.append([label, "t2v", "off (psi alone)", "", "", _fmt(base, 1), _fmt(base, 5), _fmt(base, 10)])
    for qname, q in queues.items():
        Sq = psi(q)
        for g in (g0, args.gamma2):
            b = sinkhorn_biases_dense(Sq, g, N_ITERS)[1].double()
            m = _recalls(ranks_t2v(S + b[None, :], cc), r0, args.boot)
            data["t2v"][f"on {qname} gamma={g:.4g}"] = m
            rows.append([label, "t2v", "on (psi + b)", f"{qname} ({q.shape[0]})", f"{g:.4g}", _fmt(m, 1), _fmt(m, 5),
                         _fmt(m, 10)])
            print(label, qname, g, m["R1"], m["R5"], flush=True)
    # v2t: videos query the test captions
    v0 = ranks_v2t(S, cc)
    vb = _recalls(v0, None, args.boot)
    data["v2t"]["off"] = vb
    rows.append([label, "v2t", "off (psi alone)", "", "", _fmt(vb, 1), _fmt(vb, 5), _fmt(vb, 10)])
    vq = ck.queues.get("video")
    if vq is not None and len(vq):
        vqn = F.normalize(vq.float(), dim=-1)
        tn = F.normalize(t, dim=-1)
        for g in (g0, args.gamma2):
            a = sinkhorn_biases(vqn, tn, g, N_ITERS)[1].double()  # (captions,) text biases
            m = _recalls(ranks_v2t(S + a[:, None], cc), v0, args.boot)
            data["v2t"][f"on stale-video-queue-cosine gamma={g:.4g}"] = m
            rows.append([label, "v2t", "on (psi + a, cosine-fitted)", f"stale video ({vq.shape[0]})", f"{g:.4g}",
                         _fmt(m, 1), _fmt(m, 5), _fmt(m, 10)])
    data["n_captions"], data["n_videos"] = int(S.shape[0]), int(S.shape[1])
    return rows, data


def main() -> None:
    if render_requested(RESULTS / "ncl_served/table_bench.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", nargs="+", required=True, metavar="LABEL=CKPT")
    ap.add_argument("--synth", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--gamma2", type=float, default=0.01)
    ap.add_argument("--boot", type=int, default=2000)
    add_render_arg(ap, RESULTS / "ncl_served/table_bench.json")
    args = ap.parse_args()
    run = start(__name__, MEASURES)
    run.add_inputs(*(spec.partition("=")[2] for spec in args.checkpoints), args.synth)
    rows: list[list[Any]] = []
    data: dict[str, Any] = {}
    for spec in args.checkpoints:
        label, _, path = spec.partition("=")
        r, d = run_model(label, path, args)
        rows += r
        data[label] = {"checkpoint": path, **d}
    any_d = next(iter(data.values()))
    wins = [f"{lab}: {k}" for lab, d in data.items() for k, m in d["t2v"].items() if k != "off"
            and m["R1"] >= d["t2v"]["off"]["R1"] and m["R5"] >= d["t2v"]["off"]["R5"]]
    sig = [f"{lab}: {k}" for lab, d in data.items() for k, m in d["t2v"].items() if k != "off"
           and m["dR1_ci"][0] > 0]
    # the other side of the reading: changes whose interval excludes 0 downwards, in t2v and v2t, and v2t's wins
    worse = {dirn: [f"{lab}: {k} (R@{r} Δ [{m[f'dR{r}_ci'][0]:+.1f}, {m[f'dR{r}_ci'][1]:+.1f}])"
                    for lab, d in data.items() for k, m in d[dirn].items() if k != "off"
                    for r in (1, 5) if m[f"dR{r}_ci"][1] < 0]
             for dirn in ("t2v", "v2t")}
    v2t_wins = [f"{lab}: {k}" for lab, d in data.items() for k, m in d["v2t"].items() if k != "off"
                and m["R1"] >= d["v2t"]["off"]["R1"] and m["R5"] >= d["v2t"]["off"]["R5"]]
    has_v2t = any(k != "off" for d in data.values() for k in d["v2t"])
    body = (
        f"Corpus `{args.synth}`: {any_d['n_videos']} test videos, {any_d['n_captions']} captions (every caption of each "
        f"test video). Biases dense on the psi score (Sinkhorn, {N_ITERS} iterations). Cells: value [95% bootstrap "
        f"interval] (Δ: paired 95% interval of the change against psi alone), {args.boot} resamples; t2v over "
        "captions, v2t over videos.\n\n"
        + "\n".join(f"- `{lab}` = `{d['checkpoint']}`: gamma of the model {d['gamma_model']:.4g}; stale queue "
                    f"{d['n_stale']} pushed embeddings; fresh queue {d['n_fresh']} captions of {d['fresh_captions']}"
                    for lab, d in data.items())
        + "\n\n"
        + table(["model", "direction", "biases", "queue", "gamma", "R@1", "R@5", "R@10"], rows)
        + "\nt2v configurations with psi + b >= psi alone in both R@1 and R@5: "
        + (", ".join(wins) if wins else "none")
        + ". With an R@1 gain whose interval excludes 0: " + (", ".join(sig) if sig else "none")
        + ". t2v R@1 / R@5 changes whose interval lies below 0: " + (", ".join(worse["t2v"]) if worse["t2v"] else "none") + ".\n"
        + ("\nv2t configurations with psi + a >= psi alone in both R@1 and R@5: "
           + (", ".join(v2t_wins) if v2t_wins else "none") + ". v2t R@1 / R@5 changes whose interval lies below 0: "
           + (", ".join(worse["v2t"]) if worse["v2t"] else "none") + ".\n"
           if has_v2t else "\nv2t: no checkpoint here has a video queue, so no v2t biases were fitted.\n")
    )
    (RESULTS / "ncl_served").mkdir(parents=True, exist_ok=True)
    write_results(f"ncl_served/table_{args.name}", f"NCL configurations: {args.name}", body,
                  {"corpus": args.synth, "models": data, "gamma2": args.gamma2, "wins": wins, "significant_r1": sig,
                   "significantly_worse": worse, "v2t_wins": v2t_wins,
                   "commit": git_commit()}, run)


if __name__ == "__main__":
    main()
