"""CPU text encoder benchmark: the text towers a CPU search can run, side by side.

    python -m bench.text_encoder --checkpoint runs/tq-train/best.safetensors --corpus runs/tq-corpus

The towers are the product's CPU options, each built by the service's own factory
(``gare_search.text_encoder.load_query_encoder(model, kind, "cpu", "fp32")``) and run as the service runs it,
texts -> t (``QueryEncoder.encode``: the model's tokenizer, then the tower):
- ``fp32``: the model's own tower (``GARE.encode_text``, each text alone at its own length), the reference;
- ``int8``: ``gare.text_quant``'s int8 tower (per-token int8, exact int32 sums, packed rows);
- ``fp32-packed``: the model's float32 weights on packed rows (``gare.text_packed``); where this machine's GEMM
  fails the tower's row-independence check at build, the product runs it one text at a time, and the report
  names the scheme each tower ran with.
The list is ``gare.text_quant.TEXT_ENCODERS`` less ``CUDA_TEXT_ENCODERS`` (fp16 is a CUDA tower: bench/gpu_bench.py).

Measured in one run, side by side (rounds interleave the towers so that load from other processes on a shared
machine hits all of them alike; the median of the rounds is reported):
1. speed, on the ViT-B/32 text tower (open_clip 'ViT-B-32', random weights: speed does not depend on them): one
   query and batches of 8 and 32, with 1 thread and with all threads; ms per call (tokenizing included, and
   also timed on its own) and the speed-up over fp32; plus the cosine with fp32 on these random weights
   (labelled as such: random weights are not representative);
2. fidelity on a TRAINED checkpoint (``--checkpoint``, ``--corpus``): cosine of each tower's embedding with the
   fp32 embedding (min / mean) over the corpus captions, and retrieval R@1 / R@10 (dual tower and + psi) on the
   corpus splits with the video side fixed (fp32), so only the text tower changes;
3. query-cache hit rates of Zipf query streams (bench/zipf_queries.py) for a few cache sizes.
Writes bench/results/text_encoder.{md,json} (``--out``) with the run's record (bench/harness.py). The report
applies the rule below to this run's numbers and sets its winner beside the product's
``DEFAULT_CPU_TEXT_ENCODER``, saying whether they agree; without a fidelity section it chooses nothing.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import harness  # noqa: E402
from bench.harness import cpu_name, git_commit, start, with_provenance  # noqa: E402
from bench.zipf_queries import hit_rates, vocabulary, zipf_stream  # noqa: E402
from gare.text_packed import token_lengths  # noqa: E402
from gare.text_quant import CUDA_TEXT_ENCODERS, DEFAULT_CPU_TEXT_ENCODER, TEXT_ENCODERS  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "training/gare/text_quant.py",
    "training/gare/text_packed.py",
    "training/gare/text_fixed.py",
    "training/gare/model.py",
    "training/gare/backbone.py",
    "indexer/gare_search/query.py",
    "indexer/gare_search/text_encoder.py",
)

REFERENCE = "fp32"  # the model's own tower: the search's "fp32" option, and the reference of every ratio
# the CPU towers gare.text_quant builds besides the model's own, in its order
KINDS: tuple[str, ...] = tuple(k for k in TEXT_ENCODERS if k not in CUDA_TEXT_ENCODERS)
# Rule for the CPU default (issue 14's, kept): a tower other than fp32 qualifies if it is >= SPEEDUP_MIN x faster
# than fp32 at one query on one thread AND with all threads, and its t2v R@1 (+psi) is within R1_MAX_DROP point of
# fp32's on every evaluated split; of several that qualify, the one whose smaller one-query speed-up is the
# largest; none qualifies: fp32. Without a fidelity section no tower can qualify, and the run chooses nothing.
SPEEDUP_MIN, R1_MAX_DROP = 1.7, 0.5
RULE = (f"a tower other than fp32 qualifies if it is >= {SPEEDUP_MIN}x faster than fp32 for one query with 1 thread "
        f"and with all threads, and its t2v R@1 (+psi) is within {R1_MAX_DROP} point of fp32's on every split; of "
        "several that qualify, the one whose smaller one-query speed-up is the largest; if none qualifies, fp32. "
        "A run without the fidelity section chooses nothing.")


def make_queries(n: int, seed: int = 0) -> list[str]:
    return vocabulary(n, seed)


def build_encoders(model, kinds) -> dict[str, Any]:
    """{kind: the service's QueryEncoder}: fp32 (the model's own tower) first, then ``kinds``, each built by
    ``gare_search.text_encoder.load_query_encoder`` on the CPU at fp32 (at the current torch thread count: the
    fp32-packed tower checks its GEMM at build)."""
    from gare_search.text_encoder import load_query_encoder

    return {k: load_query_encoder(model, k, "cpu", "fp32") for k in (REFERENCE, *kinds)}


def time_side_by_side(calls: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, float]:
    """Median over rounds of the mean ms per call; the callables take turns within every round (in reversed
    order every other round)."""
    for c in calls.values():  # warm-up (oneDNN / MKL pick and cache kernels on the first calls)
        for _ in range(2):
            c()
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(list(calls)))
        for k in order:
            t0 = time.perf_counter()
            for _ in range(per_round):
                calls[k]()
            samples[k].append((time.perf_counter() - t0) / per_round * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def speed_section(args) -> dict[str, Any]:
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(0)
    model = GARE.build(get_model_config("gare-vit-b-32"), pretrained="none").eval()
    queries = make_queries(64, seed=1)
    out: dict[str, Any] = {"model": "gare-vit-b-32 (open_clip ViT-B-32 text tower, random weights)",
                           "reference": REFERENCE, "towers": [REFERENCE, *args.kinds], "schemes": {}, "rows": []}
    all_threads = torch.get_num_threads()
    thread_settings = sorted(set(args.threads or [1, all_threads]))
    for th in thread_settings:
        torch.set_num_threads(th)
        encs = build_encoders(model, args.kinds)
        out["schemes"][str(th)] = {k: e.describe() for k, e in encs.items()}
        print(f"threads={th}: " + "; ".join(out["schemes"][str(th)].values()), flush=True)
        # fidelity on random weights (not representative; the trained-model section is the one that counts)
        ref = encs[REFERENCE].encode(queries)
        cos_rand = {k: F.cosine_similarity(encs[k].encode(queries), ref).numpy() for k in args.kinds}
        out.setdefault("cos_random_weights", {k: {"min": float(v.min()), "mean": float(v.mean())}
                                              for k, v in cos_rand.items()})
        for b in args.batches:
            texts = queries[:b]
            calls = {k: (lambda e=e, t=texts: e.encode(t)) for k, e in encs.items()}
            calls["tokenize"] = lambda t=texts: model.tokenize(t)
            ms = time_side_by_side(calls, args.rounds, max(1, args.calls // b))
            tok_ms = ms.pop("tokenize")
            row = {"threads": th, "batch": b, "L": max(token_lengths(model.tokenize(texts))), "ms": ms,
                   "tokenize_ms": tok_ms, "speedup_vs_fp32": {k: ms[REFERENCE] / v for k, v in ms.items()}}
            out["rows"].append(row)
            print(f"threads={th} batch={b} L={row['L']}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                  + f" (tokenize {tok_ms:.2f} ms)", flush=True)
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

    model, _ = load_model(args.checkpoint, "cpu")
    encs = build_encoders(model, args.kinds)
    out: dict[str, Any] = {"checkpoint": str(args.checkpoint), "checkpoint_sha256": file_sha256(args.checkpoint),
                           "model": model.cfg.backbone, "reference": REFERENCE, "threads": torch.get_num_threads(),
                           "schemes": {k: e.describe() for k, e in encs.items()}, "splits": {}}
    for split in args.splits:
        rs = load_dataset({"kind": "synth", "root": str(args.corpus)}, split)
        enc = encode_set(model, rs, batch_size=16, num_workers=1, progress=True)
        if enc.failed:  # then encode_set would have dropped captions; keep the comparison simple
            raise RuntimeError(f"{len(enc.failed)} corpus videos failed to decode: {enc.failed[:3]}")
        texts = list(rs.captions)
        ts = {k: torch.cat([e.encode(texts[s:s + 64]) for s in range(0, len(texts), 64)]) for k, e in encs.items()}
        ref = ts[REFERENCE]
        split_out: dict[str, Any] = {"n_captions": len(texts), "n_videos": int(enc.vbar.shape[0]), "encoders": {}}
        for k, t in ts.items():
            cos = F.cosine_similarity(t, ref).numpy()
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


def choose(speed: dict[str, Any], fid: dict[str, Any] | None, product_default: str) -> dict[str, Any]:
    """The CPU default by :data:`RULE`, from this run's numbers only, beside ``product_default`` (the product's
    DEFAULT_CPU_TEXT_ENCODER when the run started): ``default`` None when the run cannot choose (no fidelity
    section), ``agrees`` None then, else whether the winner is the product's default."""
    ref = speed["reference"]
    single = [r for r in speed["rows"] if r["batch"] == 1]
    threads_needed = {1, speed["threads_all"]}
    threads_run = {r["threads"] for r in single}
    reasons, qualified = [], {}
    for cand in [k for k in speed["towers"] if k != ref]:
        sp = [r["speedup_vs_fp32"][cand] for r in single]
        fast = threads_needed <= threads_run and all(x >= SPEEDUP_MIN for x in sp)
        drops = []
        if fid is not None:
            for split, so in fid["splits"].items():
                if cand in so["encoders"]:
                    drops.append((split, so["encoders"][ref]["psi"]["R1"] - so["encoders"][cand]["psi"]["R1"]))
        faithful = (fid is not None and bool(fid["splits"]) and len(drops) == len(fid["splits"])
                    and all(d <= R1_MAX_DROP for _, d in drops))
        speed_txt = (", ".join(f"{x:.2f}x" for x in sp) + f" (threads {', '.join(str(r['threads']) for r in single)})"
                     if sp else "not measured")
        if not threads_needed <= threads_run:
            speed_txt += f"; the rule needs threads {', '.join(map(str, sorted(threads_needed)))}"
        reasons.append(
            f"{cand}: speed-up over fp32 at one query {speed_txt}, need >= {SPEEDUP_MIN}x: {'yes' if fast else 'no'}; "
            f"R@1 (+psi) drop {', '.join(f'{s} {d:+.2f}' for s, d in drops) or 'not measured'} "
            f"(need <= {R1_MAX_DROP} on every split): {'yes' if faithful else 'no'}")
        if fast and faithful:
            qualified[cand] = min(sp)
    if fid is None:
        default = None
    else:
        default = max(qualified, key=qualified.__getitem__) if qualified else ref
    return {"rule": RULE, "default": default, "qualified": qualified, "reasons": reasons,
            "product_default": product_default, "agrees": None if default is None else default == product_default}


