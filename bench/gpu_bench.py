"""GPU figures: the text tower in fp32/fp16/bf16 with batching, the psi rerank and exhaustive psi (fold, fused,
model), psi constants at build time, NCL Sinkhorn and served-score biases, and the two-stage search end to end.

    bash bench/gpu_check.sh                 # on a lent GPU (the device tool): CUDA tests, then this script
    python -m bench.gpu_bench --quick       # smoke run; on a machine without CUDA it runs on the CPU and says so
    python -m bench.gpu_bench --prepare .gpuassets --checkpoint BEST --corpus CORPUS   # fidelity inputs (CPU)
    python -m bench.gpu_bench --render bench/results/gpu_bench.json                   # rewrite the .md

Every section runs in one process on one device; a section that fails is recorded as failed (with its error)
and the others still run; with --deadline-s a section expected (SECTION_SECONDS) to end past the deadline is not
run and the report says so. The report puts TARGETS (the issue's targets: name, how measured, threshold, the
observation key) beside the figures, met / not met computed from this run's own observations (OBSERVE), and "not
measured" with the reason where the section failed, did not run, ran on the CPU or below the target's scale;
bench/gpu_check.sh passes the `gpu` tests' junit XML in as the gpu_tests section. Timings are medians of repeated calls after warm-up, synchronised with the GPU
(torch.cuda.synchronize) and wall-clock. ViT-B/32 sizes (d = 512, f = 12) with random weights unless a
section says otherwise: timing does not depend on the values. The fidelity section uses the trained benchmark
model (gare-cpu-small, its test split) prepared on the CPU with ``--prepare``: the CPU fp32 embeddings and
metrics in it are the reference the GPU precisions are compared with.
Results: bench/results/gpu_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import gpu_stage1, harness  # noqa: E402
from bench.harness import Run, git_commit, start, with_provenance  # noqa: E402
from bench.psi_reference import FoldedAttention, fused_pair_scores  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/",
    "indexer/gare_search/",
    "indexer/gare_index/",
    "indexer/gare_build/",
    "service/gare_serve/",
)


D, FR, K = 512, 12, 256


class SectionNotRun(Exception):
    """A section that cannot run here for a stated reason (not a failure of what it measures): the report lists it
    as not run, with the reason, and its targets as not measured."""


# ------------------------------------------------------------------------------------------ timing
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_ms(fn: Callable[[], Any], dev: torch.device, *, iters: int, reps: int = 3, warm: int = 2) -> dict[str, float]:
    """Median over `reps` of the mean wall-clock ms per call over `iters` calls (synchronised)."""
    for _ in range(warm):
        fn()
    sync(dev)
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(dev)
        per.append((time.perf_counter() - t0) / iters * 1e3)
    return {"ms": statistics.median(per), "reps_ms": per}


def vit_b32(dev: torch.device):
    from bench.psi_fold import nontrivial_psi
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(0)
    model = GARE.build(get_model_config("gare-vit-b-32", pretrained="none")).eval()
    nontrivial_psi(model.psi)
    return model.to(dev)


def make_gallery(n: int, seed: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """frames (n, f, d) fp16 = a video direction + per-frame noise, ~1 in 4 padded; mask (n, f) bool."""
    g = torch.Generator().manual_seed(seed)
    base = F.normalize(torch.randn(n, 1, D, generator=g), dim=-1) * 8.0
    frames = base + 2.0 * torch.randn(n, FR, D, generator=g) / D**0.5 * 8.0
    n_real = torch.where(torch.rand(n, generator=g) < 0.25, torch.randint(1, FR, (n,), generator=g), FR)
    mask = torch.arange(FR)[None] < n_real[:, None]
    return (frames * mask[..., None]).half().to(dev), mask.to(dev)


# ------------------------------------------------------------------------------------------ sections
def section_env(ctx: dict[str, Any]) -> dict[str, Any]:
    import ctypes

    from bench.harness import cpu_name

    dev = ctx["dev"]
    out: dict[str, Any] = {"device": str(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
                           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                           "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        import faiss

        out["faiss"] = faiss.__version__
        out["faiss_gpus"] = int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0
        out["faiss_cagra"] = hasattr(faiss, "GpuIndexCagra")
        out["faiss_compile_options"] = faiss.get_compile_options() if hasattr(faiss, "get_compile_options") else None
        from importlib import metadata

        out["faiss_distribution"] = {d: metadata.version(d) for d in ("faiss-gpu", "faiss-cpu", "faiss-gpu-cu12",
                                                                      "nvidia-cublas-cu12", "nvidia-cuda-runtime-cu12")
                                     if _installed(d)}
    except ImportError as e:
        out["faiss"] = f"not importable: {e}"
    import subprocess

    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["driver"] = None
    libs = {}
    for lib in ("libcublas.so.12", "libcudart.so.12", "libcublas.so.13", "libcuvs.so"):
        try:
            ctypes.CDLL(lib)
            libs[lib] = True
        except OSError:
            libs[lib] = False
    out["shared_libraries"] = libs
    return out


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _text_encoders(model, dev: torch.device) -> list[tuple[str, str, Callable[[list[str]], torch.Tensor]]]:
    """(impl, precision, texts -> t) for every text encoder the service offers on this device, built as the service
    builds them (gare_search.text_encoder.load_query_encoder: on CUDA fixed-shape micro-batches of 32 rows replayed
    as a CUDA graph): the model's own tower at each precision (autocast for fp16/bf16) and, on CUDA, the
    half-precision tower of gare.text_quant; on the CPU the int8 and fp32-packed towers."""
    from gare_search.text_encoder import load_query_encoder

    out: list[tuple[str, str, Callable[[list[str]], torch.Tensor]]] = []
    for prec in (["fp32", "fp16", "bf16"] if dev.type == "cuda" else ["fp32", "bf16"]):
        out.append(("model", prec, load_query_encoder(model, "fp32", dev, prec).encode))
    for kind in (["fp16"] if dev.type == "cuda" else ["int8", "fp32-packed"]):
        out.append(("tower", kind, load_query_encoder(model, kind, dev, "fp32").encode))
    return out


def _served_encoder(dev: torch.device) -> dict[str, str]:
    """What gare-serve runs on this device with its defaults (text_encoder auto, precision auto)."""
    from gare_search.text_encoder import resolve_encoder

    kind, prec = resolve_encoder("auto", dev, "auto")
    return {"impl": "model", "precision": prec} if kind == "fp32" else {"impl": "tower", "precision": kind}


def section_text_encoder(ctx: dict[str, Any]) -> dict[str, Any]:
    from bench.serve_bench import make_queries
    from gare_search.query import encode_queries

    dev, model, args = ctx["dev"], ctx["model"], ctx["args"]
    rows = []
    with torch.inference_mode():
        for impl, prec, fn in _text_encoders(model, dev):
            for b in args.batches:
                texts = make_queries(b, seed=b)
                r = timed_ms(lambda texts=texts, fn=fn: fn(texts), dev, iters=max(2, 64 // b), reps=args.reps)
                rows.append({"impl": impl, "precision": prec, "batch": b, "ms_per_call": r["ms"],
                             "queries_per_s": b / r["ms"] * 1e3, "reps_ms": r["reps_ms"]})
                print(f"text encoder {impl} {prec} batch {b}: {r['ms']:.2f} ms/call, {b / r['ms'] * 1e3:.0f} q/s", flush=True)
    # batch invariance: each text of a batch of n against the same text alone (bitwise, torch.equal), per encoder
    n_inv = min(32, max(args.batches))
    texts = make_queries(n_inv, seed=77)
    invariance = []
    with torch.inference_mode():
        for impl, prec, fn in _text_encoders(model, dev):
            together = fn(texts).float().cpu()
            alone = torch.cat([fn([t]).float().cpu() for t in texts])
            same = [bool(torch.equal(together[i], alone[i])) for i in range(n_inv)]
            invariance.append({"impl": impl, "precision": prec, "texts": n_inv, "rows_equal": sum(same),
                               "bitwise_equal": all(same), "max_abs_diff": float((together - alone).abs().max())})
            print(f"text encoder {impl} {prec}: {sum(same)}/{n_inv} texts bitwise equal alone and in a batch", flush=True)
    out: dict[str, Any] = {"model": "ViT-B/32 text tower (open_clip ViT-B-32, random weights)", "rows": rows,
                           "invariance": invariance,
                           # what the service runs on this device by default (the targets read its rows)
                           "served": _served_encoder(dev)}
    if dev.type == "cuda":  # the same tower on this machine's CPU, one thread, one query (fp32): the ratio's base
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cpu_model = vit_b32(torch.device("cpu"))
            with torch.inference_mode():
                r = timed_ms(lambda: encode_queries(cpu_model, make_queries(1, seed=1), "fp32"), torch.device("cpu"),
                             iters=5, reps=args.reps)
            out["cpu_fp32_1q_1thread_ms"] = r["ms"]
            del cpu_model
        finally:
            torch.set_num_threads(threads)
    return out


def section_fidelity(ctx: dict[str, Any]) -> dict[str, Any]:
    """The trained benchmark model on its test split: each precision on this device against CPU fp32."""
    from safetensors.torch import load_file

    from gare.checkpoint import load_model
    from gare.retrieval_metrics import retrieval_metrics

    dev, assets = ctx["dev"], ctx["args"].assets
    if assets is None or not (assets / "fidelity.json").exists():
        raise SectionNotRun(f"no fidelity inputs under {assets} (made on the CPU by --prepare, carried as .gpuassets)")
    meta = json.loads((assets / "fidelity.json").read_text())
    gal = load_file(str(assets / "gallery.safetensors"))
    model, _ = load_model(assets / "model.safetensors", dev)
    texts, cc = meta["captions"], np.asarray(meta["caption_clip"])
    frames, mask, vbar = gal["frames"].to(dev), gal["mask"].bool().to(dev), gal["vbar"].to(dev)
    ref = gal["t_cpu_fp32"]
    out: dict[str, Any] = {"checkpoint_sha256": meta["checkpoint_sha256"], "n_captions": len(texts),
                           "n_videos": int(frames.shape[0]), "cpu_reference": meta["cpu_reference"], "precisions": {}}
    with torch.inference_mode():
        for impl, p, fn in _text_encoders(model, dev):
            prec = p if impl == "model" else f"{p} tower"
            t = torch.cat([fn(texts[s:s + 128]) for s in range(0, len(texts), 128)]).float()
            cos = F.cosine_similarity(t.cpu(), ref)
            dual = F.normalize(t, dim=-1) @ F.normalize(vbar, dim=-1).T
            psi = model.score(t, frames, mask, vbar=vbar)
            res: dict[str, Any] = {"cos_vs_cpu_fp32_min": float(cos.min()), "cos_vs_cpu_fp32_mean": float(cos.mean())}
            for name, s in (("dual", dual), ("psi", psi)):
                m = retrieval_metrics(s.float().cpu(), cc)["t2v"]
                res[name] = {k: float(m[k]) for k in ("R1", "R5", "R10")}
            out["precisions"][prec] = res
            print(f"fidelity {prec}: " + json.dumps(res), flush=True)
    return out


def section_psi(ctx: dict[str, Any]) -> dict[str, Any]:
    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.psi import masked_mean

    dev, model, args = ctx["dev"], ctx["model"], ctx["args"]
    temp = model.cfg.temp
    out: dict[str, Any] = {"d": D, "f": FR, "K": K}
    with torch.inference_mode():
        fw = pfw.fold_weights(model.psi).to(dev)
        folded = FoldedAttention(model.psi)  # the fused reference's folded attention, on psi's device
        frames, mask = make_gallery(args.distinct, 1, dev)
        vbar = masked_mean(frames.float(), mask)
        # build time: fold the distinct videos on this device, and a slice of them on the CPU (one thread)
        r = timed_ms(lambda: pfv.fold_videos(frames, mask, fw, chunk=4096), dev, iters=1, reps=args.reps, warm=1)
        out["fold_videos_per_s"] = args.distinct / r["ms"] * 1e3
        consts = pfv.fold_videos(frames, mask, fw, chunk=4096)
        if dev.type == "cuda":
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                n_cpu = 256
                fw_cpu = fw.to("cpu")
                fr_c, mk_c = frames[:n_cpu].cpu(), mask[:n_cpu].cpu()
                rc = timed_ms(lambda: pfv.fold_videos(fr_c, mk_c, fw_cpu), torch.device("cpu"), iters=1, reps=args.reps, warm=1)
                out["fold_videos_per_s_cpu_1thread"] = n_cpu / rc["ms"] * 1e3
                c_cpu = pfv.fold_videos(fr_c, mk_c, fw_cpu)
            finally:
                torch.set_num_threads(threads)
            tq = torch.randn(4, D, generator=torch.Generator().manual_seed(9)) * 3.0
            s_gpu = pf.pair_scores(pfq.fold_queries(tq.to(dev), fw, temp), consts.slice(0, n_cpu)).cpu()
            s_cpu = pf.pair_scores(pfq.fold_queries(tq, fw_cpu, temp), c_cpu)
            out["max_abs_diff_gpu_vs_cpu_constants_scores"] = float((s_gpu - s_cpu).abs().max())
        # rerank of K candidates for Q queries (each its own candidates), every implementation on this device
        g = torch.Generator().manual_seed(2)
        t_all = torch.randn(max(args.rerank_queries), D, generator=g).to(dev) * 3.0
        rr = []
        for nq in args.rerank_queries:
            idx = torch.stack([torch.randperm(args.distinct, generator=g)[:K] for _ in range(nq)]).to(dev)  # (Q, K)
            t = t_all[:nq]
            flat = idx.reshape(-1)

            def fold(t=t, idx=idx):
                q = pfq.fold_queries(t, fw, temp)
                return pf.pair_scores(q, consts, idx)

            def fused(t=t, flat=flat, nq=nq):
                return fused_pair_scores(model, t.repeat_interleave(K, 0), frames[flat].float(), mask[flat], vbar[flat],
                                         folded).view(nq, K)

            def model_score(t=t, idx=idx, nq=nq):
                return torch.stack([model.score(t[i:i + 1], frames[idx[i]], mask[idx[i]], vbar=vbar[idx[i]])[0] for i in range(nq)])

            row: dict[str, Any] = {"queries": nq}
            outs = {}
            for name, fn in (("fold", fold), ("fused", fused), ("model", model_score)):
                r = timed_ms(fn, dev, iters=10 if name != "model" else 3, reps=args.reps)
                row[f"{name}_ms"] = r["ms"]
                row[f"{name}_ms_per_query"] = r["ms"] / nq
                outs[name] = fn()
            row["max_abs_diff_fold_vs_model"] = float((outs["fold"] - outs["model"]).abs().max())
            row["max_abs_diff_fused_vs_model"] = float((outs["fused"] - outs["model"]).abs().max())
            rr.append(row)
            print(f"rerank Q={nq}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
        out["rerank"] = rr
        # exhaustive psi (fold) over a large gallery: the distinct videos tiled (real copies on the device)
        n_big = args.exhaustive_entries
        reps_tile = -(-n_big // args.distinct)
        try:
            big = pfv.VideoConstants.cat([consts] * reps_tile).slice(0, n_big)
            ex = []
            for nq in args.exhaustive_queries:
                q = pfq.fold_queries(t_all[:nq], fw, temp)
                r = timed_ms(lambda q=q, big=big, nq=nq: pf.exhaustive(q, big, chunk=args.exhaustive_chunk, query_chunk=nq), dev, iters=1,
                             reps=args.reps, warm=1)
                ex.append({"queries": nq, "entries": n_big, "ms": r["ms"], "ms_per_query": r["ms"] / nq,
                           "chunk": args.exhaustive_chunk})
                print(f"exhaustive fold {n_big} entries, Q={nq}: {r['ms']:.1f} ms", flush=True)
            out["exhaustive"] = ex
            del big
        except torch.cuda.OutOfMemoryError as e:  # say so; the other figures stand
            out["exhaustive"] = {"error": f"out of memory at {n_big} entries: {e}"}
    return out


def section_sinkhorn(ctx: dict[str, Any]) -> dict[str, Any]:
    """NCL Sinkhorn biases (dual-tower cosines) for a queue of Q queries over N gallery entries."""
    from gare.sinkhorn import sinkhorn_biases

    dev, args = ctx["dev"], ctx["args"]
    g = torch.Generator().manual_seed(3)
    q = F.normalize(torch.randn(args.queue, D, generator=g), dim=-1).to(dev)
    rows = []
    for n in args.sinkhorn_entries:
        gal = F.normalize(torch.randn(n, D, generator=g), dim=-1).to(dev)
        r = timed_ms(lambda gal=gal: sinkhorn_biases(q, gal, 0.01, device=dev), dev, iters=1, reps=max(1, args.reps - 1), warm=1)
        rows.append({"queue": args.queue, "entries": n, "seconds": r["ms"] / 1e3})
        print(f"sinkhorn Q={args.queue} N={n}: {r['ms'] / 1e3:.2f} s", flush=True)
        del gal
    return {"rows": rows, "n_iters": 4, "gamma": 0.01}


def section_served_biases(ctx: dict[str, Any]) -> dict[str, Any]:
    """The served-score pair scorer (psi over the queue's stage-1 candidates, through stored constants)."""
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.psi import masked_mean
    from gare_build.served_biases import fold_pair_scorer

    dev, model, args = ctx["dev"], ctx["model"], ctx["args"]
    n = args.distinct
    frames, mask = make_gallery(n, 4, torch.device("cpu"))
    vbar = masked_mean(frames.float(), mask)
    norms = vbar.norm(dim=-1)
    units = (vbar / norms[:, None]).numpy()
    consts = pfv.fold_videos(frames.to(dev), mask.to(dev), pfw.fold_weights(model.psi).to(dev)).packed.cpu().numpy()
    n_q = args.served_queries
    queue = np.random.default_rng(0).standard_normal((n_q, D)).astype(np.float32) * 3.0
    qi = np.repeat(np.arange(n_q), K)  # queue order, as score_candidates passes the pairs
    rows = np.random.default_rng(1).integers(0, n, qi.size)
    score = fold_pair_scorer(model, queue, frames.numpy(), mask.numpy().astype(np.uint8), units, norms.numpy(),
                             consts=consts, chunk=args.served_chunk)
    score(qi[: 4 * K], rows[: 4 * K])
    sync(dev)
    t0 = time.perf_counter()
    score(qi, rows)
    sync(dev)
    sec = time.perf_counter() - t0
    pairs_per_s = qi.size / sec
    q_full, k_full = 16384, 256
    return {"pairs": int(qi.size), "seconds": sec, "pairs_per_s": pairs_per_s, "chunk": args.served_chunk,
            "queue_pairs_16384x256_s_extrapolated": q_full * k_full / pairs_per_s}


def section_search(ctx: dict[str, Any]) -> dict[str, Any]:
    """Two-stage search end to end (gare_search.search.search_batch) on a gallery written in the real index format."""
    import tempfile

    from bench.serve_bench import make_queries, write_gallery
    from gare.checkpoint import file_sha256, save_checkpoint
    from gare.psi_fold_weights import fold_weights
    from gare_index.resident_version import load_resident
    from gare_index.store import open_index
    from gare_search import rerank
    from gare_search.search import SearchOptions, search_batch
    from gare_search.text_encoder import load_query_encoder, resolve_encoder

    dev, model, args = ctx["dev"], ctx["model"], ctx["args"]
    work = Path(tempfile.mkdtemp(prefix="gare-gpu-bench-"))
    cpu_model = model.to("cpu")
    path = work / "vit-b-32.safetensors"
    save_checkpoint(path, cpu_model)
    ckpt = {"path": str(path), "sha256": file_sha256(path), "model_config": cpu_model.cfg.to_dict()}
    t0 = time.perf_counter()
    gal = write_gallery(work, args.search_entries, ckpt, fold=fold_weights(cpu_model.psi), device=dev)
    model.to(dev)
    out: dict[str, Any] = {"entries": args.search_entries, "gallery": gal, "write_s": time.perf_counter() - t0, "rows": []}
    kind, prec = resolve_encoder("auto", dev, "auto")  # what the service runs by default on this device
    version = open_index(work / "index", use_gpu=False)
    resident = None
    try:
        opts = SearchOptions()
        out["candidates"] = opts.candidates
        out["precision"] = prec
        encoder = load_query_encoder(model, kind, dev, prec)  # the service's default text tower here
        out["text_encoder"] = encoder.describe()
        resident = load_resident(version, model, k=opts.candidates)  # what gare-serve serves on a GPU
        out["resident_decision"] = resident.decision.as_dict()
        # the rerank the service serves, the fold: where the model is, on the CPU kernel (GARE_RERANK_DEVICE cpu),
        # and over the device-resident copy (stage 1 by the load-time choice, the candidates' rows on the device)
        for impl, rd, served in (("fold", "model", version), ("fold, CPU kernel", "cpu", version),
                                 ("resident", "model", resident)):
            placement = rerank.RerankSettings(device=rd)
            rerank.warm_up(dev, placement)
            for nq in args.search_batches:
                texts = make_queries(nq, seed=100 + nq)
                stages: list[dict[str, float]] = []

                def run(texts=texts, stages=stages, placement=placement, served=served):
                    res = search_batch(model, served, texts, opts, precision=prec, rerank_settings=placement,
                                       encoder=encoder.encode)
                    stages.append(res[0].timings)

                enc = timed_ms(lambda texts=texts: encoder.encode(texts), dev, iters=5, reps=args.reps)
                tot = timed_ms(run, dev, iters=5, reps=args.reps)
                st = {k: 1e3 * statistics.median(s[k] for s in stages[2:]) for k in ("encode", "ann", "rerank", "rank", "total")}
                out["rows"].append({"rerank_impl": impl, "queries": nq, "encoder_alone_ms": enc["ms"], "search_ms": tot["ms"],
                                    "search_over_encoder": tot["ms"] / enc["ms"], "stage_ms": st})
                print(f"search ({impl}) Q={nq}: {tot['ms']:.2f} ms (encoder alone {enc['ms']:.2f} ms), stages {st}", flush=True)
    finally:
        if resident is not None:
            resident.resident.release()
        version.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return out


def section_gpu_tests(ctx: dict[str, Any]) -> dict[str, Any]:
    """The `gpu` tests' outcome, from the junit XML that bench/gpu_check.sh had pytest write just before this run
    (same device, same tree): counts, and the names of the tests that did not pass."""
    import xml.etree.ElementTree as ET

    args = ctx["args"]
    if args.gpu_tests_junit is None or not args.gpu_tests_junit.exists():
        raise FileNotFoundError(f"no junit XML of the gpu tests at {args.gpu_tests_junit} (bench/gpu_check.sh writes it)")
    root = ET.parse(args.gpu_tests_junit).getroot()
    cases = list(root.iter("testcase"))
    out: dict[str, Any] = {"junit": str(args.gpu_tests_junit), "pytest_exit_status": args.gpu_tests_status,
                           "total": len(cases), "failed_tests": [], "error_tests": [], "skipped_tests": []}
    for tc in cases:
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        for tag, bucket in (("failure", "failed_tests"), ("error", "error_tests"), ("skipped", "skipped_tests")):
            el = tc.find(tag)
            if el is not None:
                out[bucket].append(f"{name}: {(el.get('message') or '').strip()[:200]}")
                break
    # a collection error has no testcase of its own: the suite's counters carry it
    suite_errors = sum(int(ts.get("errors", 0)) for ts in root.iter("testsuite"))
    out["failed"], out["skipped"] = len(out["failed_tests"]), len(out["skipped_tests"])
    out["errors"] = max(len(out["error_tests"]), suite_errors)
    out["passed"] = out["total"] - out["failed"] - len(out["error_tests"]) - out["skipped"]
    print(f"gpu tests: {out['passed']} passed, {out['failed']} failed, {out['errors']} errors, {out['skipped']} skipped "
          f"(pytest exit status {args.gpu_tests_status})", flush=True)
    return out


# The sections, in the order a full run takes them (the most wanted first: a run cut short keeps those). A section is
# a function ctx -> JSON-able dict; to add one: write it, list it here with its expected seconds in SECTION_SECONDS,
# give it an observer in OBSERVE and its targets in TARGETS (below), and its markdown in markdown().
SECTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    # in the order they run: the sections with targets first, the cheapest of them first
    "env": section_env, "gpu_tests": section_gpu_tests, "text_encoder": section_text_encoder,
    "http_search": gpu_stage1.SECTIONS["http_search"], "faiss_stage1": gpu_stage1.SECTIONS["faiss_stage1"],
    "index_build": gpu_stage1.SECTIONS["index_build"], "search": section_search, "fidelity": section_fidelity, "psi": section_psi,
    "sinkhorn": section_sinkhorn, "served_biases": section_served_biases,
}
# Expected seconds of each section at the default sizes on an H100/H200 (from the runs at 5215253 and 251db38, less
# what the defaults dropped since: 10M entries, the second build precision, numpy's 1M gallery): a run with
# --deadline-s skips a section that would not finish in the time left (and says so) instead of being cut off.
SECTION_SECONDS: dict[str, float] = {
    "env": 1, "gpu_tests": 0, "index_build": 45, "http_search": 110, "faiss_stage1": 60, "text_encoder": 25,
    "search": 26, "fidelity": 6, "psi": 4, "sinkhorn": 14, "served_biases": 2,
}


