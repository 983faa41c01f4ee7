"""The GPU sections of bench/gpu_bench.py that prove FAISS on the GPU (issue 27): stage 1 at 1M and 10M entries,
`gare-index build` on generated videos, and the two-stage search over HTTP at 1M entries.

- ``faiss_stage1``: a CLIP-like gallery (bench/clip_like.py's procedure, drawn with torch on the device so
  10M x 512 takes seconds: low intrinsic dimension, a cone, heavy-tailed topics, 5% near-duplicates, text
  queries across a modality gap) with two query sets: *tuning* queries (captions of random gallery videos)
  and *held-out* queries from another distribution (every topic equally, noisier captions).  Exact top-10
  and top-256 from a torch matrix product + top-k on the device (also timed: the physical baseline).  Then
  the product's own path, `gare_index.ann.build_index` + `AnnIndex` with ``use_gpu=True``: flat (exact)
  and IVF-Flat at the default nlist with nprobe tuned on the tuning queries (the smallest power of two
  whose recall@256 of the exact top-10 is >= the target); for each, recall on both query sets, p50 for
  1 and 32 queries, and the CPU master copy's answers against the GPU copy's on the same data.
- ``index_build``: `gare_build.build.build` (the code behind `gare-index build`) over generated mp4s
  (``write_videos``, ``--build-videos``) with the ViT-B/32 vision tower (random weights), fp32 (``--build-precisions``)
  and the CLI's ``--workers auto``: frames/s decoded and encoded (decode in worker processes, overlapped; the
  workers hand on uint8 frames, normalised on the encoder's device), and where the encode loop's time went
  (``RunReport.encode_stages``).
- ``http_search``: a 1M-entry gallery in the real index format (write_gallery_device: serve_bench.write_gallery's
  gallery drawn on the device), `gare-serve`
  on the device (``--http-workers`` HTTP workers and, on CUDA, the shared engine with the resident index),
  closed-loop HTTP clients (serve_http.closed_loop): p50,
  p99 and q/s at 1 and 32 clients.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.clip_like import ClipLikeConfig, Space

D = 512
K = 256
LADDER = [2**i for i in range(12)]  # nprobe 1 .. 2,048 (faiss GPU's selection limit)


# ------------------------------------------------------------------------------------------ data
def clip_like_torch(n: int, n_queries: int, dev: torch.device, *, seed: int = 0, cfg: ClipLikeConfig | None = None,
                    held_noise: float = 1.0, chunk: int = 1 << 20) -> dict[str, Any]:
    """bench/clip_like.py's gallery drawn with torch on ``dev``: gallery (n, d), tuning queries (captions of
    random gallery videos, as clip_like) and held-out queries (a topic chosen uniformly, caption noise
    ``held_noise``), all unit float32 rows on ``dev``."""
    cfg = cfg or ClipLikeConfig()
    sp = Space(n, cfg, seed)  # the shared geometry (numpy, small): spectrum, basis, cones, centres, weights
    g = torch.Generator(device=dev).manual_seed(seed)
    scale = torch.from_numpy(sp.scale).to(dev)  # (r,)
    basis = torch.from_numpy(sp.basis).to(dev)  # (r, d)
    centres = torch.from_numpy(sp.centres).to(dev)  # (C, r)
    weights = torch.from_numpy(sp.weights).to(dev, torch.float32)
    amb = cfg.ambient_noise * sp.latent_norm / math.sqrt(cfg.d)

    def embed(z: torch.Tensor, mean: np.ndarray) -> torch.Tensor:
        x = z @ basis + torch.from_numpy(mean).to(dev) + amb * torch.randn(z.shape[0], cfg.d, generator=g, device=dev)
        return F.normalize(x, dim=-1)

    x = torch.empty(n, cfg.d, device=dev)
    z_all = torch.empty(n, scale.numel(), device=dev)
    cl_all = torch.empty(n, dtype=torch.int64, device=dev)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        cl = torch.multinomial(weights, e - s, replacement=True, generator=g)
        z = centres[cl] + cfg.within * torch.randn(e - s, scale.numel(), generator=g, device=dev) * scale
        x[s:e], z_all[s:e], cl_all[s:e] = embed(z, sp.mu_v), z, cl
    n_dup = int(round(cfg.dup_frac * n))  # near-duplicates: noisy copies of other rows
    if n_dup and n > 1:
        dst = torch.randperm(n, generator=g, device=dev)[:n_dup]
        src = torch.randint(0, n, (n_dup,), generator=g, device=dev)
        x[dst] = F.normalize(x[src] + torch.randn(n_dup, cfg.d, generator=g, device=dev) * (cfg.dup_noise / math.sqrt(cfg.d)), dim=-1)
        z_all[dst], cl_all[dst] = z_all[src], cl_all[src]
    tgt = torch.randint(0, n, (n_queries,), generator=g, device=dev)
    q_tune = embed(z_all[tgt] + cfg.query_noise * torch.randn(n_queries, scale.numel(), generator=g, device=dev) * scale, sp.mu_t)
    # held out: every topic equally likely (a row's weight = 1 / its topic's size), noisier captions
    size = torch.bincount(cl_all, minlength=centres.shape[0]).float()
    w_row = 1.0 / size[cl_all]
    tgt_h = torch.multinomial(w_row, n_queries, replacement=True, generator=g)  # n < 2**24 (torch's limit)
    q_held = embed(z_all[tgt_h] + held_noise * torch.randn(n_queries, scale.numel(), generator=g, device=dev) * scale, sp.mu_t)
    del z_all, cl_all
    return {"x": x, "q_tune": q_tune, "q_held": q_held, "topics": int(centres.shape[0])}


def exact_topk(x: torch.Tensor, q: torch.Tensor, k: int, chunk: int = 1 << 21) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product: (scores (m, k), row ids (m, k)) over x (n, d) in gallery chunks."""
    best_s = torch.full((q.shape[0], k), -math.inf, device=q.device)
    best_i = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    for s in range(0, x.shape[0], chunk):
        sc = q @ x[s:s + chunk].T  # (m, c)
        v, i = torch.topk(sc, min(k, sc.shape[1]), dim=1)
        cat_s, cat_i = torch.cat([best_s, v], 1), torch.cat([best_i, i + s], 1)
        best_s, o = torch.topk(cat_s, k, dim=1)
        best_i = torch.gather(cat_i, 1, o)
    return best_s.cpu().numpy(), best_i.cpu().numpy()


