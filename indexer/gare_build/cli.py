"""`gare-index`: build | add | remove | biases | tune | upgrade | verify | seal | stats | gc | compare: the commands run on
the parsed command line (the parser: :mod:`gare_build.cli_parser`; see docs/index-format.md and docs/postprocessing.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from gare.annotations import load_dataset, load_manifest
from gare.checkpoint import file_sha256
from gare.cli_logging import setup_cli_logging
from gare.data_args import data_spec
from gare_build.build import build, recompute_biases, remove, stats
from gare_build.cli_parser import build_parser
from gare_build.compare import CompareOptions, run_compare
from gare_build.pipeline.options import BUILD_LOCK, BuildOptions, RunReport, auto_decode_workers
from gare_build.retune import retune
from gare_build.shard_build import (
    biases_sharded,
    build_sharded,
    gc_sharded,
    remove_sharded,
    stats_sharded,
    tune_sharded,
    verify_sharded,
)
from gare_build.tuning.version_tuning import Stage1Options
from gare_build.upgrade import upgrade
from gare_index.describe import describe_stage1
from gare_index.fields import parse_field_spec
from gare_index.shards import current_generation, is_sharded, shard_root
from gare_index.store import (
    VERSIONS_DIR,
    WORK_DIR,
    IndexFormatError,
    current_version_name,
    gc,
    index_lock,
    open_version,
    seal_status,
    seal_version,
    verify_index,
)
from gare_search.search import DEFAULT_CANDIDATES

log = logging.getLogger(__name__)


def _stage1_options(args: argparse.Namespace) -> Stage1Options:
    """The stage-1 tuning options of build/add/tune."""
    for flag, value in (("--recall-target", args.recall_target), ("--coverage-target", args.coverage_target)):
        if value > 1:
            raise ValueError(f"{flag} must be in (0, 1], got {value}")
    bank = getattr(args, "from_bank", None)
    if bank is not None and args.tune_captions:
        raise ValueError("--from-bank and --tune-captions are two sources of tuning queries: give one")
    return Stage1Options(enabled=getattr(args, "tune", True), recall_target=args.recall_target,
                         candidates=DEFAULT_CANDIDATES, latency_budget_ms=args.latency_budget_ms,
                         latency_ceiling_ms=args.latency_ceiling_ms, spread=args.tune_spread,
                         n_queries=max(2, args.tune_queries), coverage_queries=getattr(args, "coverage_queries", None),
                         coverage_target=args.coverage_target, bank=bank)


def _caption_texts(source: str | None) -> list[str] | None:
    """--tune-captions: the caption strings of a manifest, or of a synth corpus's test split."""
    if not source:
        return None
    p = Path(source)
    if p.is_dir():
        rs = load_dataset({"kind": "synth", "root": str(p)}, "test")
    elif p.is_file():
        rs = load_manifest(p)
    else:
        raise ValueError(f"--tune-captions {source}: no such file or folder")
    texts = list(rs.captions)
    if not texts:
        raise ValueError(f"--tune-captions {source}: no captions")
    return texts


def _validate_build(args: argparse.Namespace) -> None:
    """Checks that need no model: a typo in a path costs a second, not a model load."""
    if args.checkpoint is not None and not Path(args.checkpoint).is_file():
        raise FileNotFoundError(f"--checkpoint {args.checkpoint!r} does not exist or is not a file; give a GARE "
                                "checkpoint (.safetensors) written by `gare-train fit`")
    if not Path(args.videos).exists():
        raise FileNotFoundError(f"--videos {args.videos!r} does not exist; give a folder of video files or a "
                                "JSONL/JSON/CSV manifest with a 'video' column")
    if args.cmd == "add" and not (Path(args.out) / "CURRENT").is_file() and not is_sharded(args.out):
        raise FileNotFoundError(f"--out {args.out!r} is not a gare index (no CURRENT file); use `gare-index build` "
                                "to create one")
    if args.segment is None and args.overlap:
        raise ValueError(f"--overlap {args.overlap:g} needs --segment SECONDS")
    if args.segment is not None and args.overlap >= args.segment:
        raise ValueError(f"--overlap {args.overlap:g} must be smaller than --segment {args.segment:g}")


