"""CPU text encoder benchmark: fp32 vs int8 (per-token int8, exact int32 sums) vs ONNX Runtime (fp32, int8).

    python -m bench.text_encoder --checkpoint runs/tq-train/best.safetensors --corpus runs/tq-corpus

Measured in one run, side by side (rounds interleave the encoders so that load from other processes on
a shared machine hits all of them alike; the median of the rounds is reported):
1. speed, on the ViT-B/32 text tower (open_clip 'ViT-B-32', random weights: speed does not depend on
   them): one query and batches of 8 and 32 (tokens trimmed after the longest query, as the service did; every
   encoder is batch-invariant since issue 24, each text computed at its own length whatever the padding),
   with 1 thread and with all threads; ms per call and the speed-up over the model's own fp32 encoder;
2. fidelity on a TRAINED checkpoint (``--checkpoint``): cosine of each encoder's embedding with the fp32
   embedding (min / mean) over the corpus captions, and retrieval R@1 / R@10 (dual tower and + psi) on the
   corpus splits with the video side fixed (fp32), so only the text encoder changes;
   plus the cosine on the random-weight ViT-B/32 (labelled as such: random weights are not representative);
3. query-cache hit rates of Zipf query streams (bench/zipf_queries.py) for a few cache sizes.
Writes bench/results/text_encoder.{md,json} with commit, command, date and CPU. The CPU default recorded
in gare/text_quant.py is chosen from section 1 and 2 by the rule printed in the report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import harness  # noqa: E402
from bench.harness import cpu_name, git_commit, start, with_provenance  # noqa: E402
from bench.zipf_queries import hit_rates, vocabulary, zipf_stream  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/text_quant.py",
    "training/gare/text_*.py",
    "training/gare/model.py",
    "training/gare/backbone.py",
    "indexer/gare_search/query.py",
)


KINDS = ("int8",)  # the CPU towers gare.text_quant offers besides the model's own (model-fp32)
# Rule for choosing int8 as the CPU default (issue 14): >= 1.7x faster than fp32 at one query on one
# thread AND with all threads, and t2v R@1 (+psi) within 0.5 point on every evaluated split.
SPEEDUP_MIN, R1_MAX_DROP = 1.7, 0.5


def make_queries(n: int, seed: int = 0) -> list[str]:
    return vocabulary(n, seed)


def build_encoders(model, kinds, threads: int) -> dict[str, Any]:
    from gare.text_quant import build_text_encoder, encode_each

    encs: dict[str, Any] = {}

    def model_fp32(tokens: torch.Tensor) -> torch.Tensor:
        # the model's own encoder as the service runs it (gare_search.query.encode_queries): each text alone
        with torch.inference_mode():
            return encode_each(model.encode_text, tokens)

    encs["model-fp32"] = model_fp32
    for k in kinds:
        encs[k] = build_text_encoder(model, k)
    return encs


def time_side_by_side(encs: dict[str, Any], tokens: torch.Tensor, rounds: int, per_round: int) -> dict[str, float]:
    """Median over rounds of the mean ms per call; the encoders take turns within every round."""
    for e in encs.values():  # warm-up (ORT and oneDNN pick kernels on first calls)
        for _ in range(2):
            e(tokens)
    samples: dict[str, list[float]] = {k: [] for k in encs}
    for r in range(rounds):
        order = list(encs) if r % 2 == 0 else list(reversed(list(encs)))
        for k in order:
            t0 = time.perf_counter()
            for _ in range(per_round):
                encs[k](tokens)
            samples[k].append((time.perf_counter() - t0) / per_round * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def speed_section(args) -> dict[str, Any]:
    from gare.config import get_model_config
    from gare.model import GARE
    from gare_search.query import trim_tokens

    torch.manual_seed(0)
    model = GARE.build(get_model_config("gare-vit-b-32"), pretrained="none").eval()
    queries = make_queries(64, seed=1)
    out: dict[str, Any] = {"model": "gare-vit-b-32 (open_clip ViT-B-32 text tower, random weights)", "rows": []}
    all_threads = torch.get_num_threads()
    thread_settings = sorted(set(args.threads or [1, all_threads]))
    tok_all = model.tokenize(queries)
    for th in thread_settings:
        torch.set_num_threads(th)
        encs = build_encoders(model, args.kinds, th)
        # fidelity on random weights (not representative; the trained-model section is the one that counts)
        ref = encs["model-fp32"](trim_tokens(tok_all))
        cos_rand = {k: F.cosine_similarity(encs[k](trim_tokens(tok_all)), ref).numpy() for k in args.kinds}
        out.setdefault("cos_random_weights", {k: {"min": float(v.min()), "mean": float(v.mean())} for k, v in cos_rand.items()})
        for b in args.batches:
            tokens = trim_tokens(tok_all[:b])
            ms = time_side_by_side(encs, tokens, args.rounds, max(1, args.calls // b))
            row = {"threads": th, "batch": b, "L": int(tokens.shape[1]), "ms": ms,
                   "speedup_vs_model_fp32": {k: ms["model-fp32"] / v for k, v in ms.items()}}
            out["rows"].append(row)
            print(f"threads={th} batch={b} L={tokens.shape[1]}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
        del encs
    torch.set_num_threads(all_threads)
    out["threads_all"] = all_threads
    return out


def retrieval(t: torch.Tensor, model, enc, caption_clip) -> dict[str, float]:
    from gare.retrieval_metrics import retrieval_metrics

    tn, vn = F.normalize(t, dim=-1), F.normalize(enc.vbar, dim=-1)
    dual = tn @ vn.T
    with torch.inference_mode():
        psi = model.score(t, enc.frames, enc.mask, vbar=enc.vbar)
    res = {}
    for name, s in (("dual", dual), ("psi", psi)):
        m = retrieval_metrics(s, caption_clip)["t2v"]
        res[name] = {"R1": float(m["R1"]), "R10": float(m["R10"])}
    return res


def fidelity_section(args) -> dict[str, Any]:
    from gare.annotations import load_dataset
    from gare.checkpoint import file_sha256, load_model
    from gare.encoded_set import encode_set
    from gare_search.query import trim_tokens

    torch.set_num_threads(torch.get_num_threads())
    model, _ = load_model(args.checkpoint, "cpu")
    encs = build_encoders(model, args.kinds, torch.get_num_threads())
    out: dict[str, Any] = {"checkpoint": str(args.checkpoint), "checkpoint_sha256": file_sha256(args.checkpoint),
                           "model": model.cfg.backbone, "splits": {}}
    cos_all: dict[str, list[np.ndarray]] = {k: [] for k in args.kinds}
    for split in args.splits:
        rs = load_dataset({"kind": "synth", "root": str(args.corpus)}, split)
        enc = encode_set(model, rs, batch_size=16, num_workers=1, progress=True)
        if enc.failed:  # then encode_set would have dropped captions; keep the comparison simple
            raise RuntimeError(f"{len(enc.failed)} corpus videos failed to decode: {enc.failed[:3]}")
        texts = list(rs.captions)
        ts: dict[str, torch.Tensor] = {}
        for k, e in encs.items():
            rows = []
            for s in range(0, len(texts), 64):
                rows.append(e(trim_tokens(model.tokenize(texts[s:s + 64]))).float())
            ts[k] = torch.cat(rows)
        ref = ts["model-fp32"]
        split_out: dict[str, Any] = {"n_captions": len(texts), "n_videos": int(enc.vbar.shape[0]), "encoders": {}}
        for k, t in ts.items():
            cos = F.cosine_similarity(t, ref).numpy()
            if k in cos_all:
                cos_all[k].append(cos)
            split_out["encoders"][k] = {"cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
                                        **retrieval(t, model, enc, enc.caption_clip)}
        out["splits"][split] = split_out
        print(f"fidelity {split}: " + json.dumps(split_out["encoders"]), flush=True)
    return out


def zipf_section(args) -> dict[str, Any]:
    vocab = vocabulary(args.zipf_distinct, 0)
    out: dict[str, Any] = {"distinct": args.zipf_distinct, "n": args.zipf_n, "perturb": args.zipf_perturb, "rows": []}
    for s in args.zipf_s:
        stream = zipf_stream(args.zipf_n, s=s, perturb=args.zipf_perturb, seed=0, vocab=vocab)
        res = hit_rates(stream, args.zipf_entries)
        out["rows"].append({"s": s, "by_entries": {str(k): v for k, v in res.items()}})
        print(f"zipf s={s}: " + ", ".join(f"{k}: {100 * v['hit_rate']:.1f}%" for k, v in res.items()), flush=True)
    return out


def choose(speed: dict[str, Any], fid: dict[str, Any] | None) -> dict[str, Any]:
    """The CPU default by the rule above, from this run's numbers only."""
    reasons = []
    best = "fp32"
    # every tower the run measured, in its order (a report rendered again keeps the towers it measured then)
    for cand in [k for k in speed["rows"][0]["ms"] if k not in ("model-fp32", "fp32")]:
        single = [r for r in speed["rows"] if r["batch"] == 1]
        sp = [r["speedup_vs_model_fp32"][cand] for r in single]
        fast = all(x >= SPEEDUP_MIN for x in sp)
        drops = []
        if fid is not None:
            for split, so in fid["splits"].items():
                base = so["encoders"]["model-fp32"]["psi"]["R1"]
                drops.append((split, base - so["encoders"][cand]["psi"]["R1"]))
        faithful = fid is not None and all(d <= R1_MAX_DROP for _, d in drops)
        reasons.append(
            f"{cand}: speed-up at one query {', '.join(f'{x:.2f}x' for x in sp)} (threads {', '.join(str(r['threads']) for r in single)}), "
            f"need >= {SPEEDUP_MIN}x: {'yes' if fast else 'no'}; R@1 (+psi) drop "
            f"{', '.join(f'{s} {d:+.2f}' for s, d in drops) or 'not measured'} (need <= {R1_MAX_DROP}): {'yes' if faithful else 'no'}"
        )
        if fast and faithful and best == "fp32":
            best = cand
    return {"default": best, "reasons": reasons}


