"""Stage 1 under a filter (``gare_search.filtered``): recall and latency of each plan at four selectivities.

A synthetic clustered gallery of ``--n`` unit vectors (d = ``--dim``) written as a real index version (one frame
per video: stage 1 reads only the unit vectors) with fields of known distributions, independent of the vectors:

* ``channel``: string, 2000 channels with Zipf(1.1) frequencies;
* ``year``: number, uniform over 2000..2024;
* ``tags``: tags, 0-4 of 40 tags per video, tag i drawn with weight 1 / (i + 1);
* the built-in ``duration``: log-normal (median 60 s).

Filters are chosen on the data to pass about 0.1 %, 1 %, 3 %, 10 % and 50 % of the gallery (the JSON and the measured
selectivity are reported). Queries are noisy copies of random gallery vectors. For each filter and query (one query
at a time, one faiss thread, K = ``--k`` candidates):

* the reference: an exhaustive filtered search (every passing row's cosine, top 10 by cosine desc, id asc);
* each plan of ``filtered_stage1``: ``exact`` (forced: ``exact_below=1``), ``ann`` (forced: ``exact_below=0``;
  still exact when ``passing <= K``) and ``auto`` (the service's default ``filter_exact_below``);
  recall@10 (the plan's top 10 against the reference's) and recall 10@K (the reference's top 10 among the plan's K
  candidates, what the rerank sees), p50 / p95 latency of a filter searched before (its rows kept by the version);
* the first search of each filter: its evaluation over every row and the id bitmap (a fresh filter cache);
* the unfiltered ANN at the same K (``IndexVersion.search``), p50.

Also the first filtered search's column load: every filter column read from the version's ``fields/`` arrays
against the same columns read from meta.sqlite (what a version written before the arrays pays).

  python -m bench.filtered_search --n 100000 --out filtered_search_100k    # ~3 minutes on 2 cores
  python -m bench.filtered_search --n 1000000 --queries 100 --out filtered_search_1m   # the 1M gallery (~3 GB RAM)

``--work DIR`` keeps the written gallery; a later run with the same arguments reuses it (DIR/gallery.json).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from bench.harness import RESULTS, start, write_results
from bench.serve_bench import gallery_ann_params
from gare_index.ann_params import choose_index_type
from gare_index.filter_cache import FilterCache
from gare_index.filters import FieldTable
from gare_index.store import open_index, write_version
from gare_search.filtered import FILTER_EXACT_BELOW, filtered_stage1

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_search/filtered.py",
    "indexer/gare_index/filters.py",
    "indexer/gare_index/ann.py",
    "indexer/gare_index/store/field_arrays.py",
    "indexer/gare_index/store/index_version.py",
)
TOP = 10
TARGETS = (0.001, 0.01, 0.03, 0.1, 0.5)  # 0.03: just above the default exact plan's 2%, the ANN's hardest
PLANS = {"exact": 1.0, "ann": 0.0, "auto": FILTER_EXACT_BELOW}
N_CHANNELS, N_TAGS = 2000, 40
USER_FIELDS = {"channel": "string", "year": "number", "tags": "tags"}


def generate(n: int, dim: int, seed: int) -> dict[str, Any]:
    """The gallery's vectors and fields (deterministic in `seed`)."""
    rng = np.random.default_rng(seed)
    n_clusters = max(32, n // 500)
    centres = rng.standard_normal((n_clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    units = centres[rng.integers(0, n_clusters, n)] + rng.standard_normal((n, dim)).astype(np.float32) * (0.5 / math.sqrt(dim))
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    zipf = 1.0 / np.arange(1, N_CHANNELS + 1) ** 1.1
    channel = rng.choice(N_CHANNELS, n, p=zipf / zipf.sum())
    year = rng.integers(2000, 2025, n)
    tw = 1.0 / np.arange(1, N_TAGS + 1)
    ntags = rng.integers(0, 5, n)
    tags = [sorted(set(rng.choice(N_TAGS, k, p=tw / tw.sum()).tolist())) for k in ntags]
    duration = np.round(np.exp(rng.normal(math.log(60.0), 1.0, n)), 2)
    return {"channel": channel, "year": year, "tags": tags, "duration": duration, "units": units, "clusters": n_clusters}


def make_gallery(root: Path, n: int, dim: int, seed: int, index_type: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the gallery under `root` (or reuse the one a previous run with the same arguments wrote there, as its
    gallery.json says); returns (timings and shape, the fields per row for choosing filters)."""
    t0 = time.perf_counter()
    d = generate(n, dim, seed)
    t1 = time.perf_counter()
    index_type = index_type or choose_index_type(n)
    params = gallery_ann_params(n, index_type)
    key = {"n": n, "dim": dim, "seed": seed, "index_type": params.index_type, "ann_params": params.to_dict()}
    stamp = root.parent / "gallery.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        info = json.loads(stamp.read_text())["info"]
        print(f"reusing the gallery written by an earlier run in {root}", flush=True)
        return {**info, "generate_s": round(t1 - t0, 1), "reused": True}, d
    if root.exists():
        shutil.rmtree(root)
    channel, year, tags, duration, units = d["channel"], d["year"], d["tags"], d["duration"], d["units"]
    ids = np.arange(n, dtype=np.int64)
    rows = ({"id": int(i), "path": f"/library/c{channel[i]:04d}/clip{i:07d}.mp4", "size": 1_000_000, "mtime": 0.0,
             "checksum": "", "duration": float(duration[i]), "fps": 30.0, "frames_used": 1, "start": None, "end": None,
             "channel": f"ch{channel[i]:04d}", "year": float(year[i]), "tags": [f"t{t:02d}" for t in tags[i]]}
            for i in range(n))
    name = write_version(root, {"ids": ids, "norms": np.ones(n, np.float32), "units": units,
                                "frames": units[:, None, :].astype(np.float16), "masks": np.ones((n, 1), np.uint8),
                                "biases": np.zeros(n, np.float32)},
                         rows, {"ann_params": params.to_dict(), "synthetic": True, "fields": USER_FIELDS})
    info = {"n": n, "dim": dim, "clusters": d["clusters"], "index_type": params.index_type, "ann_params": params.to_dict(),
            "version": name, "generate_s": round(t1 - t0, 1), "write_version_s": round(time.perf_counter() - t1, 1)}
    stamp.write_text(json.dumps({"key": key, "info": info}))
    return info, d


def choose_filters(d: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """One filter per target selectivity, built from the fields' empirical distributions."""
    counts = np.bincount(d["channel"], minlength=N_CHANNELS) / n
    tag_freq = np.bincount(np.concatenate([np.asarray(t, np.int64) for t in d["tags"]] or [np.zeros(0, np.int64)]),
                           minlength=N_TAGS) / n
    recent = float((d["year"] >= 2020).mean())
    out = []
    for target in TARGETS:
        if target <= 0.002:  # one channel of the Zipf tail
            c = int(np.argmin(np.abs(counts - target)))
            spec: dict[str, Any] = {"channel": f"ch{c:04d}"}
        elif target <= 0.05:  # two independent fields: recent years and short clips
            q = round(float(np.quantile(d["duration"], min(1.0, target / recent))), 1)
            spec = {"year": {"$gte": 2020}, "duration": {"$lt": q}}
        elif target <= 0.2:  # a tag, or the head channel's videos
            t = int(np.argmin(np.abs(tag_freq - target)))
            spec = {"$or": [{"tags": f"t{t:02d}"}, {"channel": "ch0000", "year": 2000}]}
        else:
            spec = {"duration": {"$gte": round(float(np.quantile(d["duration"], 1 - target)), 1)}}
        out.append(spec)
    return out


def exhaustive_tops(units: np.ndarray, mask: np.ndarray, queries: np.ndarray) -> list[np.ndarray]:
    """The reference: per query, ids (≤ TOP,) of the passing rows by cosine desc, id asc (ids are rows here)."""
    rows = np.flatnonzero(mask)
    out = []
    for s in range(0, len(queries), 64):  # (passing, 64) float32 scores at a time
        cos = units[rows] @ queries[s:s + 64].T
        out += [rows[np.lexsort((rows, -cos[:, j]))[:TOP]] for j in range(cos.shape[1])]
    return out


def pct_ms(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs) * 1e3, q)), 3) if xs else float("nan")


def column_load(version: Any) -> dict[str, Any]:
    """Seconds to load each filter column from fields/ arrays and from meta.sqlite (a fresh table each)."""
    schema = version.field_schema
    out = {}
    for name in ("channel", "year", "tags", "duration", "folder"):
        t0 = time.perf_counter()
        FieldTable(version.n, schema, lambda f: version._field_column(f, schema[f])).column(name)
        t1 = time.perf_counter()
        FieldTable(version.n, schema, lambda f: version._meta.field_column(f, schema[f], version.ids)).column(name)
        t2 = time.perf_counter()
        out[name] = {"arrays_ms": round((t1 - t0) * 1e3, 2), "sqlite_ms": round((t2 - t1) * 1e3, 2)}
    return out


def measure(version: Any, d: dict[str, Any], specs: list[dict[str, Any]], queries: np.ndarray, k: int
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    units = d["units"]
    rows_out = []
    for spec in specs:
        f = version.compile_filter(spec)
        cold = []
        for _ in range(5):  # the first search of a filter: its evaluation, the id bitmap (a fresh cache each time)
            version.filter_cache = FilterCache()
            t0 = time.perf_counter()
            version.filter_rows(f)
            cold.append(time.perf_counter() - t0)
        mask = version.filter_mask(f)
        refs = exhaustive_tops(units, mask, queries)
        row: dict[str, Any] = {"filter": spec, "passing": int(mask.sum()), "selectivity": float(mask.mean()), "plans": {},
                               "first_filter_ms": pct_ms(cold, 50)}
        for plan, below in PLANS.items():
            lat, r10, r10k, taken, f_s, s1_s, rounds = [], [], [], {}, [], [], []
            for q, ref in zip(queries, refs, strict=True):
                t0 = time.perf_counter()
                _, ids, fp = filtered_stage1(version, q[None, :], k, f, ncl_stage1=False, exact_below=below)
                lat.append(time.perf_counter() - t0)
                got = ids[0]
                taken[fp.plan] = taken.get(fp.plan, 0) + 1
                f_s.append(fp.filter_s)
                s1_s.append(fp.stage1_s)
                rounds.append(fp.rounds)
                if ref.size:
                    r10.append(len(set(got[:TOP].tolist()) & set(ref.tolist())) / ref.size)
                    r10k.append(len(set(got.tolist()) & set(ref.tolist())) / ref.size)
            row["plans"][plan] = {"p50_ms": pct_ms(lat, 50), "p95_ms": pct_ms(lat, 95), "filter_p50_ms": pct_ms(f_s, 50),
                                  "stage1_p50_ms": pct_ms(s1_s, 50), "ann_rounds_mean": round(float(np.mean(rounds)), 2),
                                  "recall_at_10": round(float(np.mean(r10)), 4) if r10 else None,
                                  "recall_10_at_k": round(float(np.mean(r10k)), 4) if r10k else None, "taken": taken}
        rows_out.append(row)
        print(f"  {row['selectivity']:.4f}: " + ", ".join(f"{p} {v['p50_ms']} ms r@10 {v['recall_at_10']}"
                                                           for p, v in row["plans"].items()), flush=True)
    lat = []
    for q in queries:
        t0 = time.perf_counter()
        version.search(q[None, :], k)
        lat.append(time.perf_counter() - t0)
    return rows_out, {"p50_ms": pct_ms(lat, 50), "p95_ms": pct_ms(lat, 95)}


def plot(rows: list[dict[str, Any]], unfiltered: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r["selectivity"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for plan, mark in zip(PLANS, "osd", strict=True):
        ax1.plot(sel, [r["plans"][plan]["p50_ms"] for r in rows], marker=mark, label=plan)
        ax2.plot(sel, [r["plans"][plan]["recall_at_10"] for r in rows], marker=mark, label=plan)
    ax1.axhline(unfiltered["p50_ms"], color="grey", ls="--", label="unfiltered ANN")
    ax1.set(xscale="log", yscale="log", xlabel="selectivity (passing / n)", ylabel="p50 stage 1 (ms)")
    ax2.set(xscale="log", xlabel="selectivity (passing / n)", ylabel="recall@10 vs exhaustive filtered",
            ylim=(min(0.5, min((r["plans"][p]["recall_at_10"] or 1) for r in rows for p in PLANS) - 0.02), 1.01))
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--k", type=int, default=256, help="stage-1 candidates (the service's default)")
    p.add_argument("--index-type", default=None, help="the ANN (default: the automatic type for n)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="where to write the gallery (default: a temporary folder, removed)")
    p.add_argument("--out", default=None, help="bench/results/<out>.{json,md,png} (default filtered_search_<n>)")
    args = p.parse_args(argv)
    run = start(__name__, MEASURES, argv)
    out = args.out or f"filtered_search_{args.n}"
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gare-filtered-"))
    faiss.omp_set_num_threads(1)
    try:
        info, d = make_gallery(work / "index", args.n, args.dim, args.seed, args.index_type)
        print(f"gallery: {info}", flush=True)
        rng = np.random.default_rng(args.seed + 1)
        pick = rng.integers(0, args.n, args.queries)
        queries = d["units"][pick] + rng.standard_normal((args.queries, args.dim)).astype(np.float32) * (0.6 / math.sqrt(args.dim))
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        with open_index(work / "index") as v:
            loads = column_load(v)
            rows, unfiltered = measure(v, d, choose_filters(d, args.n), queries, args.k)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    title = f"filtered stage 1, n = {args.n:,}, d = {args.dim}, {info['index_type']}, K = {args.k}"
    png = RESULTS / f"{out}.png"
    plot(rows, unfiltered, png, title)
    lines = [f"Gallery: {info}. {args.queries} queries, one at a time, one faiss thread; recall against an exhaustive",
             "filtered search (top 10 by cosine). Plans: `exact` forced, `ann` forced (still exact when passing <= K),",
             f"`auto` = the default `filter_exact_below` = {FILTER_EXACT_BELOW}.", "",
             f"Unfiltered ANN at K = {args.k}: p50 {unfiltered['p50_ms']} ms, p95 {unfiltered['p95_ms']} ms.", "",
             "p50 is the whole `filtered_stage1` call of a filter searched before (the version keeps the rows it passes:",
             "`filter ms` is the cache lookup) and the plan's stage 1 (`stage 1 ms`: the product and top K, or the ANN",
             "rounds, `rounds` on average). `first ms`: the first search of a filter pays its evaluation over every row",
             "and the id bitmap once (median of 5, a fresh cache each).", "",
             "| filter | passing | selectivity | first ms | plan | taken | p50 ms | p95 ms | filter ms | stage 1 ms | rounds | recall@10 | recall 10@K |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for plan, m in r["plans"].items():
            fl = "`" + str(r["filter"]).replace("'", '"') + "`"
            lines.append(f"| {fl} | {r['passing']} | {r['selectivity']:.4f} | {r['first_filter_ms']} | {plan} | {m['taken']} | {m['p50_ms']} | "
                         f"{m['p95_ms']} | {m['filter_p50_ms']} | {m['stage1_p50_ms']} | {m['ann_rounds_mean']} | "
                         f"{m['recall_at_10']} | {m['recall_10_at_k']} |")
    lines += ["", "First filtered search: one column loaded from the version's fields/ arrays vs from meta.sqlite (ms):", "",
              "| column | fields/ arrays | meta.sqlite |", "|---|---:|---:|"]
    lines += [f"| {c} | {m['arrays_ms']} | {m['sqlite_ms']} |" for c, m in loads.items()]
    lines += ["", f"![plot]({png.name})"]
    write_results(out, title, "\n".join(lines), {"gallery": info, "k": args.k, "queries": args.queries,
                                                  "filters": rows, "unfiltered": unfiltered, "column_load": loads,
                                                  "plot": png.name}, run)


if __name__ == "__main__":
    main()
