"""The `gare-index` command line: the argument parser, its argument types and the help of every subcommand.

The commands that run on the parsed arguments are in :mod:`gare_build.cli`.
"""

from __future__ import annotations

import argparse
import json

from gare.data_args import add_data_args
from gare_index.ann_params import INDEX_TYPES
from gare_search.search import DEFAULT_CANDIDATES

__all__ = ["EPILOG", "build_parser"]

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


def _factors(s: str) -> tuple[float, ...]:
    try:
        v = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {s!r}") from None
    if not v or any(not (f > 0 and f < float("inf")) for f in v):
        raise argparse.ArgumentTypeError(f"factors must be positive finite numbers, got {s!r}")
    return v


def _json_object(text: str) -> dict:
    """A command-line JSON object (a filter), or argparse's error naming the problem."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s!r}")
    return v


def _workers(s: str) -> int | str:
    """--workers: "auto" (gare_build.pipeline.options.auto_decode_workers) or a count >= 0."""
    if s == "auto":
        return s
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not auto or an integer: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s!r}")
    return v


def _unit_float(s: str) -> float:
    v = _nonneg_float(s)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {s!r}")
    return v


def _percent(s: str) -> float:
    v = _positive_float(s)
    if v > 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100], got {s!r}")
    return v


def _float_list(s: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {s!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"need non-negative numbers, got {s!r}")
    return vals


def _int_list(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {s!r}")
    return vals


def _add_postprocess_args(p: argparse.ArgumentParser, *, build: bool) -> None:
    g = p.add_argument_group("post-processing (docs/postprocessing.md)" + ("" if build else "; add keeps the index's"))
    g.add_argument("--invgc", action=argparse.BooleanOptionalAction, default=None,
                   help="InvGC w/ LocalAdj: correct the stage-1 vectors against the checkpoint's training videos and "
                        "queries (ann_units.npy; units/norms for psi are unchanged)")
    if build:
        g.add_argument("--invgc-val", metavar="MANIFEST|SYNTH_DIR",
                       help="validation captions + videos for choosing r_g, r_q (a caption manifest, used whole, or a "
                            "`gare-train synth` folder, whose validation split is carved as `gare-train fit` did); "
                            "default: the checkpoint's own training data")
        g.add_argument("--invgc-r-g", type=_nonneg_float, metavar="X", help="use this r_g (with --invgc-r-q) instead of the search")
        g.add_argument("--invgc-r-q", type=_nonneg_float, metavar="Y")
        g.add_argument("--invgc-k", type=_percent, default=1.0, metavar="PERCENT", help="LocalAdj neighbours, top k%% (default 1)")
        g.add_argument("--invgc-grid", type=_float_list, metavar="R,R,...",
                       help="values tried for r_g and for r_q (default 0,0.01,0.02,0.05,0.1,0.2,0.3,0.5)")
        g.add_argument("--ncl-c", type=_positive_float, default=1.0, help=argparse.SUPPRESS)
    g.add_argument("--ncl-stage1", action=argparse.BooleanOptionalAction, default=None,
                   help="also write ann_ncl.faiss: the NCL biases folded into stage 1 (candidates by cos + b)")


def _add_bias_score_args(g: argparse._ActionsContainer, *, build: bool) -> None:
    g.add_argument("--bias-score", choices=("served", "dual"), default=None,
                   help="fit the NCL biases to the score the search ranks by (served: psi on each queue query's "
                        "stage-1 candidates, the cosine elsewhere) or to the dual-tower cosine (dual); default: "
                        + ("served" if build else "the index's"))
    g.add_argument("--bias-k", type=_positive_int, default=None,
                   help="served biases: exact psi on each queue query's top K stage-1 candidates (default 256"
                        + ("" if build else ", or the index's") + ")")
    g.add_argument("--bias-queue", choices=("fresh", "stale"), default=None,
                   help="the queries NCL fits the biases to: fresh (the training captions re-encoded with this "
                        "checkpoint's text tower) or stale (the embeddings the checkpoint pushed during training, most "
                        "from earlier model states); default: " + ("fresh when the training captions can be read, "
                        "else stale" if build else "the index's") + " (manifest biases.queue)")
    g.add_argument("--ncl-val", metavar="MANIFEST|SYNTH_DIR",
                   help="validation captions of indexed videos (a caption manifest, used whole, or a `gare-train synth` "
                        "folder, its test split): psi vs psi + biases on them (R@1, R@5, R@10) decides whether the "
                        "service adds the biases by default for this index (manifest biases.default; on a sharded "
                        "index decided once over the whole gallery and recorded in every shard); default: "
                        + ("no decision (the service's default)" if build else "the captions the index decided on"))
    g.add_argument("--ncl-gammas", type=_factors, default=None, metavar="F,F,...",
                   help="with validation captions (--ncl-val): the Sinkhorn gamma is chosen among these multiples of "
                        "the checkpoint's 1/exp(logit_scale) on the even captions (R@1, then R@5), and the default "
                        "decided on the odd ones (20 captions or more; fewer keep the checkpoint's gamma); "
                        "default 0.25,0.5,1,2,4; 1 keeps the checkpoint's gamma")
    g.add_argument("--bias-captions", metavar="MANIFEST|SYNTH_DIR",
                   help="the training captions of the fresh queue: a caption manifest (.csv/.jsonl, used whole) or a "
                        "`gare-train synth` folder (its training split less the validation part); default: the data "
                        "the checkpoint names")


def _add_index_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", "--index", dest="out", required=True, metavar="INDEX", help="index directory")


def _add_encode_args(p: argparse.ArgumentParser, *, build: bool) -> None:
    p.add_argument("--checkpoint", required=build, metavar="CKPT",
                   help="GARE checkpoint (.safetensors)" + ("" if build else "; default: the one the index was built with (same sha256 required)"))
    p.add_argument("--videos", required=True, metavar="DIR|MANIFEST",
                   help="a folder (searched recursively for mp4, mkv, webm, mov, avi, ...) or a JSONL/JSON/CSV manifest "
                        "with a 'video' path column (relative to the manifest) and optional 'start', 'end' (seconds) and 'id'; "
                        "its other columns are the videos' own fields (filters in every search)")
    p.add_argument("--fields", metavar="NAME:TYPE,...", default=None,
                   help="declare the manifest's field columns: string, tags (a list, or a|b|c in CSV), number, date "
                        "(ISO 8601); undeclared columns are inferred" + ("" if build else
                        "; an add keeps the index's fields (a new column or another type is an error)"))
    _add_index_arg(p)
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

    _add_tune_args(p)

    g = p.add_argument_group("encoding")
    g.add_argument("--segment", type=_positive_float, metavar="SECONDS",
                   help="index windows of SECONDS of each video as separate entries (with start/end)")
    g.add_argument("--overlap", type=_nonneg_float, default=0.0, metavar="SECONDS", help="overlap of consecutive windows")
    g.add_argument("--batch-size", type=_positive_int, default=16, help="clips per encoder batch (default 16)")
    g.add_argument("--workers", type=_workers, default="auto",
                   help="decode worker processes (default auto: all usable cores but one when the encoder runs on a GPU, "
                        "else 2; 0 decodes in the main process)")
    g.add_argument("--device", default="auto", help="auto (cuda when present) | cpu | cuda | cuda:N")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="encoder autocast (default fp32; bf16 on CPUs with AVX512-bf16 or GPUs; fp16 on CUDA only)")
    # --store-kv is gone: the fold's stored constants rerank faster than stored K/V at a fraction of
    # their bytes (docs/index-format.md). `add` keeps the K/V of an index that has them.
    g.add_argument("--frames-dtype", choices=("float16", "int8"), default=None,
                   help="how frames.npy stores the frame features psi reranks: float16 (default for build) or int8 with "
                        "a scale per frame (half the bytes; bench/results/frames_int8.md); add keeps the index's")
    g.add_argument("--decode-timeout", type=_positive_float, default=300.0, help="seconds before a stuck decoder is killed")
    g.add_argument("--n-iters", type=_positive_int, default=4, help="Sinkhorn iterations for the NCL biases (default 4)")
    _add_bias_score_args(g, build=build)

    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=("local", "dask"), default="local",
                   help="local: decode processes + one encoder; dask: decode + encode on Dask workers")
    g.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler address (default: a LocalCluster on 127.0.0.1)")
    g.add_argument("--dask-workers", type=_positive_int, default=2, help="LocalCluster worker processes (default 2)")
    g.add_argument("--shard-size", type=_positive_int, default=64, help="clips per Dask task (default 64)")

    p.add_argument("--keep", type=_positive_int, default=3, help="versions to keep (default 3; older ones are removed)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.add_argument("--shards", type=_positive_int, default=None, metavar="N",
                   help="a sharded index: INDEX/shards/s000.. each a normal index, videos split by a hash of their "
                        "content, one generation file naming a version of every shard (docs/index-format.md)"
                        + ("" if build else "; default: the index's (add detects a sharded index)"))


def _add_tune_args(p: argparse.ArgumentParser, *, tune_cmd: bool = False) -> None:
    g = p.add_argument_group("stage-1 tuning (recall target, psi coverage, default K; docs/index-format.md)")
    if not tune_cmd:
        g.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                       help="tune the ANN to the recall target and choose the default K (default: on; --no-tune keeps "
                            "the built index and its knobs and records no stage1 figures)")
    g.add_argument("--recall-target", type=_positive_float, default=0.995, metavar="R",
                   help="recall@K of the exact cosine top-10 the ANN must reach on held-out sample queries, K = the "
                        "service's default candidates (default 0.995)")
    g.add_argument("--coverage-target", type=_positive_float, default=0.995, metavar="C",
                   help="share of psi's exact top-10 that the ANN top-K must hold: the default K is the smallest K "
                        "reaching it (up to 2048, the service's most candidates); when none does, the K of the best "
                        "measured coverage, and stage 1 is recorded as NOT met (default 0.995)")
    g.add_argument("--latency-budget-ms", type=_positive_float, default=5.0, metavar="MS",
                   help="single-query p50 on one thread the ANN may take (default 5)")
    g.add_argument("--latency-ceiling-ms", type=_positive_float, default=100.0, metavar="MS",
                   help="recall first: when no setting meets the recall target within the budget, the tuner raises the "
                        "search effort (efSearch / nprobe, the next index type, exact flat last) up to this p50 "
                        "(default 100; at or below the budget: off); the manifest's stage1 records it and the outcome")
    g.add_argument("--tune-spread", type=float, default=0.5, metavar="SHARE",
                   help="share of the sample queries spread over every cluster of the gallery next to the queue / "
                        "captions; the recall recorded is the lower of the two parts' (default 0.5; 0: the queue or "
                        "captions alone)")
    g.add_argument("--tune-captions", metavar="MANIFEST|SYNTH_DIR",
                   help="caption manifest (CSV video,caption / JSONL) or a `gare-train synth` folder (test split) whose "
                        "caption embeddings are the sample queries when the checkpoint has no NCL text queue")
    g.add_argument("--tune-queries", type=_positive_int, default=1000, metavar="N", help="sample queries (default 1000)")
    g.add_argument("--coverage-queries", type=_positive_int, default=None, metavar="N",
                   help="sample queries the psi coverage scores against every video (default: all of them while "
                        "queries x videos <= 200M, else a seeded subsample of 200M / videos, at least 100)")


def build_parser() -> argparse.ArgumentParser:
    """The `gare-index` argument parser: one subcommand per command, each with its checked arguments."""
    p = argparse.ArgumentParser(
        prog="gare-index", description="Index a video library for GARE search: FAISS + frame features + NCL biases.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, third-party libraries' lines included")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only (progress bars and results stay)")
    sub = p.add_subparsers(dest="cmd", required=True)

    for name, helptext in (("build", "index a video library (the new version holds exactly these videos)"),
                           ("add", "add new and changed files (by checksum) to the current version")):
        sp = sub.add_parser(name, help=helptext, description=helptext, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_encode_args(sp, build=name == "build")
        _add_postprocess_args(sp, build=name == "build")

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
    sp.add_argument("--from-traffic", metavar="BANK.npy",
                    help="a float32 (n, d) .npy of unit query embeddings served by gare-serve (never query text; "
                         "loaded without pickle); mixed with the checkpoint's training queue")
    sp.add_argument("--traffic-weight", type=_unit_float, default=0.5, metavar="W",
                    help="fraction of traffic queries in the mixed queue (default 0.5; 1 = traffic only)")
    _add_bias_score_args(sp, build=True)

    sp = sub.add_parser("upgrade", help="bring the current version to this format: add/refresh psi's per-video constants "
                        "(new version, other files hard-linked)", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("--checkpoint", help="default: the index's (same sha256 required)")
    sp.add_argument("--device", default=None, help="where to fold (default: cuda when present, else cpu)")
    sp.add_argument("--force", action="store_true", help="write a new version even if the constants are valid")
    sp.add_argument("--keep", type=_positive_int, default=3)

    sp = sub.add_parser("verify", help="check counts (FAISS, arrays, SQLite), files and checksums; exit 1 with the reasons",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("--version", dest="version_name", help="a version other than CURRENT")
    sp.add_argument("--quick", action="store_true", help="skip re-hashing the files (sizes are still checked)")
    sp.add_argument("--checkpoint", help="also check that the index was built with this checkpoint")
    sp.add_argument("--check-videos", action="store_true", help="also check that every video file is unchanged on disk")

    sp.add_argument("--json", action="store_true", help="print {index, version, ok, problems} as JSON on stdout")

    sp = sub.add_parser("seal", help="seal a version written before manifests were sealed (manifest.json.xxh3), after "
                        "re-hashing every file against its manifest; exit 1 without sealing when one differs",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("--version", dest="version_name", help="a version other than CURRENT (a sharded index: every "
                    "shard's version of the current generation)")

    sp = sub.add_parser("stats", help="print the index's statistics (--json for all of them as JSON)")
    _add_index_arg(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser(
        "compare", help="measure every post-processing combination side by side on a captioned test set",
        description="Index the test gallery with the real writer (plain, then with InvGC; both with the folded NCL "
                    "stage 1), run the two-stage search (gare_search.search's stage functions) for every combination and "
                    "write result.md / result.json / compare.png.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--checkpoint", required=True, metavar="CKPT")
    add_data_args(sp, "test data (one of)", "--synth: its test split; --msrvtt-anno: the 1k-A test split; "
                  "--train-manifest: for --gallery all and the InvGC validation split")
    sp.add_argument("--val", metavar="MANIFEST|SYNTH_DIR",
                    help="validation data for InvGC's r search (default: carved from the training split as `gare-train "
                         "fit` does, or the checkpoint's own training data)")
    sp.add_argument("--gallery", choices=("test", "all"), default="test",
                    help="test: the test videos only (default); all: test + training videos as the gallery, the test "
                         "captions as queries (a harder, larger gallery)")
    sp.add_argument("--out", required=True, metavar="DIR", help="where result.md, result.json and compare.png go")
    sp.add_argument("--candidates", type=_positive_int, default=DEFAULT_CANDIDATES,
                    help=f"K, the stage-1 shortlist (default {DEFAULT_CANDIDATES})")
    sp.add_argument("--coverage-ks", type=_int_list, default=(16, 32, 64, 128, 256), metavar="K,K,...",
                    help="K values for the candidate coverage (default 16,32,64,128,256)")
    sp.add_argument("--latency-queries", type=_positive_int, default=100,
                    help="queries timed one at a time per combination (default 100)")
    sp.add_argument("--latency-repeats", type=_positive_int, default=3,
                    help="runs of each timed query, the fastest kept (default 3; filters load spikes)")
    sp.add_argument("--latency-threads", type=_positive_int, default=None, metavar="N",
                    help="torch and faiss threads while timing (default: as they are; 1 gives stable single-query "
                         "figures on a busy machine)")
    sp.add_argument("--invgc-r-g", type=_nonneg_float, metavar="X", help="skip the r search (with --invgc-r-q)")
    sp.add_argument("--invgc-r-q", type=_nonneg_float, metavar="Y")
    sp.add_argument("--invgc-grid", type=_float_list, metavar="R,R,...")
    sp.add_argument("--bank", metavar="BANK.npy",
                    help="also measure NCL biases recomputed from this query bank (as `gare-index biases --from-traffic`)")
    sp.add_argument("--bank-weight", type=_unit_float, default=1.0, metavar="W",
                    help="--traffic-weight for the bank rows (default 1: the bank only)")
    sp.add_argument("--index-type", choices=("auto", *INDEX_TYPES), default="auto",
                    help="ANN type of the indexes (default auto: flat below 50k videos)")
    sp.add_argument("--filter", type=_json_object, default=None, metavar="JSON",
                    help='search a subset on every side: a filter object over the index fields, e.g. '
                         '\'{"duration": {"$lte": 20}}\' (the `filter` of POST /v1/search); the queries are the '
                         'captions whose video passes')
    sp.add_argument("--index-dir", metavar="DIR", help="keep the indexes here (default: a temporary folder, deleted)")
    sp.add_argument("--device", default="auto", help="auto (cuda when present) | cpu | cuda | cuda:N")
    sp.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    sp.add_argument("--batch-size", type=_positive_int, default=16)
    sp.add_argument("--workers", type=int, default=2)
    sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)

    sp = sub.add_parser("tune", help="re-tune stage 1 of the current version (recall target, psi coverage, default "
                        "K) without re-encoding; writes a new version", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_index_arg(sp)
    sp.add_argument("--checkpoint", help="default: the index's (same sha256 required)")
    sp.add_argument("--index-type", choices=("auto", *INDEX_TYPES), default=None,
                    help="index types the tuner may use (default: the index's requested type)")
    _add_tune_args(sp, tune_cmd=True)
    sp.add_argument("--from-bank", metavar="BANK.npy",
                    help="tune on served queries: a float32 (n, d) .npy of unit query embeddings written by gare-serve's "
                         "query bank (GARE_QUERY_BANK_PATH; loaded without pickle); its distinct rows (at most "
                         "--tune-queries) replace the checkpoint's queue / --tune-captions; the manifest's stage1 "
                         "records query_source query-bank and the bank file's sha256")
    sp.add_argument("--keep", type=_positive_int, default=3)
    sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)

    sp = sub.add_parser("gc", help="remove old versions (never the current one), unfinished writes and, with --work, the work cache")
    _add_index_arg(sp)
    sp.add_argument("--keep", type=_positive_int, default=3)
    sp.add_argument("--work", action="store_true", help="also delete INDEX/work (the resume cache of interrupted runs)")
    return p
