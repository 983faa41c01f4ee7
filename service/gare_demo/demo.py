"""The README's demo: a generated video library, a small model trained here, its index, and the server.

    bash run.sh demo          # or: python -m gare_demo [--dir demo] [--port 8000]

Every stage keeps its output under --dir and is skipped when it is already there, so the second run starts
the server in seconds. Only 127.0.0.1 is bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from gare.checkpoint import load_model
from gare_build.cli import main as index_main
from gare_index.store import open_index
from gare_search.search import SearchOptions, search_batch
from gare_serve.cli import main as serve_main
from gare_train.fit import TrainConfig, Trainer
from gare_train.synth import SynthConfig, generate_corpus

log = logging.getLogger(__name__)


# The demo's model and training recipe, chosen so that the first search comes within 5 minutes of
# `bash run.sh demo` on 2 cores, install included (bench/results/quickstart.json, docs/quickstart-times.md).
# gare-cpu-demo from scratch with the `scratch` preset's choices (whole network at one lr, no augmentation,
# patch embedding trainable); frames decoded once (cache_frames); training stops when the validation R@1 has
# not improved for 6 epochs, before the 30 allowed on that run.
DEMO_MODEL = "gare-cpu-demo"
DEMO_TRAIN = {"batch_size": 32, "lr": 1e-3, "coef_lr": 1.0, "augment": "none", "freeze_patch_embed": False,
              "cache_frames": True, "early_stop_patience": 6, "num_workers": 2, "seed": 0}
RUN_FILE = "demo-run.json"  # what this run did, stage by stage (the quickstart measurement reads it)
QUALITY_FILE = "heldout-quality.json"


class _Run:
    """The stages of one demo run with their wall times, written to <dir>/demo-run.json after each stage."""

    def __init__(self, root: Path) -> None:
        self.path = root / RUN_FILE
        self.data: dict[str, Any] = {"started_unix": time.time(), "stages": [], "heldout": None}

    def stage(self, name: str, seconds: float, reused: bool, **extra: Any) -> None:
        self.data["stages"].append({"name": name, "seconds": round(seconds, 2), "reused": reused, **extra})
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)


def prepare(root: Path, *, n_videos: int, epochs: int, run: _Run | None = None) -> tuple[Path, Path, list[str]]:
    """Corpus -> model -> index -> held-out check; returns (index dir, corpus dir, example queries).

    With one intra-op thread: this model's tensors are tiny (32 clips x 4 frames x 17 tokens x width 64), and on
    a 2-core machine shared with other work two OpenMP threads mostly wait for each other, so one thread trained
    and indexed faster there than two (the run's stage times: bench/results/quickstart.json)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _prepare(root, n_videos=n_videos, epochs=epochs, run=run or _Run(root))
    finally:
        torch.set_num_threads(threads)


def _prepare(root: Path, *, n_videos: int, epochs: int, run: _Run) -> tuple[Path, Path, list[str]]:
    corpus, model_dir, index = root / "corpus", root / "model", root / "index"
    t0 = time.perf_counter()
    if not (corpus / "corpus.json").exists():
        print(f"generating {n_videos} videos in {corpus}", flush=True)
        # An easier corpus than the benchmark one (no planted hard negatives or near-duplicates), so that a
        # model trained for a minute or two on 2 cores already finds the right video most of the time.
        generate_corpus(corpus, SynthConfig(n_videos=n_videos, seed=0, width=96, height=96, duration=4.0,
                                            hard_negative_rate=0.0, near_duplicate_rate=0.0, two_event_rate=0.3))
        run.stage("corpus", time.perf_counter() - t0, False, videos=n_videos)
    else:
        print(f"corpus: reusing {corpus}", flush=True)
        run.stage("corpus", time.perf_counter() - t0, True)

    ckpt = model_dir / "best.safetensors"
    t0 = time.perf_counter()
    if not ckpt.exists():
        print(f"training {DEMO_MODEL} from scratch (up to {epochs} epochs, stops when validation stops improving)",
              flush=True)
        cfg = TrainConfig(model=DEMO_MODEL, data={"kind": "synth", "root": str(corpus)}, out_dir=str(model_dir),
                          epochs=epochs, **DEMO_TRAIN)
        summary = Trainer(cfg).fit()
        run.stage("training", time.perf_counter() - t0, False, model=DEMO_MODEL, epochs_run=summary["epochs_run"],
                  max_epochs=epochs, best_val_r1=summary["best_val_r1"])
    else:
        print(f"model: reusing {ckpt}", flush=True)
        run.stage("training", time.perf_counter() - t0, True)

    t0 = time.perf_counter()
    if not (index / "CURRENT").exists():
        print(f"indexing {corpus / 'videos'}", flush=True)
        rc = index_main(["-q", "build", "--checkpoint", str(ckpt), "--videos", str(corpus / "videos"), "--out", str(index)])
        if rc not in (0, 3):
            raise SystemExit(f"indexing failed (exit {rc})")
        run.stage("index", time.perf_counter() - t0, False)
    else:
        print(f"index: reusing {index}", flush=True)
        run.stage("index", time.perf_counter() - t0, True)

    # The held-out check: once per index (the same search the server runs), then read back.
    t0 = time.perf_counter()
    qfile = root / QUALITY_FILE
    quality = json.loads(qfile.read_text()) if qfile.exists() else None
    reused = quality is not None and quality.get("index") == (index / "CURRENT").read_text().strip()
    if not reused:
        quality = {"index": (index / "CURRENT").read_text().strip(), **heldout_quality(index, corpus, ckpt)}
        qfile.write_text(json.dumps(quality))
    run.data["heldout"] = quality
    run.stage("held-out check", time.perf_counter() - t0, reused)
    print(f"held-out captions: the right video is in the top {quality['k']} for {quality['hits']} of "
          f"{quality['queries']} (chance: {quality['k'] * quality['queries'] / n_videos:.0f})", flush=True)

    examples = [c for c, _ in heldout_captions(corpus)[:4]]
    return index, corpus, examples


def heldout_captions(corpus: Path) -> list[tuple[str, str]]:
    """(caption, video file name) for each held-out test video: its first caption, never trained on."""
    out = []
    with open(corpus / "captions_test.jsonl") as fh:
        for line in fh:
            rec = json.loads(line)
            out.append((rec["captions"][0], Path(rec["video"]).name))
    return out


def heldout_quality(index: Path, corpus: Path, checkpoint: Path, *, k: int = 10) -> dict[str, int]:
    """How often the served search (the index's default options) puts the right video in its top k for the
    held-out captions: {"hits": x, "queries": n, "k": k}. The same search the server runs (gare_search.search)."""
    pairs = heldout_captions(corpus)
    model, _ = load_model(checkpoint, "cpu")
    with open_index(index) as version:
        results = search_batch(model, version, [c for c, _ in pairs], SearchOptions(k=k))
        hits = 0
        for (_, name), res in zip(pairs, results, strict=True):
            paths = [version.path_of(h.id) for h in res.hits]
            hits += any(p is not None and p.name == name for p in paths)
    return {"hits": hits, "queries": len(pairs), "k": k}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gare_demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="demo", help="where the demo keeps its corpus, model and index (default ./demo)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--videos", type=int, default=200, help="size of the generated library")
    p.add_argument("--epochs", type=int, default=30, help="at most this many (training stops earlier when validation stops improving)")
    p.add_argument("--prepare-only", action="store_true", help="build everything, do not start the server")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    root = Path(args.dir).resolve()
    run = _Run(root)
    index, corpus, examples = prepare(root, n_videos=args.videos, epochs=args.epochs, run=run)
    if args.prepare_only:
        return 0
    run.data["serving"] = {"url": f"http://127.0.0.1:{args.port}/", "after_s": round(time.time() - run.data["started_unix"], 2)}
    run.save()
    url = f"http://127.0.0.1:{args.port}/"
    print(f"\nserving {index}\n   open {url}\n   try these queries (held-out test captions):")
    for q in examples:
        print(f"     - {q}")
    print(f"   or: curl -s {url}v1/search -H 'content-type: application/json' -d '{json.dumps({'query': examples[0], 'k': 5})}'")
    print("   Ctrl-C stops the server.\n", flush=True)
    # one worker, in this process (the model is loaded already once torch is imported): the page is up in seconds
    return serve_main(["--index", str(index), "--host", "127.0.0.1", "--port", str(args.port), "--workers", "1",
                       "--library-root", str(corpus)])


if __name__ == "__main__":
    sys.exit(main())
