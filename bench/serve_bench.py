"""Serving benchmark: latency percentiles and throughput of the GARE search service on this machine.

    python -m bench.serve_bench                       # 10k, 100k and 1M entries (~15 min on 2 cores)
    python -m bench.serve_bench --sizes 10000 --quick # a smoke run

For every gallery size a synthetic index is written through the real index format (gare_index.store
write_version: float16 frame memmap, units, norms, masks, biases, FAISS, SQLite) with the real ViT-B/32
sizes (d = 512, f = 12 frames; 1M entries = 11.4 GiB of frames). Embeddings are clustered unit vectors;
frames are the video direction plus per-frame noise, v̄ their masked mean, so psi sees realistic inputs.
The model is ViT-B/32 GARE with random weights (``get_model_config("gare-vit-b-32", pretrained="none")``)
saved as a real checkpoint that the index names, so the service starts exactly as in production.

Measured in one run, per size:
- components (pure functions, one query): text encoder (fp32, bf16), ANN top-256, psi rerank of 256
  (the fold, as served), exhaustive psi over the whole gallery;
- the service end to end (the FastAPI app with its lifespan, micro-batcher and metadata lookups, driven
  in process through httpx.ASGITransport): ANN-only and two-stage, 1 client and 32 concurrent clients
  (closed loop), fp32 and bf16 text encoder; p50/p95/p99 latency, throughput, and the share of each stage.
Results go to bench/results/serve_bench.{json,md} with the command line and the commit;
``--render bench/results/serve_bench.json`` rewrites the .md from a saved JSON without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.harness import (
    UNKNOWN_COMMIT,
    git_commit,
    loadavg,
    machine,
    render_saved,
    start,
    with_provenance,
    write_report,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gare_index.ann_params import AnnParams  # noqa: E402
from gare_search.query import encode_queries, unit_rows  # noqa: E402
from gare_search.rerank import exhaustive_psi, fold_usable, psi_scores  # noqa: E402
from gare_search.stage1 import ann_stage  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/",
    "indexer/gare_search/",
    "indexer/gare_index/",
    "training/gare/text_quant.py",
    "training/gare/text_*.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


D, F = 512, 12

# ------------------------------------------------------------------------------------------ queries
_COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan", "black", "white"]
_THINGS = ["dog", "cat", "man", "woman", "car", "ball", "circle", "square", "bird", "child", "horse", "train"]
_ACTS = ["runs across a field", "jumps over a fence", "rises slowly", "slides to the left", "is cooking pasta",
         "plays the guitar", "rolls down a hill", "dances on a stage", "swims in a pool", "drives through a city"]
_TAILS = ["", " at night", " in slow motion", " while people watch", ", then it stops", " on a sunny beach"]


def make_queries(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append(f"a {rng.choice(_COLORS)} {rng.choice(_THINGS)} {rng.choice(_ACTS)}{rng.choice(_TAILS)}")
    return out


# ------------------------------------------------------------------------------------------ gallery
class _HashedNpy:
    """Write a .npy header + rows sequentially, hashing as we go (no re-read of a 12 GB file)."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.fh = open(path, "wb")
        self.h = hashlib.sha256()
        self.path = path
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
        import io

        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, header)
        self._write(buf.getvalue())

    def _write(self, b: bytes | memoryview) -> None:
        self.h.update(b)
        self.fh.write(b)

    def rows(self, arr: np.ndarray) -> None:
        self._write(memoryview(np.ascontiguousarray(arr)).cast("B"))

    def close(self) -> str:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        return self.h.hexdigest()


