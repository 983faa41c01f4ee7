"""psi folded into per-video constants (gare/psi_fold.py, what the search serves) against the fused and model paths.

    python -m bench.psi_fold            # ~5-10 min on one core; ~2.5 GiB peak
    python -m bench.psi_fold --quick    # smoke run (small gallery, 1 repeat each)

One run, one CPU thread (torch.set_num_threads(1)), median of 5 rounds (the rerank paths interleaved in each), ViT-B/32 sizes (d = 512, f = 12):
- psi rerank of K = 256 random rows of the gallery for one query: the fold's CPU kernel
  (`gare/psi_fold_cpu.py`, the default: per-query vectors + the kernel reading the candidates' fp16
  frames and constants straight from the gallery arrays), the fold in torch ops (CUDA's path),
  the fused scorer (bench/psi_reference.py: the search's default before the fold) and `model.score` (the training
  definition), the last three including the gather of the candidates' rows;
- the ViT-B/32 text tower for one query (open_clip ViT-B-32 with random weights: timing only);
- exhaustive psi over a 100k-entry gallery for one query: `psi_fold.exhaustive` (the kernel), the torch ops
  in one pass, and the fused reference (bench/psi_reference.py), measured on a 10k slice and extrapolated x10 (labelled);
- added bytes per video, index-time cost of folding, and the score differences fold vs fused / model
  (float32 constants, and float16-stored constants).
The 100k gallery is `--distinct` distinct videos (fp16 frames, some padded) tiled to 100k rows (real
copies, so every row is read from memory): folding 100k videos costs ~1.9 TFLOP that timing does not need.
Results: bench/results/psi_fold.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.harness import RESULTS, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import rss_bytes, table
from bench.psi_reference import fused_exhaustive, fused_pair_scores

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


D, F_FRAMES, K = 512, 12, 256


def median_time(fn: Callable[[], Any], iters: int, repeats: int) -> tuple[float, dict[str, Any]]:
    """Median over `repeats` of the seconds per call over `iters` calls (after one warm-up call), as process
    CPU time (the figure the tables and targets use: with one torch thread it is the time one core spent,
    which other jobs on a shared machine inflate far less than the wall clock) and as wall-clock time."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(iters):
            fn()
        cpu.append((time.process_time() - c0) / iters)
        wall.append((time.perf_counter() - w0) / iters)
    info = {"median": statistics.median(cpu), "wall_median": statistics.median(wall), "cpu_repeats": cpu,
            "wall_repeats": wall}
    return info["median"], info


def make_gallery(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n videos: frames (n, f, d) fp16 = a unit video direction + per-frame noise, ~1 in 4 padded; mask (n, f)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(n, 1, D, generator=g), dim=-1) * 8.0
    frames = base + 2.0 * torch.randn(n, F_FRAMES, D, generator=g) / D**0.5 * 8.0
    n_real = torch.where(torch.rand(n, generator=g) < 0.25, torch.randint(1, F_FRAMES, (n,), generator=g), F_FRAMES)
    mask = torch.arange(F_FRAMES)[None] < n_real[:, None]
    return (frames * mask[..., None]).half(), mask


