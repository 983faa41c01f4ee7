"""Stage 1 at scale: the recall / latency frontier of every index type, and what the tuner picks (issue 29).

For each gallery (``bench``: ``bench/clip_like.py``'s default CLIP-like procedure; ``hard``: its ``HARD`` preset,
a quarter near-duplicates, tighter unequal topics, a larger modality gap, noisier captions) the script draws
``--n`` unit vectors and three query sets: the *sample* handed to the tuner, an *evaluation* set from the same
distribution, and a *held-out* set from another distribution (a topic chosen uniformly, noisier captions:
``clip_like_sets``).  Then, one thread per query (faiss ``omp_set_num_threads(1)``), K = 256 (the service's
default candidates):

* the frontier of each index type, every setting built through the product (``gare_index.ann``):
  IVF-Flat over ``--nlist`` cells (flat quantiser) for each nprobe; fast-scan IVF-PQ (4-bit codes, ``pq_m``
  sub-quantisers, the same trained coarse quantiser) re-scored exactly from the float vectors
  (``AnnIndex``'s ``rescore``) for each nprobe x rescore; HNSW (M, efConstruction) for each efSearch --
  recall@256 of the exact top-10 on the evaluation and the held-out sets, p50 / p95 of one query per call, and
  the per-query time when 32 queries come in one call (the service's micro-batch);
* the tuner (``gare_build.tuning.recall.tune_ann``, its auto ladder, target 0.995, latency budget ``--budget-ms``)
  given only the sample: its choice, the build and measuring times, and the choice's recall on both sets.

Targets (issue 29): recall >= 0.995 at p50 <= 2 ms on one core at 1M, on both galleries and on the held-out
queries; the tuner's measuring time < 10% of its builds.

  python -m bench.stage1_frontier                       # 1M, both galleries (about an hour on 2 cores)
  python -m bench.stage1_frontier --n 100000 --out stage1_frontier_100k
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from typing import Any

import faiss
import numpy as np

from bench.clip_like import HARD, ClipLikeConfig, clip_like_sets, describe
from bench.harness import RESULTS, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import table
from gare_build.tuning.ladder import TuneConfig, describe_params
from gare_build.tuning.measure import exact_topk, recall_of_topk
from gare_build.tuning.recall import tune_ann
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams, default_nlist

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_index/ann.py",
    "indexer/gare_index/ann_params.py",
    "indexer/gare_build/tuning/",
)


K, TOP = 256, 10
TARGET, BUDGET_MS = 0.995, 2.0
GALLERIES = {"bench": ClipLikeConfig(), "hard": HARD}


def one_thread_latency(ann: AnnIndex, q: np.ndarray, n_lat: int) -> dict[str, float]:
    """p50 / p95 ms of one query per call, and ms per query with 32 queries per call, on ONE thread."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        ann.search(q[:1], K)  # warm-up
        lat = []
        for i in range(min(n_lat, q.shape[0])):
            t0 = time.perf_counter()
            ann.search(q[i : i + 1], K)
            lat.append(time.perf_counter() - t0)
        m = min(n_lat, q.shape[0]) // 32 * 32
        t0 = time.perf_counter()
        for s in range(0, m, 32):
            ann.search(q[s : s + 32], K)
        batch_ms = 1000 * (time.perf_counter() - t0) / m if m else float("nan")
    finally:
        faiss.omp_set_num_threads(threads)
    return {"p50_ms": 1000 * float(np.median(lat)), "p95_ms": 1000 * float(np.percentile(lat, 95)),
            "batch32_ms_per_query": batch_ms}


