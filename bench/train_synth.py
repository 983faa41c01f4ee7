"""The CPU training benchmark (issue 3): the benchmark model of ``bench/train_synth.yaml``, scored on its test split.

    gare-train synth runs/bench-corpus --preset bench          # the corpus: 1,000 real H.264 mp4s, 3 captions each
    python -m bench.train_synth --train                        # gare-train fit --config bench/train_synth.yaml, then score
    python -m bench.train_synth                                # score the finished run in runs/bench-train

Scoring is the user's command, ``gare-train eval RUN/best.safetensors --synth CORPUS --out bench/results/train_synth``
(t2v / v2t for the dual tower, + psi, + NCL and the psi + NCL rows, the NCL normalisation errors, the deviation and
the stage-1 coverage). This script adds the run's record to its ``result.json`` / ``result.md`` (commit, command,
machine, the sha256 of the checkpoint and the corpus), the training run's own summary under ``"training"``, a copy of
the run's configuration (``train_config.yaml``) and the loss plot (``loss.png``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness import REPO, RESULTS, stamp_product_report, start
from bench.plot_history import plot

# the product code this script's report measures (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare_train/",
    "training/gare/model.py",
    "training/gare/psi.py",
    "training/gare/encoded_set.py",
    "training/gare/retrieval_metrics.py",
    "training/gare/sinkhorn*.py",
    "bench/train_synth.yaml",
)
OUT = RESULTS / "train_synth"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "bench" / "train_synth.yaml")
    ap.add_argument("--run", type=Path, default=REPO / "runs" / "bench-train", help="the training run's folder")
    ap.add_argument("--corpus", type=Path, default=REPO / "runs" / "bench-corpus")
    ap.add_argument("--train", action="store_true", help="train the run first (gare-train fit --config CONFIG)")
    args = ap.parse_args(argv)
    run = start(__name__, MEASURES, argv)
    gare_train = [sys.executable, "-m", "gare_train.cli"]
    if args.train:
        subprocess.run([*gare_train, "fit", "--config", str(args.config), "--out", str(args.run)], check=True)
    ckpt = args.run / "best.safetensors"
    if not ckpt.is_file():
        raise SystemExit(f"{ckpt} does not exist: train it first (--train, or gare-train fit --config {args.config})")
    run.add_inputs(ckpt, args.corpus, args.config)
    subprocess.run([*gare_train, "eval", str(ckpt), "--synth", str(args.corpus), "--out", str(OUT)], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.copyfile(args.run / "config.yaml", OUT / "train_config.yaml")
    plot(args.run, OUT / "loss.png")
    summary = json.loads((args.run / "summary.json").read_text())
    md = stamp_product_report(OUT / "result.json", run, {"training": summary})
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
