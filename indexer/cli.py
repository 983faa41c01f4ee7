"""`gare-index`: build | add | remove | biases | verify | stats | gc (see docs/index-format.md)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

EPILOG = """\
exit codes:
  0  done
  3  done, but some files were skipped (reasons in INDEX/report.json and the summary line)
  1  failed (nothing was changed: the previous version stays current); for verify: the index is inconsistent
  2  bad command line

Every change writes a new version under INDEX/versions/ and then switches INDEX/CURRENT atomically; a run
that is killed leaves the previous version current, and the next run resumes from INDEX/work/ without
re-encoding finished videos.
"""


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s!r}")
    return v


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s!r}")
    return v


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s!r}")
    return v


def _add_index_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", "--index", dest="out", required=True, metavar="INDEX", help="index directory")


def _add_encode_args(p: argparse.ArgumentParser, *, build: bool) -> None:
    p.add_argument("--checkpoint", required=build, metavar="CKPT",
                   help="GARE checkpoint (.safetensors)" + ("" if build else "; default: the one the index was built with (same sha256 required)"))
    p.add_argument("--videos", required=True, metavar="DIR|MANIFEST",
                   help="a folder (searched recursively for mp4, mkv, webm, mov, avi, ...) or a JSONL/JSON/CSV manifest "
                        "with a 'video' path column (relative to the manifest) and optional 'start', 'end' (seconds) and 'id'")
    _add_index_arg(p)
    from .ann import INDEX_TYPES

    g = p.add_argument_group("ANN index")
    g.add_argument("--index-type", choices=("auto", *INDEX_TYPES), default=None,
                   help="auto (default for build): flat below 50k videos, ivf up to 5M, ivfpq beyond; hnsw on request"
                        + ("" if build else "; default: keep the index's setting"))
    g.add_argument("--nlist", type=_positive_int, help="IVF cells (default ~4 sqrt(n))")
    g.add_argument("--nprobe", type=_positive_int, help="IVF cells scanned per query")
    g.add_argument("--hnsw-m", type=_positive_int, help="HNSW links per node (default 32)")
    g.add_argument("--ef-search", type=_positive_int, help="HNSW search breadth (default 128)")
    g.add_argument("--ef-construction", type=_positive_int, help="HNSW build breadth (default 200)")
    g.add_argument("--pq-m", type=_positive_int, help="IVF-PQ sub-quantisers (must divide d)")
    g.add_argument("--rescore", type=_positive_int, help="IVF-PQ: re-score k * RESCORE candidates exactly (default 4)")
    g.add_argument("--rebuild-ann", action="store_true", help="rebuild (re-train) the ANN index instead of updating it")

    g = p.add_argument_group("encoding")
    g.add_argument("--segment", type=_positive_float, metavar="SECONDS",
                   help="index windows of SECONDS of each video as separate entries (with start/end)")
    g.add_argument("--overlap", type=_nonneg_float, default=0.0, metavar="SECONDS", help="overlap of consecutive windows")
    g.add_argument("--batch-size", type=_positive_int, default=16, help="clips per encoder batch (default 16)")
    g.add_argument("--workers", type=int, default=2, help="decode worker processes (default 2; 0 decodes in the main process)")
    g.add_argument("--device", default="auto", help="auto (cuda when present) | cpu | cuda | cuda:N")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="encoder autocast (default fp32; bf16 on CPUs with AVX512-bf16 or GPUs; fp16 on CUDA only)")
    g.add_argument("--store-kv", action=argparse.BooleanOptionalAction, default=None,
                   help="also store psi's per-video K/V projections (3x the frame bytes, ~5x faster CPU reranking)")
    g.add_argument("--decode-timeout", type=_positive_float, default=300.0, help="seconds before a stuck decoder is killed")
    g.add_argument("--n-iters", type=_positive_int, default=4, help="Sinkhorn iterations for the NCL biases (default 4)")

    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=("local", "dask"), default="local",
                   help="local: decode processes + one encoder; dask: decode + encode on Dask workers")
    g.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler address (default: a LocalCluster on 127.0.0.1)")
    g.add_argument("--dask-workers", type=_positive_int, default=2, help="LocalCluster worker processes (default 2)")
    g.add_argument("--shard-size", type=_positive_int, default=64, help="clips per Dask task (default 64)")

    p.add_argument("--keep", type=_positive_int, default=3, help="versions to keep (default 3; older ones are removed)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gare-index", description="Index a video library for GARE search: FAISS + frame features + NCL biases.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    for name, helptext in (("build", "index a video library (the new version holds exactly these videos)"),
                           ("add", "add new and changed files (by checksum) to the current version")):
        sp = sub.add_parser(name, help=helptext, description=helptext, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_encode_args(sp, build=name == "build")

    sp = sub.add_parser("remove", help="remove videos by id or path (all windows of a path), recompute the biases",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("items", nargs="+", metavar="ID|PATH")
    sp.add_argument("--checkpoint", help="checkpoint for the biases (default: the index's; same sha256 required)")
    sp.add_argument("--keep", type=_positive_int, default=3)

    sp = sub.add_parser("biases", help="recompute the NCL video biases (new version; other files hard-linked)",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("--checkpoint", help="default: the index's (same sha256 required)")
    sp.add_argument("--n-iters", type=_positive_int, default=None)
    sp.add_argument("--keep", type=_positive_int, default=3)

    sp = sub.add_parser("verify", help="check counts (FAISS, arrays, SQLite), files and checksums; exit 1 with the reasons",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("--version", dest="version_name", help="a version other than CURRENT")
    sp.add_argument("--quick", action="store_true", help="skip re-hashing the files (sizes are still checked)")
    sp.add_argument("--checkpoint", help="also check that the index was built with this checkpoint")
    sp.add_argument("--check-videos", action="store_true", help="also check that every video file is unchanged on disk")

    sp = sub.add_parser("stats", help="print the index's statistics (JSON)")
    _add_index_arg(sp)

    sp = sub.add_parser("gc", help="remove old versions (never the current one), unfinished writes and, with --work, the work cache")
    _add_index_arg(sp)
    sp.add_argument("--keep", type=_positive_int, default=3)
    sp.add_argument("--work", action="store_true", help="also delete INDEX/work (the resume cache of interrupted runs)")
    return p


def _cmd_build(args: argparse.Namespace) -> int:
    from .build import BuildOptions, build

    opts = BuildOptions(
        index_type=args.index_type, nlist=args.nlist, nprobe=args.nprobe, hnsw_m=args.hnsw_m, ef_search=args.ef_search,
        ef_construction=args.ef_construction, pq_m=args.pq_m, rescore=args.rescore, rebuild_ann=args.rebuild_ann,
        segment=args.segment, overlap=args.overlap, batch_size=args.batch_size, workers=args.workers,
        device=args.device, precision=args.precision, engine=args.engine, scheduler=args.scheduler,
        dask_workers=args.dask_workers, shard_size=args.shard_size, store_kv=args.store_kv, keep=args.keep,
        n_iters=args.n_iters, progress=args.progress, decode_timeout=args.decode_timeout,
    )
    report = build(args.checkpoint, args.videos, args.out, opts, mode=args.cmd)
    _print_skips(report)
    print(report.summary())
    return report.exit_code


def _print_skips(report) -> None:
    for s in report.skipped[:20]:
        where = s["path"] + (f" [{s.get('start', 0):g}-{s.get('end', 0):g}s]" if "start" in s or "end" in s else "")
        print(f"skipped {where}: {s['reason']}", file=sys.stderr)
    if len(report.skipped) > 20:
        print(f"... and {len(report.skipped) - 20} more (see {Path(report.index) / 'report.json'})", file=sys.stderr)


def _cmd_remove(args: argparse.Namespace) -> int:
    from .build import remove

    report = remove(args.out, args.items, checkpoint=args.checkpoint, keep=args.keep)
    print(report.summary())
    return report.exit_code


def _cmd_biases(args: argparse.Namespace) -> int:
    from .build import recompute_biases

    report = recompute_biases(args.out, checkpoint=args.checkpoint, keep=args.keep, n_iters=args.n_iters)
    b = report.biases
    print(report.summary() + f"; biases from {b.get('source')} ({b.get('n_queries')} queries, gamma={b.get('gamma')})")
    return report.exit_code


def _cmd_verify(args: argparse.Namespace) -> int:
    from .store import current_version_name, file_sha256, verify_index

    sha = file_sha256(args.checkpoint) if args.checkpoint else None
    problems = verify_index(args.out, name=args.version_name, rehash=not args.quick, expect_checkpoint_sha=sha,
                            check_files=args.check_videos)
    if problems:
        for p in problems:
            print(f"FAIL {p}", file=sys.stderr)
        print(f"verify: {len(problems)} problem(s) in {args.out}")
        return 1
    name = args.version_name or current_version_name(args.out)
    print(f"verify: {args.out} {name} OK")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from .build import stats

    print(json.dumps(stats(args.out), indent=1, default=str))
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    import shutil

    from .build import BUILD_LOCK
    from .store import WORK_DIR, gc, index_lock

    root = Path(args.out)
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
            "verify": _cmd_verify, "stats": _cmd_stats, "gc": _cmd_gc}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("indexer", "training"):  # third-party libraries stay at WARNING
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    from .store import IndexFormatError

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