def evaluate(ann: AnnIndex, sets: dict[str, Any], n_lat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("eval", "held"):
        _, got = ann.search(sets[f"q_{name}"], K)
        out[f"recall_{name}"] = recall_of_topk(got, sets[f"gt_{name}"])
    out.update(one_thread_latency(ann, sets["q_eval"], n_lat))
    return out


def ivfpq_sharing(coarse: faiss.Index, x: np.ndarray, pq_m: int, nlist: int) -> faiss.Index:
    """A fast-scan IVF-PQ over ``x`` whose coarse quantiser is a copy of ``coarse``'s (already trained): only the
    product quantiser is trained (faiss skips k-means when the quantiser is trained and holds nlist centroids)."""
    ivf = faiss.extract_index_ivf(coarse)
    quantizer = faiss.clone_index(ivf.quantizer)
    index = faiss.IndexIVFPQFastScan(quantizer, x.shape[1], nlist, pq_m, 4, faiss.METRIC_INNER_PRODUCT)
    rows = np.sort(np.random.default_rng(1234).choice(x.shape[0], size=min(x.shape[0], 40 * nlist), replace=False))
    index.train(np.ascontiguousarray(x[rows]))
    for s in range(0, x.shape[0], 65_536):
        e = min(x.shape[0], s + 65_536)
        index.add_with_ids(np.ascontiguousarray(x[s:e]), np.arange(s, e, dtype=np.int64))
    return index


def frontier(name: str, sets: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]],
             flush: Any, tune: Any) -> None:
    """Every type's settings into ``rows``; ``tune(index, build_s)`` runs the tuner on the IVF-Flat index built here
    (as ``gare-index build`` hands the tuner the index it built) before HNSW's build needs the memory, or on the
    first HNSW graph when no IVF type is measured."""
    x = sets["x"]
    n = x.shape[0]
    nlist = args.nlist or default_nlist(n)

    def record(kind: str, setting: str, build_s: float | None, ann: AnnIndex, extra: dict[str, Any]) -> None:
        m = evaluate(ann, sets, args.latency_queries)
        row = {"gallery": name, "n": n, "type": kind, "setting": setting, "build_s": build_s, **extra, **m}
        rows.append(row)
        print(f"  {name} {kind} {setting}: eval {m['recall_eval']:.4f} held {m['recall_held']:.4f} "
              f"p50 {m['p50_ms']:.2f} ms (x32: {m['batch32_ms_per_query']:.2f} ms/q)", flush=True)

    if "ivf" in args.types or "ivfpq-fs" in args.types:
        t0 = time.perf_counter()
        p = AnnParams("ivf", nlist=nlist, coarse="flat", train_per_cell=40)
        ivf = build_index(x, np.arange(n, dtype=np.int64), p, use_gpu=False)
        ivf_s = time.perf_counter() - t0
        print(f"{name}: ivf nlist={nlist} built in {ivf_s:.1f} s", flush=True)
        if "ivf" in args.types:
            for nprobe in args.nprobes:
                pp = AnnParams("ivf", nlist=nlist, nprobe=nprobe, coarse="flat")
                record("ivf", describe_params(pp), ivf_s if nprobe == args.nprobes[0] else None,
                       AnnIndex(ivf, pp, use_gpu=False), {"nlist": nlist, "nprobe": nprobe})
            flush()
        if "ivfpq-fs" in args.types:
            for pq_m in args.pq_m:
                t0 = time.perf_counter()
                index = ivfpq_sharing(ivf, x, pq_m, nlist)
                pq_s = time.perf_counter() - t0
                print(f"{name}: ivfpq-fs pq_m={pq_m} built in {pq_s:.1f} s (+ the shared k-means)", flush=True)
                first = True
                for nprobe in args.nprobes:
                    for rescore in args.rescores:
                        pp = AnnParams("ivfpq", nlist=nlist, nprobe=nprobe, pq_m=pq_m, fastscan=True,
                                       rescore=rescore, coarse="flat")
                        record("ivfpq-fs", describe_params(pp), pq_s if first else None,
                               AnnIndex(index, pp, x, use_gpu=False),
                               {"nlist": nlist, "nprobe": nprobe, "pq_m": pq_m, "rescore": rescore})
                        first = False
                flush()
                del index
        if not args.no_tune:
            tune(ivf, ivf_s)
        del ivf
        gc.collect()
    tuned = args.no_tune or "ivf" in args.types or "ivfpq-fs" in args.types
    if "hnsw" in args.types:
        for m in args.hnsw_m:
            t0 = time.perf_counter()
            p = AnnParams("hnsw", hnsw_m=m, ef_construction=args.ef_construction)
            index = build_index(x, np.arange(n, dtype=np.int64), p, use_gpu=False)
            h_s = time.perf_counter() - t0
            print(f"{name}: hnsw M={m} efC={args.ef_construction} built in {h_s:.1f} s", flush=True)
            for i, ef in enumerate(args.ef_search):
                pp = AnnParams("hnsw", hnsw_m=m, ef_construction=args.ef_construction, ef_search=ef)
                record("hnsw", describe_params(pp), h_s if i == 0 else None, AnnIndex(index, pp, use_gpu=False),
                       {"hnsw_m": m, "ef_search": ef})
            flush()
            if not tuned:  # no IVF measured: the tuner starts from this graph (then its own ladder)
                tune(index, h_s)
                tuned = True
            del index
            gc.collect()
    if not tuned:
        tune(None, 0.0)