def recall(found: np.ndarray, exact10: np.ndarray) -> float:
    """Mean fraction of the exact top-10 found in each row of ``found`` (m, K)."""
    return float(np.mean([np.isin(e, f).mean() for f, e in zip(found, exact10, strict=True)]))


def same_ids(a_s: np.ndarray, a_i: np.ndarray, b_i: np.ndarray, tol: float = 1e-5) -> dict[str, float]:
    """How far two top-k answers agree: the fraction of positions with the same id, and with the same id or
    a score tied (within ``tol``) with a neighbour (two tied results may trade places in another summation order)."""
    gap = np.abs(np.diff(a_s, axis=1)) < tol
    tie = np.zeros_like(a_i, dtype=bool)
    tie[:, :-1] |= gap
    tie[:, 1:] |= gap
    eq = a_i == b_i
    return {"equal_positions": float(eq.mean()), "equal_or_tied": float((eq | tie).mean())}


# ------------------------------------------------------------------------------------------ timing
def p50_ms(fn, dev: torch.device, iters: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def batched_search(search, q: np.ndarray, k: int, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    out = [search(q[s:s + batch], k) for s in range(0, q.shape[0], batch)]
    return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])


# ------------------------------------------------------------------------------------------ sections
def stage1_at(n: int, args: Any, dev: torch.device) -> dict[str, Any]:
    import faiss

    from gare_index.ann import AnnIndex, build_index
    from gare_index.ann_params import AnnParams, default_nlist

    use_gpu = True if dev.type == "cuda" else False  # on a CPU smoke run: the same path, on the CPU
    t0 = time.perf_counter()
    data = clip_like_torch(n, args.stage1_queries, dev, seed=n)
    x = data["x"]
    out: dict[str, Any] = {"entries": n, "topics": data["topics"], "queries": args.stage1_queries}
    qt, qh = data["q_tune"], data["q_held"]
    ex_t = exact_topk(x, qt, K)
    ex_h = exact_topk(x, qh, K)
    out["generate_and_exact_s"] = time.perf_counter() - t0
    exact10 = {"tune": ex_t[1][:, :10], "held_out": ex_h[1][:, :10]}
    out["torch_exact"] = {f"p50_ms_{m}q": p50_ms(lambda m=m: torch.topk(qt[:m] @ x.T, K, dim=1), dev, args.stage1_iters)
                          for m in (1, 32)}
    print(f"stage1 n={n:,}: data + exact in {out['generate_and_exact_s']:.1f}s; torch exact {out['torch_exact']}", flush=True)
    out["resident_exact"] = resident_exact(x, qt, qh, exact10, dev, args.stage1_iters)
    print(f"  resident exact (the product's exact stage 1): {out['resident_exact']}", flush=True)
    t0 = time.perf_counter()
    xh = x.cpu().numpy()
    x = data = None  # the gallery lives on the host from here (faiss's copies go to the device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ids = np.arange(n, dtype=np.int64)
    qt_n, qh_n = qt.cpu().numpy(), qh.cpu().numpy()
    out["to_host_s"] = time.perf_counter() - t0
    q32 = np.ascontiguousarray(qt_n[:32])

    # flat (exact) through the product path
    t0 = time.perf_counter()
    p = AnnParams("flat")
    ann = AnnIndex(build_index(xh, ids, p, use_gpu=use_gpu), p, use_gpu=use_gpu)
    flat: dict[str, Any] = {"build_s": time.perf_counter() - t0, "on_gpu": ann.on_gpu}
    s_t, i_t = batched_search(ann.search, qt_n, K)
    flat["recall_tune"], flat["recall_held_out"] = recall(i_t, exact10["tune"]), recall(batched_search(ann.search, qh_n, K)[1], exact10["held_out"])
    flat["vs_torch_exact"] = same_ids(ex_t[0], ex_t[1], i_t) | {"max_abs_score_diff": float(np.abs(s_t - ex_t[0]).max())}
    s_c, i_c = ann.cpu_index.search(q32, K)
    flat["gpu_vs_cpu_copy"] = same_ids(s_c, i_c, i_t[:32])
    flat["p50_ms_1q"] = p50_ms(lambda: ann.search(qt_n[:1], K), dev, args.stage1_iters)
    flat["p50_ms_32q"] = p50_ms(lambda: ann.search(q32, K), dev, args.stage1_iters)
    out["flat"] = flat
    print(f"  flat: {flat}", flush=True)
    del ann
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # IVF-Flat at the default nlist, nprobe tuned on the tuning queries
    nlist = default_nlist(n)
    p = AnnParams("ivf", nlist=nlist, nprobe=1)
    t0 = time.perf_counter()
    index = build_index(xh, ids, p, use_gpu=use_gpu)  # the GPU copy (k-means and cells assigned on the GPU)
    ivf: dict[str, Any] = {"nlist": nlist, "build_s": time.perf_counter() - t0, "target": args.stage1_target, "frontier": []}

    def set_nprobe(v: int) -> None:
        if use_gpu:
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", int(v))
        else:
            faiss.extract_index_ivf(index).nprobe = int(v)

    chosen = None
    for v in [v for v in LADDER if v <= nlist]:
        set_nprobe(v)
        r_t = recall(batched_search(index.search, qt_n, K)[1], exact10["tune"])
        r_h = recall(batched_search(index.search, qh_n, K)[1], exact10["held_out"])
        row = {"nprobe": v, "recall_tune": r_t, "recall_held_out": r_h,
               "p50_ms_1q": p50_ms(lambda: index.search(qt_n[:1], K), dev, args.stage1_iters),
               "p50_ms_32q": p50_ms(lambda: index.search(q32, K), dev, max(5, args.stage1_iters // 4))}
        ivf["frontier"].append(row)
        print(f"  ivf nprobe={v}: {row}", flush=True)
        if r_t >= args.stage1_target:
            chosen = v
            break
    ivf["chosen_nprobe"] = chosen
    if chosen is not None:  # the product path at the tuned setting: AnnIndex keeps this GPU copy, sets nprobe on it
        tuned = AnnParams("ivf", nlist=nlist, nprobe=chosen)
        ann = AnnIndex(index, tuned, use_gpu=use_gpu)
        ivf["on_gpu"] = ann.on_gpu
        i_g = batched_search(ann.search, qt_n, K)[1]
        ivf["recall_tune"] = recall(i_g, exact10["tune"])
        ivf["recall_held_out"] = recall(batched_search(ann.search, qh_n, K)[1], exact10["held_out"])
        n_cpu = min(256, qt_n.shape[0])
        i_c = batched_search(ann.cpu_index.search, qt_n[:n_cpu], K)[1]
        ivf["cpu_copy_recall_tune"] = recall(i_c, exact10["tune"][:n_cpu])
        ivf["gpu_recall_same_queries"] = recall(i_g[:n_cpu], exact10["tune"][:n_cpu])
        ivf["p50_ms_1q"] = p50_ms(lambda: ann.search(qt_n[:1], K), dev, args.stage1_iters)
        ivf["p50_ms_32q"] = p50_ms(lambda: ann.search(q32, K), dev, args.stage1_iters)
        del ann
    out["ivf"] = ivf
    print(f"  ivf: { {k: v for k, v in ivf.items() if k != 'frontier'} }", flush=True)
    out["decision"] = stage1_decision(out, dev, args.stage1_iters)
    print(f"  the product's choice (gare_index.resident_version.decide): {out['decision']}", flush=True)
    index = xh = None
    return out


def resident_exact(x: torch.Tensor, qt: torch.Tensor, qh: torch.Tensor, exact10: dict[str, np.ndarray],
                   dev: torch.device, iters: int) -> dict[str, Any]:
    """The product's exact stage 1 (gare_index.resident.ResidentIndex.search: one product + top-k with ties by id)
    over the gallery x (n, d) already on the device: recall of the exact top-10 within K and p50 for 1 and 32
    queries. Only the stage-1 tensors are filled (search reads nothing else)."""
    from gare_index.resident import ResidentEstimate, ResidentIndex, ResidentShard

    n = x.shape[0]
    empty = torch.zeros(0, device=dev)
    shard = ResidentShard(device=dev, start=0, stop=n, stage1=x, ids=torch.arange(n, device=dev),
                          biases=torch.zeros(n, device=dev), units=x, norms=empty, frames=empty, frame_scales=None,
                          packed=empty)
    est = ResidentEstimate(version="bench", devices=(str(dev),), ranges=((0, n),), row_bytes=4 * x.shape[1] + 12,
                           workspace_queries=0, bytes=(n * (4 * x.shape[1] + 12),))
    ri = ResidentIndex("bench", [shard], "none", int(x.shape[1]), 0, est)
    qt_n, qh_n = qt.cpu().numpy(), qh.cpu().numpy()
    out: dict[str, Any] = {
        "recall_tune": recall(batched_search(ri.search, qt_n, K)[1], exact10["tune"]),
        "recall_held_out": recall(batched_search(ri.search, qh_n, K)[1], exact10["held_out"]),
        "p50_ms_1q": p50_ms(lambda: ri.search(qt_n[:1], K), dev, iters),
        "p50_ms_32q": p50_ms(lambda: ri.search(np.ascontiguousarray(qt_n[:32]), K), dev, iters)}
    ri.release()
    return out


def stage1_decision(row: dict[str, Any], dev: torch.device, iters: int) -> dict[str, Any]:
    """What the service's load-time rule (gare_index.resident_version.decide) picks between the resident exact
    search and the tuned IVF-Flat from this section's p50s at one query (the service times its own index again)."""
    from gare_index.resident_version import decide

    iv = row["ivf"]
    ann_p50 = iv.get("p50_ms_1q") if iv.get("chosen_nprobe") is not None else None
    ann = (f"faiss IVF-Flat nlist {iv['nlist']} nprobe {iv['chosen_nprobe']} (GPU: {iv.get('on_gpu')})"
           if ann_p50 is not None else "faiss IVF-Flat (recall target not reached: not a candidate)")
    if ann_p50 is None:
        return {"method": "exact", "exact_p50_ms": row["resident_exact"]["p50_ms_1q"], "ann_p50_ms": None, "ann": ann,
                "reason": "the IVF-Flat did not reach the recall target at any nprobe: exact is the only candidate"}
    return decide(row["resident_exact"]["p50_ms_1q"], ann_p50, sample=iters, k=K, devices=[str(dev)], ann=ann).as_dict()


def section_faiss_stage1(ctx: dict[str, Any]) -> dict[str, Any]:
    dev, args = ctx["dev"], ctx["args"]
    rows = []
    for n in args.stage1_entries:
        try:
            rows.append(stage1_at(n, args, dev))
        except Exception as e:  # a size that fails (memory, faiss) is recorded; the next still runs
            import traceback

            traceback.print_exc()
            rows.append({"entries": n, "error": f"{type(e).__name__}: {e}"[:500]})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "k": K, "target": args.stage1_target}


def section_index_build(ctx: dict[str, Any]) -> dict[str, Any]:
    from gare.checkpoint import save_checkpoint
    from gare_build.build import build
    from gare_build.pipeline.options import BuildOptions, auto_decode_workers

    dev, model, args = ctx["dev"], ctx["model"], ctx["args"]
    work = Path(tempfile.mkdtemp(prefix="gare-gpu-build-"))
    try:
        videos = work / "videos"
        t0 = time.perf_counter()
        fmt = write_videos(videos, args.build_videos)
        made_s = time.perf_counter() - t0
        ckpt = work / "vit-b-32.safetensors"
        torch.manual_seed(0)
        save_checkpoint(ckpt, model.to("cpu"), queues={"text": torch.randn(16384, model.cfg.embed_dim)})
        model.to(dev)
        workers = args.build_workers if args.build_workers is not None else auto_decode_workers(dev.type)  # = the CLI's
        rows = []
        for precision in args.build_precisions:
            out = work / f"index-{precision}"
            t0 = time.perf_counter()
            r = build(ckpt, videos, out, BuildOptions(batch_size=args.build_batch, workers=workers, precision=precision,
                                                     progress=False, device=dev.type))
            rows.append({"precision": precision, "videos": r.encoded, "frames": r.frames_encoded,
                         "frames_per_s": r.frames_per_s, "videos_per_s": r.videos_per_s, "encode_s": r.encode_s,
                         "wall_s": time.perf_counter() - t0, "failed": len(getattr(r, "failed", []) or []),
                         "stages": r.encode_stages})
            print(f"build {precision}: {rows[-1]}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
        from gare.video_loader import decode_batch_size

        return {"videos_in_library": args.build_videos, "decode_workers": workers, "cores": len(os.sched_getaffinity(0)),
                "batch_size": args.build_batch, "decode_batch": decode_batch_size(args.build_videos, args.build_batch, workers),
                "frames_sent": "uint8", "video_format": fmt, "videos_written_s": made_s, "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def section_http_search(ctx: dict[str, Any]) -> dict[str, Any]:
    from bench.serve_bench import make_queries
    from bench.serve_http import closed_loop, serve
    from bench.support import stop_process
    from gare.checkpoint import file_sha256, save_checkpoint
    from gare.psi_fold_weights import fold_weights

    dev, model, args = ctx["dev"], ctx["model"], ctx["args"]
    work = Path(tempfile.mkdtemp(prefix="gare-gpu-http-"))
    proc = None
    try:
        cpu_model = model.to("cpu")
        path = work / "vit-b-32.safetensors"
        save_checkpoint(path, cpu_model)
        ckpt = {"path": str(path), "sha256": file_sha256(path), "model_config": cpu_model.cfg.to_dict()}
        t0 = time.perf_counter()
        gal = write_gallery_device(work, args.http_entries, ckpt, fold_weights(cpu_model.psi), device=dev)
        model.to(dev)
        from gare_search.rerank import RerankSettings

        out: dict[str, Any] = {"entries": args.http_entries, "gallery": gal, "write_s": time.perf_counter() - t0,
                               "duration_s": args.http_duration, "rows": [], "workers": args.http_workers,
                               "default_rerank_device": RerankSettings().device}
        print(f"http: gallery of {args.http_entries:,} written in {out['write_s']:.0f}s", flush=True)
        ctx["model"] = model
        stream = make_queries(20000, seed=11)
        import httpx

        for rd in args.http_rerank_devices:  # GARE_RERANK_DEVICE of the server (its gare_search.rerank.RerankSettings)
            os.environ["GARE_RERANK_DEVICE"] = rd
            t0 = time.perf_counter()
            proc, url, log = serve(work / "index", args.http_workers, False, None)
            out.setdefault("server_ready_s", {})[rd] = time.perf_counter() - t0
            # readiness as gare-serve reports it: the workers, the shared engine, the resident index's stage 1
            out["server"] = httpx.get(url + "/readyz", timeout=30).json()
            print(f"http server ({args.http_workers} workers): {out['server']}", flush=True)
            for clients in args.http_clients:
                r = {**closed_loop(url, stream[clients * 100:], clients, args.http_duration), "rerank_device": rd}
                out["rows"].append(r)
                print(f"http rerank on {rd}, {clients} clients: {r['qps']} q/s, p50 {r.get('latency_p50')} ms, "
                      f"errors {r['errors']}", flush=True)
            stop_process(proc, 30)
            proc = None
        return out
    finally:
        os.environ.pop("GARE_RERANK_DEVICE", None)
        if proc is not None:
            stop_process(proc, 30)
        shutil.rmtree(work, ignore_errors=True)


def write_gallery_device(root: Path, n: int, ckpt: dict[str, Any], fold: Any, *, device: torch.device, seed: int = 0,
                         chunk: int = 65536) -> dict[str, Any]:
    """serve_bench.write_gallery's gallery drawn with torch on ``device``: the same arrays (float16 frames, unit
    stage-1 vectors, norms, masks, psi's folded constants, synthetic biases), metadata rows and ANN parameters, and
    the same structure (clustered directions, per-frame noise from a bank of 4,096, 20% shorter clips, padded). At
    1M entries numpy on one core took 108 s of a 176-s HTTP section (H200, 5215253); here the device draws and
    folds and the host only hashes and writes. The values differ from write_gallery's (another generator); the
    search's cost does not depend on them."""
    from bench.serve_bench import _HashedNpy, gallery_ann_params, gallery_rows
    from gare.psi_fold_videos import fold_videos, packed_width
    from gare_index.ann_params import choose_index_type
    from gare_index.psi_consts import manifest_entry
    from gare_index.store import ExistingFile, write_version

    fr_n = 12
    t0 = time.perf_counter()
    stage = root / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    n_clusters = max(32, n // 500)
    centres = F.normalize(torch.randn(n_clusters, D, generator=g, device=device), dim=-1)  # (C, d)
    bank = torch.randn(4096, fr_n, D, generator=g, device=device) * (0.6 / math.sqrt(D))  # (4096, f, d) frame noise
    fold_d = fold.to(device)
    frames_w = _HashedNpy(stage / "frames.npy", (n, fr_n, D), np.float16)
    units_w = _HashedNpy(stage / "units.npy", (n, D), np.float32)
    consts_w = _HashedNpy(stage / "psi_consts.npy", (n, packed_width(fr_n)), np.float32)
    norms = np.empty(n, np.float32)
    masks = np.ones((n, fr_n), np.uint8)
    with torch.no_grad():
        for s in range(0, n, chunk):
            c = min(n, s + chunk) - s
            direction = centres[torch.randint(0, n_clusters, (c,), generator=g, device=device)]
            direction = F.normalize(direction + torch.randn(c, D, generator=g, device=device) * (0.35 / math.sqrt(D)), dim=-1)
            fr = direction[:, None, :] + bank[torch.randint(0, bank.shape[0], (c,), generator=g, device=device)]  # (c, f, d)
            short = torch.rand(c, generator=g, device=device) < 0.2
            used = torch.where(short, torch.randint(4, fr_n + 1, (c,), generator=g, device=device), fr_n)  # (c,)
            m = (torch.arange(fr_n, device=device)[None, :] < used[:, None]).to(torch.uint8)  # (c, f)
            fr16 = (fr * m[:, :, None]).half()
            vbar = fr16.float().sum(1) / used[:, None]  # v-bar from the stored (fp16) frames, (c, d)
            nr = vbar.norm(dim=1)
            consts = fold_videos(fr16, m, fold_d, vbar=vbar).packed
            masks[s:s + c] = m.cpu().numpy()
            norms[s:s + c] = nr.cpu().numpy()
            frames_w.rows(fr16.cpu().numpy())
            units_w.rows((vbar / nr[:, None]).cpu().numpy())
            consts_w.rows(consts.cpu().numpy())
    arrays: dict[str, Any] = {"psi_consts": ExistingFile(stage / "psi_consts.npy", consts_w.close())}
    frames_sha, units_sha = frames_w.close(), units_w.close()
    t_gen = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    biases = (rng.standard_normal(n) * 0.005).astype(np.float32)  # synthetic NCL biases (values do not affect cost)
    index_type = choose_index_type(n)
    params = gallery_ann_params(n, index_type)  # as write_gallery (the earlier HTTP figures)
    rows = gallery_rows(masks)
    t1 = time.perf_counter()
    name = write_version(
        root / "index",
        {"ids": np.arange(n, dtype=np.int64), "norms": norms, "units": ExistingFile(stage / "units.npy", units_sha),
         "frames": ExistingFile(stage / "frames.npy", frames_sha), "masks": masks, "biases": biases, **arrays},
        rows,
        {"checkpoint": ckpt, "ann_params": params.to_dict(), "biases": {"source": "synthetic", "gamma": None},
         "synthetic": True, "psi_fold": manifest_entry(fold, fr_n, ckpt["sha256"])},
    )
    t_write = time.perf_counter() - t1
    shutil.rmtree(stage, ignore_errors=True)
    return {"generate_s": round(t_gen, 1), "write_version_s": round(t_write, 1), "version": name, "drawn_on": str(device),
            "index_type": params.index_type, "ann_params": params.to_dict(), "frames_bytes": n * fr_n * D * 2}


def write_videos(dest: Path, n: int, *, size: int = 224, seconds: float = 12.0, fps: float = 8.0) -> str:
    """n seeded mp4 files of moving coloured blocks over a drifting background, in parallel threads: MPEG-4 Part 2
    by OpenCV's FFmpeg where OpenCV is (the GPU machine has OpenCV but no PyAV), else H.264 by PyAV
    (gare_train.synth.write_video: a CPU machine's smoke run); returns their description."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        import cv2
    except ImportError:
        cv2 = None
    dest.mkdir(parents=True, exist_ok=True)
    frames = int(round(seconds * fps))

    def draw(i: int) -> np.ndarray:  # (T, S, S, 3) uint8
        rng = np.random.default_rng(i)
        bg = rng.integers(0, 255, 3)
        blocks = [(rng.integers(0, size - 40, 2), rng.integers(-6, 7, 2), rng.integers(0, 255, 3), int(rng.integers(16, 48)))
                  for _ in range(4)]
        out = np.empty((frames, size, size, 3), np.uint8)
        for t in range(frames):
            f = out[t]
            f[:] = (bg + 2 * t) % 255
            for pos, vel, col, side in blocks:
                y, x = (pos + vel * t) % (size - side)
                f[y:y + side, x:x + side] = col
        return out

    def one(i: int) -> int:
        path = dest / f"video{i:04d}.mp4"
        if cv2 is None:
            from gare_train.synth import write_video

            write_video(path, draw(i), fps)
            return i
        w = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
        if not w.isOpened():
            raise RuntimeError(f"OpenCV could not open an mp4v writer for {dest}")
        for f in draw(i):
            w.write(f)
        w.release()
        return i

    with ThreadPoolExecutor(min(16, os.cpu_count() or 2)) as ex:
        list(ex.map(one, range(n)))
    codec = "MPEG-4 Part 2 via OpenCV" if cv2 is not None else "H.264 via PyAV (no OpenCV here)"
    return f"{n} mp4 ({codec}, {size}x{size}, {seconds:g} s at {fps:g} fps)"


SECTIONS = {"faiss_stage1": section_faiss_stage1, "http_search": section_http_search, "index_build": section_index_build}


def add_arguments(ap: Any) -> None:
    ap.add_argument("--stage1-entries", type=int, nargs="+", default=[1_000_000],
                    help="gallery sizes (10000000 adds ~130 s on an H200: past one device call with every section)")
    ap.add_argument("--stage1-queries", type=int, default=1000)
    ap.add_argument("--stage1-iters", type=int, default=30)
    ap.add_argument("--stage1-target", type=float, default=0.995)
    ap.add_argument("--build-batch", type=int, default=64)
    ap.add_argument("--build-precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp16"],
                    help="one build per value (fp32: the build's default; the stage times say whether the encoder bounds it)")
    ap.add_argument("--build-workers", type=int, default=None, help="decode workers (default: the CLI's --workers auto)")
    ap.add_argument("--http-entries", type=int, default=1_000_000)
    ap.add_argument("--http-clients", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--http-duration", type=float, default=6.0, help="seconds of load per client count")
    ap.add_argument("--http-workers", type=int, default=8,
                    help="gare-serve --workers (several: the shared engine on CUDA batches for all of them)")
    from gare_search.rerank import RERANK_DEVICES

    ap.add_argument("--http-rerank-devices", nargs="+", default=[RERANK_DEVICES[0]], choices=RERANK_DEVICES,
                    help="serve once per value of GARE_RERANK_DEVICE (default: the product's default only)")
    ap.add_argument("--build-videos", type=int, default=600)


def quick(args: Any) -> None:
    args.stage1_entries, args.stage1_queries, args.stage1_iters = [20_000], 64, 3
    args.http_entries, args.http_clients, args.http_duration, args.build_batch, args.build_videos = 3000, [1, 4], 2.0, 8, 6
    args.http_workers = 2


def markdown(sec: dict[str, Any]) -> list[str]:
    L: list[str] = []
    if "faiss_stage1" in sec:
        fs = sec["faiss_stage1"]
        L += ["## Stage 1 on the GPU (FAISS)", "",
              f"A CLIP-like gallery (bench/gpu_stage1.py: bench/clip_like.py's procedure drawn with torch on the device), "
              f"K = {fs['k']}; recall = the share of the exact top-10 found in the top {fs['k']}. *tune*: captions of random "
              "gallery videos (nprobe is chosen on them); *held-out*: another distribution (every topic equally, noisier "
              "captions). Exact answers and the *torch exact* baseline: one fp32 matrix product + top-k on the device. "
              "Flat and IVF-Flat are the product's path (`build_index` + `AnnIndex`, `use_gpu=True`); p50 of "
              "`AnnIndex.search` for 1 and 32 queries.", "",
              "| entries | method | build s | recall tune | recall held-out | p50 ms, 1 query | p50 ms, 32 queries | GPU vs CPU copy |",
              "|---|---|---|---|---|---|---|---|"]
        for r in fs["rows"]:
            if "error" in r:
                L.append(f"| {r['entries']:,} | FAILED: {r['error'][:200]} | | | | | | |")
                continue
            te = r["torch_exact"]
            L.append(f"| {r['entries']:,} | torch exact (matmul + top-k) | | 1 | 1 | {te['p50_ms_1q']:.3f} | {te['p50_ms_32q']:.3f} | |")
            rx = r.get("resident_exact")
            if rx is not None:
                L.append(f"| {r['entries']:,} | resident exact (`ResidentIndex.search`, the product's) | | {rx['recall_tune']:.4f} | "
                         f"{rx['recall_held_out']:.4f} | {rx['p50_ms_1q']:.3f} | {rx['p50_ms_32q']:.3f} | |")
            fl = r["flat"]
            L.append(f"| {r['entries']:,} | faiss flat ({'GPU' if fl['on_gpu'] else 'CPU'}) | {fl['build_s']:.1f} | "
                     f"{fl['recall_tune']:.4f} | {fl['recall_held_out']:.4f} | {fl['p50_ms_1q']:.3f} | {fl['p50_ms_32q']:.3f} | "
                     f"ids equal (or tied) at {fl['gpu_vs_cpu_copy']['equal_or_tied']:.4f} of positions |")
            iv = r["ivf"]
            if iv.get("chosen_nprobe") is None:
                L.append(f"| {r['entries']:,} | faiss IVF-Flat nlist {iv['nlist']:,} | {iv['build_s']:.1f} | target "
                         f"{iv['target']} not met up to nprobe {iv['frontier'][-1]['nprobe'] if iv['frontier'] else '-'} | | | | |")
            else:
                L.append(f"| {r['entries']:,} | faiss IVF-Flat nlist {iv['nlist']:,}, nprobe {iv['chosen_nprobe']} "
                         f"({'GPU' if iv['on_gpu'] else 'CPU'}) | {iv['build_s']:.1f} | {iv['recall_tune']:.4f} | "
                         f"{iv['recall_held_out']:.4f} | {iv['p50_ms_1q']:.3f} | {iv['p50_ms_32q']:.3f} | recall "
                         f"{iv['gpu_recall_same_queries']:.4f} (GPU) vs {iv['cpu_copy_recall_tune']:.4f} (CPU copy), 256 queries |")
        L.append("")
        for r in fs["rows"]:
            if r.get("decision"):
                L.append(f"- {r['entries']:,} entries: the load-time rule (`gare_index.resident_version.decide`) picks "
                         f"**{r['decision']['method']}**: {r['decision']['reason']}.")
        L.append("")
        for r in fs["rows"]:
            if "ivf" in r and r["ivf"]["frontier"]:
                L += [f"IVF-Flat frontier at {r['entries']:,} entries (nlist {r['ivf']['nlist']:,}; the raw GPU index):", "",
                      "| nprobe | recall tune | recall held-out | p50 ms, 1 query | p50 ms, 32 queries |", "|---|---|---|---|---|"]
                L += [f"| {f['nprobe']} | {f['recall_tune']:.4f} | {f['recall_held_out']:.4f} | {f['p50_ms_1q']:.3f} | "
                      f"{f['p50_ms_32q']:.3f} |" for f in r["ivf"]["frontier"]]
                L.append("")
        for r in fs["rows"]:
            if "flat" in r:
                v = r["flat"]["vs_torch_exact"]
                L.append(f"- {r['entries']:,} entries, faiss flat vs torch exact top-{fs['k']}: ids equal at "
                         f"{v['equal_positions']:.4f} of positions, equal or tied at {v['equal_or_tied']:.4f}; largest score "
                         f"difference {v['max_abs_score_diff']:.2e}.")
        L.append("")
    if "index_build" in sec:
        ib = sec["index_build"]
        L += ["## `gare-index build` on the GPU", "",
              f"`gare_build.build.build` over {ib['videos_in_library']} generated videos ({ib['video_format']}); ViT-B/32 "
              f"vision tower (random weights), batch {ib['batch_size']}, {ib['decode_workers']} decode worker processes"
              + (f" on {ib['cores']} cores" if "cores" in ib else "")
              + (f" (decoded in batches of {ib['decode_batch']} videos; the workers send {ib['frames_sent']} frames, "
                 "normalised on the encoder's device)" if "decode_batch" in ib else "") + ". "
              "*frames/s* = frames decoded and encoded per second of the encode loop (decode overlapped); *wall* = the "
              "whole build (scan, checksums, encode, NCL biases, ANN, version write).", "",
              "| precision | videos | frames | frames/s | videos/s | encode s | wall s |", "|---|---|---|---|---|---|---|"]
        L += [f"| {r['precision']} | {r['videos']} | {r['frames']} | {r['frames_per_s']:,.0f} | {r['videos_per_s']:.1f} | "
              f"{r['encode_s']:.1f} | {r['wall_s']:.1f} |" for r in ib["rows"]]
        L.append("")
        staged = [r for r in ib["rows"] if r.get("stages")]
        if staged:
            L += ["Where the encode loop's time went (`RunReport.encode_stages`: seconds summed over batches; the decode "
                  "workers, the device and the cache writer overlap, so the part close to *loop* bounds the rate). "
                  "*waiting*: the loop blocked on decoded batches (*first*: until the first one); *device*: transfer + "
                  "encode + copy back (CUDA events); *decode per worker*: frames/s of one worker by its own clock "
                  "(x workers: what decoding alone would give); *cpu/wall*: the workers' CPU share while decoding "
                  "(below 1: waiting for a core).", "",
                  "| precision | batches | loop s | waiting s (first) | device s: transfer / encode / back | host s | "
                  "cache writes s | decode frames/s per worker (x workers) | cpu/wall | device alone frames/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
            for r in staged:
                st = r["stages"]
                per = st.get("decode_frames_per_s_per_worker")
                dec = "-" if per is None else f"{per:,.0f} ({st['decode_frames_per_s_all_workers']:,.0f})"
                cw = "-" if not st.get("decode_s") else f"{st['decode_cpu_s'] / st['decode_s']:.2f}"
                enc = st.get("encode_frames_per_s")
                L.append(f"| {r['precision']} | {st['batches']} | {st['loop_s']:.2f} | {st['wait_s']:.2f} "
                         f"({st['first_batch_s'] or 0:.2f}) | {st['device_s']:.2f}: {st['transfer_s']:.2f} / "
                         f"{st['encode_s']:.2f} / {st['to_host_s']:.2f} | {st['host_s']:.2f} | {st['write_s']:.2f} | {dec} | "
                         f"{cw} | {'-' if enc is None else f'{enc:,.0f}'} |")
            L.append("")
    if "http_search" in sec:
        hs = sec["http_search"]
        g = hs["gallery"]
        L += [f"## Two-stage search over HTTP ({hs['entries']:,} entries)", "",
              f"`gare-serve --workers {hs.get('workers', 1)}` (defaults otherwise: on CUDA one shared engine holds the "
              f"model and the index for every worker) on the device over a gallery in the real index format "
              f"(serve_bench.write_gallery: {g['index_type']} {g['ann_params']}); its /readyz: "
              f"`{json.dumps(hs.get('server'))[:900]}`. Closed-loop clients, distinct queries, "
              f"{hs['duration_s']:g} s each; psi rerank on, caches off.", "",
              "| rerank on | clients | q/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
        L += [f"| {r.get('rerank_device', 'model')} | {r['clients']} | {r['qps']:,.1f} | {r['latency_p50']:.2f} | "
              f"{r['latency_p99']:.2f} | {r['errors']} |" for r in hs["rows"]]
        L += ["", "*rerank on*: `GARE_RERANK_DEVICE` (model = the GPU the model is on; cpu = the compiled CPU kernel over "
              "the memory-mapped index)."]
        L.append("")
    return L