def _cmd_build(args: argparse.Namespace) -> int:
    _validate_build(args)
    opts = BuildOptions(
        index_type=args.index_type, nlist=args.nlist, nprobe=args.nprobe, hnsw_m=args.hnsw_m, ef_search=args.ef_search,
        ef_construction=args.ef_construction, pq_m=args.pq_m, rescore=args.rescore, rebuild_ann=args.rebuild_ann,
        segment=args.segment, overlap=args.overlap, batch_size=args.batch_size,
        workers=auto_decode_workers(args.device) if args.workers == "auto" else args.workers,
        device=args.device, precision=args.precision, engine=args.engine, scheduler=args.scheduler,
        dask_workers=args.dask_workers, shard_size=args.shard_size, store_kv=None, frames_dtype=args.frames_dtype,
        keep=args.keep,
        n_iters=args.n_iters, progress=args.progress, decode_timeout=args.decode_timeout,
        invgc=args.invgc, ncl_stage1=args.ncl_stage1, bias_score=args.bias_score, stage1=_stage1_options(args),
        tune_captions=_caption_texts(args.tune_captions), fields=parse_field_spec(args.fields),
    )
    if args.bias_k is not None:
        opts.bias_k = args.bias_k
    opts.bias_queue, opts.bias_captions, opts.ncl_val = args.bias_queue, args.bias_captions, args.ncl_val
    if args.ncl_gammas is not None:
        opts.ncl_gammas = args.ncl_gammas
    if args.cmd == "build":
        opts.invgc_val, opts.invgc_r_g, opts.invgc_r_q = args.invgc_val, args.invgc_r_g, args.invgc_r_q
        opts.invgc_k, opts.invgc_grid, opts.ncl_c = args.invgc_k, args.invgc_grid, args.ncl_c
    if args.shards is not None and (Path(args.out) / "CURRENT").is_file():
        raise ValueError(f"--out {args.out!r} is a single index; --shards needs a new folder (or a sharded index)")
    if args.shards is not None or is_sharded(args.out):  # --ncl-val: decided once over the whole gallery
        report = build_sharded(args.checkpoint, args.videos, args.out, opts, n_shards=args.shards, mode=args.cmd)
    else:
        report = build(args.checkpoint, args.videos, args.out, opts, mode=args.cmd)
    _print_skips(report)
    print(report.summary())
    if report.invgc:
        inv = report.invgc
        sel = inv.get("selection") or {}
        how = (f"chosen on {sel.get('validation')}: validation R@1 {sel.get('baseline', float('nan')):.1f} -> "
               f"{sel.get('score', float('nan')):.1f}") if sel.get("method") == "grid" else "given"
        print(f"InvGC applied to the stage-1 vectors: r_g={inv['r_g']:g}, r_q={inv['r_q']:g}, k={inv['k_percent']:g}% ({how})")
    if report.ncl_stage1:
        print("NCL stage 1: ann_ncl.faiss written (candidates by cos + b)")
    if (report.biases or {}).get("default"):
        print(report.biases["default"]["reason"])
    if report.stage1:
        print(describe_stage1(report.stage1))
    return report.exit_code


def _cmd_tune(args: argparse.Namespace) -> int:
    run = tune_sharded if is_sharded(args.out) else retune  # sharded: every shard, then one new generation
    report = run(args.out, options=_stage1_options(args), checkpoint=args.checkpoint,
                    captions=_caption_texts(args.tune_captions), index_type=args.index_type, keep=args.keep,
                    progress=args.progress)
    print(report.summary())
    print(describe_stage1(report.stage1))
    return report.exit_code


def _refuse_sharded(args: argparse.Namespace) -> None:
    if is_sharded(args.out):
        raise ValueError(f"gare-index {args.cmd} does not run on a sharded index yet ({args.out}): it would write shard "
                         "versions outside a generation")


def _print_skips(report: RunReport) -> None:
    for s in report.skipped[:20]:
        where = s["path"] + (f" [{s.get('start', 0):g}-{s.get('end', 0):g}s]" if "start" in s or "end" in s else "")
        print(f"skipped {where}: {s['reason']}", file=sys.stderr)
    if len(report.skipped) > 20:
        print(f"... and {len(report.skipped) - 20} more (see {Path(report.index) / 'report.json'})", file=sys.stderr)


def _cmd_remove(args: argparse.Namespace) -> int:
    if is_sharded(args.out):  # ids are global ids (local * N + shard)
        report = remove_sharded(args.out, args.items, checkpoint=args.checkpoint, keep=args.keep)
        print(report.summary())
        return report.exit_code
    report = remove(args.out, args.items, checkpoint=args.checkpoint, keep=args.keep)
    print(report.summary())
    return report.exit_code


def _cmd_biases(args: argparse.Namespace) -> int:
    run = biases_sharded if is_sharded(args.out) else recompute_biases
    report = run(args.out, checkpoint=args.checkpoint, keep=args.keep, n_iters=args.n_iters,
                 traffic=args.from_traffic, traffic_weight=args.traffic_weight,
                 score=args.bias_score or "served", k=args.bias_k, queue_kind=args.bias_queue,
                 captions=args.bias_captions, ncl_val=args.ncl_val,
                 **({} if args.ncl_gammas is None else {"gamma_factors": args.ncl_gammas}))
    b = report.biases
    msg = report.summary() + f"; biases from {b.get('source')} ({b.get('n_queries')} queries, gamma={b.get('gamma')}, " \
                             f"fitted to the {'psi (served)' if b.get('score') == 'served' else 'dual-tower'} score)"
    if b.get("queue"):
        q = b["queue"]
        msg += f"; {q.get('kind')} queue ({q.get('n')} queries" + (f" of {q.get('captions')})" if q.get("captions") else ")")
    if b.get("default"):
        msg += f"; {b['default']['reason']}"
    if b.get("traffic"):
        t = b["traffic"]
        msg += f"; {t['traffic_queries']} traffic + {t['train_queries']} training queries"
    print(msg)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    return report.exit_code