def tune(g: str, sets: dict[str, Any], args: argparse.Namespace, ivf: faiss.Index | None, ivf_s: float) -> dict[str, Any]:
    """The tuner given only the sample (and the index built for the frontier, IVF-Flat or else HNSW, as ``gare-index
    build`` hands it the index it built): its choice, times, and the choice's recall on the evaluation and held-out
    sets."""
    given = None
    if ivf is not None:  # the frontier left its last knobs on the index: the tuner starts from the first ones
        gp = AnnParams.from_index(ivf)
        given = AnnIndex(ivf, dataclasses.replace(gp, ef_search=K) if gp.index_type == "hnsw" else gp, use_gpu=False)
    ann, res = tune_ann(sets["x"], sets["q_sample"], query_source=f"{g} captions (sample)", ann=given, build_s=ivf_s,
                        config=TuneConfig(latency_budget_ms=args.budget_ms, strict=False), progress=True)
    rec = {"gallery": g, "choice": f"{res.index_type} {describe_params(AnnParams.from_dict(res.params))}",
           "met": res.met, "build_s": res.build_s, "tuning_s": res.tuning_s, "message": res.message,
           "builds": res.builds, "recall_eval": float("nan"), "recall_held": float("nan"), "p50_ms": res.p50_ms}
    if ann is not None:
        rec.update(evaluate(ann, sets, args.latency_queries))
    return rec