# ------------------------------------------------------------------------------------------ targets
@dataclass(frozen=True)
class Target:
    """One target of the report: met / not met from this run's own observations (OBSERVE), never from another run.

    ``key`` names an observation "section.name"; ``op`` "<=", ">=" or "=="; ``scope``: (observation key, at least)
    pairs that say the run measured at the target's scale (a smoke run at 3,000 entries does not count for 1M);
    ``needs_cuda``: only a run on a CUDA device counts."""

    name: str
    how: str
    key: str
    op: str
    threshold: Any
    unit: str = ""
    scope: tuple[tuple[str, float], ...] = ()
    needs_cuda: bool = True

    def holds(self, value: Any) -> bool:
        if self.op == "<=":
            return value <= self.threshold
        if self.op == ">=":
            return value >= self.threshold
        if self.op == "==":
            return value == self.threshold
        raise ValueError(f"target {self.name!r}: op must be <=, >= or ==, got {self.op!r}")


def _obs_gpu_tests(r: dict[str, Any]) -> dict[str, Any]:
    return {"gpu_tests.total": r["total"], "gpu_tests.passed": r["passed"],
            "gpu_tests.not_passed": r["total"] - r["passed"] + (r["errors"] - len(r["error_tests"]))}


def _obs_index_build(r: dict[str, Any]) -> dict[str, Any]:
    row = next((x for x in r["rows"] if x["precision"] == "fp32"), r["rows"][0])  # fp32: the build's default
    out = {"index_build.frames_per_s": row["frames_per_s"], "index_build.videos": row["videos"],
           "index_build.precision": row["precision"], "index_build.decode_workers": r["decode_workers"]}
    st = row.get("stages") or {}
    for k in ("share_waiting", "share_device", "decode_frames_per_s_all_workers", "encode_frames_per_s"):
        if st.get(k) is not None:
            out[f"index_build.{k}"] = st[k]
    return out


