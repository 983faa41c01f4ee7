"""Issue 28 (must-have 6): the authors' optimizer (BertAdam with their warmup_cosine) beside AdamW, trained on the
benchmark corpus with the same seed, data and settings.

    gare-train synth runs/bench-corpus --preset bench
    python -m bench.train_optimizer --epochs 10

Both runs use bench/train_synth.yaml (gare-cpu-small from random init, lr 5e-4, coef_lr 1.0, batch 64, no
augmentation, one caption per clip per epoch) and differ only in `optimizer`. `--epochs N` shortens both runs
alike (the cosine spans the N epochs; the benchmark model trains 20). Frames are decoded once (`cache_frames`,
which trains exactly like decoding every epoch). Each run keeps the checkpoint with the best validation R@1 and
is scored on the test split; the validation R@1 after every epoch is recorded (the curve). Writes
bench/results/train_synth/optimizer_compare.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO, RESULTS, add_render_arg, render_requested, start, write_results
from bench.index_common import table
from bench.train_epoch import subset_corpus

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare_train/",
    "training/gare/model.py",
    "training/gare/encoded_set.py",
)


CODE = ("training/gare_train/optim.py", "training/gare_train/fit.py")  # the files whose contents the runs used (hashes recorded)


def main() -> None:
    if render_requested(RESULTS / "train_synth/optimizer_compare.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="runs/bench-corpus")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", default="runs/optimizer-compare")
    ap.add_argument("--optimizers", default="adamw,bertadam")
    ap.add_argument("--train-clips", type=int, default=0, help="use only the first N training clips (0: all)")
    ap.add_argument("--test-videos", type=int, default=0, help="score only the first M test videos (0: all)")
    add_render_arg(ap, RESULTS / "train_synth/optimizer_compare.json")
    args = ap.parse_args()
    corpus = subset_corpus(Path(args.corpus), args.out, args.train_clips, args.test_videos)

    from gare.annotations import load_dataset
    from gare.checkpoint import load_model
    from gare.encoded_set import encode_set
    from gare_train.evaluate import evaluate_encoded
    from gare_train.fit import TrainConfig, Trainer

    run = start(__name__, MEASURES)
    code = {f: hashlib.sha256((REPO / f).read_bytes()).hexdigest()[:12] for f in CODE}
    test = load_dataset({"kind": "synth", "root": str(corpus)}, "test")
    runs: dict[str, dict[str, Any]] = {}
    for opt in [o for o in args.optimizers.split(",") if o]:
        cfg = TrainConfig.from_sources(str(REPO / "bench" / "train_synth.yaml"), {
            "optimizer": opt, "epochs": args.epochs, "out_dir": f"{args.out}/{opt}-{args.epochs}",
            "data": {"kind": "synth", "root": str(corpus)}, "cache_frames": True})
        trainer = Trainer(cfg, progress=True)
        curve: list[dict[str, Any]] = []
        validate = trainer.validate

        def record(trainer: Trainer = trainer, validate: Any = validate, curve: list = curve) -> dict[str, Any]:
            res = validate()
            curve.append({"epoch": trainer.step // trainer.steps_per_epoch, "step": trainer.step,
                          "lr": max(trainer.scheduler.get_last_lr()), "t2v": res["rows"]["+ psi"]["t2v"],
                          "dual_t2v_R1": res["rows"]["dual-tower"]["t2v"]["R1"]})
            return res

        trainer.validate = record  # type: ignore[method-assign]
        t0 = time.time()
        summary = trainer.fit()
        wall = time.time() - t0
        if summary["steps"] != trainer.total_steps:
            raise SystemExit(f"{opt}: the run stopped at step {summary['steps']} of {trainer.total_steps}")
        model, ckpt = load_model(Path(cfg.out_dir) / "best.safetensors", "cpu")
        res = evaluate_encoded(model, encode_set(model, test, batch_size=32, num_workers=cfg.num_workers),
                               ckpt.queues.get("text"), video_queue=ckpt.queues.get("video"))
        info = [h["info"] for h in trainer.history]
        runs[opt] = {
            "optimizer": opt, "epochs": args.epochs, "steps": summary["steps"], "steps_per_epoch": trainer.steps_per_epoch,
            "train_clips": len(trainer.train_set.clips), "val_clips": len(trainer.val_set.clips),
            "test_videos": len(test.clips), "train_wall_s": round(wall, 1),
            "first_info": info[0], "last_info": info[-1], "first_total": summary["first_loss"],
            "last_total": summary["last_loss"], "best_val_r1": summary["best_val_r1"], "best_epoch": ckpt.info.get("epoch"),
            "val_curve": curve, "test": {k: {"t2v": v["t2v"], "v2t": v["v2t"]} for k, v in res["rows"].items()},
        }

    rows = []
    for r in runs.values():
        psi, dual = r["test"]["+ psi"]["t2v"], r["test"]["dual-tower"]["t2v"]
        rows.append([r["optimizer"], r["steps"], r["train_wall_s"], f"{r['first_info']:.2f} -> {r['last_info']:.2f}",
                     round(r["best_val_r1"], 1), r["best_epoch"], round(psi["R1"], 1), round(psi["R5"], 1),
                     round(psi["R10"], 1), round(dual["R1"], 1), round(dual["R5"], 1), round(dual["R10"], 1)])
    epochs = sorted({c["epoch"] for r in runs.values() for c in r["val_curve"]})
    curve_rows = []
    for e in epochs:
        row: list[Any] = [e]
        for r in runs.values():
            c = next((c for c in r["val_curve"] if c["epoch"] == e), None)
            row += [f"{c['lr']:.2e}", round(c["t2v"]["R1"], 1), round(c["t2v"]["R5"], 1)] if c else ["", "", ""]
        curve_rows.append(row)
    one = next(iter(runs.values()))
    size = ((f"the first {args.train_clips} training clips" if args.train_clips else "all training clips")
            + f" ({one['train_clips']} train + {one['val_clips']} validation clips) and "
            + (f"the first {args.test_videos} test videos" if args.test_videos else "all test videos")
            + f" ({one['test_videos']}, one caption each)")
    short = "" if args.epochs == 20 else (f" {args.epochs} epoch{'s' if args.epochs != 1 else ''} instead of the benchmark model's 20 (to fit the "
                                          "compute budget on a shared 2-core machine); the cosine spans those epochs.")
    body = (
        f"The benchmark corpus: {size}. Code: " + ", ".join(f"{f} sha256 {h}" for f, h in code.items()) + ". "
        "gare-cpu-small from random init with bench/train_synth.yaml (scratch-preset values, batch 64, no "
        f"augmentation, one caption per clip per epoch), seed 0 for both runs;{short} The runs differ only in "
        "`optimizer`: adamw is torch AdamW (bias-corrected) with the project's warm-up cosine (lr ramps (k+1)/W, "
        "then cosine of the progress after the warm-up); bertadam is gare_train/optim.py (the authors' BertAdam: no "
        "bias correction, each tensor's gradient clipped to 1.0 besides the global clip, their warmup_cosine: "
        "lr 0 on the first step, then cosine of the whole progress). Both: betas 0.9/0.98, eps 1e-6, decay 0.2 "
        "except 1-D tensors. The machine's cores were shared with other jobs, so wall times are indicative only. "
        "Test: held-out videos, one caption each; checkpoint = best validation R@1 (+ psi row).\n\n"
        "## Test split, t2v\n\n"
        + table(["optimizer", "steps", "train s", "L_info first -> last", "best val R1", "best epoch",
                 "psi R1", "psi R5", "psi R10", "dual R1", "dual R5", "dual R10"], rows)
        + "\n## Validation curve (+ psi t2v after each epoch; lr = the rate the next step would use)\n\n"
        + table(["epoch"] + [f"{o} {m}" for o in runs for m in ("lr", "R1", "R5")], curve_rows)
    )
    write_results("train_synth/optimizer_compare", "Optimizer: the authors' BertAdam vs AdamW (issue 28)", body,
                  {"epochs": args.epochs, "code_sha256": code, "runs": runs}, run)


if __name__ == "__main__":
    main()
