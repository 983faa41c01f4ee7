"""Indexing throughput on this machine, bytes on disk and RAM per indexed video.

1. `gare_build.build.build` (the code behind `gare-index build`) on synthetic mp4 libraries (96x96, 12 s at
   8 fps, so 12 frames at 1 fps): the tiny test model (`gare-test-tiny`) and the ViT-B/32 vision tower
   with random weights (`get_model_config("gare-vit-b-32", pretrained="none")`, few videos), fp32 and
   bf16 autocast. Reported: encoder videos/s and frames/s (decode in worker processes overlapped with
   encoding), and the whole run's wall time (scan + encode + biases + ANN + version write).
2. Bytes on disk per video, by file, for the ViT-B/32 index (d = 512, f = 12).
3. RAM per indexed video: a 50k-video index with ViT-B/32 shapes (random arrays through write_version)
   opened by `open_index` in a fresh process; resident memory after opening, and after 100 searches that
   each gather 256 candidates' frames from the memmap (the page cache the rerank touches is counted in
   RSS only for the pages read).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS, add_render_arg, render_requested, start, write_results
from bench.index_common import rss_bytes, table

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/",
    "indexer/gare_index/store/",
    "training/gare/video_loader.py",
)


def ram_probe(path: str) -> None:
    import numpy as np

    from gare_index.store import open_index

    before = rss_bytes()
    t0 = time.time()
    v = open_index(path, use_gpu=False)
    open_s = time.time() - t0
    after_open = rss_bytes()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((100, v.dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    for i in range(100):
        _, ids = v.search(q[i : i + 1], 256)
        rows = np.sort(v.rows(ids[0][ids[0] >= 0]))
        np.asarray(v.frames[rows], dtype=np.float32).sum()
        v.metadata(ids[0][:10].tolist())
    after_search = rss_bytes()
    print(json.dumps({"before": before, "after_open": after_open, "after_search": after_search, "open_s": open_s,
                      "n": v.n}))


def make_synthetic_index(path: Path, n: int, d: int, f: int, index_type: str) -> None:
    import numpy as np

    from gare_index.ann_params import AnnParams
    from gare_index.store import ExistingFile, write_version

    rng = np.random.default_rng(0)
    path.mkdir(parents=True, exist_ok=True)
    stage = path / "stage-frames.npy"
    frames = np.lib.format.open_memmap(stage, mode="w+", dtype=np.float16, shape=(n, f, d))
    for s in range(0, n, 4096):
        frames[s : s + 4096] = rng.standard_normal((min(4096, n - s), f, d)).astype(np.float16)
    frames.flush()
    del frames
    units = rng.standard_normal((n, d)).astype(np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    ids = np.arange(n, dtype=np.int64)
    arrays = {"ids": ids, "norms": np.ones(n, np.float32), "units": units, "frames": ExistingFile(stage),
              "masks": np.ones((n, f), np.uint8), "biases": np.zeros(n, np.float32)}
    meta = [{"id": int(i), "path": f"/library/videos/clip_{i:07d}.mp4", "size": 1_234_567, "mtime": 1.7e9,
             "checksum": f"{i:064x}", "duration": 12.0, "fps": 30.0, "frames_used": f, "start": None, "end": None}
            for i in range(n)]
    params = AnnParams(index_type, nlist=256 if index_type == "ivf" else None)
    write_version(path, arrays, meta, {"ann_params": params.to_dict(), "checkpoint": {"sha256": "0" * 64}})
    stage.unlink()


def run_build(name: str, ckpt: Path, videos: Path, work: Path, precision: str, batch_size: int, workers: int):
    from gare_build.build import BuildOptions, build

    out = work / f"index-{name}-{precision}"
    t0 = time.time()
    r = build(ckpt, videos, out, BuildOptions(batch_size=batch_size, workers=workers, precision=precision, progress=False))
    wall = time.time() - t0
    return r, wall, out


def main() -> None:
    if render_requested(RESULTS / "index_throughput.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny-videos", type=int, default=64)
    ap.add_argument("--vit-videos", type=int, default=12)
    ap.add_argument("--ram-videos", type=int, default=50_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ram-probe", help=argparse.SUPPRESS)
    add_render_arg(ap, RESULTS / "index_throughput.json")
    args = ap.parse_args()
    if args.ram_probe:
        ram_probe(args.ram_probe)
        return
    run = start(__name__, MEASURES)

    import torch

    from gare.checkpoint import save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE
    from gare_train.synth import SynthConfig, generate_corpus

    work = Path(tempfile.mkdtemp(prefix="gare-index-bench-"))
    n_lib = max(args.tiny_videos, args.vit_videos)
    t0 = time.time()
    generate_corpus(work / "corpus", SynthConfig(n_videos=n_lib, seed=0, width=96, height=96, fps=8.0, duration=12.0,
                                                 captions_per_video=1), progress=False)
    lib_all = work / "corpus" / "videos"
    print(f"corpus of {n_lib} videos in {time.time() - t0:.1f}s", flush=True)

    def subset(k: int) -> Path:
        d = work / f"lib{k}"
        d.mkdir()
        for p in sorted(lib_all.glob("*.mp4"))[:k]:
            (d / p.name).symlink_to(p)
        return d

    rows, data = [], []
    bytes_rows: list[list] = []
    for name, cfg_name, k, batch in (("gare-test-tiny", "gare-test-tiny", args.tiny_videos, 16),
                                     ("ViT-B/32 (random weights)", "gare-vit-b-32", args.vit_videos, 4)):
        torch.manual_seed(0)
        cfg = get_model_config(cfg_name, pretrained="none")
        model = GARE.build(cfg)
        ckpt = work / f"{cfg_name}.safetensors"
        save_checkpoint(ckpt, model, queues={"text": torch.randn(16384 if cfg.embed_dim == 512 else 1024, cfg.embed_dim)})
        del model
        lib = subset(k)
        for precision in ("fp32", "bf16"):
            r, wall, out = run_build(cfg_name, ckpt, lib, work, precision, batch, args.workers)
            rows.append([name, precision, r.encoded, f"{r.videos_per_s:.2f}", f"{r.frames_per_s:.1f}",
                         f"{r.encode_s:.1f}", f"{wall:.1f}"])
            data.append({"model": name, "precision": precision, "videos": r.encoded, "frames": r.frames_encoded,
                         "videos_per_s": r.videos_per_s, "frames_per_s": r.frames_per_s, "encode_s": r.encode_s,
                         "wall_s": wall, "batch_size": batch, "decode_workers": args.workers})
            print(rows[-1], flush=True)
            if cfg_name == "gare-vit-b-32" and precision == "fp32":
                man = json.loads((out / "versions" / (out / "CURRENT").read_text().strip() / "manifest.json").read_text())
                n = man["n"]
                for fname, info in sorted(man["files"].items(), key=lambda kv: -kv[1]["bytes"]):
                    bytes_rows.append([fname, info["bytes"], f"{info['bytes'] / n:,.0f}"])
                total = sum(i["bytes"] for i in man["files"].values())
                bytes_rows.append(["**total**", total, f"{total / n:,.0f}"])
            shutil.rmtree(out, ignore_errors=True)

    # RAM per indexed video, in fresh processes
    ram_rows, ram_data = [], []
    for index_type in ("flat", "ivf"):
        path = work / f"ram-{index_type}"
        t0 = time.time()
        make_synthetic_index(path, args.ram_videos, 512, 12, index_type)
        wrote = time.time() - t0
        disk = sum(p.stat().st_size for p in (path / "versions").rglob("*") if p.is_file())
        # a fresh process (its RSS is the probe), run as the package's module like every benchmark
        res = json.loads(subprocess.run([sys.executable, "-m", "bench.index_throughput", "--ram-probe", str(path)],
                                        check=True, capture_output=True, text=True,
                                        cwd=Path(__file__).resolve().parents[1]).stdout.strip().splitlines()[-1])
        n = res["n"]
        per_open = (res["after_open"] - res["before"]) / n
        per_search = (res["after_search"] - res["before"]) / n
        ram_rows.append([index_type, f"{n:,}", f"{disk / n:,.0f}", f"{per_open:,.0f}", f"{per_search:,.0f}",
                         f"{res['open_s']:.2f}", f"{wrote:.0f}"])
        ram_data.append({"index_type": index_type, "n": n, "disk_bytes_per_video": disk / n,
                         "rss_bytes_per_video_open": per_open, "rss_bytes_per_video_after_100_searches": per_search,
                         "open_s": res["open_s"], "write_s": wrote})
        print(ram_rows[-1], flush=True)
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)

    body = (
        "## Indexing throughput\n\n"
        f"Synthetic mp4 library: 96x96, 12 s at 8 fps (12 frames sampled at 1 fps; the tiny model keeps 6). "
        f"Decode in {args.workers} worker processes, encoder in the main process, CPU only. *encode* = the encoder "
        "loop (decode overlapped); *wall* = the whole `build` (scan + sha256 + probe, encode, NCL biases against the "
        "queue (16,384 x 512 for ViT-B/32, 1,024 x 64 for tiny), ANN, version write).\n\n"
        + table(["model", "precision", "videos", "videos/s", "frames/s", "encode s", "wall s"], rows)
        + "\n## Bytes on disk per video (ViT-B/32 index: d = 512, f = 12, float16 frames)\n\n"
        f"From the {args.vit_videos}-video index; sqlite and faiss headers make small indexes look heavier. "
        "Asymptotically: frames f*d*2 = 12,288 B, units d*4 = 2,048 B, flat FAISS d*4 = 2,048 B (+8 B id), "
        "masks f, ids/norms/biases 16 B, SQLite ~150-250 B (path-length dependent). `--store-kv` adds 24,576 B.\n\n"
        + table(["file", "bytes", "bytes per video"], bytes_rows)
        + f"\n## RAM per indexed video ({args.ram_videos:,} videos, d = 512, f = 12)\n\n"
        "Resident memory of a fresh process after `open_index` (ids, norms, biases, masks and the FAISS index in RAM; "
        "frames and units memory-mapped), and after 100 searches that each read 256 candidates' frames "
        "(only the touched pages count). The frames (12 KiB per video) live in the OS page cache when hot, shared "
        "by all service processes.\n\n"
        + table(["index", "videos", "disk B/video", "RSS B/video after open", "RSS B/video after 100 searches",
                 "open s", "write s"], ram_rows)
    )
    write_results("index_throughput", "Indexing throughput, bytes and RAM per video", body,
                  {"throughput": data, "bytes": bytes_rows, "ram": ram_data}, run)


if __name__ == "__main__":
    main()