def _obs_http(r: dict[str, Any]) -> dict[str, Any]:
    dev = r.get("default_rerank_device", "model")  # what gare-serve runs without GARE_RERANK_DEVICE
    by = {x["clients"]: x for x in r["rows"] if x.get("rerank_device", "model") == dev}
    out: dict[str, Any] = {"http_search.entries": r["entries"], "http_search.rerank_device": dev,
                           "http_search.errors": sum(x["errors"] for x in r["rows"])}
    if 1 in by:
        out["http_search.p50_ms_1_client"] = by[1]["latency_p50"]
    if 32 in by:
        out["http_search.qps_32_clients"] = by[32]["qps"]
        out["http_search.p99_ms_32_clients"] = by[32]["latency_p99"]
    return out


def _obs_stage1(r: dict[str, Any]) -> dict[str, Any]:
    rows = [x for x in r["rows"] if "ivf" in x]
    if not rows:
        return {"stage1.error": "; ".join(x.get("error", "?") for x in r["rows"])[:300]}
    row = min(rows, key=lambda x: abs(math.log(x["entries"] / 1e6)))  # the size the target is stated at, or nearest
    iv = row["ivf"]
    out: dict[str, Any] = {"stage1.entries": row["entries"], "stage1.torch_exact_p50_ms_1q": row["torch_exact"]["p50_ms_1q"]}
    dec, rx = row.get("decision"), row.get("resident_exact")
    if dec is not None and rx is not None and dec["method"] == "exact":  # the product's choice: the resident exact search
        out.update({"stage1.method": f"resident exact ({dec['reason']})", "stage1.recall_held_out": rx["recall_held_out"],
                    "stage1.recall_tune": rx["recall_tune"], "stage1.p50_ms_1q": rx["p50_ms_1q"]})
        return out
    if iv.get("chosen_nprobe") is not None:  # the product's stage 1 at this size: IVF-Flat, nprobe tuned
        out.update({"stage1.method": f"faiss IVF-Flat nlist {iv['nlist']} nprobe {iv['chosen_nprobe']} (GPU: {iv.get('on_gpu')})",
                    "stage1.recall_held_out": iv["recall_held_out"], "stage1.recall_tune": iv["recall_tune"],
                    "stage1.p50_ms_1q": iv["p50_ms_1q"]})
    elif iv["frontier"]:  # the tuning target was not reached: the last step's figures
        f = iv["frontier"][-1]
        out.update({"stage1.method": f"faiss IVF-Flat nlist {iv['nlist']} nprobe {f['nprobe']} (tuning target not reached)",
                    "stage1.recall_held_out": f["recall_held_out"], "stage1.recall_tune": f["recall_tune"],
                    "stage1.p50_ms_1q": f["p50_ms_1q"]})
    return out


