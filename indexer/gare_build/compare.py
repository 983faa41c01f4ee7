"""`gare-index compare`: every post-processing combination measured side by side on one captioned test set.

The test gallery is indexed with the real writer (`gare_build.build.build`): once plain and once with InvGC,
both with the folded NCL stage 1 (`ann_ncl.faiss`); the second build reuses the first one's features. The
test captions are then searched through the real two-stage path of `gare_search.search` (the one the service
runs): `encode_queries` -> stage 1 (`ann_stage`, i.e. `IndexVersion.search`, plain or with `ncl_stage1`) ->
`psi_scores` -> `rank`. Outputs: result.json, result.md, compare.png.

The report (result.md and compare.png) is written by :mod:`gare_build.compare_report`.

Ranks. A query's final list is its K candidates in the combination's order; a ground truth outside the
candidates is ranked after them, in stage-1 order (what a user paging past K would see), so MdR and MnR are
defined for every query. With K >= the gallery size every video is a candidate.

``--filter JSON`` (:mod:`gare_index.filters`, over the index's fields) restricts every side to the videos that pass:
stage 1 of every combination runs under the filter (``gare_search.filtered``, the service's plans), the exhaustive
references, the ranks past the shortlist and the exhaustive metrics count passing videos only, and the queries are
the captions whose ground-truth video passes.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from gare.annotations import load_dataset
from gare.checkpoint import load_model
from gare.model import resolve_device
from gare.retrieval_metrics import rank_summary, retrieval_metrics
from gare.sinkhorn import normalization_error
from gare_build.build import build, recompute_biases
from gare_build.compare_report import TOP, write_compare_report
from gare_build.invgc_fit import InvGCUnavailable
from gare_build.pipeline.biases import checkpoint_gamma_and_queue
from gare_build.pipeline.options import BuildOptions
from gare_build.tuning.measure import recall_of_topk
from gare_index.filters import Filter
from gare_index.store import open_index
from gare_search.filtered import FILTER_EXACT_BELOW, filtered_stage1
from gare_search.query import encode_queries, unit_rows
from gare_search.rerank import exhaustive_psi, psi_scores
from gare_search.search import DEFAULT_CANDIDATES, SearchOptions, rank
from gare_search.stage1 import ann_stage

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Combo:
    name: str
    index: str  # "plain" | "invgc" | "bank": which index version (stage-1 vectors; "bank": biases from --bank)
    stage1: str  # "ann" (cosine) | "ncl" (folded: cos + b)
    rerank: bool  # psi at stage 2
    ncl: bool  # add b_j to the final score

    def describe(self) -> tuple[str, str]:
        b = "b_bank" if self.index == "bank" else "b"
        s1 = ("InvGC vectors" if self.index == "invgc" else "unit v̄") + (f", cos + {b} (folded)" if self.stage1 == "ncl" else ", cos")
        s2 = ("psi" if self.rerank else "cos") + (f" + {b}" if self.ncl else "")
        return s1, s2


COMBOS: tuple[Combo, ...] = (
    Combo("dual-tower (ANN only)", "plain", "ann", False, False),
    Combo("+ NCL stage 2 (ANN only)", "plain", "ann", False, True),
    Combo("+ NCL stage 1 (ANN only)", "plain", "ncl", False, True),
    Combo("+ psi", "plain", "ann", True, False),
    Combo("+ psi + NCL stage 2", "plain", "ann", True, True),
    Combo("+ psi + NCL stage 1+2", "plain", "ncl", True, True),
    Combo("+ InvGC (ANN only)", "invgc", "ann", False, False),
    Combo("+ InvGC + psi", "invgc", "ann", True, False),
    Combo("all: InvGC + psi + NCL stage 1+2", "invgc", "ncl", True, True),
)
BANK_COMBOS: tuple[Combo, ...] = (  # with --bank: the biases recomputed from a query bank (`biases --from-traffic`)
    Combo("+ NCL stage 1 (ANN only), bank biases", "bank", "ncl", False, True),
    Combo("+ psi + NCL stage 1+2, bank biases", "bank", "ncl", True, True),
)


@dataclass
class CompareOptions:
    checkpoint: str
    data: dict[str, Any]  # {"kind": "synth"|"msrvtt"|"manifest", ...} as gare.annotations.load_dataset takes
    out: str
    val: Any = None  # InvGC validation data (manifest / synth folder / data spec); None: carved from the training split
    gallery: str = "test"  # "test" | "all" (test + training videos; the test captions are the queries)
    candidates: int = DEFAULT_CANDIDATES
    coverage_ks: tuple[int, ...] = (16, 32, 64, 128, 256)
    latency_queries: int = 100
    latency_repeats: int = 3
    latency_threads: int | None = None  # torch and faiss threads while timing (None: as they are)
    invgc_r_g: float | None = None
    invgc_r_q: float | None = None
    invgc_grid: tuple[float, ...] | None = None
    bank: str | None = None  # a query bank (float32 (n, d) .npy): adds the BANK_COMBOS rows
    bank_weight: float = 1.0  # --traffic-weight for the bank rows
    index_type: str = "auto"
    index_dir: str | None = None
    device: str = "auto"
    precision: str = "fp32"
    batch_size: int = 16
    workers: int = 2
    progress: bool | None = None
    combos: tuple[Combo, ...] = field(default=COMBOS)
    filter: dict[str, Any] | None = None  # a filter object (gare_index.filters) applied to every side
    filter_exact_below: float = FILTER_EXACT_BELOW  # the service's default plan threshold


# ------------------------------------------------------------------------------------------ data
def _gallery(opts: CompareOptions) -> tuple[list[Any], list[str], np.ndarray, dict[str, Any]]:
    """(gallery clips, query captions, caption -> gallery index, description)."""
    test = load_dataset(opts.data, "test")
    clips = list(test.clips)
    desc: dict[str, Any] = {"dataset": test.name, "n_test_videos": len(test.clips), "n_test_captions": len(test.captions)}
    if opts.gallery == "all":
        if opts.data.get("kind") == "manifest" and not opts.data.get("train"):
            raise ValueError("--gallery all needs --train-manifest with --test-manifest")
        train = load_dataset(opts.data, "train")
        seen = {(c.path, c.start, c.end) for c in clips}
        extra = [c for c in train.clips if (c.path, c.start, c.end) not in seen]
        clips += extra
        desc["n_distractor_videos"] = len(extra)
    elif opts.gallery != "test":
        raise ValueError(f"--gallery must be test or all, got {opts.gallery!r}")
    desc["gallery"] = opts.gallery
    return clips, list(test.captions), np.asarray(test.caption_clip, dtype=np.int64), desc


def _write_gallery_manifest(clips: list[Any], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for i, c in enumerate(clips):
            fh.write(json.dumps({"video": str(Path(c.path).absolute()), "start": c.start, "end": c.end, "id": i}) + "\n")


def _val_source(opts: CompareOptions) -> Any:
    if opts.val is not None:
        return opts.val
    kind = opts.data.get("kind")
    if kind in ("synth", "msrvtt"):
        return dict(opts.data)
    if kind == "manifest" and opts.data.get("train"):
        return {"kind": "manifest", "train": opts.data["train"]}
    return None  # the checkpoint's own training data (gare_build.invgc_fit.load_validation)


# ------------------------------------------------------------------------------------------ search
def stage1(version: Any, kind: str, units: np.ndarray, k: int, flt: Filter | None = None,
           exact_below: float = FILTER_EXACT_BELOW) -> tuple[np.ndarray, np.ndarray]:
    """(scores (a, k), ids (a, k)), missing results id -1; under `flt` the service's filtered stage 1."""
    if flt is None:
        return ann_stage(version, units, k, ncl_stage1=kind != "ann")
    s_list, i_list, _ = filtered_stage1(version, units, k, flt, ncl_stage1=kind != "ann", exact_below=exact_below)
    a = units.shape[0]
    scores = np.zeros((a, k), np.float32)
    ids = np.full((a, k), -1, np.int64)
    for r, (s, i) in enumerate(zip(s_list, i_list, strict=True)):
        scores[r, :i.size], ids[r, :i.size] = s, i
    return scores, ids