def _cmd_upgrade(args: argparse.Namespace) -> int:
    _refuse_sharded(args)
    report = upgrade(args.out, checkpoint=args.checkpoint, keep=args.keep, device=args.device, force=args.force)
    print(report.summary())
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    return report.exit_code


def _cmd_compare(args: argparse.Namespace) -> int:
    if (args.invgc_r_g is None) != (args.invgc_r_q is None):
        raise ValueError("--invgc-r-g and --invgc-r-q go together")
    if args.msrvtt_anno and not args.videos:
        raise ValueError("--msrvtt-anno needs --videos")
    given = [x for x in (args.synth, args.msrvtt_anno, args.test_manifest) if x]
    if len(given) != 1:
        raise ValueError("give exactly one of --synth, --msrvtt-anno (with --videos) or --test-manifest")
    data = data_spec(args)
    opts = CompareOptions(
        checkpoint=args.checkpoint, data=data, out=args.out, val=args.val, gallery=args.gallery,
        candidates=args.candidates, coverage_ks=tuple(args.coverage_ks), latency_queries=args.latency_queries,
        latency_repeats=args.latency_repeats, latency_threads=args.latency_threads,
        invgc_r_g=args.invgc_r_g, invgc_r_q=args.invgc_r_q, invgc_grid=args.invgc_grid, index_type=args.index_type,
        bank=args.bank, bank_weight=args.bank_weight,
        index_dir=args.index_dir, device=args.device, precision=args.precision, batch_size=args.batch_size,
        workers=args.workers, progress=args.progress, filter=args.filter,
    )
    result = run_compare(opts)
    print(Path(result["paths"]["md"]).read_text())
    print(f"wrote {', '.join(str(p) for p in result['paths'].values())}")
    return 0


# a version without manifest.json.xxh3 is not a problem: verify says so and how to seal it
UNSEALED = "unsealed: written before manifests were sealed; `gare-index seal` seals it"


def _cmd_verify(args: argparse.Namespace) -> int:
    sha = file_sha256(args.checkpoint) if args.checkpoint else None
    if is_sharded(args.out):
        return _verify_sharded(args, sha)
    problems = verify_index(args.out, name=args.version_name, rehash=not args.quick, expect_checkpoint_sha=sha,
                            check_files=args.check_videos)
    name = args.version_name or current_version_name(args.out)
    sealed = seal_status(Path(args.out) / VERSIONS_DIR / name).state == "sealed"
    if args.json:
        print(json.dumps({"index": str(args.out), "version": name, "ok": not problems, "problems": list(problems),
                          "sealed": sealed}, indent=1))
        return 1 if problems else 0
    if problems:
        for p in problems:
            print(f"FAIL {p}", file=sys.stderr)
        print(f"verify: {len(problems)} problem(s) in {args.out}")
        return 1
    with open_version(args.out, name, use_gpu=False) as v:
        padding = "reference_padding (padded rows kept, v̄ over all rows)" if v.reference_padding else "padded rows masked"
    print(f"verify: {args.out} {name} OK ({padding}; {'sealed' if sealed else UNSEALED})")
    return 0


def _cmd_seal(args: argparse.Namespace) -> int:
    """Seal CURRENT's version (or --version's; a sharded root: every shard's version of the current generation)."""
    if is_sharded(args.out):
        if args.version_name:
            raise ValueError("--version names a version of one index; a sharded index is sealed at its current "
                             "generation")
        gen = current_generation(args.out)
        targets = [(shard_root(args.out, s), name) for s, name in enumerate(gen.versions)]
    else:
        targets = [(Path(args.out), args.version_name or current_version_name(args.out))]
    for root, name in targets:
        print(f"seal: {root} {name} {seal_version(root, name)}")
    return 0


