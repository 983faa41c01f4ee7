"""Issue 15: the corrected epoch (every caption once, as the authors' loaders) against the legacy one
(one caption per clip), trained for the same number of epochs on the benchmark corpus.

    gare-train synth runs/bench-corpus --preset bench
    python -m bench.train_epoch --epochs 3

Both runs use bench/train_synth.yaml (the `scratch` preset values: gare-cpu-small from random init,
lr 5e-4, coef_lr 1.0, batch 64, no augmentation) and differ only in `epoch`. Each keeps the checkpoint with
the best validation R@1 and is scored on the 200-video test split. Writes
bench/results/train_synth/epoch_compare.{md,json}.

Budgets: `--epochs N` gives both runs N epochs; `--runs captions:7,clips:7,clips:20` lists the runs (unit and
epochs; a unit may appear more than once), e.g. the same number of epochs (captions:7 vs clips:7) and about
the same number of optimizer steps (captions:7 vs clips:20: the same training compute, both use the same
batch). The report names each pair of runs that share a budget. `--reuse clips:20=DIR` scores a finished run of
this same configuration instead of training it again (the benchmark model of bench/train_synth.yaml is the
`clips` run at 20 epochs); its config.yaml must equal the one this script would train (out_dir aside), or the
script refuses it. Its training time is read from the run's own files (config.yaml written at the start,
summary.json at the end).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO, RESULTS, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import table

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare_train/",
    "training/gare/model.py",
    "training/gare/encoded_set.py",
)


def subset_corpus(root: Path, out: str, train_clips: int, test_videos: int) -> Path:
    """A corpus folder holding the first N train / M test rows of `root` (videos and captions linked)."""
    if not train_clips and not test_videos:
        return root
    sub = Path(out) / f"corpus-{train_clips}-{test_videos}"
    sub.mkdir(parents=True, exist_ok=True)
    for name in ("videos", "MSRVTT_data.json"):
        if not (sub / name).exists():
            (sub / name).symlink_to((root / name).resolve())
    for name, n in (("train.csv", train_clips), ("test.csv", test_videos)):
        lines = (root / name).read_text().splitlines()
        (sub / name).write_text("\n".join(lines[: 1 + n] if n else lines) + "\n")
    return sub


def reused_run(out: Path, cfg: Any) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """(summary, history, training seconds) of a finished run in `out`, refused unless its config.yaml is the
    configuration `cfg` (out_dir aside)."""
    import yaml

    from gare_train.fit import TrainConfig

    theirs = TrainConfig.from_sources(str(out / "config.yaml"), {}).fingerprint()
    mine = cfg.fingerprint()
    diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    if diff or yaml.safe_load((out / "config.yaml").read_text()).get("epochs") != cfg.epochs:
        raise SystemExit(f"{out} was trained with a different configuration: {diff or ['epochs']}")
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    wall = (out / "summary.json").stat().st_mtime - (out / "config.yaml").stat().st_mtime
    return summary, history, wall


def main() -> None:
    if render_requested(RESULTS / "train_synth/epoch_compare.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="runs/bench-corpus")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default="runs/epoch-compare")
    ap.add_argument("--runs", default="", help="UNIT:EPOCHS list, e.g. captions:7,clips:7,clips:20 (default: "
                    "captions and clips at --epochs)")
    ap.add_argument("--reuse", default="", help="UNIT:EPOCHS=DIR,...: score that finished run instead of training it")
    ap.add_argument("--train-clips", type=int, default=0, help="use only the first N training clips (0: all)")
    ap.add_argument("--test-videos", type=int, default=0, help="score only the first M test videos (0: all)")
    ap.add_argument("--batch-size", type=int, default=0, help="override the YAML's batch size (0: keep)")
    add_render_arg(ap, RESULTS / "train_synth/epoch_compare.json")
    args = ap.parse_args()
    corpus = subset_corpus(Path(args.corpus), args.out, args.train_clips, args.test_videos)

    from gare.annotations import load_dataset
    from gare.checkpoint import load_model
    from gare.encoded_set import encode_set
    from gare_train.evaluate import evaluate_encoded
    from gare_train.fit import TrainConfig, Trainer

    run = start(__name__, MEASURES)
    commit = git_commit()
    test = load_dataset({"kind": "synth", "root": str(corpus)}, "test")
    specs = [(u, int(e)) for u, e in (kv.split(":") for kv in args.runs.split(",") if kv)] or \
        [("captions", args.epochs), ("clips", args.epochs)]
    if len(set(specs)) != len(specs) or any(u not in ("captions", "clips") for u, _ in specs):
        raise SystemExit(f"--runs: each run is captions:N or clips:N, once: {args.runs!r}")
    reuse = dict(kv.split("=", 1) for kv in args.reuse.split(",") if kv)
    runs: dict[str, dict[str, Any]] = {}
    for unit, epochs in specs:
        key = f"{unit}:{epochs}"
        cfg = TrainConfig.from_sources(str(REPO / "bench" / "train_synth.yaml"), {
            "epoch": unit, "epochs": epochs, "out_dir": reuse.get(key, f"{args.out}/{unit}-{epochs}"),
            "data": {"kind": "synth", "root": str(corpus)}, "batch_size": args.batch_size or None})
        trainer = Trainer(cfg, progress=True)
        if key in reuse:
            summary, history, wall = reused_run(Path(reuse[key]), cfg)
        else:
            t0 = time.time()
            summary = trainer.fit()
            wall = time.time() - t0
            history = trainer.history
        if summary["steps"] != trainer.total_steps:
            raise SystemExit(f"{key}: the run stopped at step {summary['steps']} of {trainer.total_steps}")
        model, ckpt = load_model(Path(cfg.out_dir) / "best.safetensors", "cpu")
        res = evaluate_encoded(model, encode_set(model, test, batch_size=32, num_workers=cfg.num_workers),
                               ckpt.queues.get("text"), video_queue=ckpt.queues.get("video"))
        info = [h["info"] for h in history]
        runs[key] = {
            "unit": unit, "epochs": epochs, "reused_run": reuse.get(key),
            "examples_per_epoch": len(trainer.pairs), "train_clips": len(trainer.train_set.clips),
            "steps_per_epoch": trainer.steps_per_epoch, "steps": summary["steps"],
            "warmup_steps": max(1, int(trainer.total_steps * cfg.warmup_proportion)),
            "train_wall_s": round(wall, 1), "first_info": info[0], "last_info": info[-1],
            "best_val_r1": summary["best_val_r1"], "best_epoch": ckpt.info.get("epoch"),
            "test": {k: v["t2v"] for k, v in res["rows"].items()},
        }
    rows = []
    for r in runs.values():
        name = "corrected: every caption" if r["unit"] == "captions" else "current: one caption per clip"
        rows.append([name, r["epochs"], r["examples_per_epoch"], r["steps"], r["warmup_steps"], r["train_wall_s"],
                     f"{r['first_info']:.2f} -> {r['last_info']:.2f}", round(r["best_val_r1"], 1),
                     round(r["test"]["dual-tower"]["R1"], 1), round(r["test"]["+ psi"]["R1"], 1),
                     round(r["test"]["+ psi"]["R5"], 1), round(r["test"]["+ psi"]["R10"], 1)])
    size = ("The benchmark corpus: " + (f"the first {args.train_clips} training clips" if args.train_clips else "all training clips")
            + " (10% carved for validation) and " + (f"the first {args.test_videos} test videos" if args.test_videos else
                                                     "all test videos") + f"; batch {args.batch_size or 'as the YAML'}. ")
    # which pairs of (corrected, current) runs share a budget: the same epochs, or optimizer steps within 10%
    pairs = []
    for a, ra in runs.items():
        for b, rb in runs.items():
            if ra["unit"] != "captions" or rb["unit"] != "clips":
                continue
            if ra["epochs"] == rb["epochs"]:
                pairs.append(f"{a} vs {b}: the same number of epochs ({ra['epochs']}), not the same compute (the "
                             f"corrected epoch has one example per caption: {ra['steps']} vs {rb['steps']} steps)")
            elif abs(ra["steps"] - rb["steps"]) <= 0.1 * max(ra["steps"], rb["steps"]):
                pairs.append(f"{a} vs {b}: about the same training budget ({ra['steps']} vs {rb['steps']} optimizer "
                             f"steps of the same batch, {100 * abs(ra['steps'] - rb['steps']) / rb['steps']:.0f}% apart), "
                             "hence a different number of epochs")
    budget = ("Budgets compared: " + "; ".join(pairs) + ". ") if pairs else "Different budgets per run (see the steps column). "
    reused = [f"{k} = finished run {r['reused_run']}" for k, r in runs.items() if r["reused_run"]]
    body = (
        size + f"Commit {commit}. " + budget + (f"Reused: {'; '.join(reused)}. " if reused else "") +
        "gare-cpu-small from random init with bench/train_synth.yaml (scratch-preset values, no augmentation); "
        "the machine's 2 cores were shared with other jobs, so wall times are indicative only. Test: held-out "
        "videos, one caption each; checkpoint = best validation R@1.\n\n"
        + table(["epoch", "epochs", "examples/epoch", "steps", "warm-up steps", "train s", "L_info first -> last",
                 "val R1", "test dual R1", "test psi R1", "test psi R5", "test psi R10"], rows)
    )
    write_results("train_synth/epoch_compare", "Training epoch: every caption vs one caption per clip (issue 15)",
                  body, {"commit": commit, "epochs": args.epochs, "runs": runs}, run)


if __name__ == "__main__":
    main()