def two_stage(model: Any, version: Any, t: Any, units: np.ndarray, combo: Combo, k_cand: int, k: int | None = None,
              flt: Filter | None = None, exact_below: float = FILTER_EXACT_BELOW) -> list[list[Any]]:
    """gare_search.search's stage functions on a batch of encoded queries, with the combination's stage 1.

    Returns, per query, the Hits of its candidates in final order (all of them when k is None). With
    stage1="ann" this is exactly gare_search.search.search_batch after the text encoder (under `flt`: with that
    filter)."""
    sc, ids = stage1(version, combo.stage1, units, k_cand, flt, exact_below)
    ann_s = [s[i >= 0] for s, i in zip(sc, ids, strict=True)]
    ann_i = [i[i >= 0] for i in ids]
    psi: list[np.ndarray | None] = [None] * len(ann_i)
    if combo.rerank:
        psi = list(psi_scores(model, version, t, ann_i))
    biases = np.asarray(version.biases, dtype=np.float32)
    out = []
    for s, i, p in zip(ann_s, ann_i, psi, strict=True):
        if i.size == 0:
            out.append([])
            continue
        kk = i.size if k is None else min(k, i.size)
        o = SearchOptions(k=kk, candidates=max(k_cand, kk), rerank=combo.rerank, ncl=combo.ncl)
        out.append(rank(s, i, p, biases[version.rows(i)], o))
    return out