def _verify_sharded(args: argparse.Namespace, sha: str | None) -> int:
    """verify on a sharded root: every shard's version of the current generation, and the routing."""
    if args.version_name:
        raise ValueError("--version names a version of one index; a sharded index is verified at its current generation")
    problems = verify_sharded(args.out, rehash=not args.quick, expect_checkpoint_sha=sha, check_files=args.check_videos)
    gen = current_generation(args.out)
    if args.json:
        print(json.dumps({"index": str(args.out), "generation": None if gen is None else gen.number,
                          "versions": None if gen is None else list(gen.versions), "ok": not problems,
                          "problems": list(problems)}, indent=1))
        return 1 if problems else 0
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if problems:
        print(f"verify: {len(problems)} problem(s) in {args.out}")
        return 1
    unsealed = [f"shard {s} ({name})" for s, name in enumerate(gen.versions)
                if seal_status(shard_root(args.out, s) / VERSIONS_DIR / name).state != "sealed"]
    print(f"verify: {args.out} generation {gen.number} ({gen.n_shards} shards: {', '.join(gen.versions)}) OK"
          + (f" ({', '.join(unsealed)} {UNSEALED})" if unsealed else ""))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    if is_sharded(args.out):
        st = stats_sharded(args.out)
        if args.json:
            print(json.dumps(st, indent=1, default=str))
            return 0
        print(f"generation {st['generation']}: {st['n']} videos in {st['n_shards']} shards, {st['bytes_total']} bytes")
        for s, sh in enumerate(st["shards"]):
            print(f"  shard {s}: {sh['version']}, {sh['n']} videos, {sh['bytes_total']} bytes, {sh['index_type']}")
        print("(--json prints everything)")
        return 0
    if not (Path(args.out) / "CURRENT").is_file():
        raise FileNotFoundError(f"--out {args.out!r} is not a gare index (no CURRENT file)")
    st = stats(args.out)
    if args.json:
        print(json.dumps(st, indent=1, default=str))
        return 0
    # A readable summary of the scalar fields; --json has everything (nested fields included).
    width = max(len(k) for k in st)
    for k, v in st.items():
        if not isinstance(v, (dict, list)):
            print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    s1 = st.get("stage1")
    if s1:  # the stage-1 promise measured at build time (the manifest's `stage1`, docs/index-format.md)
        verdict = {True: "met", False: "NOT met"}.get(s1.get("met"), "")
        print(f"{'stage1':<{width}}  {verdict + ': ' if verdict else ''}recall@{s1.get('recall_at')} of the exact "
              f"cosine top-{s1.get('recall_k', 10)} {s1.get('recall')} (target {s1.get('recall_target')}), p50 "
              f"{s1.get('p50_ms')} ms, default K={s1.get('default_candidates')} (psi coverage target "
              f"{s1.get('coverage_target')}), "
              "psi coverage " + ", ".join(f"K={k}: {v}" for k, v in sorted((s1.get("coverage") or {}).items(),
                                                                            key=lambda kv: int(kv[0])))
              + f", queries: {s1.get('query_source')}")
        dv = s1.get("deviation")
        if dv:  # SPEC §4's deviation, next to the figure the authors' rebuttal gives for MSR-VTT
            print(f"{'deviation':<{width}}  |cos(t+Δ, v̄) - cos(t, v̄)| mean {dv['delta_mean_abs']:.4f}, 95th percentile "
                  f"{dv['delta_p95_abs']:.4f} over {dv['pairs']} sampled pairs (authors: {dv['authors']})")
    print("(--json prints everything)")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    root = Path(args.out)
    if is_sharded(root):  # never a version that the current or the previous generation names
        removed_by = gc_sharded(root, keep=args.keep)
        msg = "gc: " + "; ".join(f"shard {s}: removed {r}" for s, r in removed_by.items())
        if args.work:
            with index_lock(root, BUILD_LOCK, blocking=False):
                for s in removed_by:
                    shutil.rmtree(shard_root(root, s) / WORK_DIR, ignore_errors=True)
            msg += "; work caches deleted"
        print(msg)
        return 0
    if not (root / "CURRENT").is_file():
        raise ValueError(f"{root}: not a gare index (no CURRENT file)")
    removed = gc(root, keep=args.keep)
    msg = f"gc: removed {len(removed)} old version(s) {removed}"
    if args.work:
        with index_lock(root, BUILD_LOCK, blocking=False):
            shutil.rmtree(root / WORK_DIR, ignore_errors=True)
        msg += "; work cache deleted"
    print(msg)
    return 0


COMMANDS = {"build": _cmd_build, "add": _cmd_build, "remove": _cmd_remove, "biases": _cmd_biases,
            "verify": _cmd_verify, "seal": _cmd_seal, "stats": _cmd_stats, "gc": _cmd_gc, "compare": _cmd_compare,
            "upgrade": _cmd_upgrade, "tune": _cmd_tune}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # third-party libraries stay at WARNING unless -v
    setup_cli_logging(args.verbose, level=logging.WARNING if args.quiet else logging.INFO)
    try:
        return COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        print(f"gare-index {args.cmd}: interrupted; the previous version is still current", file=sys.stderr)
        return 1
    except (IndexFormatError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"gare-index {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the exit code contract: 1 on any failure
        log.debug("failure", exc_info=True)
        print(f"gare-index {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