def write_report(res: dict[str, Any], out_dir: Path) -> None:
    harness.write_report(out_dir / "text_encoder.json", res, markdown)


def _choice_md(ch: dict[str, Any]) -> list[str]:
    L = ["## Choice of the CPU default", "", f"Rule (bench/text_encoder.py, `RULE`): {ch['rule']}", ""]
    L += [f"- {r}" for r in ch["reasons"]]
    prod = f"`{ch['product_default']}` (`gare.text_quant.DEFAULT_CPU_TEXT_ENCODER` at the run's commit)"
    if ch["default"] is None:
        L += ["", "**No choice from this run**: it measured no fidelity on a trained checkpoint (`--checkpoint`), which "
              f"the rule needs. The product's CPU default is {prod}; this run neither confirms nor contradicts it.", ""]
    elif ch["agrees"]:
        L += ["", f"**Default from this run: `{ch['default']}`**, the product's CPU default {prod}.", ""]
    else:
        L += ["", f"**Default from this run: `{ch['default']}`. This DISAGREES with the product's CPU default {prod}**: "
              "by this run's numbers the product does not serve the tower its rule picks.", ""]
    return L


@with_provenance
def markdown(res: dict[str, Any]) -> str:
    sp = res["speed"]
    ref, towers = sp["reference"], sp["towers"]
    L = [
        f"# CPU text towers: {' vs '.join(towers)}", "",
        f"- commit `{res['commit']}`, date {res['date']}, CPU: {res['cpu']} ({res['cores']} logical cores visible, "
        f"torch {res['torch']})",
        f"- command: `{res['command']}`",
        f"- note: {res['note']}",
        *([f"- fidelity and Zipf sections from an earlier run on the same machine: commit `{res['sections_from']['commit']}`, "
           f"{res['sections_from']['date']}, command `{res['sections_from']['command']}`"] if res.get("sections_from") else []),
        *([f"- Zipf section from the run: commit `{res['zipf_from']['commit']}`, {res['zipf_from']['date']}, "
           f"command `{res['zipf_from']['command']}`"] if res.get("zipf_from") else []),
        "",
        "## Speed (ViT-B/32 text tower, random weights)", "",
        "Each tower as the service builds and runs it (`gare_search.text_encoder.load_query_encoder(model, kind, "
        "\"cpu\", \"fp32\").encode(texts)`: tokenizing, then the tower). ms per call, median of interleaved rounds; "
        f"speed-up = {ref} / tower. `{ref}` is the model's own tower (`GARE.encode_text`, each text alone); "
        "`tokenize` is the tokenizing alone, included in every tower's time. L: the longest text's tokens. The "
        "scheme each tower ran with:", "",
    ]
    for th, schemes in sp["schemes"].items():
        L.append(f"- {th} thread{'s' if th != '1' else ''}: " + "; ".join(schemes.values()))
    others = [k for k in towers if k != ref]
    L += ["", "| threads | batch | L | " + " | ".join(towers) + " | tokenize | " + " | ".join(f"x {k}" for k in others) + " |",
          "|---:|---:|---:|" + "---:|" * (len(towers) + 1 + len(others))]
    for r in sp["rows"]:
        L.append(f"| {r['threads']} | {r['batch']} | {r['L']} | " + " | ".join(f"{r['ms'][k]:.2f}" for k in towers)
                 + f" | {r['tokenize_ms']:.2f} | " + " | ".join(f"{r['speedup_vs_fp32'][k]:.2f}" for k in others) + " |")
    L += ["", f"Cosine with the {ref} embedding on the random-weight ViT-B/32 (64 queries; NOT representative of trained "
          "weights):", "", "| tower | min | mean |", "|---|---:|---:|"]
    for k, v in sp["cos_random_weights"].items():
        L.append(f"| {k} | {v['min']:.5f} | {v['mean']:.5f} |")
    fid = res.get("fidelity")
    if fid:
        L += ["", f"## Fidelity on a trained checkpoint ({fid['model']})", "",
              f"Checkpoint `{fid['checkpoint']}` (sha256 {fid['checkpoint_sha256'][:12]}…), {fid['threads']} threads; "
              f"towers: {'; '.join(fid['schemes'].values())}. Video side fixed ({ref}). {res.get('fidelity_note', '')}", "",
              "| split | captions | videos | tower | cos min | cos mean | R@1 dual | R@10 dual | R@1 +psi | R@10 +psi |",
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
    L += ["", *_choice_md(res["choice"])]
    return "\n".join(L)


def _current(data: dict[str, Any], what: str, section: str) -> None:
    """Refuse a section written before the towers were the product's (its reference was the removed stand-alone
    fp32 tower beside "model-fp32", and it measured towers the product no longer has): rerun instead."""
    sec = data.get(section)
    if sec is not None and sec.get("reference") != REFERENCE:
        raise SystemExit(f"{what}: its {section} section predates the current CPU towers ({', '.join((REFERENCE, *KINDS))}); "
                         "rerun python -m bench.text_encoder instead of re-rendering it")


def _merge(res: dict[str, Any], prev: dict[str, Any]) -> None:
    """Fidelity and Zipf sections from another run (which measured no speed), with its provenance."""
    res["fidelity"], res["zipf"] = prev.get("fidelity"), prev.get("zipf")
    res["fidelity_note"] = prev.get("fidelity_note", "")
    res["sections_from"] = {k: prev[k] for k in ("commit", "command", "date", "cpu")}


def _say(ch: dict[str, Any], out: Path) -> None:
    if ch["default"] is None:
        verdict = f"no choice (no fidelity section); the product's default is {ch['product_default']}"
    else:
        verdict = (f"default {ch['default']}, " + ("the product's default" if ch["agrees"] else
                   f"DISAGREES with the product's default {ch['product_default']}"))
    print(f"{verdict}; wrote {out / 'text_encoder.md'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="a trained GARE checkpoint for the fidelity section")
    ap.add_argument("--corpus", type=Path, help="the synth corpus the checkpoint was trained on")
    ap.add_argument("--splits", nargs="+", default=["test", "train"])
    ap.add_argument("--fidelity-note", default="")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                    help="the CPU towers measured beside fp32, the model's own (default: all of them)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, nargs="+", help="torch thread counts (default: 1 and all)")
    ap.add_argument("--fidelity-json", type=Path,
                    help="take the fidelity and zipf sections from this earlier run's JSON (its provenance is kept)")
    ap.add_argument("--zipf-json", type=Path, help="take the zipf section from this run's JSON instead")
    ap.add_argument("--render", type=Path, metavar="SPEED_JSON",
                    help="run nothing: re-render the report from a speed run's text_encoder.json (with --fidelity-json)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=32, help="texts per round and tower (calls = calls // batch)")
    ap.add_argument("--zipf-distinct", type=int, default=100_000)
    ap.add_argument("--zipf-n", type=int, default=200_000)
    ap.add_argument("--zipf-s", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    ap.add_argument("--zipf-entries", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--zipf-perturb", type=float, default=0.1)
    ap.add_argument("--skip", nargs="*", default=[], choices=["speed", "fidelity", "zipf"])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    if args.checkpoint is not None and args.corpus is None and "fidelity" not in args.skip:
        ap.error("--checkpoint needs --corpus (the synth corpus the checkpoint was trained on)")

    if args.render is not None:
        res = json.loads(args.render.read_text())
        _current(res, str(args.render), "speed")
        if args.fidelity_json is not None:
            prev = json.loads(args.fidelity_json.read_text())
            _current(prev, str(args.fidelity_json), "fidelity")
            _merge(res, prev)
        if args.zipf_json is not None:
            z = json.loads(args.zipf_json.read_text())
            res["zipf"] = z["zipf"]
            res["zipf_from"] = {k: z[k] for k in ("commit", "command", "date", "cpu")}
        res["choice"] = choose(res["speed"], res["fidelity"], res["product_default"])
        write_report(res, args.out)
        _say(res["choice"], args.out)
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
        "product_default": DEFAULT_CPU_TEXT_ENCODER,  # what `text_encoder: auto` serves on the CPU at this commit
    }
    res["speed"] = speed_section(args) if "speed" not in args.skip else None
    res["fidelity"] = fidelity_section(args) if args.checkpoint and "fidelity" not in args.skip else None
    res["zipf"] = zipf_section(args) if "zipf" not in args.skip else None
    if args.fidelity_json is not None:
        prev = json.loads(args.fidelity_json.read_text())
        _current(prev, str(args.fidelity_json), "fidelity")
        _merge(res, prev)
    res["run"] = run.record()
    if res["speed"] is not None:
        res["choice"] = choose(res["speed"], res["fidelity"], res["product_default"])
        write_report(res, args.out)
        _say(res["choice"], args.out)
    else:
        harness.write_json(args.out / "text_encoder_fidelity.json", res)
        print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