def nontrivial_psi(psi: torch.nn.Module) -> torch.nn.Module:
    """In place: LayerNorm gamma ~ N(1, 0.2), beta ~ N(0, 0.2), everything else ~ N(0, 0.05). psi's N(0, 0.02)
    init makes Δ ~ 0: timing does not care, the accuracy comparisons do. Shared with bench/gpu_bench.py."""
    with torch.no_grad():
        for name, p in psi.named_parameters():
            if name.startswith("ln"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    return psi


def main() -> None:
    if render_requested(RESULTS / "psi_fold.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gallery", type=int, default=100_000, help="exhaustive gallery size")
    ap.add_argument("--distinct", type=int, default=1024, help="distinct videos folded (tiled to --gallery)")
    ap.add_argument("--fused-slice", type=int, default=10_000, help="entries the fused exhaustive is measured on")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (rerank, interleaved) / repeats (the rest)")
    ap.add_argument("--quick", action="store_true")
    add_render_arg(ap, RESULTS / "psi_fold.json")
    args = ap.parse_args()
    if args.quick:
        args.gallery, args.distinct, args.fused_slice, args.repeats = 4096, 512, 1024, 1
    run = start(__name__, MEASURES)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from gare import psi_fold as pf
    from gare import psi_fold_cpu as pc
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.config import get_model_config
    from gare.model import GARE
    from gare.psi import masked_mean

    cfg = get_model_config("gare-vit-b-32", pretrained="none")
    model = GARE.build(cfg).eval()
    nontrivial_psi(model.psi)
    reps = args.repeats
    results: dict[str, Any] = {"load_average_start": os.getloadavg(), "commit": git_commit(), "threads": torch.get_num_threads(), "repeats": reps,
                               "d": D, "f": F_FRAMES, "K": K}

    # ---------------------------------------------------------------- text tower, one query
    tokens = model.tokenize(["a man is cooking pasta in a small kitchen while people watch"])
    with torch.inference_mode():
        t_text, per = median_time(lambda: model.encode_text(tokens), iters=5, repeats=reps)
        t = model.encode_text(tokens)  # (1, d)
    results["text_encoder_s"] = per
    print(f"text encoder {t_text * 1e3:.2f} ms CPU", flush=True)

    # ---------------------------------------------------------------- fold the distinct videos (index time)
    frames, mask = make_gallery(args.distinct, 1)
    t = t + 0.0  # plain tensor (encode_text ran under inference_mode)
    t0 = time.perf_counter()
    fw = pfw.fold_weights(model.psi)
    t_fold_w = time.perf_counter() - t0
    t0 = time.perf_counter()
    consts = pfv.fold_videos(frames, mask, fw, chunk=256)
    t_fold_v = (time.perf_counter() - t0) / args.distinct
    results["fold_weights_s"] = t_fold_w
    results["fold_videos_s_per_video"] = t_fold_v
    results["bytes_per_video"] = {"fp32": consts.bytes_per_video(), "fp16": consts.to(dtype=torch.float16).bytes_per_video()}
    print(f"fold weights {t_fold_w:.2f} s, videos {t_fold_v * 1e3:.3f} ms/video", flush=True)

    # ---------------------------------------------------------------- the gallery: distinct videos tiled (real copies)
    reps_tile = -(-args.gallery // args.distinct)
    big = pfv.VideoConstants.cat([consts] * reps_tile).slice(0, args.gallery)
    big_mask = mask.repeat(reps_tile, 1)[: args.gallery]
    vbar_all = masked_mean(frames.float(), mask)
    norms_all = vbar_all.norm(dim=-1)
    units_big = (vbar_all / norms_all[:, None]).repeat(reps_tile, 1)[: args.gallery].contiguous()
    norms_big = norms_all.repeat(reps_tile)[: args.gallery].contiguous()
    frames_np, packed_np = big.frames.numpy(), big.packed.numpy()
    packed16_np = big.packed.half().numpy()
    units_np, norms_np = units_big.numpy(), norms_big.numpy()

    # ---------------------------------------------------------------- rerank K = 256, one query
    # K random rows of the whole gallery (as an ANN returns them), each path reading them from the gallery arrays
    g = torch.Generator().manual_seed(2)
    idx = torch.randperm(args.gallery, generator=g)[:K]
    idx_np = idx.numpy()[None]
    ar = torch.arange(K).view(1, K)
    pc.warm_up()

    def rr_kernel(pk: np.ndarray) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:  # as gare_search.search on the CPU: the kernel reads the rows from the arrays
            q = pfq.fold_queries(t, fw, cfg.temp)
            return torch.from_numpy(pc.pair_scores(q, frames_np, pk, idx_np, vrows=units_np, vscale=norms_np)[0])
        return run

    def rr_fold_torch() -> torch.Tensor:  # the torch ops (CUDA's path; the CPU default before the kernel)
        q = pfq.fold_queries(t, fw, cfg.temp)
        vs = pfv.VideoConstants(frames=big.frames[idx], packed=big.packed[idx], fingerprint=big.fingerprint,
                               vbar=units_big[idx] * norms_big[idx, None])
        return pf.pair_scores(q, vs, ar, kernel=False)[0]

    def rr_fused() -> torch.Tensor:
        fr = big.frames[idx].float()
        return fused_pair_scores(model, t.expand(K, -1), fr, big_mask[idx], units_big[idx] * norms_big[idx, None])

    def rr_model() -> torch.Tensor:
        return model.score(t, big.frames[idx], big_mask[idx], vbar=units_big[idx] * norms_big[idx, None], block_videos=K)[0]

    rr: dict[str, Any] = {}
    paths = (("fold", rr_kernel(packed_np), 50), ("fold_fp16_consts", rr_kernel(packed16_np), 50),
             ("fold_torch", rr_fold_torch, 50), ("fused", rr_fused, 10), ("model", rr_model, 3))
    with torch.inference_mode():
        outs = {name: fn() for name, fn, _ in paths}  # also the warm-up call of each
        # interleaved: every round times each path once, so a slow spell of the shared machine hits all paths of
        # that round; the ratios below are medians of the per-round ratios
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in paths}
        for _ in range(reps):
            for name, fn, iters in paths:
                _, per = median_time(fn, iters, 1)
                rounds[name].append((per["cpu_repeats"][0], per["wall_repeats"][0]))
        for name, _, _ in paths:
            cpu = [c for c, _ in rounds[name]]
            rr[name] = {"median_s": statistics.median(cpu), "wall_median": statistics.median(w for _, w in rounds[name]),
                        "cpu_repeats": cpu, "wall_repeats": [w for _, w in rounds[name]]}
            print(f"rerank {name}: {rr[name]['median_s'] * 1e3:.3f} ms", flush=True)
        rr["fused_over_fold_per_round"] = [f / k for (f, _), (k, _) in zip(rounds["fused"], rounds["fold"], strict=True)]
    diffs = {
        "fold_vs_fused": float((outs["fold"] - outs["fused"]).abs().max()),
        "fold_vs_model": float((outs["fold"] - outs["model"]).abs().max()),
        "fold_torch_vs_model": float((outs["fold_torch"] - outs["model"]).abs().max()),
        "fused_vs_model": float((outs["fused"] - outs["model"]).abs().max()),
        "fold_fp16_consts_vs_model": float((outs["fold_fp16_consts"] - outs["model"]).abs().max()),
    }
    results["rerank"] = rr
    results["max_abs_score_diff"] = diffs
    print(diffs, flush=True)

    # ---------------------------------------------------------------- exhaustive over the gallery, one query
    q1 = pfq.fold_queries(t, fw, cfg.temp)
    with torch.inference_mode():
        ex_fold, per = median_time(lambda: pf.exhaustive(q1, big), 1, reps)  # one query: the CPU kernel
        s_fold = pf.exhaustive(q1, big)
        ex_torch, per_t = median_time(lambda: pf.exhaustive(q1, big, kernel=False), 1, reps)  # the torch ops
    results["exhaustive_fold_s"] = {**per, "entries": args.gallery}
    results["exhaustive_fold_torch_s"] = {**per_t, "entries": args.gallery}
    print(f"exhaustive fold {args.gallery}: {ex_fold:.3f} s, torch ops {ex_torch:.3f} s (rss {rss_bytes() / 2**30:.2f} GiB)", flush=True)

    class Slice:  # the attributes fused_exhaustive reads from an index version
        def __init__(self, n: int) -> None:
            fr = big.frames[:n]
            self.n = n
            self.frames = fr.numpy()
            self.masks = big_mask[:n].numpy()
            vb = masked_mean(fr.float(), big_mask[:n])
            nrm = vb.norm(dim=-1)
            self.norms = nrm.numpy()
            self.units = (vb / nrm[:, None]).numpy()

    sl = Slice(args.fused_slice)
    with torch.inference_mode():
        ex_fused, per = median_time(lambda: fused_exhaustive(model, sl, t), 1, reps)
        s_fused = fused_exhaustive(model, sl, t)
    results["exhaustive_fused_slice_s"] = {**per, "entries": args.fused_slice}
    scale = args.gallery / args.fused_slice
    results["exhaustive_fused_extrapolated_s"] = ex_fused * scale
    results["max_abs_score_diff"]["exhaustive_fold_vs_fused"] = float(np.abs(s_fold[:, : args.fused_slice].numpy() - s_fused).max())
    results["peak_rss_gib"] = rss_bytes() / 2**30
    results["load_average_end"] = os.getloadavg()
    print(f"exhaustive fused {args.fused_slice}: {ex_fused:.3f} s", flush=True)

    # ---------------------------------------------------------------- report
    ms = 1e3
    fold_rr, fused_rr = rr["fold"]["median_s"], rr["fused"]["median_s"]
    speedup = statistics.median(rr["fused_over_fold_per_round"])
    targets = {
        "rerank >= 10x faster than fused (median of the per-round ratios)": (speedup, speedup >= 10),
        "rerank <= 10% of the text encoder": (fold_rr / t_text, fold_rr / t_text <= 0.10),
        f"exhaustive {args.gallery:,} <= 2 s": (ex_fold, ex_fold <= 2.0),
        "bytes per video <= 4 KB (fp32)": (results["bytes_per_video"]["fp32"], results["bytes_per_video"]["fp32"] <= 4096),
    }
    results["targets"] = {k: {"value": v, "met": m} for k, (v, m) in targets.items()}
    body = (f"Commit `{results['commit']}`; {results['threads']} torch thread; median of {reps} repeats. "
            f"Load average (1/5/15 min) at start {', '.join(f'{x:.1f}' for x in results['load_average_start'])}, at end "
            f"{', '.join(f'{x:.1f}' for x in results['load_average_end'])} on {os.cpu_count()} cores: other jobs shared "
            "the machine, so compare the ratios measured side by side, not the absolute times. Times are process CPU "
            "time (one torch thread: one core's time) unless a column says wall.\n\n")
    body += (f"## psi rerank of K = 256 candidates, one query (d = 512, f = 12, fp16 stored frames)\n\n"
             f"K random rows of the {args.gallery:,}-row gallery; every path reads them from the gallery's arrays (the "
             "kernel straight from them, as `gare_search.search` does on the CPU; the others gather them first).\n\n")
    def wall(name: str) -> float:
        return rr[name]["wall_median"] * ms

    body += table(
        ["path", "CPU ms / query", "vs fold", "wall ms / query", "max |s - s_model|"],
        [["fold, CPU kernel (the default; fp32 constants)", fold_rr * ms, 1.0, wall("fold"), diffs["fold_vs_model"]],
         ["fold, CPU kernel (fp16 constants)", rr["fold_fp16_consts"]["median_s"] * ms, rr["fold_fp16_consts"]["median_s"] / fold_rr,
          wall("fold_fp16_consts"), diffs["fold_fp16_consts_vs_model"]],
         ["fold, torch ops (CUDA's path; the CPU default before the kernel)", rr["fold_torch"]["median_s"] * ms,
          rr["fold_torch"]["median_s"] / fold_rr, wall("fold_torch"), diffs["fold_torch_vs_model"]],
         ["fused (bench/psi_reference.py, the previous default)", fused_rr * ms, fused_rr / fold_rr, wall("fused"), diffs["fused_vs_model"]],
         ["model.score", rr["model"]["median_s"] * ms, rr["model"]["median_s"] / fold_rr, wall("model"), 0.0],
         ["text encoder ViT-B/32, one query", t_text * ms, t_text / fold_rr, results["text_encoder_s"]["wall_median"] * ms, "-"]],
    )
    body += (f"\nThe paths ran interleaved, {reps} rounds; fused / fold (kernel) in each round: "
             f"{', '.join(f'{x:.2f}' for x in rr['fused_over_fold_per_round'])} (median {speedup:.2f}). "
             f"max |fold - fused| on these pairs: {diffs['fold_vs_fused']:.2e}.\n\n")
    body += f"## Exhaustive psi, one query, {args.gallery:,} entries\n\n"
    wf, wu = results["exhaustive_fold_s"]["wall_median"], results["exhaustive_fused_slice_s"]["wall_median"]
    body += table(
        ["path", "entries measured", "CPU s", f"CPU s for {args.gallery:,}", f"wall s for {args.gallery:,}"],
        [["fold (psi_fold.exhaustive: the CPU kernel for one query)", args.gallery, ex_fold, ex_fold, wf],
         ["fold, torch ops (psi_fold.exhaustive(kernel=False), in chunks)", args.gallery, ex_torch, ex_torch, results["exhaustive_fold_torch_s"]["wall_median"]],
         [f"fused (bench/psi_reference.py), EXTRAPOLATED x{scale:g} from a {args.fused_slice:,} slice",
          args.fused_slice, ex_fused, ex_fused * scale, wu * scale]],
    )
    body += (f"\nmax |fold - fused| over the measured slice: {results['max_abs_score_diff']['exhaustive_fold_vs_fused']:.2e}. "
             f"The gallery is {args.distinct:,} distinct videos tiled to {args.gallery:,} rows (real copies).\n\n")
    body += "## Index-time cost and bytes\n\n"
    body += table(
        ["figure", "value"],
        [["added bytes per video, fp32 constants", results["bytes_per_video"]["fp32"]],
         ["added bytes per video, fp16 constants", results["bytes_per_video"]["fp16"]],
         ["fold_videos, wall ms per video (1 thread)", t_fold_v * ms],
         ["fold_weights, wall s (once per checkpoint)", t_fold_w],
         ["peak RSS, GiB", results["peak_rss_gib"]]],
    )
    body += "\n## Targets (issue 12; reported, not asserted)\n\n"
    body += table(["target", "measured", "met"], [[k, v, "yes" if m else "NO"] for k, (v, m) in targets.items()])
    write_results("psi_fold", "psi fold benchmark (issue 12)", body, results, run)


if __name__ == "__main__":
    sys.exit(main())