def best_within(rows: list[dict[str, Any]], gallery: str, kind: str, budget: float) -> dict[str, Any] | None:
    """The setting of ``kind`` with the highest min(eval, held-out) recall at p50 <= budget."""
    ok = [r for r in rows if r["gallery"] == gallery and r["type"] == kind and r["p50_ms"] <= budget]
    return max(ok, key=lambda r: (min(r["recall_eval"], r["recall_held"]), -r["p50_ms"])) if ok else None


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gals = sorted({r["gallery"] for r in rows})
    fig, axes = plt.subplots(1, len(gals), figsize=(6 * len(gals), 4.5), squeeze=False)
    for ax, g in zip(axes[0], gals, strict=True):
        for key in sorted({(r["type"], r.get("pq_m"), r.get("hnsw_m"), r.get("rescore")) for r in rows if r["gallery"] == g},
                          key=str):
            pts = sorted((r["p50_ms"], r["recall_held"]) for r in rows
                         if r["gallery"] == g and (r["type"], r.get("pq_m"), r.get("hnsw_m"), r.get("rescore")) == key)
            label = key[0] + (f" pq_m={key[1]} x{key[3]}" if key[1] else "") + (f" M={key[2]}" if key[2] else "")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(TARGET, color="grey", ls="--", lw=0.8)
        ax.axvline(BUDGET_MS, color="grey", ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("p50 ms, one query, one thread")
        ax.set_ylabel("recall@256 of the exact top-10 (held-out queries)")
        ax.set_ylim(max(0.8, min(r["recall_held"] for r in rows if r["gallery"] == g) - 0.01), 1.001)
        ax.set_title(f"{g} gallery, n = {rows[0]['n']:,}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if render_requested(RESULTS / "stage1_frontier.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--galleries", nargs="+", default=list(GALLERIES), choices=list(GALLERIES))
    ap.add_argument("--queries", type=int, default=500, help="per set: tuner sample, evaluation, held-out")
    ap.add_argument("--latency-queries", type=int, default=200)
    ap.add_argument("--types", nargs="+", default=["ivf", "ivfpq-fs", "hnsw"])
    ap.add_argument("--nlist", type=int, default=None, help="IVF cells (default: default_nlist(n))")
    ap.add_argument("--nprobes", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--pq-m", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--rescores", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--hnsw-m", type=int, nargs="+", default=[32])
    ap.add_argument("--ef-construction", type=int, default=200, help="HNSW build depth (the product default)")
    ap.add_argument("--ef-search", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--budget-ms", type=float, default=BUDGET_MS, help="the tuner's p50 budget")
    ap.add_argument("--no-tune", action="store_true", help="frontier only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="stage1_frontier")
    add_render_arg(ap, RESULTS / "stage1_frontier.json")
    args = ap.parse_args()
    run = start(__name__, MEASURES)
    commit = git_commit()
    rows: list[dict[str, Any]] = []
    tuned: list[dict[str, Any]] = []
    stats: dict[str, Any] = {}

    def report(final: bool = False) -> None:
        lines = [
            f"Commit `{commit}`. n = {args.n:,} unit vectors, d = 512, per gallery; {args.queries} queries per set. "
            "*eval*: queries from the tuner's distribution (captions of random gallery videos); *held-out*: another "
            "distribution (a topic chosen uniformly, noisier captions). Recall: share of each query's exact top-10 "
            f"inside the top-{K}. *p50 / p95*: one query per call on ONE thread over {args.latency_queries} queries; "
            "*x32*: ms per query when 32 come in one call (one thread). *build s*: training + adding (IVF-PQ: its "
            "product quantiser and codes; its coarse quantiser is the IVF-Flat one, trained once)."
            + ("" if final else " **PARTIAL: the run had not finished when this was written.**"), ""]
        for g in args.galleries:
            gr = [r for r in rows if r["gallery"] == g]
            if not gr:
                continue
            lines += [f"## {g} gallery: the frontier", "", table(
                ["type", "setting", "build s", "recall eval", "recall held-out", "p50 ms", "p95 ms", "x32 ms/q"],
                [[r["type"], r["setting"], "" if r["build_s"] is None else f"{r['build_s']:.0f}",
                  f"{r['recall_eval']:.4f}", f"{r['recall_held']:.4f}", f"{r['p50_ms']:.2f}", f"{r['p95_ms']:.2f}",
                  f"{r['batch32_ms_per_query']:.2f}"] for r in gr])]
            best = [(t, best_within(rows, g, t, args.budget_ms)) for t in args.types]
            lines += [f"Best of each type at p50 <= {args.budget_ms} ms (by the lower of the two recalls):", ""]
            lines += [f"- {t}: " + (f"{b['setting']}: eval {b['recall_eval']:.4f}, held-out {b['recall_held']:.4f}, "
                                    f"p50 {b['p50_ms']:.2f} ms" if b else "no setting within the budget")
                      for t, b in best]
            lines.append("")
        if tuned:
            lines += ["## The tuner (given the sample only)", "", table(
                ["gallery", "choice", "met", "recall eval", "recall held-out", "p50 ms", "build s", "tune s",
                 "tune / build"],
                [[t["gallery"], t["choice"], t["met"], f"{t['recall_eval']:.4f}" if t["recall_eval"] == t["recall_eval"]
                  else "n/a", f"{t['recall_held']:.4f}" if t["recall_held"] == t["recall_held"] else "n/a",
                  f"{t['p50_ms']:.2f}", f"{t['build_s']:.0f}", f"{t['tuning_s']:.1f}",
                  f"{t['tuning_s'] / t['build_s']:.1%}"] for t in tuned])]
            lines += [f"- {t['gallery']}: {t['message']}" for t in tuned] + [""]
        checks = []
        for g in args.galleries:
            ok = [r for r in rows if r["gallery"] == g and r["p50_ms"] <= BUDGET_MS
                  and min(r["recall_eval"], r["recall_held"]) >= TARGET]
            if any(r["gallery"] == g for r in rows):
                f = min(ok, key=lambda r: r["p50_ms"]) if ok else None
                checks.append((f"{g}: a setting with recall >= {TARGET} on both query sets at p50 <= {BUDGET_MS} ms "
                               + (f"(fastest: {f['type']} {f['setting']}, {f['p50_ms']:.2f} ms)" if f else "(none)"),
                               bool(ok)))
        for t in tuned:
            checks.append((f"{t['gallery']}: the tuner met the target within {args.budget_ms} ms and its held-out "
                           f"recall >= {TARGET} (got {t['recall_held']:.4f})", bool(t["met"]) and t["recall_held"] >= TARGET))
            checks.append((f"{t['gallery']}: tuning < 10% of the build (got {t['tuning_s'] / t['build_s']:.1%})",
                           t["tuning_s"] < 0.10 * t["build_s"]))
        lines += ["## Targets (issue 29)", ""] + [f"- {'PASS' if ok else 'FAIL'}: {s}" for s, ok in checks]
        lines += ["", "Data statistics (sampled; held-out queries): " + "; ".join(
            f"{g}: " + ", ".join(f"{a} {b:.3f}" for a, b in s.items()) for g, s in stats.items())]
        if rows:
            plot(rows, RESULTS / f"{args.out}.png")
            lines += ["", f"![recall vs p50]({args.out}.png)"]
        write_results(args.out, f"Stage 1 at {args.n:,}: the recall / latency frontier per index type, and the tuner",
                      "\n".join(lines), {"final": final, "rows": rows, "tuned": tuned, "stats": stats,
                                         "checks": [{"check": s, "pass": ok} for s, ok in checks],
                                         "generators": {g: GALLERIES[g].to_dict() for g in args.galleries}}, run)

    for g in args.galleries:
        t0 = time.time()
        s = clip_like_sets(args.n, 2 * args.queries, args.queries, seed=args.seed, cfg=GALLERIES[g], progress=True)
        sets = {"x": s["x"], "q_sample": s["q"][: args.queries], "q_eval": s["q"][args.queries :], "q_held": s["q_held"]}
        stats[g] = describe(s["x"], s["q_held"], s["target_held"])
        sets["gt_eval"] = exact_topk(sets["x"], sets["q_eval"], TOP)[1]
        sets["gt_held"] = exact_topk(sets["x"], sets["q_held"], TOP)[1]
        print(f"{g}: generated and ground truth in {time.time() - t0:.0f} s; {stats[g]}", flush=True)

        frontier(g, sets, args, rows, report,
                 lambda ivf, ivf_s, g=g, sets=sets: tuned.append(tune(g, sets, args, ivf, ivf_s)) or report())
        del sets, s
        gc.collect()
        report()
    report(final=True)
    print(json.dumps([r for r in tuned], indent=1, default=str))


if __name__ == "__main__":
    main()