def write_random_gallery(work: Path, n: int) -> Path:
    """A fresh folder ``work`` with a random-weight ViT-B/32 GARE checkpoint and a gallery of n entries written by
    :func:`write_gallery` with psi's constants folded (timing only); returns the checkpoint's path (the index is
    ``work / "g" / "index"``)."""
    from gare.checkpoint import file_sha256, save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE
    from gare.psi_fold_weights import fold_weights

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.manual_seed(0)
    cfg = get_model_config("gare-vit-b-32", pretrained="none")
    ck = work / "gare-vit-b-32-random.safetensors"
    m = GARE.build(cfg).eval()
    save_checkpoint(ck, m, queues={})
    write_gallery(work / "g", n, {"path": str(ck), "sha256": file_sha256(ck), "model_config": cfg.to_dict()},
                  fold_weights(m.psi))
    return ck


def gallery_ann_params(n: int, index_type: str) -> AnnParams:
    """The ANN of a synthetic gallery of n entries: the type's defaults, IVF at 500k+ with nlist 1024 / nprobe 32
    (the default nlist 4000 takes ~10 min to train on 2 cores)."""
    if index_type == "ivf" and n >= 500_000:
        return AnnParams("ivf", nlist=1024, nprobe=32)
    return AnnParams(index_type)


def gallery_rows(masks: np.ndarray) -> Iterator[dict[str, Any]]:
    """meta.sqlite rows of a synthetic gallery, one per mask row (id = row)."""
    return ({"id": int(i), "path": f"/library/clip{i:07d}.mp4", "size": 1_000_000, "mtime": 0.0, "checksum": "",
             "duration": 10.0, "fps": 30.0, "frames_used": int(masks[i].sum()), "start": None, "end": None}
            for i in range(masks.shape[0]))