def _obs_text(r: dict[str, Any]) -> dict[str, Any]:
    sv = r.get("served", {"impl": "model", "precision": "fp32"})
    ms = {x["batch"]: x["ms_per_call"] for x in r["rows"]
          if x.get("impl", "model") == sv["impl"] and x["precision"] == sv["precision"]}
    out: dict[str, Any] = {"text_encoder.encoder": f"{sv['impl']} {sv['precision']}"}
    if 1 in ms and 32 in ms:
        out["text_encoder.ms_32_over_1"] = ms[32] / ms[1]
    inv = [x for x in r.get("invariance", []) if x["impl"] == sv["impl"] and x["precision"] == sv["precision"]]
    if inv:
        out["text_encoder.bitwise_alone_vs_batch"] = inv[0]["bitwise_equal"]
        out["text_encoder.invariance_texts"] = inv[0]["texts"]
    return out


OBSERVE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gpu_tests": _obs_gpu_tests, "index_build": _obs_index_build, "http_search": _obs_http,
    "faiss_stage1": _obs_stage1, "text_encoder": _obs_text,
}
_HTTP = "closed-loop HTTP clients, distinct queries, psi rerank on, caches off, gare-serve's default rerank device"
TARGETS: list[Target] = [
    Target("HTTP two-stage search at 1M: p50 at one client", _HTTP, "http_search.p50_ms_1_client", "<=", 5.0, "ms",
           (("http_search.entries", 1_000_000),)),
    Target("HTTP two-stage search at 1M: q/s at 32 clients", _HTTP, "http_search.qps_32_clients", ">=", 1000.0, "q/s",
           (("http_search.entries", 1_000_000),)),
    Target("HTTP two-stage search at 1M: p99 at 32 clients", _HTTP, "http_search.p99_ms_32_clients", "<=", 50.0, "ms",
           (("http_search.entries", 1_000_000),)),
    Target("HTTP answers without errors", _HTTP, "http_search.errors", "==", 0, "errors"),
    Target("CUDA text tower: 32 texts in at most 3x the time of one", "median ms per call, the served encoder and "
           "precision, batch 32 / batch 1", "text_encoder.ms_32_over_1", "<=", 3.0, "x"),
    Target("CUDA text tower: each text bitwise equal alone and among 32", "torch.equal per row, the served encoder",
           "text_encoder.bitwise_alone_vs_batch", "==", True, "", (("text_encoder.invariance_texts", 32),)),
    Target("Stage 1 at 1M: recall of the exact top-10 within K = 256", "held-out queries (another distribution "
           "than the tuning queries), the product's stage 1 (the method the load-time rule picks: resident exact or the tuned IVF-Flat on the GPU)", "stage1.recall_held_out", ">=",
           0.995, "", (("stage1.entries", 1_000_000),)),
    Target("Stage 1 at 1M: p50 for one query", "ResidentIndex.search or AnnIndex.search, one query, the same method as the recall",
           "stage1.p50_ms_1q", "<=", 1.0, "ms", (("stage1.entries", 1_000_000),)),
    Target("gare-index build: frames/s", "gare_build.build.build (fp32, the CLI's --workers auto) over generated "
           "mp4s; frames per second of the encode loop", "index_build.frames_per_s", ">=", 2000.0, "frames/s",
           (("index_build.videos", 600),)),
    Target("Every gpu test passes", "pytest -m gpu (bench/gpu_check.sh) before this run, its junit XML; a skip "
           "counts as not passed", "gpu_tests.not_passed", "==", 0, "not passed", (("gpu_tests.total", 1),)),
]