def _stage1_full(version: Any, units: np.ndarray, kind: str) -> np.ndarray:
    s = units @ np.asarray(version.stage1_units, dtype=np.float32).T
    if kind == "ncl":
        s = s + np.asarray(version.biases, dtype=np.float32)[None, :]
    return s


def final_ranks(hits: list[list[Any]], version: Any, units: np.ndarray, kind: str, gt_ids: np.ndarray,
                chunk: int | None = None, allowed: np.ndarray | None = None) -> np.ndarray:
    """1-based rank of each query's ground truth: its place among the candidates, else after them in stage-1 order
    (`allowed` (n,) bool in row order: only those rows count, a filter's passing videos)."""
    ranks = np.empty(len(hits), dtype=np.int64)
    gt_rows = version.rows(gt_ids)
    ids_all = np.asarray(version.ids)
    chunk = chunk or max(1, min(512, (1 << 25) // max(1, version.n)))  # <= 128 MB of float32 scores at a time
    for s0 in range(0, len(hits), chunk):
        full = _stage1_full(version, units[s0:s0 + chunk], kind)  # (c, n) in row order
        for j in range(full.shape[0]):
            q = s0 + j
            ids = [h.id for h in hits[q]]
            try:
                ranks[q] = ids.index(int(gt_ids[q])) + 1
                continue
            except ValueError:
                pass
            row = full[j]
            cand = np.zeros(row.shape[0], dtype=bool)
            if ids:
                cand[version.rows(np.asarray(ids, dtype=np.int64))] = True
            g = row[gt_rows[q]]
            better = (~cand) & ((row > g) | ((row == g) & (ids_all < gt_ids[q])))
            if allowed is not None:
                better &= allowed
            ranks[q] = len(ids) + 1 + int(better.sum())
    return ranks


def _top_ids(scores: np.ndarray, ids: np.ndarray, top: int) -> np.ndarray:
    return np.stack([ids[np.lexsort((ids, -row))[:top]] for row in scores]) if len(scores) else np.zeros((0, top), np.int64)


def latency(model: Any, versions: dict[str, Any], combos: list[Combo], texts: list[str], k_cand: int,
            precision: str, repeats: int = 3, filters: dict[str, Filter] | None = None,
            exact_below: float = FILTER_EXACT_BELOW) -> dict[str, dict[str, float]]:
    """Per combination, one query at a time (a request without micro-batching): stage 1, psi, rank (k = 10).

    The text encoder runs once per query (it is the same for every combination) and is timed apart. The
    combinations are interleaved, each query starting at another one, and each (query, combination) is run
    `repeats` times keeping the fastest, so that load from other processes on a shared machine falls on all
    of them alike and spikes are filtered out; the table reports the median over queries."""
    enc: list[float] = []
    times: dict[str, list[float]] = {c.name: [] for c in combos}
    with torch.inference_mode():
        warm = min(3, len(texts))
        for i, text in enumerate(list(texts[:warm]) + list(texts)):  # the first ones are a warm-up
            e = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                t = encode_queries(model, [text], precision)
                u = unit_rows(t)
                e = min(e, time.perf_counter() - t0)
            for j in range(len(combos)):
                c = combos[(i + j) % len(combos)]
                best = math.inf
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    two_stage(model, versions[c.index], t, u, c, k_cand, k=10,
                              flt=(filters or {}).get(c.index), exact_below=exact_below)
                    best = min(best, time.perf_counter() - t0)
                if i >= warm:
                    times[c.name].append(best)
            if i >= warm:
                enc.append(e)
    out = {}
    for c in combos:
        ms = 1e3 * np.asarray(times[c.name])
        if ms.size == 0:
            out[c.name] = {"n": 0}
            continue
        out[c.name] = {"n": int(ms.size), "repeats": repeats, "search_ms_p50": float(np.median(ms)), "search_ms_mean": float(ms.mean()),
                       "search_ms_p95": float(np.percentile(ms, 95)), "encode_ms_p50": float(np.median(1e3 * np.asarray(enc)))}
    return out


# ------------------------------------------------------------------------------------------ main
def run_compare(opts: CompareOptions) -> dict[str, Any]:
    t_start = time.time()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    clips, captions, caption_clip, desc = _gallery(opts)
    tmp = None
    if opts.index_dir:
        root = Path(opts.index_dir).absolute()
        root.mkdir(parents=True, exist_ok=True)
        work = root
    else:
        tmp = Path(tempfile.mkdtemp(prefix="gare-compare-"))
        root, work = tmp / "index", tmp
    try:
        manifest = work / "gallery.jsonl"
        _write_gallery_manifest(clips, manifest)
        base = dict(index_type=opts.index_type, batch_size=opts.batch_size, workers=opts.workers, device=opts.device,
                    precision=opts.precision, progress=opts.progress, keep=3)
        t0 = time.time()
        rep_plain = build(opts.checkpoint, manifest, root, BuildOptions(**base, invgc=False, ncl_stage1=True))
        build_s = {"plain": round(time.time() - t0, 1)}
        versions: dict[str, Any] = {"plain": open_index(root, use_gpu=False)}
        notes: list[str] = []
        if rep_plain.skipped:
            notes.append(f"{len(rep_plain.skipped)} gallery videos could not be indexed (skipped with their captions)")
        if opts.bank:  # biases from the bank on top of the plain version (`gare-index biases --from-traffic`)
            rb = recompute_biases(root, traffic=opts.bank, traffic_weight=opts.bank_weight)
            versions["bank"] = open_index(root, use_gpu=False)
            desc["bank"] = rb.biases.get("traffic")
        # the InvGC build starts from the checkpoint's queue again (`build` does not carry a bank)
        want_invgc = any(c.index == "invgc" for c in opts.combos)
        if want_invgc:
            t0 = time.time()
            try:
                build(opts.checkpoint, manifest, root, BuildOptions(
                    **base, invgc=True, ncl_stage1=True, invgc_val=_val_source(opts), invgc_r_g=opts.invgc_r_g,
                    invgc_r_q=opts.invgc_r_q, invgc_grid=opts.invgc_grid))
                versions["invgc"] = open_index(root, use_gpu=False)
            except InvGCUnavailable as e:  # the other rows stand without it
                notes.append(f"InvGC rows left out: {e}")
                log.warning("InvGC rows left out: %s", e)
            build_s["invgc"] = round(time.time() - t0, 1)
        combos = [c for c in (*opts.combos, *(BANK_COMBOS if opts.bank else ())) if c.index in versions]
        v0 = versions["plain"]

        # ---- the filter: compiled per version (each checks it against its own fields), the passing rows
        filters: dict[str, Filter] = {}
        allowed: np.ndarray | None = None
        if opts.filter is not None:
            filters = {name: v.compile_filter(opts.filter) for name, v in versions.items()}
            allowed = np.asarray(v0.filter_mask(filters["plain"]), dtype=bool)
            for name, v in versions.items():
                if not np.array_equal(np.asarray(v.filter_mask(filters[name]), dtype=bool), allowed):
                    raise RuntimeError(f"the filter passes other videos in the {name} index than in the plain one")
            if not allowed.any():
                raise ValueError(f"--filter {json.dumps(opts.filter)}: no video of the gallery passes")
            desc["filter"] = {"filter": opts.filter, "passing": int(allowed.sum()), "n": int(allowed.size)}
            notes.append(f"filter {filters['plain'].text}: {int(allowed.sum())} of {allowed.size} gallery videos pass; "
                         "every row searches those only, the queries are the captions whose video passes")

        # ---- queries: the captions whose video made it into the index (and passes the filter)
        present = set(np.asarray(v0.ids).tolist() if allowed is None else np.asarray(v0.ids)[allowed].tolist())
        keep_q = [i for i, c in enumerate(caption_clip) if int(c) in present]
        texts = [captions[i] for i in keep_q]
        gt_ids = caption_clip[keep_q].astype(np.int64)
        if not texts:
            raise ValueError("no test caption has an indexed video" + (" that passes --filter" if allowed is not None else ""))
        device = resolve_device(opts.device)
        model, ckpt = load_model(opts.checkpoint, device)
        with torch.inference_mode():
            t = torch.cat([encode_queries(model, texts[s:s + 256], opts.precision) for s in range(0, len(texts), 256)])
        units = unit_rows(t)
        gamma, queue = checkpoint_gamma_and_queue(ckpt)
        ids_all = np.asarray(v0.ids)
        n = v0.n
        t0 = time.time()
        psi_full = exhaustive_psi(model, v0, t)  # (a, n) in row order
        psi_s = round(time.time() - t0, 1)
        b_all = np.asarray(v0.biases, dtype=np.float32)
        for name, v in versions.items():
            if not np.array_equal(np.asarray(v.ids), ids_all):
                raise RuntimeError(f"the {name} index holds other ids than the plain one")
        # under a filter the references are the top TOP of the passing videos (the others scored -inf)
        off = np.zeros(n, np.float32) if allowed is None else np.where(allowed, 0.0, -np.inf).astype(np.float32)
        ref = {"psi": _top_ids(psi_full + off[None, :], ids_all, TOP)}
        for name, v in versions.items():
            ref[f"psi+b:{name}"] = _top_ids(psi_full + np.asarray(v.biases, np.float32)[None, :] + off[None, :], ids_all, TOP)
        if allowed is not None:  # fewer than TOP passing videos: the rest of a reference row is no video (-1)
            ref = {key: np.where(allowed[v0.rows(r.reshape(-1))].reshape(r.shape), r, -1) for key, r in ref.items()}
        gt_rows = v0.rows(gt_ids)
        # the exhaustive metrics over the passing videos: their columns, the ground truths' places among them
        gt_sub = gt_rows if allowed is None else (np.cumsum(allowed) - 1)[gt_rows]
        K = int(opts.candidates)
        ks = sorted({int(k) for k in opts.coverage_ks} | {K})
        rng = np.random.default_rng(0)
        lat_idx = np.sort(rng.choice(len(texts), size=min(len(texts), opts.latency_queries), replace=False))
        lat_texts = [texts[i] for i in lat_idx]

        rows: dict[str, dict[str, Any]] = {}
        for combo in combos:
            v = versions[combo.index]
            t0 = time.time()
            with torch.inference_mode():
                hits = two_stage(model, v, t, units, combo, K, flt=filters.get(combo.index),
                                 exact_below=opts.filter_exact_below)
            ranks = final_ranks(hits, v, units, combo.stage1, gt_ids, allowed=allowed)
            cand = stage1(v, combo.stage1, units, max(ks), filters.get(combo.index), opts.filter_exact_below)[1]
            # the share of each reference top-10 inside the first K candidates (all queries have TOP references)
            cov = {name: {int(k): recall_of_topk(np.asarray(cand)[:, :k], ref[key]) for k in ks}
                   for name, key in (("psi", "psi"), ("psi+b", f"psi+b:{combo.index}"))}
            # the combination's score over the whole gallery (its NCL normalisation error)
            base = psi_full if combo.rerank else units @ np.asarray(v.stage1_units, dtype=np.float32).T
            full = base + np.asarray(v.biases, np.float32)[None, :] if combo.ncl else base
            m = retrieval_metrics(full if allowed is None else full[:, allowed], gt_sub, gamma=gamma)
            s1, s2 = combo.describe()
            rows[combo.name] = {
                "index": combo.index, "stage1": s1, "stage2": s2, "t2v": rank_summary(ranks),
                "norm_err_t2v": m["norm_err"]["t2v"], "exhaustive_t2v": m["t2v"],
                "coverage_psi_top10": cov["psi"], "coverage_psi_b_top10": cov["psi+b"],
                "eval_seconds": round(time.time() - t0, 2),
            }
            log.info("%s: R@1 %.1f", combo.name, rows[combo.name]["t2v"]["R1"])
        t0 = time.time()
        threads = (torch.get_num_threads(), faiss.omp_get_max_threads())
        if opts.latency_threads:
            torch.set_num_threads(opts.latency_threads)
            faiss.omp_set_num_threads(opts.latency_threads)
        try:
            lat_threads = {"torch": torch.get_num_threads(), "faiss": faiss.omp_get_max_threads()}
            for name, lat in latency(model, versions, combos, lat_texts, K, opts.precision, opts.latency_repeats,
                                     filters, opts.filter_exact_below).items():
                rows[name]["latency"] = lat
        finally:
            torch.set_num_threads(threads[0])
            faiss.omp_set_num_threads(threads[1])
        lat_s = round(time.time() - t0, 1)

        qn = None if queue is None else queue
        ncl = {"bias_source": v0.manifest.biases.get("source"), "gamma": gamma,
               "queue": 0 if qn is None else int(qn.shape[0]),
               "norm_err_test_before": normalization_error(units, np.asarray(v0.units), gamma),
               "norm_err_test_after": normalization_error(units, np.asarray(v0.units), gamma, b_all)}
        if qn is not None:
            ncl["norm_err_queue_before"] = normalization_error(qn, np.asarray(v0.units), gamma)
            ncl["norm_err_queue_after"] = normalization_error(qn, np.asarray(v0.units), gamma, b_all)
        if "bank" in versions:
            vb = versions["bank"]
            ncl["bank"] = {"biases": vb.manifest.biases,
                           "norm_err_test_after": normalization_error(units, np.asarray(v0.units), gamma,
                                                                      np.asarray(vb.biases, np.float32))}
        result: dict[str, Any] = {
            "checkpoint": str(Path(opts.checkpoint).absolute()),
            "options": {k: v for k, v in asdict(opts).items() if k != "combos"},
            "data": desc, "n_queries": len(texts), "n_gallery": n, "candidates": K, "coverage_ks": ks,
            "k_ge_gallery": K >= n, "rows": rows, "ncl": ncl, "filter": desc.get("filter"),
            "invgc": versions["invgc"].manifest.invgc if "invgc" in versions else None,
            "ncl_stage1": v0.manifest.ncl_stage1,
            "index_type": v0.manifest.index_type,
            "timings_s": {"build": build_s, "exhaustive_psi": psi_s, "latency": lat_s,
                          "total": round(time.time() - t_start, 1)},
            "notes": notes,
            "latency_threads": lat_threads,
        }
        for v in versions.values():
            v.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result["paths"] = write_compare_report(result, out)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result
