"""The per-index NCL decision on real corpora (issue 28, must-have 4): `gare-index build --ncl-val` on each corpus's
test videos, and what the manifest records (biases.default: on/off, why, R@1/R@5/R@10 of psi vs psi + biases on the
validation captions through the served search) and the K stage 1 chose for the score served by default.

Validation captions: the synth folder's test split (its videos are the gallery; the synth corpora hold no other
videos with captions in a gallery), one caption per video. The queue is the fresh one (the checkpoint's training
captions re-encoded) unless ``--bias-queue stale``.

  python -m bench.ncl_decision --checkpoint CKPT --synth CORPUS [--synth CORPUS2 ...] --name NAME [--bias-queue stale]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, add_render_arg, git_commit, render_requested, start, write_results
from bench.index_common import table

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/",
    "indexer/gare_index/store/",
    "training/gare/sinkhorn*.py",
    "training/gare/retrieval_metrics.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


def main() -> None:
    if render_requested(RESULTS / "ncl_served/decision_bench_ncl_model.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--synth", required=True, nargs="+")
    ap.add_argument("--name", required=True)
    ap.add_argument("--bias-queue", choices=("fresh", "stale"), default="fresh")
    add_render_arg(ap, RESULTS / "ncl_served/decision_bench_ncl_model.json")
    args = ap.parse_args()

    import csv

    from gare_build.cli import main as gare_index
    from gare_index.store import open_index

    run = start(__name__, MEASURES)
    run.add_inputs(args.checkpoint, *args.synth)
    rows: list[list[Any]] = []
    data: dict[str, Any] = {}
    for corpus in args.synth:
        root = Path(corpus)
        with tempfile.TemporaryDirectory() as tmp:
            videos = Path(tmp) / "videos.csv"  # the test split's videos: the gallery
            with open(root / "test.csv", newline="") as fh, open(videos, "w", newline="") as out:
                w = csv.writer(out)
                w.writerow(["video"])
                for r in csv.DictReader(fh):
                    w.writerow([str((root / "videos" / f"{r['video_id']}.mp4").absolute())])
            idx = Path(tmp) / "INDEX"
            t0 = time.time()
            rc = gare_index(["build", "--checkpoint", args.checkpoint, "--videos", str(videos), "--out", str(idx),
                             "--workers", "1", "--no-progress", "--bias-queue", args.bias_queue, "--ncl-val", str(root)])
            secs = time.time() - t0
            if rc != 0:
                raise SystemExit(f"gare-index build failed on {corpus} (exit {rc})")
            m = open_index(idx).manifest
            d, st, q = m["biases"]["default"], m["stage1"] or {}, m["biases"]["queue"]
        g = d.get("gamma") or {}
        ci = d.get("intervals") or {}
        rows.append([corpus, f"{q['kind']} ({q['n']})", d["n_captions"],
                     f"{g['chosen']:.4g} ({g['chosen'] / g['checkpoint_gamma']:g} x)" if g else "-",
                     f"{d['psi']['R1']:.1f} / {d['psi_biases']['R1']:.1f}",
                     "[{:+.1f}, {:+.1f}]".format(*ci["dR1"]) if "dR1" in ci else "-",
                     f"{d['psi']['R5']:.1f} / {d['psi_biases']['R5']:.1f}",
                     "[{:+.1f}, {:+.1f}]".format(*ci["dR5"]) if "dR5" in ci else "-",
                     f"{d['psi']['R10']:.1f} / {d['psi_biases']['R10']:.1f}",
                     "**on**" if d["on"] else "**off**", st.get("default_candidates"), st.get("ncl_default"), round(secs)])
        data[corpus] = {"default": d, "stage1_default_candidates": st.get("default_candidates"),
                        "stage1_ncl_default": st.get("ncl_default"), "queue": q, "build_s": secs}
        print(corpus, d["reason"], flush=True)
    body = (
        f"Checkpoint `{args.checkpoint}`; for each corpus: `gare-index build` over its test videos with `--bias-queue "
        f"{args.bias_queue} --ncl-val CORPUS` (the test split's captions, one per video, through the served search: "
        "stage-1 top 256, psi, + b). gamma is chosen among multiples of the checkpoint's on the even validation "
        "captions and the default decided on the odd ones (the decision never sees the captions that chose gamma; "
        "with too few captions gamma is not chosen). Rule, as each manifest records it: "
        + "; ".join(sorted({v["default"].get("rule", "?") for v in data.values()})) + ".\n\n"
        + table(["corpus", "queue", "captions decided on", "gamma chosen", "R@1 psi / + b", "R@1 Δ 95%",
                 "R@5 psi / + b", "R@5 Δ 95%", "R@10 psi / + b", "biases by default", "stage-1 K",
                 "K tuned for psi + b"], [r[:-1] for r in rows])
        + "\ngamma's choice, as recorded (every candidate with its R@1 / R@5 on the choosing captions):\n\n"
        + "\n".join(f"- `{c}`: " + ("; ".join(f"{t['gamma']:.4g}: {t['R1']:.1f} / {t['R5']:.1f}"
                                             for t in v["default"]["gamma"].get("tried", []))
                                   or v["default"]["gamma"].get("rule", "-")) + f" ({v['default']['gamma'].get('rule')})"
                     if v["default"].get("gamma") else f"- `{c}`: not chosen" for c, v in data.items())
        + "\n\nReasons recorded in the manifests:\n\n"
        + "\n".join(f"- `{c}`: {v['default']['reason']}" for c, v in data.items()) + "\n"
    )
    (RESULTS / "ncl_served").mkdir(parents=True, exist_ok=True)
    write_results(f"ncl_served/decision_{args.name}", f"The per-index NCL decision: {args.name}", body,
                  {"checkpoint": args.checkpoint, "corpora": data, "bias_queue": args.bias_queue, "commit": git_commit()},
                  run)


if __name__ == "__main__":
    main()
