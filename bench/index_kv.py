"""Store psi's per-video K/V in the index or not? Rerank latency against bytes per video.

Reranking K candidates runs psi for every (query, candidate) pair; psi's key/value projections depend on
the video only (`model.video_kv(F)`), so they can be computed at query time from the stored frames F, or
precomputed at index time (`gare-index build --store-kv`, keys.npy + values.npy, float16).
This measures model.score for K candidates read from float16 memmaps (page cache warm), both ways, at the
ViT-B/32 sizes (d = 512, f = 12, random weights: the cost does not depend on them).
Issue 12 adds the third way the index now serves by default: psi folded into per-video constants
(psi_consts.npy, float32, 3,368 B per video at f = 12; `gare_index.psi_consts`), gather of frames + constants +
v̄, then `gare.psi_fold.pair_scores`. The verdict line says whether stored K/V still pays for its bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS, add_render_arg, render_requested, start, write_results
from bench.index_common import table

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


def main() -> None:
    if render_requested(RESULTS / "index_kv.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--videos", type=int, default=20000, help="videos in the memmapped gallery")
    ap.add_argument("--candidates", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the rerank")
    add_render_arg(ap, RESULTS / "index_kv.json")
    args = ap.parse_args()
    run = start(__name__, MEASURES)

    import numpy as np
    import torch

    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(0)
    cfg = get_model_config("gare-vit-b-32", pretrained="none")
    model = GARE.build(cfg).eval()
    d, f, n = cfg.embed_dim, cfg.max_frames, args.videos
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="gare-kv-bench-"))
    frames = np.lib.format.open_memmap(tmp / "frames.npy", mode="w+", dtype=np.float16, shape=(n, f, d))
    keys = np.lib.format.open_memmap(tmp / "keys.npy", mode="w+", dtype=np.float16, shape=(n, f, d))
    values = np.lib.format.open_memmap(tmp / "values.npy", mode="w+", dtype=np.float16, shape=(n, f, d))
    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.psi_fold_videos import packed_width

    fw = pfw.fold_weights(model.psi)
    consts = np.lib.format.open_memmap(tmp / "psi_consts.npy", mode="w+", dtype=np.float32, shape=(n, packed_width(f)))
    vbars = np.empty((n, d), np.float32)
    masks = np.ones((n, f), dtype=np.uint8)
    with torch.no_grad():
        for s in range(0, n, 2048):
            fr = torch.from_numpy(rng.standard_normal((min(2048, n - s), f, d)).astype(np.float32) * 0.1)
            k, v = model.video_kv(fr)
            frames[s : s + len(fr)] = fr.numpy().astype(np.float16)
            keys[s : s + len(fr)] = k.numpy().astype(np.float16)
            values[s : s + len(fr)] = v.numpy().astype(np.float16)
            vb = fr.mean(1)  # the index's v̄ (float32 features), not the mean of the float16 frames
            vbars[s : s + len(fr)] = vb.numpy()
            consts[s : s + len(fr)] = pfv.fold_videos(fr.half(), None, fw, vbar=vb).packed.numpy()
    for a in (frames, keys, values, consts):
        a.flush()
    del frames, keys, values, consts
    frames = np.load(tmp / "frames.npy", mmap_mode="r")
    keys = np.load(tmp / "keys.npy", mmap_mode="r")
    values = np.load(tmp / "values.npy", mmap_mode="r")
    consts = np.load(tmp / "psi_consts.npy", mmap_mode="r")
    for a in (frames, keys, values, consts):  # warm the page cache: the service's steady state
        np.asarray(a).sum()

    torch.set_num_threads(args.threads)  # one request = one thread (OpenMP jitter on a shared box otherwise)
    rows_out = []
    data = []
    for nq in args.queries:
        t = torch.nn.functional.normalize(torch.randn(nq, d), dim=1)
        for kc in args.candidates:
            res = {}
            for mode in ("frames only (kv computed)", "precomputed K/V", "fold"):
                gather, compute = [], []
                for r in range(args.repeats + 1):
                    rows = np.sort(rng.choice(n, size=kc, replace=False))
                    t0 = time.perf_counter()
                    if mode == "fold":  # what gare_search.search does: gather rows once, fold the queries, pair scores
                        v = pfv.VideoConstants(frames=torch.from_numpy(frames[rows]), packed=torch.from_numpy(consts[rows]),
                                              fingerprint=fw.fingerprint, vbar=torch.from_numpy(vbars[rows]))
                        t1 = time.perf_counter()
                        with torch.no_grad():
                            q = pfq.fold_queries(t, fw, cfg.temp)
                            pf.pair_scores(q, v, torch.arange(kc).expand(nq, kc))
                        t2 = time.perf_counter()
                        if r:
                            gather.append(t1 - t0)
                            compute.append(t2 - t1)
                        continue
                    fr = torch.from_numpy(np.asarray(frames[rows], dtype=np.float32))
                    mk = torch.from_numpy(masks[rows])
                    kv = None
                    if mode == "precomputed K/V":
                        kv = (torch.from_numpy(np.asarray(keys[rows], dtype=np.float32)),
                              torch.from_numpy(np.asarray(values[rows], dtype=np.float32)))
                    t1 = time.perf_counter()
                    with torch.no_grad():
                        model.score(t, fr, mk, kv=kv)
                    t2 = time.perf_counter()
                    if r:  # the first run is a warm-up
                        gather.append(t1 - t0)
                        compute.append(t2 - t1)
                # minimum over repeats: the machine is shared and the computation is deterministic
                g, c = 1000 * float(np.min(gather)), 1000 * float(np.min(compute))
                res[mode] = (g + c, g, c)
            a, b, c = res["frames only (kv computed)"], res["precomputed K/V"], res["fold"]
            rows_out.append([nq, kc, f"{a[0]:.1f} ({a[1]:.1f} + {a[2]:.1f})", f"{b[0]:.1f} ({b[1]:.1f} + {b[2]:.1f})",
                             a[0] / b[0], f"{c[0]:.2f} ({c[1]:.2f} + {c[2]:.2f})", b[0] / c[0]])
            data.append({"queries": nq, "candidates": kc, "frames_only_ms": a[0], "frames_only_gather_ms": a[1],
                         "frames_only_score_ms": a[2], "kv_ms": b[0], "kv_gather_ms": b[1], "kv_score_ms": b[2],
                         "speedup": a[0] / b[0], "fold_ms": c[0], "fold_gather_ms": c[1], "fold_score_ms": c[2],
                         "kv_over_fold": b[0] / c[0]})
            print(rows_out[-1], flush=True)

    per_video_frames = f * d * 2
    body = (
        f"Gallery: {n:,} videos as float16 memmaps (page cache warm), d = {d}, f = {f}, all frames real; "
        f"times are the minimum over {args.repeats} reranks of (gather from the memmaps) + (`model.score`), "
        f"torch threads = {torch.get_num_threads()} (one request per thread).\n\n"
        + table(["queries", "candidates K", "frames only: ms (gather + score)", "with stored K/V: ms (gather + score)",
                 "K/V speed-up", "fold (stored constants): ms (gather + score)", "fold vs K/V"], rows_out)
        + "\nBytes per video on disk (and in the page cache when hot): frames "
        f"{per_video_frames:,} B; with K/V {3 * per_video_frames:,} B (3x). For 1M videos: "
        f"{per_video_frames * 1e6 / 2**30:.1f} GiB vs {3 * per_video_frames * 1e6 / 2**30:.1f} GiB; "
        f"with the fold's constants {per_video_frames + 4 * packed_width(f):,} B "
        f"({(per_video_frames + 4 * packed_width(f)) * 1e6 / 2**30:.1f} GiB).\n"
    )
    slower = [r for r in data if r["kv_ms"] < r["fold_ms"]]
    verdict = ("stored K/V is slower than the fold in every case measured, at 3x the frame bytes (the fold adds "
               f"{4 * packed_width(f) / per_video_frames:.0%}): it no longer pays; `gare-index build` no longer offers --store-kv"
               if not slower else f"stored K/V beats the fold in {len(slower)} of {len(data)} cases: "
               + ", ".join(f"{r['queries']} q x K={r['candidates']}" for r in slower))
    body += f"\nVerdict (from this run): {verdict}.\n"
    write_results("index_kv", "psi K/V precomputation: rerank latency vs bytes", body,
                  {"videos": n, "d": d, "f": f, "rows": data, "bytes_per_video_frames": per_video_frames,
                   "bytes_per_video_with_kv": 3 * per_video_frames, "bytes_per_video_fold_consts": 4 * packed_width(f),
                   "verdict": verdict}, run)


if __name__ == "__main__":
    main()
