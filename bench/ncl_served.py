"""NCL biases of the served score (issue 17): accuracy of the dense and sparse forms, and their cost.

Two parts, each writing bench/results/ncl_served/<name>.{md,json}:

* ``accuracy`` (one corpus, one checkpoint): the test captions against the test gallery, t2v R@1/R@5 and
  the NCL normalisation error (eq. 5, on the test captions, of the score that row ranks by) for
    + psi                      psi scores, no biases
    + psi + NCL(dual)          biases fitted to the dual-tower cosine (what the service added until now)
    + psi + NCL(served, dense) biases fitted to the psi score of every (queue query, video) pair
    + psi + NCL(served, sparse K, dual fill / no fill)   exact psi on each queue query's stage-1 top-K only
  plus, for every sparse form, its error against the dense biases and the R@K it changes.
  The psi scores of the test captions are exhaustive (the test gallery is smaller than the service's
  K = 256 candidates, so the two-stage search ranks exactly these scores).
* ``cost``: seconds of each form at measured gallery sizes (random unit vectors, the checkpoint's psi
  on random frame features), extrapolated linearly to 100k and 1M videos (labelled EXTRAPOLATED).

  python -m bench.ncl_served accuracy --checkpoint CKPT --synth CORPUS --name NAME [--ks 16 64]
  python -m bench.ncl_served cost --checkpoint CKPT --name cost [--sizes 2000 8000]
  python -m bench.ncl_served explain --checkpoint CKPT --synth CORPUS --name NAME [--gammas 0.01]

* ``explain`` (one corpus): why the served-score biases help or hurt: the same dense biases fitted to other
  banks (the training queue, the other half of the test captions, the test captions themselves) and gammas.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import RESULTS, Run, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import table
from bench.psi_reference import fused_pair_scorer, fused_pair_scores

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/served_biases.py",
    "indexer/gare_index/psi_consts.py",
    "training/gare/sinkhorn*.py",
    "training/gare/retrieval_metrics.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


N_ITERS = 4


def _psi_scorers(model: Any, t, frames, mask, vbar, pair_chunk: int = 8192):
    """(matrix scorer, pair scorer) over encoded features: model.score and the fused pair scorer (the search's
    rerank before the fold; bench/psi_reference.py)."""
    import torch

    def matrix(qi, rows):
        qi, rows = torch.as_tensor(qi), torch.as_tensor(rows)
        with torch.inference_mode():
            return model.score(t[qi], frames[rows], mask[rows], vbar=vbar[rows], block_texts=512, block_videos=256)

    def pairs(qi, rows):
        qi, rows = torch.as_tensor(qi), torch.as_tensor(rows)
        out = []
        with torch.inference_mode():
            for s in range(0, qi.numel(), pair_chunk):
                q, r = qi[s:s + pair_chunk], rows[s:s + pair_chunk]
                out.append(fused_pair_scores(model, t[q].float(), frames[r].float(), mask[r], vbar[r].float()))
        return torch.cat(out) if out else torch.zeros(0)

    return matrix, pairs


def _centred(b):
    return b.double() - b.double().mean()


def _load(args: argparse.Namespace):
    """(model, the encoded test split of args.synth, the checkpoint's text queue); refuses a checkpoint without one."""
    from gare.annotations import load_dataset
    from gare.checkpoint import load_model
    from gare.encoded_set import encode_set

    model, ckpt = load_model(args.checkpoint)
    rs = load_dataset({"kind": "synth", "root": args.synth}, "test")
    enc = encode_set(model, rs, batch_size=16, num_workers=1, progress=True)
    queue = ckpt.queues.get("text")
    if queue is None or not len(queue):
        raise SystemExit(f"{args.checkpoint}: no text query queue; NCL needs one")
    return model, enc, queue


def accuracy(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from gare.retrieval_metrics import retrieval_metrics
    from gare.sinkhorn import served_score_matrix, sinkhorn_biases, sinkhorn_biases_dense
    from gare.sinkhorn_sparse import (
        normalization_error_scores,
        score_candidates,
        sinkhorn_biases_sparse,
        stage1_candidates,
    )

    run = start(__name__, MEASURES)
    run.add_inputs(args.checkpoint, args.synth)
    model, enc, queue = _load(args)
    if args.queue_limit:
        queue = queue[-args.queue_limit:]
    queue = queue.float()
    gamma = float(1.0 / model.clip.logit_scale.detach().exp())
    t, vbar = enc.t.float(), enc.vbar.float()
    tn, vn, qn = F.normalize(t, dim=-1), F.normalize(vbar, dim=-1), F.normalize(queue, dim=-1)
    n_q, n = queue.shape[0], vbar.shape[0]
    cc = enc.caption_clip
    timing: dict[str, float] = {}

    with torch.inference_mode():
        psi_test = model.score(t, enc.frames, enc.mask, vbar=vbar, block_texts=256, block_videos=256)
    m_queue, p_queue = _psi_scorers(model, queue, enc.frames, enc.mask, vbar)

    t0 = time.perf_counter()
    _, b_dual = sinkhorn_biases(qn, vn, gamma, N_ITERS)
    timing["dual"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    S_queue = served_score_matrix(m_queue, n_q, n, chunk=256, progress=True)
    timing["served dense: psi"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, b_dense = sinkhorn_biases_dense(S_queue, gamma, N_ITERS)
    timing["served dense: sinkhorn"] = time.perf_counter() - t0

    variants: dict[str, Any] = {"none": None, "dual": b_dual, "served dense": b_dense}
    sparse_info: dict[str, Any] = {}
    for k in args.ks:
        t0 = time.perf_counter()
        _, rows = stage1_candidates(qn, vn, k)
        t_stage1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        sc = score_candidates(p_queue, rows, chunk=65536)
        t_psi = time.perf_counter() - t0
        # the fused pair scorer of the search agrees with model.score (the dense matrix) on the candidates
        diff = float((sc - S_queue.gather(1, rows)).abs().max())
        for fill in ("dual", "none"):
            t0 = time.perf_counter()
            _, b, info = sinkhorn_biases_sparse(rows, sc, n, gamma, N_ITERS, fill=fill, queries=qn, gallery=vn)
            t_sk = time.perf_counter() - t0
            name = f"served sparse K={k} {fill}"
            variants[name] = b
            err = (_centred(b) - _centred(b_dense)).abs()
            sparse_info[name] = {**info, "k": int(rows.shape[1]), "bias_err_mean": float(err.mean()),
                                 "bias_err_max": float(err.max()), "seconds_stage1": t_stage1,
                                 "seconds_psi": t_psi, "seconds_sinkhorn": t_sk, "pair_vs_matrix_max_abs": diff}

    rows_out, data_rows = [], {}
    for name, b in variants.items():
        S = psi_test if b is None else psi_test + b[None, :]
        m = retrieval_metrics(S, cc)["t2v"]
        ne = normalization_error_scores(psi_test, gamma, b)
        ne_q = normalization_error_scores(S_queue, gamma, b)
        label = "+ psi" if b is None else f"+ psi + NCL({name})"
        extra = sparse_info.get(name, {})
        rows_out.append([label, m["R1"], m["R5"], m["R10"], m["MdR"], ne, ne_q,
                         extra.get("bias_err_mean", 0.0 if name == "served dense" else ""),
                         extra.get("bias_err_max", 0.0 if name == "served dense" else ""),
                         extra.get("n_uncovered", "") if name.endswith("none") else ""])
        data_rows[label] = {"t2v": m, "norm_err_test": ne, "norm_err_queue_served": ne_q, **extra}
    dual_row = retrieval_metrics(tn @ vn.T, cc)["t2v"]

    base, served = data_rows["+ psi"]["t2v"], data_rows["+ psi + NCL(served dense)"]["t2v"]
    verdict = served["R1"] >= base["R1"] and served["R5"] >= base["R5"]
    body = (
        f"Corpus `{args.synth}` (test split: {t.shape[0]} captions, {n} videos, {len(enc.failed)} skipped); "
        f"checkpoint `{args.checkpoint}`; queue: the checkpoint's {n_q} training text embeddings; "
        f"gamma = 1 / exp(logit_scale) = {gamma:.4g}; n_iters = {N_ITERS}.\n\n"
        f"Dual-tower (no psi, no biases) for reference: t2v R@1 {dual_row['R1']:.1f}, R@5 {dual_row['R5']:.1f}.\n\n"
        + table(["scores ranked", "t2v R@1", "R@5", "R@10", "MdR", "norm err (test captions)",
                 "norm err (queue, psi)", "|b - b_dense| mean", "|b - b_dense| max", "uncovered videos"], rows_out)
        + "\nnorm err: NCL eq. 5 (t2v) of softmax((psi + b) / gamma) summed over the queries, rescaled to target 1 "
          "(gare.sinkhorn.normalization_error_scores); test captions = the rows' own queries, queue = the "
          "checkpoint's queue scored with psi. |b - b_dense|: the biases centred (a common shift does not change "
          "a ranking) against the dense served biases.\n\n"
        + f"**+ psi + NCL(served, dense) >= + psi in t2v R@1 and R@5: {'yes' if verdict else 'NO'}** "
          f"(R@1 {served['R1']:.1f} vs {base['R1']:.1f}, R@5 {served['R5']:.1f} vs {base['R5']:.1f}).\n\n"
        + "Seconds on this run (contended 2-core CPU; side by side only):\n\n"
        + table(["step", "seconds"], [[k, v] for k, v in timing.items()]
                + [[f"{k}: stage 1 / psi / sinkhorn", f"{v['seconds_stage1']:.2f} / {v['seconds_psi']:.2f} / "
                    f"{v['seconds_sinkhorn']:.2f}"] for k, v in sparse_info.items()])
    )
    (RESULTS / "ncl_served").mkdir(parents=True, exist_ok=True)
    write_results(f"ncl_served/{args.name}", f"NCL biases of the served score: {args.name}", body,
                  {"corpus": args.synth, "checkpoint": args.checkpoint, "gamma": gamma, "n_queue": n_q,
                   "n_test_captions": int(t.shape[0]), "n_videos": n, "rows": data_rows, "timing_s": timing,
                   "dual_tower_t2v": dual_row, "served_dense_ge_psi": verdict, "commit": git_commit()},
                  run)


def explain(args: argparse.Namespace) -> None:
    """Why served-score biases help or hurt on one corpus: the bank the biases are fitted to, and gamma.

    NCL normalises the gallery against a bank of queries standing in for the queries to come. The service's
    bank is the checkpoint's queue of *training* captions. This part fits the dense served-score biases
    (Sinkhorn on the psi score, as ``accuracy``) to other banks and gammas and ranks the same test captions:
    - the training-caption queue (what the service uses), at the checkpoint's gamma and at NCL's CLIP value;
    - the other half of the test captions (2-fold: each half is ranked with biases fitted to the other half):
      disjoint captions drawn like the queries, the realistic best case for a bank (a served-query bank);
    - the test captions themselves (an oracle: NCL's premise exactly met; not a deployable setting).
    It also measures how alike the banks' view of the gallery is: the Pearson correlation between the videos'
    soft popularity sum_i softmax_j(S_ij / gamma) under the bank and under the test captions (NCL moves a
    video's bias against its popularity in the bank, which helps the test queries only if they agree).
    psi scores come from the exact fold (gare.psi_fold), equal to model.score within 1e-5."""
    import torch

    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.retrieval_metrics import retrieval_metrics
    from gare.sinkhorn import sinkhorn_biases_dense
    from gare.sinkhorn_sparse import normalization_error_scores

    run = start(__name__, MEASURES)
    run.add_inputs(args.checkpoint, args.synth)
    model, enc, queue = _load(args)
    queue = queue.float()
    gamma_model = float(1.0 / model.clip.logit_scale.detach().exp())
    t, cc = enc.t.float(), np.asarray(enc.caption_clip)
    fw = pfw.fold_weights(model.psi)
    v = pfv.fold_videos(enc.frames, enc.mask, fw, vbar=enc.vbar.float())

    def psi(x: torch.Tensor) -> torch.Tensor:  # (a, n) served scores of queries x against the test gallery
        return pf.exhaustive(pfq.fold_queries(x, fw, model.cfg.temp), v)

    with torch.inference_mode():
        S_test, S_queue = psi(t), psi(queue)
        ref = model.score(t, enc.frames, enc.mask, vbar=enc.vbar.float(), block_texts=256, block_videos=256)
    fold_err = float((S_test - ref).abs().max())
    n_t = t.shape[0]
    half = np.random.default_rng(0).permutation(n_t) < n_t // 2  # a seeded split of the test captions

    def popularity(S: torch.Tensor, gamma: float) -> torch.Tensor:
        return torch.softmax(S.double() / gamma, dim=1).sum(0)

    def fit(S_bank: torch.Tensor, gamma: float) -> torch.Tensor:
        return sinkhorn_biases_dense(S_bank, gamma, N_ITERS)[1].double()

    def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    rows_md, data = [], {}
    base = retrieval_metrics(S_test, cc)["t2v"]
    rows_md.append(["+ psi (no biases)", "", "", base["R1"], base["R5"], base["R10"],
                    normalization_error_scores(S_test, gamma_model), ""])
    data["+ psi"] = {"t2v": base}
    gammas = sorted({round(gamma_model, 5), *args.gammas}, reverse=True)
    for bank in ("training queue", "other half of the test captions", "the test captions (oracle)"):
        for gamma in gammas:
            S = S_test.double().clone()
            if bank == "training queue":
                b = fit(S_queue, gamma)
                S += b[None, :]
                corr = pearson(popularity(S_queue, gamma), popularity(S_test, gamma))
            elif bank.startswith("other half"):
                hm = torch.from_numpy(half)
                b_a, b_b = fit(S_test[hm], gamma), fit(S_test[~hm], gamma)
                S[~hm] += b_a[None, :]  # half B ranked with biases fitted to half A, and the reverse
                S[hm] += b_b[None, :]
                b = None
                corr = pearson(popularity(S_test[hm], gamma), popularity(S_test[~hm], gamma))
            else:
                b = fit(S_test, gamma)
                S += b[None, :]
                corr = 1.0
            m = retrieval_metrics(S, cc)["t2v"]
            ne = normalization_error_scores(S, gamma_model)
            label = f"+ psi + NCL(served dense), bank = {bank}, gamma = {gamma:.4g}"
            rows_md.append([label, bank, f"{gamma:.4g}", m["R1"], m["R5"], m["R10"], ne, round(corr, 3)])
            data[label] = {"t2v": m, "bank": bank, "gamma": gamma, "norm_err_test": ne, "popularity_corr": corr,
                           "ge_psi": bool(m["R1"] >= base["R1"] and m["R5"] >= base["R5"])}
            print(label, m["R1"], m["R5"], round(corr, 3), flush=True)
    queue_rows = [k for k, r in data.items() if r.get("bank") == "training queue"]
    half_rows = [k for k, r in data.items() if r.get("bank", "").startswith("other half")]
    body = (
        f"Corpus `{args.synth}` (test split: {n_t} captions, {enc.vbar.shape[0]} videos); checkpoint "
        f"`{args.checkpoint}`; training queue: {queue.shape[0]} caption embeddings; the checkpoint's gamma = "
        f"1 / exp(logit_scale) = {gamma_model:.4g}; n_iters = {N_ITERS}; folded psi vs model.score: max |diff| "
        f"{fold_err:.1e}. Halves: a seeded split of the test captions ({int(half.sum())} / {int((~half).sum())}).\n\n"
        + table(["scores ranked", "bank", "gamma", "t2v R@1", "R@5", "R@10", "norm err (test captions, model gamma)",
                 "popularity corr (bank vs test)"], rows_md)
        + "\npopularity corr: Pearson correlation over the videos of sum_i softmax_j(S_ij / gamma) under the bank and "
          "under the test captions (for the halves: half A vs half B).\n\n"
        + "Reading: with the training queue at any gamma here, + psi + NCL >= + psi in R@1 and R@5: "
        + ("yes" if any(data[k]["ge_psi"] for k in queue_rows) else "NO")
        + "; with a bank drawn like the queries (the other half of the test captions): "
        + ("yes" if any(data[k]["ge_psi"] for k in half_rows) else "NO")
        + ". Best popularity correlation of the training queue: "
        + f"{max(data[k]['popularity_corr'] for k in queue_rows):.3f}; of the halves: "
        + f"{max(data[k]['popularity_corr'] for k in half_rows):.3f}.\n"
    )
    (RESULTS / "ncl_served").mkdir(parents=True, exist_ok=True)
    write_results(f"ncl_served/explain_{args.name}", f"Why NCL(served) helps or hurts: {args.name}", body,
                  {"corpus": args.synth, "checkpoint": args.checkpoint, "gamma_model": gamma_model,
                   "n_queue": int(queue.shape[0]), "n_test_captions": n_t, "rows": data, "fold_vs_model_max_abs": fold_err,
                   "commit": git_commit()}, run)


def cost(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from gare.checkpoint import load_model
    from gare.sinkhorn import sinkhorn_biases
    from gare.sinkhorn_sparse import sinkhorn_biases_sparse, stage1_candidates

    run = start(__name__, MEASURES)
    run.add_inputs(args.checkpoint)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.checkpoint)
    d, f = model.cfg.embed_dim, model.cfg.max_frames
    g = torch.Generator().manual_seed(0)
    Q, K = args.queries, args.k
    q_raw = torch.randn(Q, d, generator=g)
    qn = F.normalize(q_raw, dim=-1)
    gamma = 0.01
    # psi throughput (pairs per second) of the three pair scorers of gare_build.served_biases on the same random
    # pairs, for this checkpoint's psi and for a ViT-B/32-size psi (random weights: speed only)
    from gare.config import get_model_config
    from gare.model import GARE

    big = GARE.build(get_model_config("gare-vit-b-32", pretrained="none")).eval()
    throughput = {"checkpoint": _psi_throughput(model, args.pairs, seed=1),
                  "vit-b-32": _psi_throughput(big, args.pairs, seed=2)}
    for k, v in throughput.items():
        print(k, v, flush=True)
    psi_s_per_pair = 1.0 / throughput["vit-b-32"]["fold_stored"]["pairs_per_s"]

    measured = []
    for n in args.sizes:
        gal = F.normalize(torch.randn(n, d, generator=g), dim=-1)
        t0 = time.perf_counter()
        sinkhorn_biases(qn, gal, gamma, N_ITERS, block_elems=1 << 26)
        t_dual = time.perf_counter() - t0
        t0 = time.perf_counter()
        cos, rows = stage1_candidates(qn, gal, K, block_elems=1 << 26)
        t_stage1 = time.perf_counter() - t0
        # stand-in served scores (the psi part is timed above, per pair): cosine + a pair-specific increment
        sc = cos + 0.1 * torch.randn(cos.shape, generator=g)
        t0 = time.perf_counter()
        sinkhorn_biases_sparse(rows, sc, n, gamma, N_ITERS, fill="dual", queries=qn, gallery=gal, block_elems=1 << 26)
        t_sp_dual = time.perf_counter() - t0
        t0 = time.perf_counter()
        sinkhorn_biases_sparse(rows, sc, n, gamma, N_ITERS, fill="none")
        t_sp_none = time.perf_counter() - t0
        measured.append({"n": n, "dual_sinkhorn": t_dual, "stage1_exact": t_stage1, "sparse_dual_sinkhorn": t_sp_dual,
                         "sparse_none_sinkhorn": t_sp_none})
        print(measured[-1], flush=True)

    meta = {"queries": Q, "k": K, "d": d, "frames": f, "psi_seconds_per_pair": psi_s_per_pair, "n_pairs": args.pairs,
            "checkpoint": args.checkpoint, "gamma": gamma, "measured": measured, "commit": git_commit(),
            "throughput": throughput, "threads": args.threads}
    _cost_report(args.name, meta, run)


def _psi_throughput(model: Any, n_pairs: int, seed: int, n_feat: int = 4096, n_queries: int = 1024) -> dict[str, Any]:
    """Pairs per second of gare_build.served_biases' scorers on n_pairs random (queue query, video) pairs in queue
    order (each query's candidates together, as score_candidates passes them): "fused" (the fused psi reference,
    bench/psi_reference.py), "fold_per_chunk" (the fold, each chunk's videos folded on the fly) and "fold_stored" (the fold reading the
    index's stored constants: what build/add/remove/biases run). The constants' one-off cost per video (paid
    by the build anyway, for the rerank) is "fold_videos_s_per_video". Scores agree (max |diff| reported)."""
    import numpy as np
    import torch

    from gare_build.served_biases import fold_pair_scorer
    from gare_index import psi_consts

    d, f = model.cfg.embed_dim, model.cfg.max_frames
    g = torch.Generator().manual_seed(seed)
    frames = (torch.randn(n_feat, f, d, generator=g) / d**0.5 * 8).half().numpy()
    masks = np.ones((n_feat, f), dtype=bool)
    masks[: n_feat // 4, f // 2 :] = False  # a quarter of the videos padded
    frames[~masks] = 0
    vbar = (frames.astype(np.float32) * masks[..., None]).sum(1) / masks.sum(1, keepdims=True)
    norms = np.linalg.norm(vbar, axis=1).astype(np.float32)
    units = (vbar / norms[:, None]).astype(np.float32)
    queries = torch.randn(n_queries, d, generator=g).numpy()
    per_q = 256
    rng = np.random.default_rng(seed)
    qi = np.repeat(np.arange(n_queries), per_q)[:n_pairs]
    rows = rng.integers(0, n_feat, qi.size)
    t0 = time.perf_counter()
    consts = np.empty((n_feat, psi_consts.packed_width(f)), np.float32)
    psi_consts.compute_rows(psi_consts.fold_of(model), frames, masks, units, norms, consts, np.arange(n_feat), device="cpu")
    fold_s = (time.perf_counter() - t0) / n_feat
    out: dict[str, Any] = {"d": d, "f": f, "fold_videos_s_per_video": fold_s}
    scores = {}
    for name, scorer, n in (
        ("fold_stored", fold_pair_scorer(model, queries, frames, masks, units, norms, consts=consts), qi.size),
        ("fold_per_chunk", fold_pair_scorer(model, queries, frames, masks, units, norms), min(qi.size, 16384)),
        ("fused", fused_pair_scorer(model, queries, frames, masks, units, norms), min(qi.size, 8192)),
    ):
        t0 = time.perf_counter()
        scores[name] = scorer(qi[:n], rows[:n]).numpy()
        dt = time.perf_counter() - t0
        out[name] = {"pairs": n, "seconds": dt, "pairs_per_s": n / dt}
    m = min(len(v) for v in scores.values())
    out["max_abs_diff_vs_fused"] = {k: float(np.abs(v[:m] - scores["fused"][:m]).max()) for k, v in scores.items()}
    return out


def _extrapolate(measured: list[dict[str, Any]], key: str, n: int) -> float:
    """a + b N through the two largest measured sizes (b >= 0), or proportional with one size."""
    pts = sorted(measured, key=lambda m: m["n"])[-2:]
    if len(pts) == 2 and pts[1]["n"] > pts[0]["n"]:
        b = (pts[1][key] - pts[0][key]) / (pts[1]["n"] - pts[0]["n"])
        if b > 0:
            return pts[1][key] + b * (n - pts[1]["n"])
    return pts[-1][key] / pts[-1]["n"] * n


def _cost_report(name: str, meta: dict[str, Any], run: Run, source: str | None = None) -> None:
    Q, K, d, f = meta["queries"], meta["k"], meta["d"], meta["frames"]
    psi_s_per_pair, measured = meta["psi_seconds_per_pair"], meta["measured"]
    psi_cands = Q * K * psi_s_per_pair
    rows_md = []
    for n in [m["n"] for m in measured] + [100_000, 1_000_000]:
        m = next((x for x in measured if x["n"] == n), None)
        lab = "measured" if m is not None else "**EXTRAPOLATED** (a + b·N through the two measured sizes)"

        def v(key: str, m: dict[str, Any] | None = m, n: int = n) -> float:
            return m[key] if m is not None else _extrapolate(measured, key, n)

        rows_md.append([f"{n:,}", lab, v("dual_sinkhorn"), Q * n * psi_s_per_pair,
                        v("stage1_exact") + psi_cands + v("sparse_dual_sinkhorn"),
                        v("stage1_exact") + psi_cands + v("sparse_none_sinkhorn")])
    body = (
        (f"Re-rendered from the measurements in `{source}` (measured by `{meta.get('measured_by')}` at commit "
         f"{meta.get('commit')}).\n\n" if source else "")
        + f"Queue Q = {Q:,} queries, K = {K} stage-1 candidates per queue query, d = {d}, f = {f} frames "
        f"(the checkpoint `{meta['checkpoint']}`'s psi), gamma = {meta['gamma']}, n_iters = {N_ITERS}; random unit "
        f"vectors, CPU, {meta.get('threads', 'default')} torch thread(s), other jobs may share the cores (compare "
        "within this table only).\n\n"
        + _throughput_md(meta, Q * K)
        + f"The table below uses the build's scorer at ViT-B/32 size: {1 / psi_s_per_pair:,.0f} pairs/s, so the exact "
        f"psi on every queue query's candidates (Q x K = {Q * K:,} pairs, independent of N) costs {psi_cands:,.0f} s.\n\n"
        + table(["videos N", "", "NCL(dual): Sinkhorn on cosines (s)", "NCL(served) dense: Q x N psi pairs only (s)",
                 "NCL(served) sparse, dual fill: exact stage 1 + Q·K psi + Sinkhorn (s)",
                 "NCL(served) sparse, no fill: exact stage 1 + Q·K psi + Sinkhorn (s)"], rows_md)
        + "\nDense served: the psi of every (queue query, video) pair, i.e. Q x N / throughput; its Sinkhorn needs "
          "the Q x N matrix kept (4 Q N bytes: 6.5 GB at 100k) or psi recomputed in each of the 5 passes, so the "
          "dense form is only for galleries that fit. Sparse: the stage-1 candidates of the queue queries are "
          "found here by an exact chunked matmul top-K (an ANN search of the index would be cheaper at 1M); the "
          "Q·K part (scattering the exact entries, the psi) does not grow with N, the cosine passes of the dual "
          "fill and the stage-1 search do. The measured rows and the per-pair psi rate come from the run; the "
          "100k and 1M rows are extrapolations, labelled.\n"
    )
    (RESULTS / "ncl_served").mkdir(parents=True, exist_ok=True)
    write_results(f"ncl_served/{name}", "NCL biases of the served score: cost", body, meta, run)


def _throughput_md(meta: dict[str, Any], qk: int) -> str:
    tp = meta.get("throughput")
    if not tp:  # a re-render of measurements from before the fold scorers
        return (f"psi throughput (the search's fused pair scorer, {meta['n_pairs']:,} random pairs): "
                f"{1 / meta['psi_seconds_per_pair']:,.0f} pairs/s.\n\n")
    names = {"fold_stored": "fold, stored constants (build/add/remove/biases)",
             "fold_per_chunk": "fold, videos folded per chunk (before this change)",
             "fused": "fused psi (the search's previous default)"}
    rows = []
    for size, r in tp.items():
        for k, lab in names.items():
            rows.append([f"{size} (d = {r['d']}, f = {r['f']})", lab, r[k]["pairs"], r[k]["pairs_per_s"],
                         qk / r[k]["pairs_per_s"], r["max_abs_diff_vs_fused"][k]])
    return ("psi on the queue pairs: the pair scorers of `gare_build.served_biases` on the same random pairs, in queue "
            "order (each query's 256 candidates together), one process, side by side. `vit-b-32` is a ViT-B/32-size "
            "psi with random weights (speed only). The stored constants cost "
            + ", ".join(f"{r['fold_videos_s_per_video'] * 1e3:.2f} ms per video ({s})" for s, r in tp.items())
            + " once, at index time (the rerank needs them anyway).\n\n"
            + table(["psi", "scorer", "pairs timed", "pairs/s", f"s for Q x K = {qk:,}", "max |s - s_fused|"], rows)
            + "\n")


def cost_render(args: argparse.Namespace) -> None:
    import json
    import re

    data = json.loads(Path(args.json).read_text())
    meta = {k: data[k] for k in ("queries", "k", "d", "frames", "psi_seconds_per_pair", "measured", "commit")}
    cmd = data.get("measured_by") or data.get("command", "")
    opt = dict(re.findall(r"--(pairs|checkpoint) (\S+)", cmd))
    meta.update(n_pairs=int(data.get("n_pairs") or opt.get("pairs", 65536)), gamma=data.get("gamma", 0.01),
                checkpoint=data.get("checkpoint") or opt.get("checkpoint", "?"), measured_by=cmd)
    _cost_report(args.name, meta, start(__name__, MEASURES), source=args.json)


def main() -> None:
    if render_requested(RESULTS / "ncl_served/bench.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--checkpoint", required=True)
    a.add_argument("--synth", required=True, help="a `gare-train synth` corpus (its test split is the gallery)")
    a.add_argument("--name", required=True)
    a.add_argument("--ks", type=int, nargs="+", default=[16, 64])
    a.add_argument("--queue-limit", type=int, default=0, help="use only the newest N queue entries (0: all)")
    a.set_defaults(fn=accuracy)
    e = sub.add_parser("explain", help="bank and gamma: why the served-score biases help or hurt on one corpus")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--synth", required=True)
    e.add_argument("--name", required=True)
    e.add_argument("--gammas", type=float, nargs="+", default=[0.01])
    e.set_defaults(fn=explain)
    c = sub.add_parser("cost")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--name", default="cost")
    c.add_argument("--queries", type=int, default=16384)
    c.add_argument("--k", type=int, default=256)
    c.add_argument("--pairs", type=int, default=65536)
    c.add_argument("--threads", type=int, default=1, help="torch threads (1: per-pair rates that other jobs distort least)")
    c.add_argument("--sizes", type=int, nargs="+", default=[500, 1000])
    c.set_defaults(fn=cost)
    r = sub.add_parser("cost-render", help="re-render a cost report from its saved measurements (.json)")
    r.add_argument("json")
    r.add_argument("--name", default="cost")
    r.set_defaults(fn=cost_render)
    add_render_arg(ap, RESULTS / "ncl_served/bench.json")
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
