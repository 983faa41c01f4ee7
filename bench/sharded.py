"""Sharded search benchmark (issue 26): one gallery served as 1, 2 and 4 shards on one machine, against the single
index over the same videos, and a capacity plan for 10M / 100M videos derived from the measured per-shard costs.

    python -m bench.sharded                 # 100k videos (~10 min on 2 cores)
    python -m bench.sharded --quick         # 10k videos, few queries (~1 min)
    python -m bench.sharded --render bench/results/sharded.json   # rewrite the .md from the JSON, run nothing

The gallery is bench/serve_bench.py's synthetic one (clustered unit vectors, 12 float16 frames of d = 512 per video,
psi's folded constants), written once as a real index with exact (flat) stage 1; that index is shard s000 of the
1-shard root and the reference single index. The 2- and 4-shard roots hold the same videos, routed by
``gare_index.shards.shard_of`` of a per-video content id, each shard a normal version written by
``gare_index.store.write_version``, named by a generation file (``write_generation``).

Query path measured (one query at a time, one client, torch and faiss on 1 thread, warm page cache):
- ``single``: ``gare_search.search.search_batch`` on the single index (encode, stage 1, psi rerank, rank);
- ``N seq``: encode once, ``gare_search.shard_search.shard_candidates`` on every shard one after the other, ``merge``:
  exactly ``search_sharded``'s steps (checked equal to it), with each shard's stage times recorded: the work one
  Ray shard replica does per request (``gare_serve.ray_serve.shard_replica.ShardWorker.candidates``);
- ``N pool``: the same with the shards in a thread pool (one thread per shard: FAISS and the rerank kernel release
  the GIL), what a one-host Ray deployment overlaps, bounded here by 2 cores. Each pool thread gets FAISS's
  thread bound itself: OpenMP keeps its thread count per thread, and a new thread that runs FAISS before any
  torch op would search with every core (Ray sets OMP_NUM_THREADS in its replicas);
- ``critical path`` (derived from the seq samples, per query): encode + the slowest shard + merge, what a cluster
  with one core per shard replica would see before network and serialisation.
The exactness check runs ``search_sharded`` (text, NCL off and on), ``search_sharded_by_videos`` and
``search_sharded_by_image`` on every query against the single index: same ids (mapped to global ids), scores within
1e-5. Memory: bytes of every shard's version files, and the RSS (anonymous / file-backed) of a child process that
holds only one shard as a replica does. The capacity plan (``plan``) takes its costs from this run's JSON and its
assumptions from the command line, both recorded; the report is rendered from the JSON by :func:`markdown`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import (
    UNKNOWN_COMMIT,
    command_line,
    cpu_name,
    git_commit,
    loadavg,
    render_saved,
    start,
    with_provenance,
    write_report,
)
from bench.serve_bench import make_queries, summary_ms, warm_file, write_gallery

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gare.checkpoint import file_sha256, load_model, save_checkpoint  # noqa: E402
from gare.config import get_model_config  # noqa: E402
from gare.model import GARE  # noqa: E402
from gare.psi_fold_weights import fold_weights  # noqa: E402
from gare.text_quant import DEFAULT_CPU_TEXT_ENCODER, build_text_encoder  # noqa: E402
from gare_index.shards import current_generation, open_sharded, shard_of, shard_root, write_generation  # noqa: E402
from gare_index.store import open_index, open_version, write_version  # noqa: E402
from gare_search import by_example, rerank  # noqa: E402
from gare_search.query import encode_queries  # noqa: E402
from gare_search.search import SearchOptions, search_batch  # noqa: E402
from gare_search.shard_search import (  # noqa: E402
    merge,
    search_sharded,
    search_sharded_by_image,
    search_sharded_by_videos,
    shard_candidates,
)
from gare_serve.engine.versions import advise_random_access  # noqa: E402
from gare_serve.ray_serve.shard_replica import load_shard_model  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_search/",
    "indexer/gare_index/shards.py",
    "indexer/gare_index/store/",
    "indexer/gare_build/shard_build.py",
    "service/gare_serve/ray_serve/shard_replica.py",
    "service/gare_serve/engine/versions.py",
    "training/gare/text_quant.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


SHARD_COUNTS = (1, 2, 4)
TOL = 1e-5  # |score(sharded) - score(single)|: float32 sums over the same rows in the same order
K, TOP_K = 256, 10


# ------------------------------------------------------------------------------------------ the gallery as shards
def content_ids(n: int, seed: int) -> list[str]:
    """A content id per video (what a real build takes from the file's sha256): routes it to its shard."""
    return [hashlib.sha256(f"synthetic-video-{seed}-{i}".encode()).hexdigest() for i in range(n)]


def assignment(n: int, n_shards: int, seed: int) -> np.ndarray:
    """(n,) int64: the shard of every video of the single index (row i = single id i)."""
    return np.asarray([shard_of(c, n_shards) for c in content_ids(n, seed)], dtype=np.int64)


def global_ids(n: int, n_shards: int, seed: int) -> np.ndarray:
    """(n,) int64: single id -> the sharded index's global id (local * N + shard; a shard's local ids number its
    videos in single-id order)."""
    shard = assignment(n, n_shards, seed)
    out = np.empty(n, np.int64)
    for s in range(n_shards):
        rows = np.flatnonzero(shard == s)
        out[rows] = np.arange(rows.size, dtype=np.int64) * n_shards + s
    return out


def write_shards(work: Path, n: int, ckpt: dict[str, Any], fold: Any, seed: int) -> dict[str, Any]:
    """(In a child process.) The gallery as the 1-shard root (its s000 is the single index) and the 2- and 4-shard
    roots over the same rows; returns the generation timings."""
    t0 = time.perf_counter()
    g = write_gallery(work / "src", n, ckpt, fold, seed=seed, index_type="flat")
    roots = {c: work / f"n{c}" for c in SHARD_COUNTS}
    shard_root(roots[1], 0).parent.mkdir(parents=True)
    os.replace(work / "src" / "index", shard_root(roots[1], 0))  # the single index, moved (it is relocatable)
    write_generation(roots[1], [g["version"]])
    t_gen = time.perf_counter() - t0
    src = open_index(shard_root(roots[1], 0))
    extra = {k: v for k, v in src.manifest.to_dict().items() if k in ("checkpoint", "ann_params", "biases",
                                                                      "psi_fold", "synthetic")}
    cids = content_ids(n, seed)
    t1 = time.perf_counter()
    for c in SHARD_COUNTS[1:]:
        shard = assignment(n, c, seed)
        versions = []
        for s in range(c):
            rows = np.flatnonzero(shard == s)  # ascending single ids: local id j = rows[j]'s position
            arrays = {"ids": np.arange(rows.size, dtype=np.int64), "norms": src.norms[rows], "units": src.units[rows],
                      "frames": src.frames[rows], "masks": src.masks[rows], "biases": src.biases[rows],
                      "psi_consts": src.psi_consts[rows]}
            meta = ({"id": j, "path": f"/library/clip{int(i):07d}.mp4", "size": 1_000_000, "mtime": 0.0,
                     "checksum": cids[int(i)], "duration": 10.0, "fps": 30.0,
                     "frames_used": int(src.masks[int(i)].sum()), "start": None, "end": None}
                    for j, i in enumerate(rows))
            versions.append(write_version(shard_root(roots[c], s), arrays, meta, extra, keep=None))
            del arrays
        write_generation(roots[c], versions)
    src.close()
    return {**g, "single_and_1_shard_s": round(t_gen, 1), "split_2_and_4_shards_s": round(time.perf_counter() - t1, 1)}


def version_bytes(path: Path) -> dict[str, int]:
    """Bytes of every file of one version directory (apparent sizes)."""
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def replica_memory(ckpt_path: str, root: str, shard: int, t: np.ndarray, threads: int) -> dict[str, int]:
    """(In a child process.) Hold one shard as a Ray shard replica does (psi alone, loaded by
    gare_serve.ray_serve.shard_replica.load_shard_model; the shard's version memory-mapped, the fold prepared, the kernel
    compiled) and answer every query of t (a, d): RSS before opening, after opening and after the queries,
    anonymous (private: model, runtime) and file-backed (mapped index pages, shared with the page cache)."""
    torch.set_num_threads(threads)
    import faiss

    faiss.omp_set_num_threads(threads)
    model = load_shard_model(ckpt_path, "cpu")
    rerank.warm_up(model.device)
    out = {"anon_model": status_kib("RssAnon"), "file_model": status_kib("RssFile")}
    gen = current_generation(root)
    v = open_version(shard_root(root, shard), gen.versions[shard], mmap_ann=True)
    rerank.prepare(model, v)
    advise_random_access(v)
    opts = SearchOptions(k=TOP_K, candidates=K)
    for i in range(t.shape[0]):
        shard_candidates(model, v, t[i : i + 1], opts)
    out.update(anon_served=status_kib("RssAnon"), file_served=status_kib("RssFile"), n=int(v.n))
    v.close()
    return out


# ------------------------------------------------------------------------------------------ exactness
def same(ref_hits: list[Any], got_hits: list[Any], gid: np.ndarray) -> tuple[bool, float]:
    """Equal answers: the single index's ids mapped to global ids, in order, and the scores within TOL."""
    if [int(gid[h.id]) for h in ref_hits] != [h.id for h in got_hits]:
        return False, float("inf")
    d = max((abs(a.score - b.score) for a, b in zip(ref_hits, got_hits, strict=True)), default=0.0)
    return d <= TOL, float(d)


def exactness(model, tower, single, sharded: dict[int, Any], gids: dict[int, np.ndarray], texts: list[str],
              n_examples: int, n_images: int, seed: int) -> dict[str, Any]:
    """Every query of every kind on the single index and on 1, 2, 4 shards: counts of equal answers."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(seed)

    def tally(kind: str, c: int, pairs: list[tuple[list[Any], list[Any]]]) -> None:
        oks = [same(r, g, gids[c]) for r, g in pairs]
        out.setdefault(kind, {})[str(c)] = {"queries": len(oks), "equal": sum(ok for ok, _ in oks),
                                            "max_score_diff": max((d for _, d in oks), default=0.0)}

    for ncl in (False, True):
        opts = SearchOptions(k=TOP_K, candidates=K, ncl=ncl)
        ref = [h for s in range(0, len(texts), 32) for h in
               (r.hits for r in search_batch(model, single, texts[s : s + 32], opts, tower=tower))]
        for c, sh in sharded.items():
            got = [h for s in range(0, len(texts), 32) for h in
                   (r.hits for r in search_sharded(model, sh, texts[s : s + 32], opts, tower=tower))]
            tally(f"text, NCL {'on' if ncl else 'off'}", c, list(zip(ref, got, strict=True)))
    opts = SearchOptions(k=TOP_K, candidates=K)
    examples = [rng.choice(single.n, size=int(rng.integers(1, 4)), replace=False) for _ in range(n_examples)]
    ref = [by_example.search_by_videos(single, [int(i) for i in ex], opts).hits for ex in examples]
    for c, sh in sharded.items():
        got = [search_sharded_by_videos(sh, [int(gids[c][i]) for i in ex], opts).hits for ex in examples]
        tally("by example (1-3 videos)", c, list(zip(ref, got, strict=True)))
    from PIL import Image  # an image query's input; only this check needs PIL

    images = [Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(n_images)]
    ref = [by_example.search_by_image(model, single, im, opts).hits for im in images]
    for c, sh in sharded.items():
        got = [search_sharded_by_image(model, sh, im, opts).hits for im in images]
        tally("by image (random pixels)", c, list(zip(ref, got, strict=True)))
    return out


# ------------------------------------------------------------------------------------------ exactness, benchmark corpus
CORPUS_K, CORPUS_TOP = 64, 10  # K < the test gallery (200 videos): the merged stage 1 must find the single index's K


def corpus_exactness(corpus: Path, ckpt_path: Path, work: Path, workers: int) -> dict[str, Any]:
    """The test split of the benchmark corpus indexed with the trained model by ``gare-index build`` (one flat
    index) and ``gare-index build --shards N`` (N = 1, 2, 4: NCL biases fitted over the whole gallery); every test
    caption as a text query (NCL off and on) and every test video as a "more like this" example, on each: counts of
    answers equal to the single index's (the same files in the same order, scores within TOL)."""
    from gare_build.build import BuildOptions, build  # noqa: PLC0415 - only this check builds indexes
    from gare_build.shard_build import build_sharded  # noqa: PLC0415

    started, load_start = time.time(), loadavg()
    rows = [json.loads(x) for x in (corpus / "captions_test.jsonl").read_text().splitlines() if x.strip()]
    videos = [str((corpus / r["video"]).resolve()) for r in rows]
    captions = [c for r in rows for c in r["captions"]]
    listing = work / "corpus_test_videos.csv"
    listing.write_text("video\n" + "".join(f"{p}\n" for p in videos))
    build_s: dict[str, float] = {}
    t0 = time.perf_counter()
    build(str(ckpt_path), str(listing), work / "corpus-single", BuildOptions(workers=workers, progress=False,
                                                                             index_type="flat"))
    build_s["single"] = round(time.perf_counter() - t0, 1)
    for c in SHARD_COUNTS:
        t0 = time.perf_counter()
        rep = build_sharded(str(ckpt_path), str(listing), work / f"corpus-n{c}",
                            BuildOptions(workers=workers, progress=False, index_type="flat"), n_shards=c)
        assert rep.exit_code == 0 and rep.n_videos == len(videos), rep.summary()
        name = f"{c} shard{'s' if c > 1 else ''}"
        build_s[name] = round(time.perf_counter() - t0, 1)
        print(f"   built {name} in {build_s[name]} s", flush=True)
    model, _ = load_model(ckpt_path, "cpu")
    single = open_index(work / "corpus-single")
    single_name = {int(r["id"]): Path(r["path"]).name for r in single.all_metadata()}
    results: dict[str, dict[str, Any]] = {}

    def tally(kind: str, c: int, names: dict[int, str], pairs: list[tuple[list[Any], list[Any]]]) -> None:
        oks = []
        for want, got in pairs:
            same_files = [single_name[h.id] for h in want] == [names[h.id] for h in got]
            d = max((abs(a.score - b.score) for a, b in zip(want, got, strict=True)), default=0.0) if same_files \
                else float("inf")
            oks.append((same_files and d <= TOL, d))
        results.setdefault(kind, {})[str(c)] = {"queries": len(oks), "equal": sum(ok for ok, _ in oks),
                                                "max_score_diff": max((d for _, d in oks), default=0.0)}

    refs = {ncl: [r.hits for s in range(0, len(captions), 64) for r in
                  search_batch(model, single, captions[s:s + 64], SearchOptions(k=CORPUS_TOP, candidates=CORPUS_K,
                                                                                ncl=ncl))]
            for ncl in (False, True)}
    ex_opts = SearchOptions(k=CORPUS_TOP, candidates=CORPUS_K)
    by_file = {n: i for i, n in single_name.items()}
    ex_ref = [by_example.search_by_videos(single, [by_file[Path(v).name]], ex_opts).hits for v in videos]
    for c in SHARD_COUNTS:
        with open_sharded(work / f"corpus-n{c}") as sh:
            names = {int(g): Path(r["path"]).name for s in range(c)
                     for g, r in zip(sh.global_ids(s), sh.shards[s].all_metadata(), strict=True)}
            for ncl in (False, True):
                opts = SearchOptions(k=CORPUS_TOP, candidates=CORPUS_K, ncl=ncl)
                got = [r.hits for s in range(0, len(captions), 64)
                       for r in search_sharded(model, sh, captions[s:s + 64], opts)]
                tally(f"text, NCL {'on' if ncl else 'off'}", c, names, list(zip(refs[ncl], got, strict=True)))
            gid = {n: g for g, n in names.items()}
            got = [search_sharded_by_videos(sh, [gid[Path(v).name]], ex_opts).hits for v in videos]
            tally("by example (each test video)", c, names, list(zip(ex_ref, got, strict=True)))
    single.close()
    return {"corpus": str(corpus), "checkpoint": str(ckpt_path), "checkpoint_sha256": file_sha256(ckpt_path),
            "n_videos": len(videos), "n_captions": len(captions), "k": CORPUS_TOP, "candidates": CORPUS_K, "tol": TOL,
            "build_s": build_s, "results": results, "load_start": load_start, "load_end": loadavg(),
            "wall_s": round(time.time() - started, 1)}


def corpus_md(x: dict[str, Any]) -> str:
    """The benchmark-corpus section, rendered from its JSON alone."""
    kinds = list(x["results"])
    tot = sum(v["queries"] for k in kinds for v in x["results"][k].values())
    eq = sum(v["equal"] for k in kinds for v in x["results"][k].values())
    L = ["## Exactness on the benchmark corpus (the trained model)\n",
         f"Command: `{x['command']}`; commit {x.get('commit', UNKNOWN_COMMIT)}; {x['date']}; {x['cpu']}; wall time "
         f"{x['wall_s']:.0f} s; load average at start {x['load_start']}, at end {x['load_end']}.\n",
         f"Gallery: the {x['n_videos']} test videos of `{x['corpus']}`, indexed with `{x['checkpoint']}` (sha256 "
         f"{x['checkpoint_sha256'][:12]}) with exact (flat) stage 1 by `gare-index build` (one index) and by "
         "`gare-index build --shards N` (each shard a normal index; NCL biases fitted once over the whole gallery). "
         f"Queries: every test caption ({x['n_captions']}) as a text query, NCL off and on, and every test video as a "
         f"\"more like this\" example; k = {x['k']}, K = {x['candidates']} candidates (fewer than the gallery, so the "
         "merged stage 1 must pick the single index's K). Equal: the same files in the same order, every score within "
         f"{x['tol']:g}. Build seconds: {', '.join(f'{k} {v}' for k, v in x['build_s'].items())}.\n",
         "| queries | " + " | ".join(f"{c} shard{'s' if int(c) > 1 else ''}" for c in x["results"][kinds[0]]) + " |",
         "|---|" + "---|" * len(x["results"][kinds[0]])]
    for k in kinds:
        L.append(f"| {k} | " + " | ".join(f"{v['equal']}/{v['queries']} (max \\|Δscore\\| {v['max_score_diff']:.1e})"
                                           for v in x["results"][k].values()) + " |")
    L.append(f"\nSharded answers equal single-index answers on the benchmark corpus: {eq}/{tot} (target 100%): "
             f"{'met' if eq == tot else 'NOT met'}.")
    return "\n".join(L)


# ------------------------------------------------------------------------------------------ timing
class Runner:
    """One text query through each mode; returns the total seconds and the stage seconds."""

    def __init__(self, model, tower, single, sharded: dict[int, Any], threads: int) -> None:
        import faiss

        self.model, self.tower, self.single, self.sharded = model, tower, single, sharded
        self.opts = SearchOptions(k=TOP_K, candidates=K)
        # OpenMP's thread count is per thread: each pool thread sets FAISS's bound for itself
        self.pools = {c: cf.ThreadPoolExecutor(c, thread_name_prefix=f"shards{c}", initializer=faiss.omp_set_num_threads,
                                               initargs=(threads,)) for c in sharded if c > 1}

    def modes(self) -> list[str]:
        return ["single"] + [f"{c} seq" for c in self.sharded] + [f"{c} pool" for c in self.pools]

    def run(self, mode: str, q: str) -> tuple[float, dict[str, Any], list[Any]]:
        t0 = time.perf_counter()
        if mode == "single":
            r = search_batch(self.model, self.single, [q], self.opts, tower=self.tower)[0]
            return time.perf_counter() - t0, {"encode": r.timings["encode"]}, r.hits
        c, how = int(mode.split()[0]), mode.split()[1]
        sh = self.sharded[c]
        t = encode_queries(self.model, [q], "fp32", tower=self.tower)
        t1 = time.perf_counter()
        if how == "seq":
            parts = [shard_candidates(self.model, v, t, self.opts) for v in sh.shards]
        else:
            parts = list(self.pools[c].map(lambda v, t=t: shard_candidates(self.model, v, t, self.opts), sh.shards))
        t2 = time.perf_counter()
        res = merge(parts, c, self.opts)[0]
        t3 = time.perf_counter()
        shards = [{"ann": p[0].timings["ann"], "rerank": p[0].timings["rerank"]} for p in parts]
        return t3 - t0, {"encode": t1 - t0, "shards": t2 - t1, "merge": t3 - t2, "per_shard": shards}, res.hits

    def close(self) -> None:
        for p in self.pools.values():
            p.shutdown()


def timing(runner: Runner, queries: list[str], rounds: int, per_round: int, warmup: int) -> dict[str, Any]:
    """Interleaved rounds: each round sends its own queries through every mode (the order rotated per round)."""
    modes = runner.modes()
    for m in modes:
        for q in queries[:warmup]:
            runner.run(m, q)
    lat: dict[str, list[float]] = {m: [] for m in modes}
    stages: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(rounds):
        qs = queries[warmup + r * per_round : warmup + (r + 1) * per_round]
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for m in order:
            for q in qs:
                s, st, _ = runner.run(m, q)
                lat[m].append(s)
                stages[m].append(st)
        print(f"   round {r + 1}/{rounds}: " + ", ".join(f"{m} {1000 * np.median(lat[m]):.1f}" for m in modes)
              + " ms (p50 so far)", flush=True)
    out: dict[str, Any] = {}
    for m in modes:
        row = {"total": summary_ms(lat[m]), "qps": round(len(lat[m]) / sum(lat[m]), 2),
               "encode": summary_ms([s["encode"] for s in stages[m]])}
        if m != "single":
            c = int(m.split()[0])
            row["merge"] = summary_ms([s["merge"] for s in stages[m]])
            row["per_shard"] = [{k: summary_ms([s["per_shard"][j][k] for s in stages[m]]) for k in ("ann", "rerank")}
                                for j in range(c)]
            if m.endswith("seq"):
                # one core per shard replica: the slowest shard bounds the request (network not included)
                crit = [s["encode"] + max(p["ann"] + p["rerank"] for p in s["per_shard"]) + s["merge"]
                        for s in stages[m]]
                row["critical_path"] = summary_ms(crit)
                # each shard's (ann + rerank) over its median: the shape of a shard's delay, for the plan's tail
                work = np.asarray([[p["ann"] + p["rerank"] for p in s["per_shard"]] for s in stages[m]])  # (q, c)
                row["shard_work_over_median"] = np.round(np.sort((work / np.median(work, axis=0)).ravel()), 4).tolist()
        out[m] = row
    return out


# ------------------------------------------------------------------------------------------ the capacity plan
def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = a + b x with a, b >= 0 (through the origin when the free intercept comes out negative; a
    constant when x does not vary or the slope comes out negative): a cost never shrinks with size."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if np.ptp(x) == 0:
        return {"a": float(y.mean()), "b": 0.0}
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return {"a": float(y.mean()), "b": 0.0}
    if a < 0:
        return {"a": 0.0, "b": float(x @ y / (x @ x))}
    return {"a": float(a), "b": float(b)}


def at(f: dict[str, float], x: float) -> float:
    return f["a"] + f["b"] * x


def costs(data: dict[str, Any]) -> dict[str, Any]:
    """The per-shard cost model from a run's measurements (fits over the 1 + 2 + 4 shards)."""
    t, mem = data["timing"], data["memory"]
    n_s, ann, rr, work, byt, anon = [], [], [], [], [], []
    for c in data["shard_counts"]:
        row = t[f"{c} seq"]
        for j, ps in enumerate(row["per_shard"]):
            n_s.append(mem[str(c)][j]["n"])
            ann.append(ps["ann"]["p50"])
            rr.append(ps["rerank"]["p50"])
            work.append(ps["ann"]["p50"] + ps["rerank"]["p50"])
            byt.append(sum(mem[str(c)][j]["files"].values()))
            anon.append(mem[str(c)][j]["rss"]["anon_served"] if mem[str(c)][j].get("rss") else float("nan"))
    merges = [t[f"{c} seq"]["merge"]["p50"] for c in data["shard_counts"]]
    enc = [t[m]["encode"]["p50"] for m in t]
    ratios = [r for c in data["shard_counts"] for r in t[f"{c} seq"]["shard_work_over_median"]]
    ok = [i for i, a in enumerate(anon) if not math.isnan(a)]
    return {"ann_ms": fit(n_s, ann), "rerank_ms": fit(n_s, rr), "shard_ms": fit(n_s, work),
            "bytes": fit(n_s, byt), "anon_bytes": fit([n_s[i] for i in ok], [anon[i] for i in ok]) if ok else None,
            "merge_ms": fit(list(data["shard_counts"]), merges), "encode_ms": float(np.median(enc)),
            "work_ratios": sorted(ratios), "points": len(n_s), "rss_points": len(ok)}


def tail_factor(ratios: list[float], shards: int) -> tuple[float, float]:
    """The p50 of the slowest of `shards` independent shard delays, as a multiple of one shard's median: the
    measured delay/median distribution at level 0.5^(1/shards) (clamped to the largest level measured)."""
    level = 0.5 ** (1.0 / shards)
    top = 1.0 - 1.0 / len(ratios)
    return float(np.quantile(np.asarray(ratios), min(level, top))), level


def plan(data: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    """Shards, hosts, RAM per host and expected p50 for each library size, from the measured costs and the stated
    assumptions `a` (host RAM and cores, the RAM share for replicas, replicas per shard, the per-shard budget,
    the network hop). Two layouts: latency-bound (a shard's stage 1 + rerank p50 within the budget) and
    RAM-bound (the largest shard one host holds, fewest hosts)."""
    c = costs(data)
    if c["anon_bytes"] is None:
        return {"costs": c, "assumptions": a, "rows": [], "why_none": "no replica RSS was measured (--no-rss)"}
    ram = a["host_ram_gib"] * 2**30 * a["ram_share"]
    per_video = c["bytes"]["b"] + c["anon_bytes"]["b"]
    fixed = c["bytes"]["a"] + c["anon_bytes"]["a"]
    s_ram = int((ram - fixed) / per_video)  # one replica's files (page cache) + its process, on one host
    sw = c["shard_ms"]
    s_lat = int((a["shard_budget_ms"] - sw["a"]) / sw["b"]) if sw["b"] > 0 else s_ram
    rows = []
    for videos in a["plan_sizes"]:
        for layout, cap in (("latency-bound", min(s_lat, s_ram)), ("RAM-bound", s_ram)):
            if cap < 1:
                rows.append({"videos": videos, "layout": layout, "error": "no shard size meets the assumptions"})
                continue
            shards = math.ceil(videos / cap)
            size = math.ceil(videos / shards)
            mem = at(c["bytes"], size) + at(c["anon_bytes"], size)
            per_host = max(1, min(a["host_cores"], int(ram // mem)))
            replicas = shards * a["replicas"]
            hosts = max(a["replicas"], math.ceil(replicas / per_host))
            on_host = math.ceil(replicas / hosts)
            tf, level = tail_factor(c["work_ratios"], shards)
            shard_p50 = at(sw, size)
            p50 = c["encode_ms"] + shard_p50 * tf + at(c["merge_ms"], shards) + a["network_ms"]
            qps = a["replicas"] * 1000.0 / shard_p50  # each query holds one replica of every shard
            rows.append({"videos": videos, "layout": layout, "shards": shards, "videos_per_shard": size,
                         "shard_files_gib": round(at(c["bytes"], size) / 2**30, 2),
                         "replica_ram_gib": round(mem / 2**30, 2), "replicas_per_host": on_host, "hosts": hosts,
                         "ram_per_host_gib": round(on_host * mem / 2**30, 1), "shard_p50_ms": round(shard_p50, 1),
                         "tail_factor": round(tf, 3), "tail_level": round(level, 4),
                         "expected_p50_ms": round(p50, 1), "qps_shard_bound": round(qps, 1),
                         "ingress_cores_at_that_qps": round(qps * (c["encode_ms"] + at(c["merge_ms"], shards)) / 1000, 1)})
    return {"costs": c, "assumptions": a, "max_videos_per_shard": {"latency": s_lat, "ram": s_ram}, "rows": rows}


# ------------------------------------------------------------------------------------------ report
def fmt_ms(s: dict[str, Any]) -> str:
    return f"{s['p50']:.1f} / {s['p99']:.1f}"


@with_provenance
def markdown(data: dict[str, Any]) -> str:
    """The report, rendered from the run's JSON alone."""
    m, t = data["machine"], data["timing"]
    L = ["# Sharded search: 1, 2 and 4 shards on one machine vs one index, and a capacity plan\n",
         f"Command (from the repository root): `{data['command']}`; commit {data.get('commit', UNKNOWN_COMMIT)}\n",
         f"Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, faiss {m['faiss']}; torch/faiss threads "
         f"{m['torch_threads']}/{m['faiss_threads']}. Date {data['date']}, wall time {data['wall_s']:.0f} s. Load "
         f"average (1/5/15 min) at start {data['load_start']}, at end {data['load_end']} (the machine is shared).\n",
         f"Gallery: {data['n']:,} synthetic videos (bench/serve_bench.py's: clustered unit vectors, f = 12 float16 "
         "frames of d = 512, psi's folded constants), stage 1 **flat (exact)**, written once; the single index is "
         "shard s000 of the 1-shard root, the 2- and 4-shard roots hold the same videos routed by "
         "`shard_of(content id, N)`. Model: GARE ViT-B/32, random weights, from a real checkpoint; text tower "
         f"`{data['text_encoder']}` (the CPU default). k = {TOP_K}, K = {K} per shard, NCL "
         f"{'on' if data['ncl'] else 'off'} (the default). One query at a time, one client, in process, warm "
         f"page cache; {data['rounds']} interleaved rounds of {data['per_round']} queries per mode.\n",
         "## Exactness: every sharded answer vs the single index\n",
         f"Same ids (single ids mapped to global ids) in the same order and every score within {TOL:g}.\n",
         "| query kind | " + " | ".join(f"{c} shard{'s' if c > 1 else ''}" for c in data["shard_counts"])
         + " |", "|---|" + "---|" * len(data["shard_counts"])]
    for kind, per in data["exactness"].items():
        L.append(f"| {kind} | " + " | ".join(
            f"{v['equal']}/{v['queries']} (max diff {v['max_score_diff']:.1e})" for v in per.values()) + " |")
    total = sum(v["queries"] for per in data["exactness"].values() for v in per.values())
    equal = sum(v["equal"] for per in data["exactness"].values() for v in per.values())
    L.append(f"\nAll kinds: {equal} of {total} sharded answers equal the single index's ({100 * equal / total:.1f}%).\n")
    L += ["## Latency and throughput (same gallery, same queries)\n",
          "`seq`: the shards one after the other in one thread; `pool`: one thread per shard (2 cores here); "
          "`critical path`: encode + the slowest shard + merge per query (from the seq samples), what one core "
          "per shard replica gives before the network hop. q/s = queries / summed latency (one client).\n",
          "| mode | p50 / p99 ms | q/s | encode p50 ms | merge p50 ms | per shard: ann p50 ms, rerank p50 ms | "
          "critical path p50 / p99 ms |", "|---|---|---|---|---|---|---|"]
    for mode, r in t.items():
        ps = "; ".join(f"s{j}: {p['ann']['p50']:.1f}, {p['rerank']['p50']:.1f}" for j, p in
                       enumerate(r.get("per_shard", [])))
        merge_ms = f"{r['merge']['p50']:.2f}" if "merge" in r else ""
        crit = fmt_ms(r["critical_path"]) if "critical_path" in r else ""
        L.append(f"| {mode} | {fmt_ms(r['total'])} | {r['qps']:.1f} | {r['encode']['p50']:.1f} | {merge_ms} | {ps} | "
                 f"{crit} |")
    L.append("\nRatios of p50 (this run): " + "; ".join(f"{k} {v}" for k, v in data["ratios"].items()) + "\n")
    L += ["## Memory per shard\n",
          "Files: the bytes of the shard's version (frames, units, psi constants, ann.faiss, meta.sqlite, ...). RSS: a "
          "child process holding only that shard as a replica does (model loaded, version memory-mapped, every "
          "benchmark query answered); anonymous = private to the process, file = mapped index pages (shared with "
          "the page cache).\n",
          "| shards | shard | videos | files MiB | frames MiB | RSS anon MiB (model only → serving) | RSS file MiB |",
          "|---|---|---|---|---|---|---|"]
    for c, shards in data["memory"].items():
        for j, s in enumerate(shards):
            rss = s.get("rss")
            L.append(f"| {c} | s{j:03d} | {s['n']:,} | {sum(s['files'].values()) / 2**20:.1f} | "
                     f"{s['files'].get('frames.npy', 0) / 2**20:.1f} | " +
                     (f"{rss['anon_model'] / 2**20:.0f} → {rss['anon_served'] / 2**20:.0f} | "
                      f"{rss['file_served'] / 2**20:.0f} |" if rss else "not measured | |"))
    L.append("\n## Targets\n")
    L += [f"- {x}" for x in data["targets"]]
    L.append("\n" + plan_md(data["plan"], data))
    if data.get("corpus_exactness"):  # written by a full run, or alone by --corpus-only
        L.append("\n" + corpus_md(data["corpus_exactness"]))
    return "\n".join(L) + "\n"


def plan_md(p: dict[str, Any], data: dict[str, Any]) -> str:
    c, a = p["costs"], p["assumptions"]
    L = ["## Capacity plan for 10M and 100M videos (derived from this run's measurements)\n",
         "Measured costs (least-squares fits over the " f"{c['points']} shards of the 1-, 2- and 4-shard runs, n = "
         "videos in a shard; seq mode, so each shard's times are its own, without contention):\n",
         f"- files per shard: {c['bytes']['a'] / 2**20:.1f} MiB + {c['bytes']['b']:.0f} bytes x n",
         (f"- replica process, anonymous RSS ({c['rss_points']} replica(s) measured; "
          f"{data.get('replica_model', 'the whole GARE model is loaded in each')}): "
          f"{c['anon_bytes']['a'] / 2**20:.0f} MiB + {c['anon_bytes']['b']:.1f} bytes x n"
          if c["anon_bytes"] else "- replica process RSS: not measured"),
         f"- stage 1 (flat) p50: {c['ann_ms']['a']:.2f} ms + {c['ann_ms']['b'] * 1e6:.2f} ms per million videos; "
         f"rerank of K = {K} p50: {c['rerank_ms']['a']:.2f} ms + {c['rerank_ms']['b'] * 1e6:.2f} ms per million; "
         f"their sum (fitted directly): {c['shard_ms']['a']:.2f} ms + {c['shard_ms']['b'] * 1e6:.2f} ms per million",
         f"- ingress: encode p50 {c['encode_ms']:.1f} ms; merge p50 {c['merge_ms']['a']:.3f} ms + "
         f"{c['merge_ms']['b']:.3f} ms per shard",
         "- tail: the p50 of the slowest of S shards = one shard's median x the measured (shard time / its median) "
         "distribution at level 0.5^(1/S), clamped to the highest level measured "
         f"({1 - 1 / len(c['work_ratios']):.4f}; beyond it the figure is optimistic). That distribution was measured "
         f"on this shared {data['machine']['cores']}-core machine at load average {data['load_start'][0]} at the "
         f"start and {data['load_end'][0]} at the end: other jobs' interference is in it, so it is this machine's "
         "tail, not a dedicated host's\n",
         "Assumptions (command-line options, not measurements): "
         f"a host has {a['host_ram_gib']} GiB of RAM and {a['host_cores']} cores, of which a share of "
         f"{a['ram_share']:.0%} holds shard replicas (their files in the page cache + their processes; the rest for "
         f"the OS and the ingress); one core and one thread per replica, as measured; {a['replicas']} replicas per "
         "shard on distinct hosts (one can die); every shard's files stay in the page cache (the rerank reads "
         f"random rows); exact flat stage 1 as measured; a shard's stage 1 + rerank p50 within "
         f"{a['shard_budget_ms']} ms in the latency-bound layout; {a['network_ms']} ms for the ingress → shard → "
         "ingress hop (not measured here); shard delays independent. The ingress hosts are extra (their cores are "
         "in the last column).\n",
         f"Largest shard: {p['max_videos_per_shard']['latency']:,} videos within the budget, "
         f"{p['max_videos_per_shard']['ram']:,} in one host's RAM share.\n" if p.get("max_videos_per_shard") else "",
         "| videos | layout | shards | videos / shard | files / shard GiB | RAM / replica GiB | replicas / host | "
         "hosts | RAM used / host GiB | shard p50 ms | tail x | expected p50 ms | q/s (shard-bound) | ingress cores |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        if "error" in r:
            L.append(f"| {r['videos']:,} | {r['layout']} | {r['error']} |" + " |" * 11)
            continue
        L.append(f"| {r['videos']:,} | {r['layout']} | {r['shards']} | {r['videos_per_shard']:,} | "
                 f"{r['shard_files_gib']} | {r['replica_ram_gib']} | {r['replicas_per_host']} | {r['hosts']} | "
                 f"{r['ram_per_host_gib']} | {r['shard_p50_ms']} | {r['tail_factor']} | {r['expected_p50_ms']} | "
                 f"{r['qps_shard_bound']} | {r['ingress_cores_at_that_qps']} |")
    if p.get("why_none"):
        L.append(f"\nNo plan: {p['why_none']}.")
    L.append("\nExpected p50 = encode + shard p50 x tail + merge + network hop. A tuned stage 1 (IVF, "
             "bench/results/index_ann.md) would shrink the stage-1 term, which dominates large flat shards; this plan "
             "uses only what this run measured.")
    return "\n".join(L)


# ------------------------------------------------------------------------------------------ main
def machine() -> dict[str, Any]:
    import faiss

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "faiss": faiss.__version__,
            "torch_threads": torch.get_num_threads(), "faiss_threads": faiss.omp_get_max_threads()}


def targets(data: dict[str, Any]) -> list[str]:
    ex = data["exactness"]
    tot = sum(v["queries"] for per in ex.values() for v in per.values())
    eq = sum(v["equal"] for per in ex.values() for v in per.values())
    out = [f"sharded answers equal single-index answers (exact stage 1): {eq}/{tot} (target 100%): "
           f"{'met' if eq == tot else 'NOT met'}"]
    t = data["timing"]
    for mode in ("2 seq", "2 pool"):
        if mode in t:
            for base in ("single", "1 seq"):
                r = t[mode]["total"]["p50"] / t[base]["total"]["p50"]
                out.append(f"2 shards ({mode.split()[1]}) p50 / {base} p50: {r:.2f} (target <= 1.3): "
                           f"{'met' if r <= 1.3 else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=50, help="queries per mode per round")
    ap.add_argument("--check-queries", type=int, default=400, help="text queries of the exactness check")
    ap.add_argument("--check-examples", type=int, default=50)
    ap.add_argument("--check-images", type=int, default=10)
    ap.add_argument("--rss-queries", type=int, default=100, help="queries each replica-memory child answers")
    ap.add_argument("--rss", choices=("all", "one", "none"), default="all",
                    help="replica RSS children (~15 s each): every shard, s000 of every root (--quick), or none")
    ap.add_argument("--threads", type=int, default=1, help="torch and faiss threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="10k videos, few queries (~1 min)")
    ap.add_argument("--work", default="/tmp/gare-sharded-bench", help="scratch folder (deleted after)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sharded"))
    ap.add_argument("--render", type=Path, help="rewrite the .md beside this saved JSON from it; run nothing")
    c = ap.add_argument_group("exactness on the benchmark corpus (the trained model)")
    c.add_argument("--corpus-only", action="store_true",
                   help="run only this check; its section replaces the one in the saved JSON (--out), the .md is "
                        "re-rendered, the other sections are kept as they were measured")
    c.add_argument("--no-corpus", action="store_true", help="a full run without this check (no such section)")
    c.add_argument("--corpus", type=Path, default=REPO / "runs" / "bench-corpus")
    c.add_argument("--checkpoint", type=Path, default=REPO / "runs" / "bench-train" / "best.safetensors")
    c.add_argument("--corpus-workers", type=int, default=1, help="decode worker processes of the builds")
    g = ap.add_argument_group("capacity plan assumptions")
    g.add_argument("--plan-sizes", default="10000000,100000000")
    g.add_argument("--host-ram-gib", type=float, default=64.0)
    g.add_argument("--host-cores", type=int, default=16)
    g.add_argument("--ram-share", type=float, default=0.75)
    g.add_argument("--replicas", type=int, default=2)
    g.add_argument("--shard-budget-ms", type=float, default=50.0)
    g.add_argument("--network-ms", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.render:
        print(f"wrote {render_saved(args.render, markdown)}")
        return 0
    if args.corpus_only:
        return corpus_only(args, argv)
    if args.quick:
        args.videos, args.rounds, args.per_round, args.check_queries = 10_000, 2, 10, 40
        args.check_examples, args.check_images, args.rss_queries, args.rss = 10, 3, 20, "one"
    for name in ("videos", "rounds", "per_round", "check_queries", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.ram_share <= 1:
        raise SystemExit(f"--ram-share must be in (0, 1], got {args.ram_share}")
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    started = time.time()
    run = start(__name__, MEASURES, argv)
    data: dict[str, Any] = {"command": run.command,
                            "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "load_start": loadavg(), "n": args.videos, "shard_counts": list(SHARD_COUNTS),
                            "text_encoder": DEFAULT_CPU_TEXT_ENCODER, "ncl": SearchOptions().ncl,
                            "rounds": args.rounds, "per_round": args.per_round,
                            "replica_model": "each holds psi alone, as a Ray shard replica does "
                                             "(gare_serve.ray_serve.shard_replica.load_shard_model; the CLIP towers only in the "
                                             "ingress)"}
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        print("saving a ViT-B/32 GARE checkpoint (random weights)", flush=True)
        torch.manual_seed(args.seed)
        cfg = get_model_config("gare-vit-b-32", pretrained="none")
        m = GARE.build(cfg).eval()
        with torch.no_grad():  # psi with non-trivial weights (the cost does not depend on them)
            for name, p in m.psi.named_parameters():
                if name.endswith("weight") and p.ndim == 2:
                    p.normal_(0, 0.05)
        ck_path = work / "gare-vit-b-32-random.safetensors"
        save_checkpoint(ck_path, m, queues={})
        fold = fold_weights(m.psi)
        del m
        ckpt = {"path": str(ck_path), "sha256": file_sha256(ck_path), "model_config": cfg.to_dict()}
        print(f"writing {args.videos:,} videos as 1, 2 and 4 shards", flush=True)
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:  # its memory goes back after
            data["gallery"] = ex.submit(write_shards, work, args.videos, ckpt, fold, args.seed).result()
        print(f"   {data['gallery']}", flush=True)
        roots = {c: work / f"n{c}" for c in SHARD_COUNTS}
        model, _ = load_model(ck_path, "cpu")
        rerank.warm_up(model.device)
        tower = build_text_encoder(model, DEFAULT_CPU_TEXT_ENCODER)
        single = open_index(shard_root(roots[1], 0), mmap_ann=True)
        sharded = {c: open_sharded(roots[c], mmap_ann=True) for c in SHARD_COUNTS}
        for v in [single, *(v for sh in sharded.values() for v in sh.shards)]:
            rerank.prepare(model, v)
            advise_random_access(v)
            for f in ("frames.npy", "units.npy", "psi_consts.npy", "ann.faiss"):
                warm_file(v.path / f)  # every shard's files in the page cache, as the plan assumes
        gids = {c: global_ids(args.videos, c, args.seed) for c in SHARD_COUNTS}
        runner = Runner(model, tower, single, sharded, args.threads)
        probe = make_queries(8, seed=args.seed + 5)
        for c, sh in sharded.items():  # the timed seq driver is search_sharded's steps: check it answers the same
            want = [r.hits for r in search_sharded(model, sh, probe, runner.opts, tower=tower)]
            got = [runner.run(f"{c} seq", q)[2] for q in probe]
            assert [[h.id for h in x] for x in want] == [[h.id for h in x] for x in got], f"{c} shards: driver"
        print("exactness check", flush=True)
        data["exactness"] = exactness(model, tower, single, sharded, gids,
                                      make_queries(args.check_queries, seed=args.seed + 1), args.check_examples,
                                      args.check_images, args.seed + 2)
        print(f"   {json.dumps(data['exactness'])}", flush=True)
        print("timing", flush=True)
        queries = make_queries(5 + args.rounds * args.per_round, seed=args.seed + 3)
        data["timing"] = timing(runner, queries, args.rounds, args.per_round, warmup=5)
        runner.close()
        t = data["timing"]
        data["ratios"] = {f"{a} / {b}": round(t[a]["total"]["p50"] / t[b]["total"]["p50"], 3)
                          for a, b in (("1 seq", "single"), ("2 seq", "1 seq"), ("2 pool", "1 seq"),
                                       ("4 seq", "1 seq"), ("4 pool", "1 seq"), ("2 seq", "single"),
                                       ("2 pool", "single"))}
        data["ratios"].update({f"{c} critical path / 1 seq": round(t[f"{c} seq"]["critical_path"]["p50"]
                                                                  / t["1 seq"]["total"]["p50"], 3)
                               for c in SHARD_COUNTS[1:]})
        t_rss = encode_queries(model, make_queries(args.rss_queries, seed=args.seed + 4), "fp32",
                               tower=tower).numpy()
        single.close()
        for sh in sharded.values():
            sh.close()
        print("memory per shard", flush=True)
        data["memory"] = {}
        for c in SHARD_COUNTS:
            gen = current_generation(roots[c])
            rows = []
            for s in range(c):
                files = version_bytes(shard_root(roots[c], s) / "versions" / gen.versions[s])
                n_s = int(np.sum(assignment(args.videos, c, args.seed) == s))
                if args.rss == "all" or (args.rss == "one" and s == 0):
                    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
                        rss = ex.submit(replica_memory, str(ck_path), str(roots[c]), s, t_rss, args.threads).result()
                    assert rss.pop("n") == n_s, (c, s)
                    rows.append({"n": n_s, "files": files, "rss": rss})
                else:
                    rows.append({"n": n_s, "files": files})
            data["memory"][str(c)] = rows
            print(f"   {c} shards: {[(r['n'], sum(r['files'].values()), r.get('rss')) for r in rows]}", flush=True)
        if not args.no_corpus:
            print("exactness on the benchmark corpus", flush=True)
            data["corpus_exactness"] = {**corpus_exactness(args.corpus, args.checkpoint, work, args.corpus_workers),
                                        "command": data["command"], "commit": data["commit"], "date": data["date"],
                                        "cpu": data["machine"]["cpu"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data["load_end"] = loadavg()
    data["wall_s"] = round(time.time() - started, 1)
    data["targets"] = targets(data)
    data["plan"] = plan(data, {"plan_sizes": [int(s) for s in args.plan_sizes.split(",") if s],
                               "host_ram_gib": args.host_ram_gib, "host_cores": args.host_cores,
                               "ram_share": args.ram_share, "replicas": args.replicas,
                               "shard_budget_ms": args.shard_budget_ms, "network_ms": args.network_ms})
    out = Path(args.out)
    data["run"] = run.record()
    write_report(out.with_suffix(".json"), data, markdown)
    print("\n".join(data["targets"]))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def corpus_only(args: argparse.Namespace, argv: list[str] | None) -> int:
    """--corpus-only: the benchmark-corpus check alone, written into the saved JSON's own section."""
    out = Path(args.out).with_suffix(".json")
    if not out.is_file():
        raise SystemExit(f"{out}: no saved run to add the section to; run bench/sharded.py without --corpus-only")
    for p in (args.corpus / "captions_test.jsonl", args.checkpoint):
        if not p.is_file():
            raise SystemExit(f"{p}: not found (--corpus / --checkpoint)")
    data = json.loads(out.read_text())
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(args.threads)
    try:
        x = corpus_exactness(args.corpus, args.checkpoint, work, args.corpus_workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data["corpus_exactness"] = {**x, "command": command_line(argv, __name__), "commit": git_commit(),
                                "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name()}
    write_report(out, data, markdown)
    print(corpus_md(data["corpus_exactness"]))
    print(f"wrote the corpus section of {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
