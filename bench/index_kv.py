"""Store psi's per-video K/V in the index or not? Rerank latency of what the service runs, against bytes per video.

Reranking K candidates runs psi for every (query, candidate) pair. psi's key/value projections depend on the
video only (`model.video_kv(F)`), so they can be precomputed at index time (`gare-index build --store-kv`,
keys.npy + values.npy, float16) and passed to `model.score(..., kv=)`. The service does neither by default:
its rerank is the fused path (`indexer.search.psi_scores(..., impl="fused")`, GARE_RERANK_IMPL=fused), which
moves psi's per-frame projections to the query side and never reads K/V. This measures, through
`indexer.search.psi_scores` on the same float16 memmaps (page cache warm), ViT-B/32 sizes (d = 512, f = 12,
random weights: the cost does not depend on them):

* fused (the service's default; frames only),
* model.score with the stored K/V (`rerank_impl=model` on an index built with --store-kv),
* model.score computing K/V from the frames (`rerank_impl=model`, no --store-kv),

and checks that the three give the same scores (max abs difference in the table).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from index_common import table, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--videos", type=int, default=20000, help="videos in the memmapped gallery")
    ap.add_argument("--candidates", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the rerank")
    args = ap.parse_args()
    started = time.time()

    import numpy as np
    import torch

    from training.config import get_model_config
    from training.model import GARE

    torch.manual_seed(0)
    cfg = get_model_config("gare-vit-b-32", pretrained="none")
    model = GARE.build(cfg).eval()
    d, f, n = cfg.embed_dim, cfg.max_frames, args.videos
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="gare-kv-bench-"))
    frames = np.lib.format.open_memmap(tmp / "frames.npy", mode="w+", dtype=np.float16, shape=(n, f, d))
    keys = np.lib.format.open_memmap(tmp / "keys.npy", mode="w+", dtype=np.float16, shape=(n, f, d))
    values = np.lib.format.open_memmap(tmp / "values.npy", mode="w+", dtype=np.float16, shape=(n, f, d))
    masks = np.ones((n, f), dtype=np.uint8)
    with torch.no_grad():
        for s in range(0, n, 2048):
            fr = torch.from_numpy(rng.standard_normal((min(2048, n - s), f, d)).astype(np.float32) * 0.1)
            k, v = model.video_kv(fr)
            frames[s : s + len(fr)] = fr.numpy().astype(np.float16)
            keys[s : s + len(fr)] = k.numpy().astype(np.float16)
            values[s : s + len(fr)] = v.numpy().astype(np.float16)
    for a in (frames, keys, values):
        a.flush()
    del frames, keys, values
    frames = np.load(tmp / "frames.npy", mmap_mode="r")
    keys = np.load(tmp / "keys.npy", mmap_mode="r")
    values = np.load(tmp / "values.npy", mmap_mode="r")
    for a in (frames, keys, values):  # warm the page cache: the service's steady state
        np.asarray(a).sum()

    torch.set_num_threads(args.threads)  # one request = one thread (OpenMP jitter on a shared box otherwise)
    from indexer.search import psi_scores

    class Gallery:
        """The part of an IndexVersion the rerank reads (ids are row positions here)."""

        def __init__(self, kv: bool) -> None:
            self.frames, self.masks = frames, masks
            self.units = np.ones((n, d), np.float32) / np.sqrt(d)
            self.norms = np.ones(n, np.float32)
            self.kv = (keys, values) if kv else None

        def rows(self, ids: np.ndarray) -> np.ndarray:
            return np.asarray(ids, dtype=np.int64)

    modes = {"fused (service default)": ("fused", Gallery(kv=False)),
             "model.score + stored K/V": ("model", Gallery(kv=True)),
             "model.score, K/V computed": ("model", Gallery(kv=False))}
    rows_out = []
    data = []
    for nq in args.queries:
        t = torch.nn.functional.normalize(torch.randn(nq, d), dim=1)
        for kc in args.candidates:
            times: dict[str, list[float]] = {m: [] for m in modes}
            diff = 0.0
            for r in range(args.repeats + 1):
                cands = [np.sort(rng.choice(n, size=kc, replace=False)) for _ in range(nq)]
                got = {}
                for mode, (impl, gal) in modes.items():  # interleaved: the three see the same machine state
                    t0 = time.perf_counter()
                    got[mode] = psi_scores(model, gal, t, cands, impl=impl)
                    if r:  # the first run is a warm-up
                        times[mode].append(time.perf_counter() - t0)
                ref = got["fused (service default)"]
                for mode in modes:
                    diff = max(diff, max(float(np.abs(a - b).max()) for a, b in zip(got[mode], ref, strict=True)))
            # minimum over repeats: the machine is shared and the computation is deterministic
            ms = {m: 1000 * float(np.min(v)) for m, v in times.items()}
            fused, kv_ms, plain = ms["fused (service default)"], ms["model.score + stored K/V"], ms["model.score, K/V computed"]
            rows_out.append([nq, kc, f"{fused:.1f}", f"{kv_ms:.1f}", f"{plain:.1f}", kv_ms / fused, plain / fused,
                             f"{diff:.1e}"])
            data.append({"queries": nq, "candidates": kc, "fused_ms": fused, "model_kv_ms": kv_ms, "model_ms": plain,
                         "model_kv_over_fused": kv_ms / fused, "model_over_fused": plain / fused, "max_abs_diff": diff})
            print(rows_out[-1], flush=True)
            if diff > 1e-3:
                raise SystemExit(f"the rerank implementations disagree by {diff} (queries {nq}, K {kc})")

    per_video_frames = f * d * 2
    body = (
        f"Gallery: {n:,} videos as float16 memmaps (page cache warm), d = {d}, f = {f}; times are the minimum over "
        f"{args.repeats} reranks through `indexer.search.psi_scores` (gather from the memmaps included), torch "
        f"threads = {torch.get_num_threads()} (one request per thread); the three are run interleaved, side by side.\n\n"
        + table(["queries", "candidates K", "fused, frames only (service default): ms", "model.score + stored K/V: ms",
                 "model.score, K/V computed: ms", "stored K/V / fused", "computed / fused", "max abs score diff"], rows_out)
        + "\nBytes per video on disk (and in the page cache when hot): frames "
        f"{per_video_frames:,} B; with K/V {3 * per_video_frames:,} B (3x). For 1M videos: "
        f"{per_video_frames * 1e6 / 2**30:.1f} GiB vs {3 * per_video_frames * 1e6 / 2**30:.1f} GiB. "
        "A ratio above 1 means the stored K/V path is slower than what the service runs without them.\n"
    )
    write_results("index_kv", "psi K/V precomputation vs the fused rerank: latency vs bytes", body,
                  {"videos": n, "d": d, "f": f, "rows": data, "bytes_per_video_frames": per_video_frames,
                   "bytes_per_video_with_kv": 3 * per_video_frames}, started)


if __name__ == "__main__":
    main()