def observations(res: dict[str, Any]) -> dict[str, Any]:
    """Every observation of a run's JSON (OBSERVE over the sections that ran and succeeded)."""
    out: dict[str, Any] = {}
    for name, sec in res["sections"].items():
        if sec.get("ok") and name in OBSERVE:
            try:
                out.update(OBSERVE[name](sec["result"]))
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # an older JSON's shape
                out[f"{name}.observe_error"] = f"{type(e).__name__}: {e}"
    return out


def evaluate(res: dict[str, Any]) -> list[dict[str, Any]]:
    """TARGETS against this run's observations: met / NOT MET / not measured (and why)."""
    obs = observations(res)
    on_cuda = res["sections"].get("env", {}).get("result", {}).get("device", "").startswith("cuda")
    rows = []
    for t in TARGETS:
        section = SECTION_OF_PREFIX.get(t.key.split(".")[0], t.key.split(".")[0])
        sec = res["sections"].get(section)
        value = obs.get(t.key)
        if sec is None:
            status = "not measured (section not run)"
        elif sec.get("skipped"):
            status = f"not measured (section not run: {sec['skipped']})"
        elif not sec.get("ok"):
            status = "not measured (section failed)"
        elif value is None:
            status = "not measured (no observation" + (f": {obs[section + '.observe_error']}" if section + ".observe_error" in obs else "") + ")"
        else:
            short = [(k, v) for k, v in t.scope if not (isinstance(obs.get(k), (int, float)) and obs[k] >= v)]
            if short:
                status = "not measured (" + ", ".join(f"{k.split('.')[-1]} {_f(obs.get(k), 0)} < {v:,}" for k, v in short) + ")"
            elif t.needs_cuda and not on_cuda:
                status = "not measured (ran on the CPU)"
            else:
                status = "met" if t.holds(value) else "NOT MET"
        rows.append({"target": t.name, "how": t.how, "key": t.key, "threshold": f"{t.op} {t.threshold} {t.unit}".strip(),
                     "observed": value, "status": status})
    return rows


