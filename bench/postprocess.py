"""Post-processing side by side (``gare-index compare``) on the benchmark corpus: every option of
docs/postprocessing.md through the real two-stage search, on two galleries.

    python -m bench.postprocess          # runs/bench-train/best.safetensors on runs/bench-corpus (~10 min on 2 cores)

What runs, as a user would run it:
1. a query bank standing in for served traffic: the training split's captions encoded by the checkpoint's text
   tower (``gare_search.search.encode_queries``), unit rows, saved to ``runs/bench-bank.npy``;
2. ``gare-index compare --checkpoint CKPT --synth CORPUS --gallery G --bank BANK --index-dir runs/postprocess-index
   --latency-threads 1 --out bench/results/postprocess/G`` for G = ``all`` (the test captions against every video of
   the corpus: the main result) and ``test`` (the test videos only).

Each ``result.json`` / ``result.md`` then gains this run's record (commit, command, machine, the sha256 of the
checkpoint, the corpus and the bank). The reading is bench/results/postprocess/README.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.harness import REPO, RESULTS, stamp_product_report, start

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/compare.py",
    "indexer/gare_build/pipeline/",
    "indexer/gare_search/",
    "indexer/gare_index/",
    "training/gare/sinkhorn*.py",
    "training/gare/invgc.py",
    "training/gare/psi_fold*.py",
)
GALLERIES = ("all", "test")


def write_bank(ckpt: Path, corpus: Path, out: Path, batch: int = 256) -> Path:
    """The training split's captions, encoded by the checkpoint and made unit rows: (n_captions, d) float32."""
    from gare.annotations import load_dataset
    from gare.checkpoint import load_model
    from gare_search.search import encode_queries

    model, _ = load_model(str(ckpt))
    rs = load_dataset({"kind": "synth", "root": str(corpus)}, "train")
    t = np.concatenate([encode_queries(model, rs.captions[i:i + batch]).float().numpy()
                        for i in range(0, len(rs.captions), batch)])
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, (t / np.linalg.norm(t, axis=1, keepdims=True)).astype(np.float32))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=REPO / "runs" / "bench-train" / "best.safetensors")
    ap.add_argument("--corpus", type=Path, default=REPO / "runs" / "bench-corpus")
    ap.add_argument("--work", type=Path, default=REPO / "runs", help="where the bank and the kept indexes go")
    args = ap.parse_args(argv)
    for g in GALLERIES:
        run = start(__name__, MEASURES, argv)
        bank = args.work / "bench-bank.npy"
        if g == GALLERIES[0]:
            write_bank(args.checkpoint, args.corpus, bank)
        run.add_inputs(args.checkpoint, args.corpus, bank)
        out = RESULTS / "postprocess" / g
        subprocess.run([sys.executable, "-m", "gare_build.cli", "compare", "--checkpoint", str(args.checkpoint),
                        "--synth", str(args.corpus), "--gallery", g, "--bank", str(bank),
                        "--index-dir", str(args.work / "postprocess-index"), "--latency-threads", "1",
                        "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        print(stamp_product_report(out / "result.json", run).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