def write_report(res: dict[str, Any], out_dir: Path) -> None:
    harness.write_report(out_dir / "text_encoder.json", res, markdown)


@with_provenance
def markdown(res: dict[str, Any]) -> str:
    L = [
        "# CPU text encoder: the model's fp32 tower vs the int8 tower (issue 14)", "",
        f"- commit `{res['commit']}`, date {res['date']}, CPU: {res['cpu']} ({res['cores']} logical cores visible, "
        f"torch {res['torch']}" + (f", onnxruntime {res['onnxruntime']}" if res.get("onnxruntime") else "") + ")",
        f"- command: `{res['command']}`",
        f"- note: {res['note']}",
        *([f"- fidelity and Zipf sections from an earlier run on the same machine: commit `{res['sections_from']['commit']}`, "
           f"{res['sections_from']['date']}, command `{res['sections_from']['command']}`"] if res.get("sections_from") else []),
        *([f"- Zipf section from the run: commit `{res['zipf_from']['commit']}`, {res['zipf_from']['date']}, "
           f"command `{res['zipf_from']['command']}`"] if res.get("zipf_from") else []),
        "",
        "## Speed (ViT-B/32 text tower, random weights)", "",
        "ms per call, median of interleaved rounds; speed-up = model fp32 / encoder. `model-fp32` is "
        "`GARE.encode_text` run on each text alone (the service's path, `gare_search.query.encode_queries`); `fp32` is "
        "the stand-alone tower in text_quant.", "",
    ]
    sp = res["speed"]
    kinds = list(sp["rows"][0]["ms"])
    L.append("| threads | batch | L | " + " | ".join(kinds) + " | " + " | ".join(f"x {k}" for k in kinds[1:]) + " |")
    L.append("|---:|---:|---:|" + "---:|" * (2 * len(kinds) - 1))
    for r in sp["rows"]:
        L.append(f"| {r['threads']} | {r['batch']} | {r['L']} | " + " | ".join(f"{r['ms'][k]:.2f}" for k in kinds) + " | "
                 + " | ".join(f"{r['speedup_vs_model_fp32'][k]:.2f}" for k in kinds[1:]) + " |")
    L += ["", "Cosine with the fp32 embedding on the random-weight ViT-B/32 (64 queries; NOT representative of trained weights):", "",
          "| encoder | min | mean |", "|---|---:|---:|"]
    for k, v in sp["cos_random_weights"].items():
        L.append(f"| {k} | {v['min']:.5f} | {v['mean']:.5f} |")
    fid = res.get("fidelity")
    if fid:
        L += ["", f"## Fidelity on a trained checkpoint ({fid['model']})", "",
              f"Checkpoint `{fid['checkpoint']}` (sha256 {fid['checkpoint_sha256'][:12]}…). {res.get('fidelity_note', '')}", "",
              "| split | captions | videos | encoder | cos min | cos mean | R@1 dual | R@10 dual | R@1 +psi | R@10 +psi |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for split, so in fid["splits"].items():
            for k, e in so["encoders"].items():
                L.append(f"| {split} | {so['n_captions']} | {so['n_videos']} | {k} | {e['cos_min']:.5f} | {e['cos_mean']:.5f} | "
                         f"{e['dual']['R1']:.2f} | {e['dual']['R10']:.2f} | {e['psi']['R1']:.2f} | {e['psi']['R10']:.2f} |")
    z = res.get("zipf")
    if z:
        ents = list(z["rows"][0]["by_entries"])
        L += ["", "## Query-cache hit rate on Zipf query streams", "",
              f"{z['n']} queries drawn from {z['distinct']} distinct ones with P(rank r) ∝ 1/r^s, {100 * z['perturb']:.0f}% re-typed "
              "(capitalised / doubled space / trailing space / upper case; the key normalisation merges them); cold cache, "
              "replayed through gare_serve.engine.query_cache.QueryCache. Cells: hit rate over the whole stream (second half, warm).", "",
              "| s | " + " | ".join(f"{e} entries" for e in ents) + " |", "|---:|" + "---:|" * len(ents)]
        for r in z["rows"]:
            L.append(f"| {r['s']} | " + " | ".join(
                f"{100 * r['by_entries'][e]['hit_rate']:.1f}% ({100 * r['by_entries'][e]['hit_rate_second_half']:.1f}%)" for e in ents) + " |")
    ch = res["choice"]
    L += ["", "## Choice of the CPU default", "",
          f"Rule: an encoder other than fp32 becomes the default only if it is >= {SPEEDUP_MIN}x faster than model fp32 for one query "
          f"with 1 thread and with all threads, and its t2v R@1 (+psi) is within {R1_MAX_DROP} point of fp32 on every split.", ""]
    L += [f"- {r}" for r in ch["reasons"]]
    L += ["", f"**Default from this run: `{ch['default']}`.**", ""]
    return "\n".join(L)


def _merge(res: dict[str, Any], prev: dict[str, Any]) -> None:
    """Fidelity and Zipf sections from another run (which measured no speed), with its provenance."""
    res["fidelity"], res["zipf"] = prev.get("fidelity"), prev.get("zipf")
    res["fidelity_note"] = prev.get("fidelity_note", "")
    res["sections_from"] = {k: prev[k] for k in ("commit", "command", "date", "cpu")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="a trained GARE checkpoint for the fidelity section")
    ap.add_argument("--corpus", type=Path, help="the synth corpus the checkpoint was trained on")
    ap.add_argument("--splits", nargs="+", default=["test", "train"])
    ap.add_argument("--fidelity-note", default="")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, nargs="+", help="torch/ORT thread counts (default: 1 and all)")
    ap.add_argument("--fidelity-json", type=Path,
                    help="take the fidelity and zipf sections from this earlier run's JSON (its provenance is kept)")
    ap.add_argument("--zipf-json", type=Path, help="take the zipf section from this run's JSON instead")
    ap.add_argument("--render", type=Path, metavar="SPEED_JSON",
                    help="run nothing: re-render the report from a speed run's text_encoder.json (with --fidelity-json)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=32, help="texts per round and encoder (calls = calls // batch)")
    ap.add_argument("--zipf-distinct", type=int, default=100_000)
    ap.add_argument("--zipf-n", type=int, default=200_000)
    ap.add_argument("--zipf-s", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    ap.add_argument("--zipf-entries", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--zipf-perturb", type=float, default=0.1)
    ap.add_argument("--skip", nargs="*", default=[], choices=["speed", "fidelity", "zipf"])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)

    if args.render is not None:
        res = json.loads(args.render.read_text())
        if args.fidelity_json is not None:
            _merge(res, json.loads(args.fidelity_json.read_text()))
        if args.zipf_json is not None:
            z = json.loads(args.zipf_json.read_text())
            res["zipf"] = z["zipf"]
            res["zipf_from"] = {k: z[k] for k in ("commit", "command", "date", "cpu")}
        res["choice"] = choose(res["speed"], res["fidelity"])
        write_report(res, args.out)
        print(f"default: {res['choice']['default']}; wrote {args.out / 'text_encoder.md'}")
        return 0

    run = start(__name__, MEASURES, argv)
    run.add_inputs(*(p for p in (args.checkpoint, args.corpus) if p is not None))
    res: dict[str, Any] = {
        "commit": git_commit(),
        "command": run.command,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
        "torch": torch.__version__,
        "note": "timings are ratios measured side by side in one run; absolute ms depend on the machine's load",
        "fidelity_note": args.fidelity_note,
    }
    res["speed"] = speed_section(args) if "speed" not in args.skip else None
    res["fidelity"] = fidelity_section(args) if args.checkpoint and "fidelity" not in args.skip else None
    res["zipf"] = zipf_section(args) if "zipf" not in args.skip else None
    if args.fidelity_json is not None:
        _merge(res, json.loads(args.fidelity_json.read_text()))
    res["run"] = run.record()
    if res["speed"] is not None:
        res["choice"] = choose(res["speed"], res["fidelity"])
        write_report(res, args.out)
        print(f"default: {res['choice']['default']}; wrote {args.out / 'text_encoder.md'}")
    else:
        harness.write_json(args.out / "text_encoder_fidelity.json", res)
        print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
