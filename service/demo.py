"""The README's demo: a generated video library, a small model trained here, its index, and the server.

    bash run.sh demo          # or: python -m service.demo [--dir demo] [--port 8000]

Every stage keeps its output under --dir and is skipped when it is already there, so the second run starts
the server in seconds. Only 127.0.0.1 is bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _stage(name: str) -> float:
    print(f"\n== {name}", flush=True)
    return time.perf_counter()


def prepare(root: Path, *, n_videos: int, epochs: int) -> tuple[Path, Path, list[str]]:
    """Corpus -> model -> index; returns (index dir, corpus dir, example queries)."""
    corpus, run, index = root / "corpus", root / "model", root / "index"
    if not (corpus / "corpus.json").exists():
        t0 = _stage(f"generating {n_videos} videos in {corpus}")
        from training.synth import SynthConfig, generate_corpus

        # An easier corpus than the benchmark one (no planted hard negatives or near-duplicates), so that a
        # model trained for a few minutes on 2 cores already finds the right video most of the time.
        generate_corpus(corpus, SynthConfig(n_videos=n_videos, seed=0, width=96, height=96, duration=4.0,
                                            hard_negative_rate=0.0, near_duplicate_rate=0.0, two_event_rate=0.3))
        print(f"   done in {time.perf_counter() - t0:.0f} s")
    else:
        print(f"== corpus: reusing {corpus}")

    ckpt = run / "best.safetensors"
    if not ckpt.exists():
        t0 = _stage(f"training the small model for {epochs} epochs (gare-cpu-small, from scratch)")
        from training.fit import TrainConfig, Trainer

        cfg = TrainConfig(model="gare-cpu-small", data={"kind": "synth", "root": str(corpus)}, out_dir=str(run),
                          epochs=epochs, batch_size=32, lr=5e-4, coef_lr=1.0, num_workers=2, seed=0)
        Trainer(cfg).fit()
        print(f"   done in {time.perf_counter() - t0:.0f} s")
    else:
        print(f"== model: reusing {ckpt}")

    if not (index / "CURRENT").exists():
        t0 = _stage(f"indexing {corpus / 'videos'}")
        from indexer.cli import main as index_main

        rc = index_main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus / "videos"), "--out", str(index)])
        if rc not in (0, 3):
            raise SystemExit(f"indexing failed (exit {rc})")
        print(f"   done in {time.perf_counter() - t0:.0f} s")
    else:
        print(f"== index: reusing {index}")

    examples = []
    with open(corpus / "captions_test.jsonl") as fh:
        for line in fh:
            examples.append(json.loads(line)["captions"][0])
            if len(examples) == 4:
                break
    return index, corpus, examples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="demo", help="where the demo keeps its corpus, model and index (default ./demo)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--videos", type=int, default=200, help="size of the generated library")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--prepare-only", action="store_true", help="build everything, do not start the server")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    index, corpus, examples = prepare(Path(args.dir).resolve(), n_videos=args.videos, epochs=args.epochs)
    if args.prepare_only:
        return 0
    url = f"http://127.0.0.1:{args.port}/"
    print(f"\n== serving {index}\n   open {url}\n   try these queries (held-out test captions):")
    for q in examples:
        print(f"     - {q}")
    print(f"   or: curl -s {url}v1/search -H 'content-type: application/json' -d '{json.dumps({'query': examples[0], 'k': 5})}'")
    print("   Ctrl-C stops the server.\n", flush=True)
    from service.cli import main as serve_main

    return serve_main(["--index", str(index), "--host", "127.0.0.1", "--port", str(args.port),
                       "--library-root", str(corpus)])


if __name__ == "__main__":
    sys.exit(main())