SECTION_OF_PREFIX = {"stage1": "faiss_stage1"}  # observation prefixes that are not their section's name


# ------------------------------------------------------------------------------------------ fidelity inputs
def prepare(assets: Path, checkpoint: Path, corpus: Path, split: str) -> None:
    """On the CPU: a queue-free copy of the checkpoint, the split's encoded gallery and the CPU fp32 reference."""
    from safetensors.torch import save_file

    from gare.annotations import load_dataset
    from gare.checkpoint import file_sha256, load_model, save_checkpoint
    from gare.encoded_set import encode_set
    from gare.retrieval_metrics import retrieval_metrics
    from gare_search.query import encode_queries

    assets.mkdir(parents=True, exist_ok=True)
    model, _ = load_model(checkpoint, "cpu")
    save_checkpoint(assets / "model.safetensors", model)  # the same weights, without the NCL queues (smaller)
    rs = load_dataset({"kind": "synth", "root": str(corpus)}, split)
    enc = encode_set(model, rs, batch_size=16, num_workers=1, progress=True)
    if enc.failed:
        raise RuntimeError(f"{len(enc.failed)} videos failed to decode: {enc.failed[:3]}")
    texts = list(rs.captions)
    with torch.inference_mode():
        t = torch.cat([encode_queries(model, texts[s:s + 128], "fp32") for s in range(0, len(texts), 128)]).float()
        psi = model.score(t, enc.frames, enc.mask, vbar=enc.vbar)
    dual = F.normalize(t, dim=-1) @ F.normalize(enc.vbar, dim=-1).T
    ref = {}
    for name, s in (("dual", dual), ("psi", psi)):
        m = retrieval_metrics(s, enc.caption_clip)["t2v"]
        ref[name] = {k: float(m[k]) for k in ("R1", "R5", "R10")}
    from bench.harness import cpu_name

    save_file({"frames": enc.frames.contiguous(), "mask": enc.mask.to(torch.uint8).contiguous(), "vbar": enc.vbar.contiguous(),
               "t_cpu_fp32": t.contiguous()}, str(assets / "gallery.safetensors"))
    meta = {"checkpoint": str(checkpoint), "checkpoint_sha256": file_sha256(checkpoint), "corpus": str(corpus), "split": split,
            "captions": texts, "caption_clip": enc.caption_clip.tolist(),
            "cpu_reference": {"cpu": cpu_name(), "precision": "fp32", **ref}}
    (assets / "fidelity.json").write_text(json.dumps(meta))
    print(f"prepared {assets}: {len(texts)} captions, {enc.vbar.shape[0]} videos; CPU fp32 {ref}", flush=True)


# ------------------------------------------------------------------------------------------ report
def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else (f"{x:,.{nd}f}" if isinstance(x, float) else str(x))


