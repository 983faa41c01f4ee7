"""The build's decode pipeline on this machine: videos/s through `iter_decoded`'s worker processes when the workers
send float32 frames (normalised in the worker, as before) against uint8 frames (normalised by the encoder's side,
`gare.video.normalize_frames`, what `gare-index build` does now).

    python -m bench.decode_pipeline [--videos 128] [--size 224] [--workers 2] [--rounds 3]

Synthetic H.264 mp4s (gare_train.synth.write_video: SIZE x SIZE, 12 s at 8 fps, moving blocks), the model's
sampling (12 frames at 1 fps, CLIP transform at 224). The two modes alternate within each round so drift and
other load hit both; a round's figure is one full pass over the library. The normalising is timed separately on
this CPU (on a GPU it is a few element-wise kernels). Results: bench/results/decode_pipeline.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import RESULTS, add_render_arg, render_requested, start, write_results  # noqa: E402
from bench.index_common import table  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/video.py",
    "training/gare/video_loader.py",
)


def write_library(dest: Path, n: int, size: int, seconds: float = 12.0, fps: float = 8.0, opencv: bool = False) -> None:
    if opencv:  # a machine with OpenCV but no PyAV (the lent GPU machine): gpu_stage1's MPEG-4 Part 2 writer
        from bench import gpu_stage1

        gpu_stage1.write_videos(dest, n, size=size, seconds=seconds, fps=fps)
        return
    from gare_train.synth import write_video

    t = int(seconds * fps)
    for i in range(n):
        rng = np.random.default_rng(i)
        frames = np.empty((t, size, size, 3), np.uint8)
        bg = rng.integers(0, 255, 3)
        for k in range(t):
            frames[k] = (bg + 2 * k) % 255
            y, x = (rng.integers(0, size - 40, 2) + 3 * k) % (size - 40)
            frames[k, y:y + 40, x:x + 40] = rng.integers(0, 255, 3)
        write_video(dest / f"v{i:04d}.mp4", frames, fps)


def one_pass(items: list, *, workers: int, batch: int, as_uint8: bool) -> dict[str, float]:
    from gare.video_loader import iter_decoded

    t0 = time.perf_counter()
    n = frames = 0
    nbytes = 0
    for b in iter_decoded(items, max_frames=12, framerate=1.0, image_size=224, batch_size=batch,
                          num_workers=workers, as_uint8=as_uint8):
        n += len(b["keys"])
        frames += int(b["mask"].sum())
        nbytes += b["frames"].nbytes
    dt = time.perf_counter() - t0
    return {"videos_per_s": n / dt, "frames_per_s": frames / dt, "bytes_per_frame_slot": nbytes / max(n * 12, 1)}


def main() -> None:
    if render_requested(RESULTS / "decode_pipeline.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--videos", type=int, default=128)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--opencv", action="store_true", help="write the library with OpenCV (MPEG-4 Part 2), not PyAV")
    add_render_arg(ap, RESULTS / "decode_pipeline.json")
    args = ap.parse_args()
    run = start(__name__, MEASURES)
    import open_clip  # noqa: F401 - imported before the workers fork, as in a build (the model is loaded first)
    import torch

    from gare.video import clip_geometry, clip_transform, normalize_frames
    from gare.video_loader import decode_batch_size

    clip_transform(224), clip_geometry(224)
    with tempfile.TemporaryDirectory(prefix="gare-decode-") as tmp:
        lib = Path(tmp)
        t0 = time.perf_counter()
        write_library(lib, args.videos, args.size, opencv=args.opencv)
        print(f"wrote {args.videos} videos in {time.perf_counter() - t0:.1f}s", flush=True)
        items = [(p.name, str(p)) for p in sorted(lib.glob("*.mp4"))]
        batch = decode_batch_size(len(items), args.batch, args.workers)  # as the build splits a small library
        one_pass(items[:args.workers * 2], workers=args.workers, batch=2, as_uint8=True)  # warm the page cache path
        runs: dict[str, list[dict[str, float]]] = {"float32": [], "uint8": []}
        for r in range(args.rounds):
            for mode in (("float32", "uint8") if r % 2 == 0 else ("uint8", "float32")):
                runs[mode].append(one_pass(items, workers=args.workers, batch=batch, as_uint8=mode == "uint8"))
                print(f"round {r} {mode}: {runs[mode][-1]['videos_per_s']:.1f} videos/s", flush=True)
    u8 = torch.randint(0, 256, (args.batch, 12, 3, 224, 224), dtype=torch.uint8)
    mask = torch.ones(args.batch, 12, dtype=torch.int64)
    normalize_frames(u8, mask)
    t0 = time.perf_counter()
    for _ in range(5):
        normalize_frames(u8, mask)
    norm_ms_per_frame = (time.perf_counter() - t0) / 5 / (args.batch * 12) * 1e3
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
    ratio = med["uint8"]["videos_per_s"] / med["float32"]["videos_per_s"]
    rows = [[m, f"{med[m]['videos_per_s']:.1f}", f"{med[m]['frames_per_s']:.0f}",
             " / ".join(f"{x['videos_per_s']:.1f}" for x in runs[m]), f"{med[m]['bytes_per_frame_slot']:,.0f}"]
            for m in ("float32", "uint8")]
    codec = "MPEG-4 Part 2 (OpenCV)" if args.opencv else "H.264"
    body = (f"{args.videos} {codec} mp4s ({args.size}x{args.size}, 12 s at 8 fps), 12 frames each at 1 fps through the CLIP "
            f"transform at 224; `iter_decoded` with {args.workers} worker processes, batches of {batch} videos (decode_batch_size); "
            f"{args.rounds} rounds, the two modes alternating. Median of the rounds.\n\n"
            + table(["frames sent", "videos/s", "frames/s", "per round (videos/s)", "bytes per frame"], rows)
            + f"\nuint8 / float32 videos/s: **x{ratio:.2f}**. The consumer's normalising of the uint8 frames "
            f"(`normalize_frames`, on this CPU, torch threads {torch.get_num_threads()}): {norm_ms_per_frame:.3f} ms per "
            "frame, not in the figures above (the build runs it on the encoder's device).\n")
    write_results("decode_pipeline", "Decode pipeline: float32 vs uint8 frames from the decode workers", body,
                  {"args": vars(args), "decode_batch": batch, "runs": runs, "median": med, "ratio_uint8_over_float32": ratio,
                   "normalize_ms_per_frame_cpu": norm_ms_per_frame}, run)


if __name__ == "__main__":
    main()
