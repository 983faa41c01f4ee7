"""What `gare-index tune` costs (issue 29: the tuner must stay a small part of the build): the psi coverage step's
scorer before and after it read the index's stored psi constants, side by side in one run, then the real command.

    python -m bench.tune_cost                                   # ~3 min: a 20,000-entry ViT-B/32-sized gallery in /tmp
    python -m bench.tune_cost --index /tmp/gare-peer/g/index --bank /tmp/gare-peer/tune_bank.npy   # an existing one
    python -m bench.tune_cost --quick                           # smoke run

1. Side by side, interleaved rep by rep, on the first --side-videos rows of the index and every bank query: the
   coverage scorer (`gare_build.tuning.coverage.psi_fold_scorer`) with the stored constants (the compiled kernel of
   the served rerank) and without them (every video folded again: the path `gare-index tune` took before), at
   torch's thread count (every usable core, as the command runs); seconds per call, µs per pair, the ratio, and
   the largest score difference between the two.
2. `gare-index tune --index INDEX --from-bank BANK --tune-queries Q` itself, as a user runs it (a subprocess): wall
   time, its own split (ANN tuning, psi coverage) from the manifest it writes, peak RSS (memory-mapped index pages
   count in it).
Without --index a gallery is written with `bench/serve_bench.write_gallery` (the real index format, psi constants
stored, random ViT-B/32 weights: timing only) and the bank is the int8 tower's embeddings of template queries.
Results: bench/results/tune_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.harness import RESULTS, add_render_arg, loadavg, render_requested, start, write_results
from bench.index_common import table
from bench.serve_bench import make_queries, write_random_gallery
from bench.support import CHECKOUT_PATH

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_build/tuning/",
    "indexer/gare_build/cli.py",
)


REPO = Path(__file__).resolve().parents[1]


def make_gallery(work: Path, n: int, n_queries: int) -> tuple[Path, Path]:
    """A fresh gallery of n entries and a bank of n_queries query rows as the service writes them (t, |t| kept);
    (index, bank)."""
    from gare.checkpoint import load_model
    from gare.text_quant import build_text_encoder
    from gare_search.query import encode_queries

    ck = write_random_gallery(work, n)
    model, _ = load_model(ck, "cpu")
    bank = encode_queries(model, make_queries(n_queries, seed=5), tower=build_text_encoder(model, "int8")).numpy()
    np.save(work / "bank.npy", bank.astype(np.float32))
    return work / "g" / "index", work / "bank.npy"


def side_by_side(index: Path, bank: np.ndarray, n_videos: int, reps: int) -> dict[str, Any]:
    from gare.checkpoint import load_model
    from gare_build.tuning.coverage import psi_fold_scorer
    from gare_build.tuning.version_tuning import stored_consts
    from gare_index.store import open_index

    with open_index(index, use_gpu=False) as v:
        model, _ = load_model(v.manifest.checkpoint.path, "cpu")
        stored = stored_consts(v, model)
        if stored is None:
            raise SystemExit(f"{index}: no psi constants valid for its checkpoint; run `gare-index upgrade` first")
        ids = np.asarray(v.ids)
        n = min(n_videos, ids.shape[0])
        gids = ids[:n].copy()
        unit = np.ascontiguousarray(bank / np.linalg.norm(bank, axis=1, keepdims=True), dtype=np.float32)
        scorers = {  # psi scores the bank's rows at their |t|; the scorers are called with their unit rows
            "stored constants (kernel)": psi_fold_scorer(model, v.frames, v.masks, np.asarray(v.biases), ids, unit, bank,
                                                         stored=stored),
            "fold every video (before)": psi_fold_scorer(model, v.frames, v.masks, np.asarray(v.biases), ids, unit, bank),
        }
        out = {name: sc(unit[:2], gids[:64]) for name, sc in scorers.items()}  # compile the kernel, touch the pages
        times: dict[str, list[float]] = {name: [] for name in scorers}
        for r in range(reps):
            for name in (list(scorers) if r % 2 == 0 else list(scorers)[::-1]):
                t0 = time.perf_counter()
                out[name] = scorers[name](unit, gids)
                times[name].append(time.perf_counter() - t0)
    a, b = out.values()
    med = {name: statistics.median(t) for name, t in times.items()}
    pairs = bank.shape[0] * n
    return {"videos": n, "queries": int(bank.shape[0]), "reps": reps, "threads": torch.get_num_threads(),
            "seconds": {k: [round(x, 4) for x in t] for k, t in times.items()},
            "median_s": {k: round(x, 4) for k, x in med.items()},
            "us_per_pair": {k: round(x * 1e6 / pairs, 3) for k, x in med.items()},
            "ratio_before_over_after": round(med["fold every video (before)"] / med["stored constants (kernel)"], 2),
            "max_abs_diff": float(np.abs(a - b).max())}


def run_tune(index: Path, bank: Path, n_queries: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gare_build.cli", "tune", "--index", str(index), "--from-bank", str(bank),
           "--tune-queries", str(n_queries), "--no-progress"]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": CHECKOUT_PATH}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB (the largest child's)
    res: dict[str, Any] = {"command": f"gare-index tune --index INDEX --from-bank BANK --tune-queries {n_queries}",
                           "returncode": proc.returncode, "wall_s": round(wall, 1), "peak_rss_gib": round(peak, 2),
                           "output_tail": (proc.stdout + proc.stderr)[-1500:]}
    if proc.returncode == 0:
        from gare_index.store import open_index

        with open_index(index, use_gpu=False) as v:
            st = dict(v.manifest.get("stage1") or {})
            res["version"], res["n"] = v.name, v.n
        res.update({k: st.get(k) for k in ("tuning_s", "coverage_s", "coverage_scorer", "setting", "recall",
                                           "recall_target", "met", "p50_ms", "n_queries")})
    return res


def markdown(data: dict[str, Any]) -> str:
    s, t = data["side_by_side"], data["tune"]
    rows = [[name, s["median_s"][name], s["us_per_pair"][name], ", ".join(f"{x:.3f}" for x in s["seconds"][name])]
            for name in s["median_s"]]
    body = [
        f"CPU load average before / after: {data['load_before']} / {data['load_after']}. Index: {data['index_n']:,} "
        f"entries ({data['index']}).",
        "",
        f"## The coverage scorer, side by side ({s['videos']:,} videos x {s['queries']} queries, {s['reps']} reps "
        f"interleaved, {s['threads']} torch threads)",
        "",
        table(["scorer", "median s", "µs per pair", "every rep (s)"], rows),
        f"Ratio (before / after): x{s['ratio_before_over_after']}; largest score difference {s['max_abs_diff']:.2e} "
        "(the stored constants use the served v̄ = norm · unit, the fold the masked mean of the fp16 frames).",
        "",
        "## `gare-index tune` itself",
        "",
    ]
    if t["returncode"] != 0:
        body += [f"FAILED (exit {t['returncode']}):", "", "```", t["output_tail"], "```"]
    else:
        body += [table(["command", "wall s", "ANN tuning s", "psi coverage s", "peak RSS GiB", "result"],
                       [[f"`{t['command']}`", t["wall_s"], t["tuning_s"], t["coverage_s"], t["peak_rss_gib"],
                         f"{t['setting']}: recall {t['recall']} (target {t['recall_target']}, met {t['met']}), "
                         f"p50 {round(t['p50_ms'], 3)} ms; {t['n_queries']} queries"]]),
                 f"Coverage scorer recorded in the manifest: {t['coverage_scorer']}. Peak RSS counts the index's "
                 "memory-mapped pages the coverage reads (every frame, constant and unit row once)."]
    return "\n".join(body) + "\n"


def main() -> None:
    if render_requested(RESULTS / "tune_cost.json"):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", help="an existing index (default: write a gallery of --n entries)")
    ap.add_argument("--bank", help="query bank .npy of served query rows (with --index)")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--tune-queries", type=int, default=200)
    ap.add_argument("--side-videos", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/gare-tune-cost")
    ap.add_argument("--quick", action="store_true")
    add_render_arg(ap, RESULTS / "tune_cost.json")
    args = ap.parse_args()
    if args.quick:
        args.n, args.tune_queries, args.side_videos, args.reps = 3000, 40, 1024, 2
    run = start(__name__, MEASURES)
    load_before = loadavg()
    if args.index:
        if not args.bank:
            raise SystemExit("--index needs --bank (a query bank .npy of served query rows)")
        index, bank_path = Path(args.index), Path(args.bank)
    else:
        index, bank_path = make_gallery(Path(args.work), args.n, args.tune_queries)
    bank = np.load(bank_path).astype(np.float32)[: args.tune_queries]
    side = side_by_side(index, bank, args.side_videos, args.reps)
    print(json.dumps(side, indent=1), flush=True)
    tune = run_tune(index, bank_path, args.tune_queries)
    from gare_index.store import open_index

    with open_index(index, use_gpu=False) as v:
        n = v.n
    data = {"index": str(index), "index_n": n, "side_by_side": side, "tune": tune, "load_before": load_before,
            "load_after": loadavg()}
    path = write_results("tune_cost", "What gare-index tune costs: the psi coverage with stored constants",
                         markdown(data), data, run)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
