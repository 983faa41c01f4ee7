"""int8 frames vs float16 frames on the trained benchmark model (issue 29, must-have 5): score error, recall, bytes.

    python -m bench.frames_int8              # ~2 min: two builds of the 200 test videos, 600 captions
    python -m bench.frames_int8 --render     # re-render bench/results/frames_int8.md from its JSON

The test split of runs/bench-corpus is indexed with runs/bench-train/best.safetensors twice by ``gare-index
build`` (flat stage 1): ``--frames-dtype float16`` and ``--frames-dtype int8``. On both, every test caption:
- the psi rerank's scores of every caption x video pair (the served rerank, gare_search.rerank.psi_scores, every
  video a candidate): max and mean |int8 - float16|;
- t2v R@1/R@5/R@10 of the psi ranking over the whole gallery, and of the served search (search_batch, the
  index's defaults: stage-1 K, psi, the NCL default);
- bytes per video of frames.npy (+ frame_scales.npy).
The default follows RULE (stated before the run, applied to these numbers): int8 becomes the default only if
it holds. Results: bench/results/frames_int8.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import (
    REPO,
    RESULTS,
    add_render_arg,
    cpu_name,
    git_commit,
    loadavg,
    render_saved,
    start,
    with_provenance,
    write_report,
)

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "indexer/gare_index/frame_quant.py",
    "indexer/gare_index/store/",
    "indexer/gare_search/rerank.py",
    "indexer/gare_search/search.py",
    "indexer/gare_build/build.py",
)


# int8 becomes the default only if, on the benchmark model's test captions, R@1 and R@5 (psi ranking and
# served search) change by at most 0.5 point and the psi scores move by at most 1e-3 on average, 1e-2 at most
RULE = {"max_r_change_points": 0.5, "max_mean_abs_score_err": 1e-3, "max_max_abs_score_err": 1e-2}


def recall(ranks: np.ndarray) -> dict[str, float]:
    """ranks (captions,) 0-based rank of the right video (large when missing) -> R@1/5/10 in percent."""
    return {f"R{k}": round(100.0 * float(np.mean(ranks < k)), 2) for k in (1, 5, 10)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gare.checkpoint import file_sha256, load_model
    from gare_build.build import BuildOptions, build
    from gare_index.store import open_index
    from gare_search import query as Q
    from gare_search import rerank as R
    from gare_search.search import SearchOptions, search_batch

    started, load_start = time.time(), loadavg()
    torch.set_num_threads(1)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = [json.loads(x) for x in (args.corpus / "captions_test.jsonl").read_text().splitlines() if x.strip()]
    videos = [str((args.corpus / r["video"]).resolve()) for r in rows]
    captions = [c for r in rows for c in r["captions"]]
    truth_path = [videos[i] for i, r in enumerate(rows) for _ in r["captions"]]
    listing = work / "videos.csv"
    listing.write_text("video\n" + "".join(f"{p}\n" for p in videos))
    build_s = {}
    for dt in ("float16", "int8"):
        t0 = time.perf_counter()
        build(str(args.checkpoint), str(listing), work / dt, BuildOptions(workers=args.workers, progress=False,
                                                                          index_type="flat", frames_dtype=dt))
        build_s[dt] = round(time.perf_counter() - t0, 1)
        print(f"built {dt} in {build_s[dt]} s", flush=True)
    model, _ = load_model(args.checkpoint, "cpu")
    t = torch.cat([Q.encode_queries(model, captions[s : s + 64]) for s in range(0, len(captions), 64)])
    out: dict[str, Any] = {}
    scores: dict[str, np.ndarray] = {}
    for dt in ("float16", "int8"):
        with open_index(work / dt) as v:
            assert v.frame_dtype == dt, (v.frame_dtype, dt)
            path_of = {int(m["id"]): str(Path(m["path"]).resolve()) for m in v.all_metadata()}
            by_path = {p: i for i, p in path_of.items()}
            ids = np.array(sorted(path_of), dtype=np.int64)  # the same order (by path) in both indexes
            ids = np.array(sorted(ids, key=lambda i: path_of[int(i)]), dtype=np.int64)
            s = np.stack([x for c in range(0, len(captions), 64)
                          for x in R.psi_scores(model, v, t[c : c + 64], [ids] * len(t[c : c + 64]))])
            scores[dt] = s
            truth = np.array([by_path[p] for p in truth_path], dtype=np.int64)
            col = {int(i): j for j, i in enumerate(ids)}
            right = s[np.arange(len(captions)), [col[int(i)] for i in truth]]
            psi_ranks = (s > right[:, None]).sum(axis=1)
            served_ranks = []
            for c in range(0, len(captions), 64):
                for r, want in zip(search_batch(model, v, captions[c : c + 64], SearchOptions(k=10)), truth[c : c + 64],
                                   strict=True):
                    got = [int(h.id) for h in r.hits]
                    served_ranks.append(got.index(int(want)) if int(want) in got else 10**6)
            files = v.manifest.files
            f, d = v.max_frames, v.dim
            frame_bytes = f * d * (1 if dt == "int8" else 2) + (4 * f if dt == "int8" else 0)
            out[dt] = {
                "psi": recall(psi_ranks), "served": recall(np.array(served_ranks)),
                "bytes_per_video": frame_bytes,
                "files_bytes": {k: files[k].bytes for k in ("frames.npy", "frame_scales.npy") if k in files},
                "n_videos": v.n, "max_frames": f, "dim": d, "build_s": build_s[dt],
            }
    err = np.abs(scores["int8"] - scores["float16"])
    data = {
        "corpus": str(args.corpus), "checkpoint": str(args.checkpoint), "checkpoint_sha256": file_sha256(args.checkpoint),
        "n_captions": len(captions), "n_videos": len(videos), "pairs": int(err.size),
        "score_err": {"max_abs": float(err.max()), "mean_abs": float(err.mean()),
                      "score_std": float(scores["float16"].std())},
        "rows": out, "rule": RULE,
        "load_start": load_start, "load_end": loadavg(), "elapsed_s": round(time.time() - started, 1),
    }
    data["choice"] = choose(data)
    return data


def choose(data: dict[str, Any]) -> dict[str, Any]:
    """The default frames dtype by RULE, from the measured rows alone."""
    rule, r, e = data["rule"], data["rows"], data["score_err"]
    deltas = {f"{kind} {k}": round(r["int8"][kind][k] - r["float16"][kind][k], 2) for kind in ("psi", "served")
              for k in ("R1", "R5")}
    ok_r = all(abs(x) <= rule["max_r_change_points"] for x in deltas.values())
    ok_e = e["mean_abs"] <= rule["max_mean_abs_score_err"] and e["max_abs"] <= rule["max_max_abs_score_err"]
    return {"default": "int8" if ok_r and ok_e else "float16", "r_changes": deltas, "recall_ok": ok_r, "score_ok": ok_e}


@with_provenance
def markdown(d: dict[str, Any]) -> str:
    """The report, rendered from its JSON alone."""
    r, e, c = d["rows"], d["score_err"], d["choice"]
    L = ["# int8 frames vs float16 frames on the benchmark model (issue 29)", "",
         f"Command (from the repository root): `{d['command']}`; commit {d['commit']}", "",
         f"CPU: {d['cpu']} ({d['cores']} cores). Load average (1/5/15 min) at start {d['load_start']}, at end "
         f"{d['load_end']}. Wall time {d['elapsed_s']} s. Date {d['date']}.", "",
         f"Gallery: the {d['n_videos']} test videos of `{d['corpus']}`, indexed twice with `{d['checkpoint']}` "
         f"(sha256 {d['checkpoint_sha256'][:12]}) by `gare-index build --index-type flat --frames-dtype float16|int8`; "
         f"queries: every test caption ({d['n_captions']}). int8: each frame stored as int8 with a float32 scale "
         "(max |x| / 127), psi's constants folded from the stored frames.", "",
         f"## psi rerank score error ({d['pairs']:,} caption x video pairs, every video a candidate)", "",
         "| max abs error | mean abs error | std of the float16 scores |", "|---:|---:|---:|",
         f"| {e['max_abs']:.3g} | {e['mean_abs']:.3g} | {e['score_std']:.3g} |", "",
         "## Recall (t2v, percent) and bytes", "",
         "| frames | psi ranking R@1 | R@5 | R@10 | served search R@1 | R@5 | R@10 | frame bytes per video | build s |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dt in ("float16", "int8"):
        x = r[dt]
        L.append(f"| {dt} | {x['psi']['R1']:.2f} | {x['psi']['R5']:.2f} | {x['psi']['R10']:.2f} | "
                 f"{x['served']['R1']:.2f} | {x['served']['R5']:.2f} | {x['served']['R10']:.2f} | "
                 f"{x['bytes_per_video']:,} | {x['build_s']} |")
    f16, i8 = r["float16"], r["int8"]
    L += ["", f"Frame bytes per video: f x d values ({f16['max_frames']} x {f16['dim']}) at 2 bytes (float16) or 1 "
          f"byte + {4 * i8['max_frames']} bytes of scales (int8): {i8['bytes_per_video'] / f16['bytes_per_video']:.3f} "
          f"of float16. Files: float16 {f16['files_bytes']}, int8 {i8['files_bytes']} (with .npy headers).", "",
          "## Default", "",
          f"Rule (fixed before the run): int8 becomes the default only if R@1 and R@5 (psi ranking and served search) "
          f"change by at most {d['rule']['max_r_change_points']} point and the psi scores move by at most "
          f"{d['rule']['max_mean_abs_score_err']:g} on average and {d['rule']['max_max_abs_score_err']:g} at most.", "",
          f"Changes int8 - float16 (points): {', '.join(f'{k} {v:+.2f}' for k, v in c['r_changes'].items())}; "
          f"recall within the rule: {'yes' if c['recall_ok'] else 'NO'}; scores within the rule: "
          f"{'yes' if c['score_ok'] else 'NO'}.", "",
          f"**Default frames dtype: {c['default']}**"]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=REPO / "runs" / "bench-corpus")
    ap.add_argument("--checkpoint", type=Path, default=REPO / "runs" / "bench-train" / "best.safetensors")
    ap.add_argument("--work", default="/tmp/gare-frames-int8")
    ap.add_argument("--workers", type=int, default=1, help="decode worker processes of the builds")
    add_render_arg(ap, RESULTS / "frames_int8.json")
    args = ap.parse_args(argv)
    if args.render:
        render_saved(args.render, markdown)
        return 0
    run = start(__name__, MEASURES)
    run.add_inputs(args.checkpoint, args.corpus)
    data = measure(args)
    data.update({"command": "python -m bench.frames_int8 " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "commit": git_commit(), "cpu": cpu_name(), "cores": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d", time.gmtime())})
    data["command"] = data["command"].rstrip()
    data["run"] = run.record()
    print(write_report(RESULTS / "frames_int8.json", data, markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
