"""Time to recompute the NCL video biases (SPEC §5) for 1M videos against a 16,384-query queue, d = 512.

`gare_build.build.compute_biases` -> `gare.sinkhorn.sinkhorn_biases` (log domain, gallery chunks,
n_iters = 4: five passes over the gallery). The cost is linear in the number of videos (every pass visits
each gallery chunk once, with the same Q x chunk work), so on a CPU too slow for the full 1M it is measured
at smaller galleries and extrapolated linearly (labelled). `--full` runs the real 1M.
"""

from __future__ import annotations

import argparse
import time

from bench.harness import RESULTS, add_render_arg, render_requested, start, write_results
from bench.index_common import rss_bytes, table

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/build.py",
    "indexer/gare_build/served_biases.py",
    "indexer/gare_index/ann_eval.py",
)


def main() -> None:
    if render_requested(RESULTS / "index_biases.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queries", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 20_000])
    ap.add_argument("--target", type=int, default=1_000_000)
    ap.add_argument("--full", action="store_true", help="also run the target size itself")
    add_render_arg(ap, RESULTS / "index_biases.json")
    args = ap.parse_args()
    run = start(__name__, MEASURES)

    import numpy as np
    import torch

    from gare_build.build import compute_biases
    from gare_index.ann_eval import clustered_vectors

    rng = np.random.default_rng(0)
    queue = rng.standard_normal((args.queries, args.dim)).astype(np.float32)
    queue /= np.linalg.norm(queue, axis=1, keepdims=True)
    gamma = 0.01
    sizes = list(args.sizes) + ([args.target] if args.full else [])
    rows, data = [], []
    for n in sizes:
        units = clustered_vectors(n, args.dim, max(1, n // 100), seed=0, spread=0.5)
        r0 = rss_bytes()
        t0 = time.time()
        b, info = compute_biases(units, gamma, queue, 4, device="cpu")
        el = time.time() - t0
        assert np.isfinite(b).all() and info["source"] == "checkpoint-queue"
        rows.append([f"{n:,}", f"{args.queries:,}", f"{el:.1f}", f"{el / n * 1e6:.0f}", "measured"])
        data.append({"n": n, "queries": args.queries, "seconds": el, "us_per_video": el / n * 1e6,
                     "rss_delta_bytes": rss_bytes() - r0, "extrapolated": False})
        print(rows[-1], flush=True)
    measured = [d for d in data if not d["extrapolated"]]
    per_video = float(np.median([d["seconds"] / d["n"] for d in measured]))
    if not args.full:
        est = per_video * args.target
        rows.append([f"{args.target:,}", f"{args.queries:,}", f"{est:.0f} (~{est / 60:.0f} min)",
                     f"{per_video * 1e6:.0f}", "**EXTRAPOLATED** (linear in n)"])
        data.append({"n": args.target, "queries": args.queries, "seconds": est, "us_per_video": per_video * 1e6,
                     "extrapolated": True})
    flops = 5 * 2 * args.queries * args.dim  # five matmul passes per video
    body = (
        f"Queue Q = {args.queries:,} unit queries, gamma = {gamma}, n_iters = 4 (5 chunked passes), float32 matmuls with "
        f"float64 accumulators, CPU ({torch.get_num_threads()} threads).\n\n"
        + table(["videos", "queries", "seconds", "us / video", ""], rows)
        + f"\nPer video and pass the work is a {args.queries:,} x {args.dim} dot product block plus two logsumexps over "
        f"{args.queries:,} values ({flops / 1e6:.0f} MFLOP of matmul per video in total); on this CPU the exp/logsumexp "
        "part dominates. On a GPU (`compute_biases` uses CUDA when present) the same 1M x 16k job is a few "
        "seconds of matmul. `gare-index add/remove/biases` recompute the biases of the whole gallery each time "
        "(they depend on every video), so on CPU hosts with very large libraries schedule `add` in batches.\n"
    )
    write_results("index_biases", "NCL video biases: recompute time for 1M videos x 16,384 queries", body,
                  {"rows": data, "per_video_s": per_video}, run)


if __name__ == "__main__":
    main()