def write_gallery(root: Path, n: int, ckpt: dict[str, Any], fold: Any = None, *, seed: int = 0, chunk: int = 32768,
                  device: Any = "cpu", index_type: str | None = None) -> dict[str, Any]:
    """Synthetic clustered gallery of n entries written as a real index version; returns timings.

    `index_type`: the stage-1 index ("flat": exact, what bench/sharded.py compares); None = the automatic type.

    `fold` (the checkpoint's PsiFold): also fold psi's per-video constants (psi_consts.npy, what `gare-index build`
    writes), so the service reranks with the fold; ~19 MFLOP per video (minutes at 1M on one core), on `device`."""
    from gare.psi_fold_videos import fold_videos, packed_width
    from gare_index.ann_params import choose_index_type
    from gare_index.psi_consts import manifest_entry
    from gare_index.store import ExistingFile, write_version

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    stage = root / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    n_clusters = max(32, n // 500)
    centres = rng.standard_normal((n_clusters, D)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    bank = (rng.standard_normal((4096, F, D)) * (0.6 / math.sqrt(D))).astype(np.float32)  # per-frame noise
    frames_w = _HashedNpy(stage / "frames.npy", (n, F, D), np.float16)
    units_w = _HashedNpy(stage / "units.npy", (n, D), np.float32)
    consts_w = _HashedNpy(stage / "psi_consts.npy", (n, packed_width(F)), np.float32) if fold is not None else None
    t_fold = 0.0
    norms = np.empty(n, np.float32)
    masks = np.ones((n, F), np.uint8)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        c = e - s
        direction = centres[rng.integers(0, n_clusters, c)] + rng.standard_normal((c, D)).astype(np.float32) * (0.35 / math.sqrt(D))
        direction /= np.linalg.norm(direction, axis=1, keepdims=True)
        fr = direction[:, None, :] + bank[rng.integers(0, bank.shape[0], c)]
        used = np.where(rng.random(c) < 0.2, rng.integers(4, F + 1, c), F)  # 20% shorter clips, padded
        m = (np.arange(F)[None, :] < used[:, None]).astype(np.uint8)
        fr *= m[:, :, None]
        masks[s:e] = m
        fr16 = fr.astype(np.float16)
        vbar = fr16.astype(np.float32).sum(1) / used[:, None]  # v̄ from the stored (fp16) frames
        nr = np.linalg.norm(vbar, axis=1)
        norms[s:e] = nr
        frames_w.rows(fr16)
        units_w.rows((vbar / nr[:, None]).astype(np.float32))
        if consts_w is not None:
            tf = time.perf_counter()
            with torch.no_grad():
                dev = torch.device(device)
                consts_w.rows(fold_videos(torch.from_numpy(fr16).to(dev), torch.from_numpy(m).to(dev), fold.to(dev),
                                          vbar=torch.from_numpy(vbar).to(dev)).packed.cpu().numpy())
            t_fold += time.perf_counter() - tf
        del fr, fr16
    frames_sha, units_sha = frames_w.close(), units_w.close()
    arrays: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if consts_w is not None:
        arrays["psi_consts"] = ExistingFile(stage / "psi_consts.npy", consts_w.close())
        extra["psi_fold"] = manifest_entry(fold, F, ckpt["sha256"])
    t_gen = time.perf_counter() - t0

    ids = np.arange(n, dtype=np.int64)
    biases = (rng.standard_normal(n) * 0.005).astype(np.float32)  # synthetic NCL biases (values do not affect cost)
    index_type = index_type or choose_index_type(n)
    params = gallery_ann_params(n, index_type)
    rows = gallery_rows(masks)
    t1 = time.perf_counter()
    name = write_version(
        root / "index",
        {"ids": ids, "norms": norms, "units": ExistingFile(stage / "units.npy", units_sha),
         "frames": ExistingFile(stage / "frames.npy", frames_sha), "masks": masks, "biases": biases, **arrays},
        rows,
        {"checkpoint": ckpt, "ann_params": params.to_dict(), "biases": {"source": "synthetic", "gamma": None},
         "synthetic": True, **extra},
    )
    t_write = time.perf_counter() - t1
    shutil.rmtree(stage, ignore_errors=True)
    return {"generate_s": round(t_gen, 1), "fold_constants_s": round(t_fold, 1), "write_version_s": round(t_write, 1), "version": name,
            "index_type": params.index_type, "ann_params": params.to_dict(),
            "frames_bytes": n * F * D * 2}


# ------------------------------------------------------------------------------------------ measuring
def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summary_ms(xs_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in xs_s]
    return {"p50": round(pct(ms, 50), 2), "p95": round(pct(ms, 95), 2), "p99": round(pct(ms, 99), 2),
            "mean": round(statistics.fmean(ms), 2) if ms else float("nan"), "n": len(ms)}


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def components(model, version, queries: list[str], reps: int) -> tuple[dict[str, Any], Any, list[np.ndarray]]:
    res: dict[str, Any] = {}
    qs = queries[:reps]
    for prec in ("fp32", "bf16"):
        for q in qs[:3]:
            encode_queries(model, [q], prec)
        it = iter(qs * 2)
        res[f"encode_1q_{prec}"] = summary_ms(timed(lambda it=it, prec=prec: encode_queries(model, [next(it)], prec), reps))
    t = encode_queries(model, qs, "fp32")
    units = unit_rows(t)
    for i in range(3):
        ann_stage(version, units[i : i + 1], 256)
    it = iter(range(10**9))
    res["ann_1q_K256"] = summary_ms(timed(lambda: ann_stage(version, units[next(it) % len(qs)][None], 256), reps))
    cands = [ann_stage(version, units[i : i + 1], 256)[1][0] for i in range(len(qs))]
    cands = [c[c >= 0] for c in cands]
    assert fold_usable(model, version), "the gallery has no valid psi constants: the fold would not be measured"
    psi_scores(model, version, t[0:1], [cands[0]])  # the served rerank (the fold); warm-up, not counted
    it = iter(range(10**9))

    def one() -> None:
        i = next(it) % len(qs)
        psi_scores(model, version, t[i : i + 1], [cands[i]])

    res["rerank_1q_K256_fold"] = summary_ms(timed(one, reps))
    return res, t, cands


def exhaustive(model, version, t, cands, n_queries: int) -> dict[str, Any]:
    """Exhaustive psi over the whole gallery (the fold over the stored constants) for a few queries."""
    import mmap

    mm = getattr(version.frames, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_SEQUENTIAL"):
        mm.madvise(mmap.MADV_SEQUENTIAL)  # the service advised random access; this pass reads it all in order
    ex_times, found = [], []
    for i in range(n_queries):
        t0 = time.perf_counter()
        s = exhaustive_psi(model, version, t[i : i + 1], block=4096)[0] + np.asarray(version.biases)
        ex_times.append(time.perf_counter() - t0)
        top10 = np.asarray(version.ids)[np.argsort(-s, kind="stable")[:10]]
        found.append(np.isin(top10, cands[i]).mean())
        del s
        gc.collect()
    if mm is not None and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return {"exhaustive_psi_1q": summary_ms(ex_times),
            "exhaustive_top10_in_ann_top256": round(float(np.mean(found)), 4) if found else None}


def resident_fraction(path: Path) -> float | None:
    """Share of the file in the page cache (util-linux fincore), None when unavailable."""
    import subprocess

    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return round(int(out[0]) / max(1, int(out[1])), 3)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def warm_file(path: Path) -> float:
    """Read a file once (buffered, sequential) so its pages are cached; returns seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while fh.read(16 << 20):
            pass
    return time.perf_counter() - t0


def drop_file_cache(path: Path, arr: Any = None) -> None:
    """Evict this one file from the page cache (POSIX_FADV_DONTNEED; other processes are unaffected).

    Pages mapped by our own memmap are released first (MADV_DONTNEED), else the kernel keeps them."""
    import mmap

    mm = getattr(arr, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


async def drive(client, queries: list[str], body: dict[str, Any], clients: int, per_client: int) -> dict[str, Any]:
    lat: list[float] = []
    stages: dict[str, list[float]] = {}
    batch: list[int] = []
    errors = 0
    failures: list[str] = []

    async def worker(w: int) -> None:
        nonlocal errors
        for j in range(per_client):
            q = queries[(w * per_client + j) % len(queries)]
            t0 = time.perf_counter()
            r = await client.post("/v1/search", json={"query": q, **body})
            lat.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors += 1
                failures.append(f"HTTP {r.status_code}: {r.text[:300]}")
                continue
            js = r.json()
            batch.append(js["batch_size"])
            for k, v in js["timings_ms"].items():
                if isinstance(v, int | float):  # "cache": hit/miss is a label, not a time
                    stages.setdefault(k, []).append(v)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    wall = time.perf_counter() - t0
    if not batch:  # nothing was served: there is no figure to report
        raise RuntimeError(f"every one of {len(lat)} requests failed, the first with {failures[0]}")
    out = summary_ms(lat)
    out.update(throughput_qps=round(len(lat) / wall, 2), errors=errors, mean_batch=round(statistics.fmean(batch), 2) if batch else 0)
    out["stage_mean_ms"] = {k: round(statistics.fmean(v), 2) for k, v in stages.items()}
    return out


async def size_bench(app, queries: list[str], args, n_exhaustive: int, cold: bool) -> dict[str, Any]:
    """Inside one app lifespan: warm the page cache, components, service runs, exhaustive, cold run."""
    import httpx

    out: dict[str, Any] = {}
    async with app.router.lifespan_context(app):
        state = app.state.gare
        version = state.handle.version
        frames_path = version.path / "frames.npy"
        out["page_cache"] = {"frames_resident_before_warm": resident_fraction(frames_path)}
        out["page_cache"]["warm_read_s"] = round(warm_file(frames_path) + warm_file(version.path / "units.npy"), 1)
        out["page_cache"]["frames_resident_after_warm"] = resident_fraction(frames_path)
        comp, t, cands = await asyncio.to_thread(components, state.model, version, queries, args.component_reps)
        print(f"   components: {json.dumps(comp)}", flush=True)
        svc: dict[str, Any] = {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=600) as c:  # loopback: the Host check
            for _ in range(5):  # warm-up
                await c.post("/v1/search", json={"query": queries[0], "k": 10})
            for prec in args.precisions:
                state.precision = prec
                await drive(c, queries, {"k": 10}, 4, 2)  # warm the shapes of this precision
                modes = [("ann_only", {"k": 10, "rerank": False}), ("two_stage", {"k": 10, "candidates": 256})]
                for mode, body in modes:
                    single = await drive(c, queries, body, 1, args.single_requests)
                    conc = await drive(c, queries, body, args.clients, args.concurrent_per_client)
                    svc[f"{prec}/{mode}"] = {
                        "1_client": single, f"{args.clients}_clients": conc,
                        "throughput_gain": round(conc["throughput_qps"] / single["throughput_qps"], 2),
                    }
                    print(f"    {prec:5s} {mode:9s} 1 client p50 {single['p50']:7.1f} ms {single['throughput_qps']:6.1f} q/s | "
                          f"{args.clients} clients p50 {conc['p50']:7.1f} ms {conc['throughput_qps']:6.1f} q/s "
                          f"(x{svc[f'{prec}/{mode}']['throughput_gain']}, mean batch {conc['mean_batch']})", flush=True)
            state.precision = "fp32"
            out["page_cache"]["frames_resident_after_service"] = resident_fraction(frames_path)
            if n_exhaustive:
                comp.update(await asyncio.to_thread(exhaustive, state.model, version, t, cands, n_exhaustive))
                print(f"   exhaustive: {comp['exhaustive_psi_1q']}", flush=True)
            if cold:
                drop_file_cache(frames_path, version.frames)
                drop_file_cache(version.path / "units.npy", version.units)
                out["page_cache"]["frames_resident_cold"] = resident_fraction(frames_path)
                cold_q = make_queries(args.cold_requests, seed=99)  # queries not seen before
                svc["fp32/two_stage_cold_cache"] = {"1_client": await drive(c, cold_q, {"k": 10, "candidates": 256}, 1, len(cold_q))}
                svc["fp32/two_stage_cold_cache"][f"{args.clients}_clients"] = await drive(
                    c, make_queries(args.clients * 2, seed=98), {"k": 10, "candidates": 256}, args.clients, 2)
                v = svc["fp32/two_stage_cold_cache"]
                v["throughput_gain"] = round(v[f"{args.clients}_clients"]["throughput_qps"] / v["1_client"]["throughput_qps"], 2)
                print(f"    cold page cache: two-stage 1 client p50 {v['1_client']['p50']:.1f} ms", flush=True)
        out["components"] = comp
        out["service"] = svc
    return out


# ------------------------------------------------------------------------------------------ report
def notes(data: dict[str, Any]) -> str:
    """How to read the tables: every figure here is one this run measured (nothing typed in by hand)."""
    m = data["machine"]
    L = ["", "## Notes (how to read these numbers)", "",
         f"- **Shared machine.** Other jobs may run on the same {m['cores']}-core machine (load averages above): "
         "repeat the command before trusting a small difference.",
         f"- **Threads.** torch/faiss used {m['torch_threads']}/{m['faiss_threads']} threads (`--threads`); on a "
         "shared host set `GARE_TORCH_THREADS` for the service the same way."]
    sizes = data["sizes"]
    if sizes:
        size, r = max(sizes.items(), key=lambda kv: int(kv[0]))
        c = r["components"]
        enc, fold = c.get("encode_1q_fp32"), c.get("rerank_1q_K256_fold")
        if enc and fold:
            L.append(f"- **Where the time goes ({int(size):,} entries, one query, p50).** The text encoder (fp32) took "
                     f"{enc['p50']:.1f} ms and the psi rerank of 256 candidates (fold) {fold['p50']:.1f} ms; the "
                     "rerank is per (query, video) pair, so batching queries does not share it. The stage shares "
                     "and the ratios above are this run's.")
        g = r["gallery"]
        ap = g["ann_params"]
        L.append(f"- **{int(size):,} entries** use {g['frames_bytes'] / 2**30:.1f} GiB of float16 frames "
                 f"({g['index_type']}" + (f", nlist {ap['nlist']} / nprobe {ap['nprobe']}" if ap.get("nlist") else "")
                 + "). The \"page cache\" line says how much of frames.npy stayed in RAM; reranks of non-resident rows "
                 "read the disk (the cold-cache rows, when present, show the fully cold case).")
    L += ["- **The rerank** is the fold: psi folded into per-video constants stored in the index (what the service "
          "serves). Rows for other forms appear only in reports of runs that measured them.",
          "- **Exhaustive psi** scores every gallery entry with the fold over the stored constants; the \"top-10 in "
          "the ANN top-256\" figure is meaningless with random psi weights: measure it with a trained checkpoint.",
          "- **GPU.** " + (f"This run had {m['gpu']}." if m.get("gpu") else
                           "This run had no GPU; bench/gpu_bench.py measures the CUDA path."), ""]
    return "\n".join(L)


@with_provenance
def markdown(data: dict[str, Any]) -> str:
    L = []
    L.append("# Serving benchmark: GARE two-stage search on CPU\n")
    L.append(f"Command (from the repository root): `{data['command']}`; commit {data.get('commit', UNKNOWN_COMMIT)}\n")
    m = data["machine"]
    L.append(f"Machine: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'}; torch {m['torch']}, faiss {m['faiss']}; "
             f"torch/faiss threads {m['torch_threads']}/{m['faiss_threads']}. Date {data['date']}, wall time {data['wall_s']:.0f} s. "
             f"Load average (1/5/15 min) at start {data['load_start']}, at end {data['load_end']} (the machine is shared).\n")
    L.append("Model: GARE ViT-B/32 (text tower 12 x 512, 32-token context; psi d = 512), random weights, from a real "
             "checkpoint file that the index names. Gallery: synthetic clustered embeddings written with the real index "
             f"format, d = {D}, f = {F} frames (float16), 20% of the clips padded. Queries: short English sentences "
             "(~10-14 tokens after trimming the padding). k = 10, K = 256. Service numbers are end to end through the "
             "FastAPI app (lifespan, validation, micro-batcher, SQLite metadata, JSON) in process via httpx.ASGITransport, "
             "closed loop; no network stack.\n")
    for size, r in data["sizes"].items():
        g = r["gallery"]
        L.append(f"\n## {int(size):,} entries ({g['index_type']} {json.dumps({k: v for k, v in g['ann_params'].items() if k in ('nlist', 'nprobe') and v})}; "
                 f"frames {g['frames_bytes'] / 2**30:.2f} GiB; generated in {g['generate_s']} s, write_version {g['write_version_s']} s)\n")
        pc = r.get("page_cache", {})
        L.append("Page cache (share of frames.npy resident, util-linux fincore): " + ", ".join(
            f"{k.replace('frames_resident_', '').replace('_', ' ')} {v:.0%}" if isinstance(v, float) and k.startswith("frames") else f"{k.replace('_', ' ')} {v}"
            for k, v in pc.items() if v is not None) + ".\n")
        c = r["components"]
        L.append("| component (1 query) | p50 ms | p95 ms | p99 ms |\n|---|---|---|---|")
        for key, label in (("encode_1q_fp32", "text encoder fp32"), ("encode_1q_bf16", "text encoder bf16"),
                           ("ann_1q_K256", "ANN top-256"), ("rerank_1q_K256_fold", "psi rerank of 256 (fold, default)"),
                           ("rerank_1q_K256_fused", "psi rerank of 256 (fused)"),
                           ("rerank_1q_K256_model", "psi rerank of 256 (model.score)"),
                           ("exhaustive_psi_1q", "exhaustive psi over the gallery (fold)")):
            v = c.get(key)
            if v:
                L.append(f"| {label} | {v['p50']:.2f} | {v['p95']:.2f} | {v['p99']:.2f} |")
        if c.get("exhaustive_top10_in_ann_top256") is not None:
            L.append(f"\nExhaustive GARE top-10 found in the ANN top-256: {c['exhaustive_top10_in_ann_top256']:.1%} "
                     f"(over {c['exhaustive_psi_1q']['n']} queries; random psi weights, so this says nothing about a trained "
                     "model, where psi only nudges the cosine ranking).\n")
        L.append("\n| precision / mode | clients | p50 ms | p95 ms | p99 ms | q/s | mean batch | gain vs 1 client |\n|---|---|---|---|---|---|---|---|")
        for key, s in r["service"].items():
            for ck, v in s.items():
                if ck == "throughput_gain":
                    continue
                gain = f"x{s['throughput_gain']}" if not ck.startswith("1_") else ""
                L.append(f"| {key} | {ck.split('_')[0]} | {v['p50']:.1f} | {v['p95']:.1f} | {v['p99']:.1f} | {v['throughput_qps']:.1f} | {v['mean_batch']} | {gain} |")
        rr = r["ratios"]
        L.append("\nRatios measured in this run (p50, one client, fp32): " + "; ".join(f"{k} {v}" for k, v in rr.items()) + "\n")
        sh = r["stage_share_two_stage_fp32_1_client"]
        L.append("Share of the two-stage request time (fp32, 1 client, server side): " + ", ".join(f"{k} {v:.0%}" for k, v in sh.items()) + "\n")
    L.append("\n## Targets\n")
    for line in data["targets"]:
        L.append(f"- {line}")
    L.append(notes(data))
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--work", default="/tmp/gare-serve-bench", help="scratch folder for the indexes (deleted after)")
    ap.add_argument("--threads", type=int, default=1, help="torch and faiss threads (1: see the notes on the shared 2-core machine)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--single-requests", type=int, default=60)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--concurrent-per-client", type=int, default=6)
    ap.add_argument("--component-reps", type=int, default=40)
    ap.add_argument("--exhaustive-queries", default="5,2,1", help="queries for the exhaustive psi, per size")
    ap.add_argument("--cold-requests", type=int, default=30, help="two-stage requests after evicting the frames from the page cache (largest size)")
    ap.add_argument("--quick", action="store_true", help="few requests (smoke test)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch indexes")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_bench"))
    ap.add_argument("--render", type=Path, help="rewrite the .md beside this saved JSON from it; run nothing")
    args = ap.parse_args(argv)
    if args.render:
        print(f"wrote {render_saved(args.render, markdown)}")
        return 0
    args.precisions = [p for p in args.precisions.split(",") if p]
    if args.quick:
        args.single_requests, args.concurrent_per_client, args.component_reps, args.cold_requests = 10, 2, 8, 5
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ex_q = [int(x) for x in args.exhaustive_queries.split(",")]
    ex_q = (ex_q + [ex_q[-1]] * len(sizes))[: len(sizes)]

    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    started = time.time()
    run = start(__name__, MEASURES, argv)
    data: dict[str, Any] = {"command": run.command,
                            "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "load_start": loadavg(), "sizes": {}}
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        from gare.checkpoint import file_sha256, save_checkpoint
        from gare.config import get_model_config
        from gare.model import GARE
        from gare_serve.app import create_app
        from gare_serve.settings import Settings

        print("saving a ViT-B/32 GARE checkpoint (random weights)", flush=True)
        torch.manual_seed(0)
        cfg = get_model_config("gare-vit-b-32", pretrained="none")
        m = GARE.build(cfg).eval()
        with torch.no_grad():  # psi with non-trivial weights (the cost does not depend on them)
            for name, p in m.psi.named_parameters():
                if name.endswith("weight") and p.ndim == 2:
                    p.normal_(0, 0.05)
        ck_path = work / "gare-vit-b-32-random.safetensors"
        save_checkpoint(ck_path, m, queues={})
        from gare.psi_fold_weights import fold_weights

        fold = fold_weights(m.psi)
        del m
        ckpt = {"path": str(ck_path), "sha256": file_sha256(ck_path), "model_config": cfg.to_dict()}
        queries = make_queries(400)
        for n, nex in zip(sizes, ex_q, strict=True):
            print(f"== {n:,} entries", flush=True)
            root = work / f"g{n}"
            # In a child process: write_version materialises the metadata rows (~1 GB at 1M) and the
            # generator's buffers; the child's exit gives that memory back to the page cache.
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
                g = ex.submit(write_gallery, root, n, ckpt, fold).result()
            print(f"   gallery written: {g}", flush=True)
            gc.collect()
            app = create_app(Settings(index=root / "index", torch_threads=args.threads, precision="fp32",
                                      batch_max_size=32, batch_max_wait_ms=2.0, max_body_bytes=1 << 20,
                                      query_cache_entries=0, result_cache_entries=0))
            # both caches off: every request encodes and searches (bench/serve_http.py measures the caches)
            r = asyncio.run(size_bench(app, queries, args, nex, cold=n == max(sizes) and args.cold_requests > 0))
            del app
            comp, svc = r["components"], r["service"]
            two = svc["fp32/two_stage"]["1_client"]
            ann = svc["fp32/ann_only"]["1_client"]
            enc = comp["encode_1q_fp32"]["p50"]
            ratios = {
                "two-stage / ANN-only (service)": round(two["p50"] / ann["p50"], 2),
                "fold rerank / text encoder": round(comp["rerank_1q_K256_fold"]["p50"] / enc, 3),
                "two-stage (fold) p50 / text encoder p50": round(two["p50"] / enc, 2),
            }
            if "exhaustive_psi_1q" in comp:
                ratios["exhaustive psi / two-stage rerank (components, fold)"] = round(comp["exhaustive_psi_1q"]["p50"] / comp["rerank_1q_K256_fold"]["p50"], 1)
                ratios["exhaustive search / two-stage search"] = round((comp["exhaustive_psi_1q"]["p50"] + enc) / two["p50"], 1)
            st = two["stage_mean_ms"]
            tot = st["total"]
            share = {k: st[k] / tot for k in ("queue", "encode", "ann", "rerank")}
            share["http+metadata+rank"] = max(0.0, 1 - sum(share.values()))
            data["sizes"][str(n)] = {"gallery": g, "page_cache": r["page_cache"], "components": comp, "service": svc,
                                     "ratios": ratios,
                                     "stage_share_two_stage_fp32_1_client": {k: round(v, 3) for k, v in share.items()}}
            print(f"   ratios: {ratios}", flush=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
            gc.collect()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    data["load_end"] = loadavg()
    data["wall_s"] = time.time() - started
    targets = []
    big = data["sizes"].get(str(max(sizes)))
    if big:
        for prec in args.precisions:
            two = big["service"][f"{prec}/two_stage"]
            enc = big["components"][f"encode_1q_{prec}"]["p50"]
            r = two["1_client"]["p50"] / enc
            targets.append(f"two-stage p50 at {max(sizes):,} ({prec}): {two['1_client']['p50']:.1f} ms = {r:.2f} x the text encoder's "
                           f"{enc:.1f} ms (target <= 1.15 x, issue 12): {'met' if r <= 1.15 else 'NOT met'}")
            gain = two["throughput_gain"]
            targets.append(f"throughput at {args.clients} clients vs 1 ({prec}, two-stage, {max(sizes):,}): x{gain} "
                           f"(target >= 2.5): {'met' if gain >= 2.5 else 'NOT met'}")
    data["targets"] = targets
    out = Path(args.out)
    data["run"] = run.record()
    write_report(out.with_suffix(".json"), data, markdown)
    print("\n".join(targets))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