def last_line(error: str) -> str:
    """The exception's own line of a traceback (the last line that names an error), for a table cell."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return ((named or lines or ["?"])[-1])[:200].replace("|", "/")


@with_provenance
def markdown(res: dict[str, Any]) -> str:
    env = res["sections"].get("env", {}).get("result", {})
    commit = res["commit"]
    dirty = "unknown" if commit == "unknown" else ("yes" if commit.endswith("-dirty") else "no")
    if res.get("commit_source", "git") != "git":  # a copy without .git: the caller named the commit (and -dirty)
        dirty += ", as the caller gave it"
    L = ["# GPU figures", "", "<!-- generated by bench/gpu_bench.py; do not edit by hand -->", "",
         f"Command: `{res['command']}`" + (f" (from `{res['wrapper']}`)" if res.get("wrapper") else "")
         + f" at commit `{commit}` (tree dirty: {dirty}; {res.get('commit_source', 'git')}), {res['date']}, host "
         f"`{res.get('host', '?')}`" + (f"; {res['wall_s']:.0f} s" if res.get("wall_s") else "") + "."
         + (" **Quick smoke run (small sizes)**." if res.get("quick") else ""),
         f"Device: {env.get('gpu') or env.get('device')}; CPU {env.get('cpu')} ({env.get('cores')} cores); "
         f"driver {env.get('driver')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), faiss {env.get('faiss')} "
         f"({env.get('faiss_distribution')}; compile options: {env.get('faiss_compile_options')}; GPUs seen by faiss: {env.get('faiss_gpus')}, "
         f"CAGRA: {env.get('faiss_cagra')}); shared libraries found: "
         + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in env.get("shared_libraries", {}).items()) + ".", ""]
    if env.get("device") == "cpu":
        L += ["**No CUDA device: every section ran on the CPU (one thread); the targets are not measured.**", ""]
    L.append("| section | status | seconds |")
    L.append("|---|---|---|")
    for name, s in res["sections"].items():
        status = ("ok" if s["ok"] else f"not run: {s['skipped']}" if s.get("skipped") else "FAILED: " + last_line(s["error"]))
        L.append(f"| {name} | {status} | {s['seconds']:.1f} |")
    L.append("")
    L += ["## Targets (this run's own observations)", "",
          "| target | how measured | threshold | observed | status |", "|---|---|---|---|---|"]
    for t in evaluate(res):
        obs = t["observed"]
        shown = "-" if obs is None else (f"{obs:,.4g}" if isinstance(obs, float) else str(obs))
        status = t["status"] if t["status"] != "met" else "met"
        L.append(f"| {t['target']} | {t['how']} | {t['threshold']} | {shown} | **{status}** |")
    L.append("")
    sec = {k: v["result"] for k, v in res["sections"].items() if v["ok"]}
    if "gpu_tests" in sec:
        gt = sec["gpu_tests"]
        L += ["## The `gpu` tests", "", f"`pytest -m gpu` just before this run on the same device (bench/gpu_check.sh; "
              f"exit status {gt['pytest_exit_status']}): {gt['passed']} passed, {gt['failed']} failed, {gt['errors']} "
              f"errors, {gt['skipped']} skipped of {gt['total']}.", ""]
        L += [f"- {kind}: `{name}`" for kind, key in (("failed", "failed_tests"), ("error", "error_tests"),
                                                      ("skipped", "skipped_tests")) for name in gt[key]]
        L.append("")
    if "text_encoder" in sec:
        te = sec["text_encoder"]
        L += ["## Text encoder", "", f"{te['model']}, each encoder built as the service builds it "
              "(`gare_search.text_encoder.load_query_encoder`: on CUDA fixed-shape micro-batches of 32 rows x the query "
              "context, replayed as a CUDA graph; on the CPU the model's tower one text at a time and the packed towers); "
              f"the service's default here: {te.get('served', {}).get('impl', '?')} {te.get('served', {}).get('precision', '?')}; "
              "median wall-clock per call." + (f" The same tower on this machine's CPU, fp32, one thread, one query: "
              f"{te['cpu_fp32_1q_1thread_ms']:.2f} ms." if "cpu_fp32_1q_1thread_ms" in te else ""), "",
              "`model` = the model's own tower (fp16/bf16 under autocast); `tower` = a gare.text_quant tower "
              "(`text_encoder` fp16 on CUDA: half-precision weights; int8 / fp32-packed on the CPU).", "",
              "| encoder | precision | batch | ms per call | queries/s |", "|---|---|---|---|---|"]
        for r in te["rows"]:
            L.append(f"| {r.get('impl', 'model')} | {r['precision']} | {r['batch']} | {r['ms_per_call']:.2f} | {r['queries_per_s']:,.0f} |")
        L.append("")
        if te.get("invariance"):
            L += ["Batch invariance: each text of one batch against the same text encoded alone (`torch.equal` per row).", "",
                  "| encoder | precision | texts | rows bitwise equal | max abs diff |", "|---|---|---|---|---|"]
            L += [f"| {r['impl']} | {r['precision']} | {r['texts']} | {r['rows_equal']} | {r['max_abs_diff']:.2e} |"
                  for r in te["invariance"]]
            L.append("")
    if "fidelity" in sec:
        fi = sec["fidelity"]
        ref = fi["cpu_reference"]
        L += ["## Fidelity of the GPU precisions (trained benchmark model, test split)", "",
              f"{fi['n_captions']} captions, {fi['n_videos']} videos; checkpoint sha256 `{fi['checkpoint_sha256'][:12]}`. "
              f"Reference: CPU fp32 on {ref['cpu']}.", "",
              "| precision | cos vs CPU fp32 (min / mean) | dual R@1 / R@5 / R@10 | + psi R@1 / R@5 / R@10 |", "|---|---|---|---|",
              f"| CPU fp32 (reference) | 1 / 1 | {ref['dual']['R1']:.1f} / {ref['dual']['R5']:.1f} / {ref['dual']['R10']:.1f} | "
              f"{ref['psi']['R1']:.1f} / {ref['psi']['R5']:.1f} / {ref['psi']['R10']:.1f} |"]
        for p, r in fi["precisions"].items():
            L.append(f"| {env.get('device')} {p} | {r['cos_vs_cpu_fp32_min']:.6f} / {r['cos_vs_cpu_fp32_mean']:.6f} | "
                     f"{r['dual']['R1']:.1f} / {r['dual']['R5']:.1f} / {r['dual']['R10']:.1f} | "
                     f"{r['psi']['R1']:.1f} / {r['psi']['R5']:.1f} / {r['psi']['R10']:.1f} |")
        L.append("")
    if "psi" in sec:
        ps = sec["psi"]
        L += ["## psi: rerank, exhaustive, constants", "",
              f"d = {ps['d']}, f = {ps['f']}, K = {ps['K']}. Folding the per-video constants (index time): "
              f"{ps['fold_videos_per_s']:,.0f} videos/s on the device"
              + (f", {ps['fold_videos_per_s_cpu_1thread']:,.0f} videos/s on one CPU thread; scores from GPU- and CPU-folded "
                 f"constants differ by at most {ps['max_abs_diff_gpu_vs_cpu_constants_scores']:.2e}" if "fold_videos_per_s_cpu_1thread" in ps else "")
              + ".", "",
              "| queries | fold ms | fused ms | model.score ms | fold ms/query | fused / fold | max abs diff fold vs model |",
              "|---|---|---|---|---|---|---|"]
        for r in ps["rerank"]:
            L.append(f"| {r['queries']} | {r['fold_ms']:.3f} | {r['fused_ms']:.3f} | {r['model_ms']:.3f} | {r['fold_ms_per_query']:.4f} | "
                     f"{r['fused_ms'] / r['fold_ms']:.1f}x | {r['max_abs_diff_fold_vs_model']:.1e} |")
        L.append("")
        ex = ps.get("exhaustive")
        if isinstance(ex, list):
            L += ["| exhaustive psi (fold) | entries | ms | ms per query |", "|---|---|---|---|"]
            for r in ex:
                L.append(f"| {r['queries']} queries | {r['entries']:,} | {r['ms']:.1f} | {r['ms_per_query']:.2f} |")
            L.append("")
        elif ex:
            L += [f"Exhaustive psi: {ex['error']}", ""]
    if "sinkhorn" in sec:
        L += ["## NCL Sinkhorn biases (dual-tower cosines, 4 iterations)", "", "| queue | entries | seconds |", "|---|---|---|"]
        for r in sec["sinkhorn"]["rows"]:
            L.append(f"| {r['queue']:,} | {r['entries']:,} | {r['seconds']:.2f} |")
        L.append("")
    if "served_biases" in sec:
        sb = sec["served_biases"]
        L += ["## Served-score bias pairs (`gare_build.served_biases.fold_pair_scorer`, stored constants)", "",
              f"{sb['pairs']:,} queue pairs in {sb['seconds']:.2f} s: {sb['pairs_per_s']:,.0f} pairs/s; a 16,384-query queue x "
              f"K = 256 (4.2M pairs, whatever the gallery size) would take {sb['queue_pairs_16384x256_s_extrapolated']:.1f} s "
              "(extrapolated from this rate).", ""]
    if "search" in sec:
        se = sec["search"]
        L += [f"## Two-stage search end to end ({se['entries']:,} entries, {se['gallery']['index_type']}, K = {se['candidates']}, "
              f"precision {se['precision']}, text encoder {se.get('text_encoder', '?')})", "",
              "`gare_search.search.search_batch` over a gallery written in the real index format (serve_bench.write_gallery). "
              "*fold* and *fold, CPU kernel*: the index opened with `use_gpu=False` (faiss on the CPU; the rerank's "
              "candidate rows read from the memory-mapped arrays); *resident*: the same version copied to the device "
              "(`gare_index.resident_version.load_resident`, what gare-serve serves on a GPU: stage 1 by the load-time "
              "choice, the candidates' rows gathered on the device)."
              + (f" Load-time choice: **{se['resident_decision']['method']}** ({se['resident_decision']['reason']})."
                 if se.get("resident_decision") else ""), "",
              "| rerank impl | queries per call | encoder alone ms | search ms | search / encoder | encode | ann | rerank | rank |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in se["rows"]:
            s = r["stage_ms"]
            impl = r.get("rerank_impl", "fold")
            impl = f"{impl} (= {r['resolved']})" if impl == "auto" else impl
            L.append(f"| {impl} | {r['queries']} | {r['encoder_alone_ms']:.2f} | {r['search_ms']:.2f} | {r['search_over_encoder']:.2f}x | "
                     f"{s['encode']:.2f} | {s['ann']:.2f} | {s['rerank']:.2f} | {s['rank']:.2f} |")
        L.append("")
    L += gpu_stage1.markdown(sec)
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_bench")
    ap.add_argument("--assets", type=Path, default=REPO / ".gpuassets", help="fidelity inputs made by --prepare")
    ap.add_argument("--sections", nargs="+", default=[k for k in SECTIONS if k != "gpu_tests"], choices=list(SECTIONS),
                    help="default: every section (gpu_tests too when --gpu-tests-junit is given)")
    ap.add_argument("--gpu-tests-junit", type=Path, help="the gpu tests' junit XML (bench/gpu_check.sh): its outcome "
                    "becomes the gpu_tests section")
    ap.add_argument("--gpu-tests-status", type=int, help="pytest's exit status for that junit XML")
    ap.add_argument("--deadline-s", type=float, help="seconds this run may take: a section expected (SECTION_SECONDS) "
                    "to end past it is not run and the report says so")
    ap.add_argument("--wrapper", help="the command that ran this one (bench/gpu_check.sh records itself)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--distinct", type=int, default=16384, help="distinct videos folded (psi and served-bias sections)")
    ap.add_argument("--rerank-queries", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--exhaustive-entries", type=int, default=1_000_000)
    ap.add_argument("--exhaustive-queries", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--exhaustive-chunk", type=int, default=16384)
    ap.add_argument("--queue", type=int, default=16384, help="NCL queue length for the Sinkhorn section")
    ap.add_argument("--sinkhorn-entries", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--served-queries", type=int, default=2048)
    ap.add_argument("--served-chunk", type=int, default=65536)
    ap.add_argument("--search-entries", type=int, default=100_000)
    ap.add_argument("--search-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--commit", default=git_commit(), help="the commit the tree is at (default: git, or GARE_COMMIT)")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--prepare", type=Path, metavar="ASSETS", help="write the fidelity inputs and exit (CPU)")
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--split", default="test")
    ap.add_argument("--render", type=Path, metavar="JSON", help="rewrite the markdown from a saved JSON and exit")
    gpu_stage1.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        res = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(res))  # the targets are evaluated afresh from the figures
        return 0
    if args.prepare:
        if not (args.checkpoint and args.corpus):
            ap.error("--prepare needs --checkpoint and --corpus")
        prepare(args.prepare, args.checkpoint, args.corpus, args.split)
        return 0
    if args.quick:
        args.batches, args.distinct, args.exhaustive_entries, args.exhaustive_queries = [1, 8], 512, 4096, [1, 4]
        args.rerank_queries, args.queue, args.sinkhorn_entries, args.served_queries = [1, 4], 512, [4096], 16
        args.search_entries, args.search_batches, args.reps = 2000, [1, 4], 1
        gpu_stage1.quick(args)
    if args.gpu_tests_junit is not None and "gpu_tests" not in args.sections:
        args.sections = [k for k in SECTIONS if k in {"gpu_tests", *args.sections}]  # in the registry's order
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)
        print("no CUDA here: every section runs on the CPU (one thread); the report says so", flush=True)
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 (fp16/bf16 are measured as such)
    import socket

    res: dict[str, Any] = {"command": "python -m bench.gpu_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "wrapper": args.wrapper, "commit": args.commit,
                           "commit_source": "GARE_COMMIT, given by the caller" if os.environ.get("GARE_COMMIT") else "git",
                           "host": socket.gethostname(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "quick": args.quick, "sections": {}}
    ctx: dict[str, Any] = {"dev": dev, "args": args}
    run = start(__name__, MEASURES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_run = time.perf_counter()
    for name in args.sections:
        left = None if args.deadline_s is None else args.deadline_s - (time.perf_counter() - t_run)
        need = SECTION_SECONDS.get(name, 30.0)
        if left is not None and not args.quick and need > left:
            why = f"time budget: expected ~{need:.0f} s, {max(left, 0):.0f} s left of --deadline-s {args.deadline_s:g}"
            print(f"== {name}: not run ({why})", flush=True)
            res["sections"][name] = {"ok": False, "seconds": 0.0, "skipped": why}
            continue
        if name not in ("env", "gpu_tests") and "model" not in ctx:
            ctx["model"] = vit_b32(dev)
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        # on disk while it runs: a run killed here (the device call's time limit) reports this section as unfinished
        res["sections"][name] = {"ok": False, "seconds": 0.0,
                                 "error": "RuntimeError: did not finish (the run ended during this section)"}
        write_report(res, args.out, run)
        try:
            r = SECTIONS[name](ctx)
            res["sections"][name] = {"ok": True, "seconds": time.perf_counter() - t0, "result": r}
        except SectionNotRun as e:
            print(f"{name}: not run ({e})", flush=True)
            res["sections"][name] = {"ok": False, "seconds": time.perf_counter() - t0, "skipped": str(e)}
        except Exception:  # recorded as a failure in the report; the other sections still run
            err = traceback.format_exc()
            print(err, flush=True)
            res["sections"][name] = {"ok": False, "seconds": time.perf_counter() - t0, "error": err}
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        res["wall_s"] = time.perf_counter() - t_run
        write_report(res, args.out, run)  # after every section: a run cut short keeps its report
    write_report(res, args.out, run)
    failed = [k for k, v in res["sections"].items() if not v["ok"] and not v.get("skipped")]
    skipped = [k for k, v in res["sections"].items() if v.get("skipped")]
    print(f"wrote {args.out.with_suffix('.md')}; failed sections: {failed or 'none'}; not run: {skipped or 'none'}",
          flush=True)
    for t in evaluate(res):
        print(f"target: {t['target']}: {t['observed']} ({t['threshold']}): {t['status']}", flush=True)
    return 1 if failed else 0


def write_report(res: dict[str, Any], out: Path, run: Run) -> None:
    """The JSON (with the run's record, the observations and the targets' outcome, recomputed by --render) and its
    markdown."""
    res = {**res, "observations": observations(res), "targets": evaluate(res), "run": run.record()}
    harness.write_report(out.with_suffix(".json"), res, markdown)


if __name__ == "__main__":
    sys.exit(main())
