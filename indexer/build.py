"""Videos -> index versions: `build`, `add`, `remove` and `biases` (the work behind `gare-index`).

Optional post-processing (docs/postprocessing.md, indexer/postprocess.py): `--invgc` (InvGC-corrected
stage-1 vectors in ann_units.npy), `--ncl-stage1` (ann_ncl.faiss, the NCL biases folded into stage 1) and
`biases --from-traffic` (biases from a bank of served query embeddings mixed with the training queue).

Every command ends in :func:`indexer.store.write_version` (a complete new version, then an atomic switch
of CURRENT) and writes INDEX/report.json. Features come from, in this order: the current version (same
checkpoint and precision, same file content and window), the work/ cache of an interrupted run, or the
encoder (local decode worker processes + a batched encoder, or Dask workers).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import json
import logging
import math
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.checkpoint import file_sha256

from .ann import INDEX_TYPES, AnnIndex, AnnParams, build_index, choose_index_type
from .discover import Clip, Skip, discover, expand_segments, fmt_time, scan, seg_of
from .stage1_tune import STAGE1_KEY, Stage1Options
from .store import (
    MANIFEST_FILE,
    REPORT_FILE,
    VERSIONS_DIR,
    WORK_DIR,
    ExistingFile,
    IndexFormatError,
    IndexMismatchError,
    IndexVersion,
    atomic_write_text,
    current_version_name,
    index_lock,
    open_index,
    test_pause,
    write_version,
)
from .work import Shard, WorkCache, model_key, units_norms

log = logging.getLogger(__name__)

BUILD_LOCK = ".build.lock"
EXIT_OK, EXIT_FAILED, EXIT_SKIPPED = 0, 1, 3
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class BuildOptions:
    index_type: str | None = None  # None: "auto" for build, the index's own choice for add/remove
    nlist: int | None = None
    nprobe: int | None = None
    hnsw_m: int | None = None
    ef_search: int | None = None
    ef_construction: int | None = None
    pq_m: int | None = None
    rescore: int | None = None
    rebuild_ann: bool = False
    segment: float | None = None
    overlap: float = 0.0
    batch_size: int = 16
    workers: int = 2  # decode worker processes (local engine)
    device: str = "auto"
    precision: str | None = None  # None: fp32 for build, the index's precision for add
    engine: str = "local"
    scheduler: str | None = None
    dask_workers: int = 2
    shard_size: int = 64
    store_kv: bool | None = None  # None: off for build, as the index for add
    keep: int = 3
    n_iters: int = 4
    progress: bool | None = None  # None: when stderr is a terminal
    decode_timeout: float = 300.0
    scan_threads: int = 4
    # post-processing (docs/postprocessing.md); None: off for build, as the index for add
    invgc: bool | None = None  # InvGC w/ LocalAdj on the stage-1 vectors
    invgc_val: Any = None  # validation data for the r search: manifest, synth folder, data spec; None: the checkpoint's
    invgc_r_g: float | None = None  # given r values skip the search
    invgc_r_q: float | None = None
    invgc_k: float = 1.0  # LocalAdj: top k% neighbours
    invgc_grid: tuple[float, ...] | None = None  # None: training.invgc.DEFAULT_GRID
    ncl_stage1: bool | None = None  # also write ann_ncl.faiss (NCL biases folded into stage 1)
    ncl_c: float = 1.0  # fold constant: index [v ; b / c], query [t ; c]
    # NCL biases: fitted to the served psi score (sparse: exact psi on each queue query's top bias_k) or to the
    # dual-tower cosine; None: "served" for build, as the index for add
    bias_score: str | None = None
    bias_k: int = 256
    # stage-1 tuning (indexer/stage1_tune.py): recall target, latency budget, psi coverage -> default K
    stage1: Stage1Options = field(default_factory=Stage1Options)
    tune_captions: Sequence[str] | None = None  # caption texts for the sample queries (--tune-captions)

    def validate(self) -> None:
        if self.index_type not in (None, "auto", *INDEX_TYPES):
            raise ValueError(f"--index-type must be auto or one of {INDEX_TYPES}, got {self.index_type!r}")
        if self.precision not in (None, *PRECISIONS):
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.engine not in ("local", "dask"):
            raise ValueError(f"--engine must be local or dask, got {self.engine!r}")
        if self.segment is not None and not (self.segment > 0):
            raise ValueError(f"--segment must be > 0 seconds, got {self.segment}")
        if self.overlap < 0 or (self.segment and self.overlap >= self.segment):
            raise ValueError(f"--overlap must be >= 0 and < --segment, got {self.overlap}")
        if self.overlap and not self.segment:
            raise ValueError("--overlap needs --segment")
        for name in ("batch_size", "shard_size", "keep", "n_iters", "dask_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if (self.invgc_r_g is None) != (self.invgc_r_q is None):
            raise ValueError("--invgc-r-g and --invgc-r-q go together (or neither: they are chosen on validation data)")
        for name in ("invgc_r_g", "invgc_r_q"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
        if not 0 < self.invgc_k <= 100:
            raise ValueError(f"--invgc-k must be in (0, 100] (percent of neighbours), got {self.invgc_k}")
        if self.invgc_grid is not None and (not self.invgc_grid or any(not (math.isfinite(g) and g >= 0) for g in self.invgc_grid)):
            raise ValueError(f"--invgc-grid must be non-negative numbers, got {self.invgc_grid}")
        if self.bias_score not in (None, "served", "dual"):
            raise ValueError(f"--bias-score must be served or dual, got {self.bias_score!r}")
        if self.bias_k < 1:
            raise ValueError(f"--bias-k must be >= 1, got {self.bias_k}")
        if not (math.isfinite(self.ncl_c) and self.ncl_c > 0):
            raise ValueError(f"--ncl-c must be > 0, got {self.ncl_c}")
        self.stage1.validate()
        if self.invgc is False and (self.invgc_r_g is not None or self.invgc_val is not None):
            raise ValueError("--invgc-val / --invgc-r-g / --invgc-r-q need --invgc")


@dataclass
class RunReport:
    command: str
    index: str
    status: str = "ok"
    exit_code: int = EXIT_OK
    version: str | None = None
    previous_version: str | None = None
    started: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    elapsed_s: float = 0.0
    n_videos: int = 0  # entries in the new version
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    removed: int = 0
    encoded: int = 0  # clips run through the encoder by this run
    from_cache: int = 0  # clips taken from work/ (an interrupted run)
    from_index: int = 0  # clips whose features came from the previous version
    frames_encoded: int = 0
    encode_s: float = 0.0
    videos_per_s: float = 0.0
    frames_per_s: float = 0.0
    engine: str = "local"
    index_type: str | None = None
    biases: dict[str, Any] = field(default_factory=dict)
    invgc: dict[str, Any] | None = None  # the InvGC values applied to the stage-1 vectors (manifest["invgc"])
    ncl_stage1: bool = False  # whether the version has ann_ncl.faiss
    stage1: dict[str, Any] | None = None  # manifest["stage1"] of the new version (build / add / tune)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def finish(self, t0: float) -> None:
        self.elapsed_s = round(time.time() - t0, 3)
        if self.error:
            self.status, self.exit_code = "failed", EXIT_FAILED
        elif self.skipped:
            self.status, self.exit_code = "done with skipped files", EXIT_SKIPPED
        else:
            self.status, self.exit_code = "ok", EXIT_OK

    def summary(self) -> str:
        if self.error:
            return f"{self.command} failed: {self.error}"
        s = f"{self.command}: {self.n_videos} videos in {self.version or '(no new version)'}"
        if self.command in ("build", "add"):
            s += (
                f" ({self.added} added, {self.updated} updated, {self.unchanged} unchanged; {self.encoded} encoded"
                f" at {self.videos_per_s:.1f} videos/s, {self.frames_per_s:.1f} frames/s; {self.from_cache} from the"
                f" work cache, {self.from_index} reused from the index)"
            )
        if self.removed:
            s += f"; {self.removed} removed"
        s += f"; {len(self.skipped)} skipped"
        if self.skipped:
            s += f" (reasons in {Path(self.index) / REPORT_FILE})"
        return s + f"; {self.elapsed_s:.1f}s"


def write_report(root: Path, report: RunReport) -> None:
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / REPORT_FILE, json.dumps(report.to_dict(), indent=1, default=str))


def _write_report_logged(root: Path, report: RunReport) -> None:
    """Write report.json, but never turn the run's outcome into a failure: once a version is current (or
    when the run already failed), a report that cannot be written (disk full, read-only) is logged only, so
    that exit code 1 keeps meaning "nothing was changed"."""
    try:
        write_report(root, report)
    except OSError as e:
        log.error("could not write %s (%s); the run's outcome is unchanged: %s", Path(root) / REPORT_FILE, e,
                  report.status)
        report.notes.append(f"report.json could not be written: {e}")


# ------------------------------------------------------------------------------------------ helpers
def _progress_enabled(opt: bool | None) -> bool:
    return sys.stderr.isatty() if opt is None else bool(opt)


def _clean_staging(root: Path) -> None:
    work = root / WORK_DIR
    if work.is_dir():
        for p in work.glob(".staging-*"):
            shutil.rmtree(p, ignore_errors=True)


def _open_current(root: Path, *, required: bool) -> IndexVersion | None:
    try:
        current_version_name(root)
    except IndexFormatError:
        if required:
            raise
        return None
    try:
        return open_index(root, use_gpu=False)
    except IndexFormatError:
        if required:
            raise
        log.warning("the current version of %s cannot be read; building without it", root, exc_info=True)
        return None


def checkpoint_gamma_and_queue(ckpt: Any, *, raw: bool = False) -> tuple[float, np.ndarray | None]:
    """gamma = 1 / exp(logit_scale) and the text query queue (float32; unit rows, or as stored with `raw`: psi
    needs the un-normalised t) of a Checkpoint."""
    ls = ckpt.state_dict.get("clip.logit_scale")
    if ls is None:
        raise ValueError(f"{ckpt.path}: no clip.logit_scale in the checkpoint")
    gamma = float(1.0 / math.exp(float(ls.float().reshape(-1)[0])))
    q = ckpt.queues.get("text")
    if q is None or q.numel() == 0:
        return gamma, None
    q = q.float().reshape(q.shape[0], -1)
    if not raw:
        q = q / q.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return gamma, q.numpy().astype(np.float32)


def compute_biases(units: np.ndarray, gamma: float, queue: np.ndarray | None, n_iters: int = 4,
                   device: str | None = None, *, served: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """NCL video biases b (SPEC §5) of every indexed video against the checkpoint's text queue.

    `served`: fit them to the psi score the search ranks by (indexer.served_biases; `queue` then holds the
    un-normalised t): a dict with model, norms, frames, masks, stage1 (optional) and k. Without it they are
    fitted to the dual-tower cosine (the queue rows are normalised here)."""
    n = units.shape[0]
    if queue is None or n == 0:
        info = {"gamma": gamma, "n_iters": n_iters, "n_queries": 0, "source": "none",
                "score": "served" if served is not None else "dual"}
        if queue is None:
            log.warning("the checkpoint has no text query queue: video biases are zero (no NCL correction)")
        return np.zeros(n, dtype=np.float32), info
    import torch

    from training.sinkhorn import sinkhorn_biases

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if queue.shape[1] != units.shape[1]:
        raise ValueError(f"the query queue has d={queue.shape[1]}, the index has d={units.shape[1]}")
    info = {"gamma": gamma, "n_iters": n_iters, "n_queries": int(queue.shape[0]), "source": "checkpoint-queue"}
    if served is not None:
        from .served_biases import served_biases

        model = served["model"]
        with torch.no_grad():
            b_np, sinfo = served_biases(model, queue, gamma, units=units, norms=served["norms"], frames=served["frames"],
                                        masks=served["masks"], stage1=served.get("stage1"), n_iters=n_iters,
                                        k=int(served.get("k", 256)), device=dev if model.device.type == dev else None)
        return b_np, {**info, "score": "served", "served": sinfo}
    unit_q = queue / np.maximum(np.linalg.norm(queue, axis=1, keepdims=True), 1e-12)
    t0 = time.time()
    _, b = sinkhorn_biases(torch.from_numpy(np.ascontiguousarray(unit_q, dtype=np.float32)), units, gamma,
                           n_iters=n_iters, device=dev)
    log.info("NCL biases for %d videos against %d queries in %.1fs", n, queue.shape[0], time.time() - t0)
    return b.numpy().astype(np.float32), {**info, "score": "dual"}


def bias_score_of(manifest: dict[str, Any]) -> str:
    """The score an index's biases were fitted to (indexes from before issue 17: the dual-tower cosine)."""
    return str((manifest.get("biases") or {}).get("score") or "dual")


def _served_inputs(model: Any, arrays: dict[str, Any], k: int) -> dict[str, Any]:
    """compute_biases(served=...) from a version's arrays (frames may be a staged file)."""
    fr = arrays["frames"]
    if isinstance(fr, ExistingFile):
        fr = np.load(fr.path, mmap_mode="r")
    st = arrays.get("ann_units")
    if isinstance(st, ExistingFile):
        st = np.load(st.path, mmap_mode="r")
    return {"model": model, "norms": np.asarray(arrays["norms"]), "frames": fr, "masks": np.asarray(arrays["masks"]),
            "stage1": None if st is None else np.asarray(st, dtype=np.float32), "k": k}


def _ann_params(index_type: str, opts: BuildOptions, base: dict[str, Any] | None = None) -> AnnParams:
    d = dict(base or {})
    d["index_type"] = index_type
    for name in ("nlist", "nprobe", "hnsw_m", "ef_search", "ef_construction", "pq_m", "rescore"):
        v = getattr(opts, name)
        if v is not None:
            d[name] = v
    if base and base.get("index_type") != index_type:  # knobs of another type do not carry over
        d = {k: v for k, v in d.items() if k == "index_type" or getattr(opts, k, None) is not None}
    return AnnParams.from_dict(d)


def _choose_type(requested: str, n: int) -> str:
    if requested == "auto":
        return choose_index_type(n)
    if requested in ("ivf", "ivfpq") and n == 0:
        return "flat"
    return requested


def _make_ann(units: np.ndarray, ids: np.ndarray, opts: BuildOptions, prev: IndexVersion | None, requested: str,
              *, incremental: bool, drop_ids: np.ndarray, new_rows: np.ndarray) -> tuple[AnnIndex, dict[str, Any]]:
    """The ANN index of the new version: updated in place from the previous one when possible, else built."""
    n = units.shape[0]
    t = _choose_type(requested, n)
    knobs = any(getattr(opts, k) is not None for k in ("nlist", "hnsw_m", "ef_construction", "pq_m"))
    if prev is not None and incremental and not opts.rebuild_ann and not knobs and prev.manifest.get("index_type") == t:
        trained = int(prev.manifest.get("ann_trained_n") or prev.n)
        if t not in ("ivf", "ivfpq") or n <= 2 * max(trained, 1):
            params = _ann_params(t, opts, prev.manifest.get("ann_params"))
            ann = AnnIndex(prev.ann.cpu_index, params)
            if drop_ids.size:
                ann.remove_ids(drop_ids)
            if new_rows.size:
                ann.add(units[new_rows], ids[new_rows])
            return ann, {"ann_params": params.to_dict(), "ann_trained_n": trained}
    params = _ann_params(t, opts, prev.manifest.get("ann_params") if prev is not None else None)
    t0 = time.time()
    ann = AnnIndex(build_index(units, ids, params, use_gpu=False), params)
    log.info("built a %s index over %d vectors in %.1fs", t, n, time.time() - t0)
    return ann, {"ann_params": params.to_dict(), "ann_trained_n": n}


# ------------------------------------------------------------------------------------------ assembly
@dataclass
class _Entry:
    meta: dict[str, Any]
    src: tuple  # ("prev", row) | ("shard", path, row)


def alloc_npy(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A writable memmap of a new .npy file whose data blocks are reserved up front (posix_fallocate).

    Writing into a sparse memory map on a full disk kills the process with SIGBUS; reserving the space
    first turns that into an ordinary OSError (ENOSPC) before anything is written.
    """
    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(int(x) for x in shape)}
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_2_0(fh, header)
        offset = fh.tell()
        if nbytes:
            try:
                os.posix_fallocate(fh.fileno(), offset, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                fh.seek(offset)  # no fallocate on this filesystem: write the zeros ourselves
                zeros = bytes(1 << 20)
                left = nbytes
                while left:
                    left -= fh.write(zeros[: min(left, len(zeros))])
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    return np.lib.format.open_memmap(path, mode="r+")


def _assemble(entries: list[_Entry], f: int, d: int, prev: IndexVersion | None, cache: WorkCache | None,
              staging: Path, kv_fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None,
              chunk: int = 8192) -> dict[str, Any]:
    """Gather every entry's features into new arrays (frames and K/V staged as .npy files on disk)."""
    staging.mkdir(parents=True, exist_ok=True)
    n = len(entries)
    ids = np.array([e.meta["id"] for e in entries], dtype=np.int64)
    frames = alloc_npy(staging / "frames.npy", np.float16, (n, f, d))
    units = np.zeros((n, d), dtype=np.float32)
    norms = np.zeros(n, dtype=np.float32)
    masks = np.zeros((n, f), dtype=np.uint8)
    want_kv = kv_fn is not None
    keys = values = None
    if want_kv:
        keys = alloc_npy(staging / "keys.npy", np.float16, (n, f, d))
        values = alloc_npy(staging / "values.npy", np.float16, (n, f, d))
    kv_done = np.zeros(n, dtype=bool)

    prev_dst = np.array([i for i, e in enumerate(entries) if e.src[0] == "prev"], dtype=np.int64)
    if prev_dst.size:
        assert prev is not None
        prev_src = np.array([entries[i].src[1] for i in prev_dst], dtype=np.int64)
        for s in range(0, prev_dst.size, chunk):
            dst, src = prev_dst[s : s + chunk], prev_src[s : s + chunk]
            order = np.argsort(src, kind="stable")  # sorted reads from the memmaps
            dst, src = dst[order], src[order]
            frames[dst] = prev.frames[src]
            units[dst] = prev.units[src]
            norms[dst] = prev.norms[src]
            masks[dst] = prev.masks[src]
            if want_kv and prev.kv is not None:
                keys[dst] = prev.keys[src]
                values[dst] = prev.values[src]
                kv_done[dst] = True
    by_shard: dict[Path, list[tuple[int, int]]] = defaultdict(list)
    for i, e in enumerate(entries):
        if e.src[0] == "shard":
            by_shard[e.src[1]].append((i, e.src[2]))
    for path, pairs in by_shard.items():
        assert cache is not None
        sh = cache.load(path)
        dst = np.array([p[0] for p in pairs], dtype=np.int64)
        src = np.array([p[1] for p in pairs], dtype=np.int64)
        u, nn = units_norms(sh.vbar[src])
        frames[dst] = sh.frames[src]
        units[dst] = u
        norms[dst] = nn
        masks[dst] = sh.masks[src]
    if want_kv:
        todo = np.flatnonzero(~kv_done)
        for s in range(0, todo.size, 1024):
            rows = todo[s : s + 1024]
            k, v = kv_fn(np.asarray(frames[rows]))
            keys[rows] = k
            values[rows] = v
    for arr in (frames, keys, values):
        if isinstance(arr, np.memmap):
            arr.flush()
    out: dict[str, Any] = {
        "ids": ids, "norms": norms, "units": units, "frames": ExistingFile(staging / "frames.npy"),
        "masks": masks,
    }
    del frames
    if want_kv:
        del keys, values
        out["keys"] = ExistingFile(staging / "keys.npy")
        out["values"] = ExistingFile(staging / "values.npy")
    return out


def _kv_fn(model: Any) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    import torch

    @torch.no_grad()
    def fn(frames16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fr = torch.from_numpy(np.asarray(frames16, dtype=np.float32)).to(model.device)
        k, v = model.video_kv(fr)
        return k.float().cpu().numpy().astype(np.float16), v.float().cpu().numpy().astype(np.float16)

    return fn


def _meta_row(c: Clip, frames_used: int) -> dict[str, Any]:
    return {
        "id": int(c.id), "path": c.path, "size": int(c.size), "mtime": float(c.mtime), "checksum": c.checksum,
        "duration": c.duration, "fps": c.fps, "frames_used": int(frames_used), "start": c.start, "end": c.end,
        "status": "ok",
    }


# ------------------------------------------------------------------------------------------ encoding
class _Encoder:
    """Runs the jobs through the local or Dask engine; every finished batch goes to the work cache."""

    def __init__(self, *, cache: WorkCache, report: RunReport, opts: BuildOptions, progress: bool) -> None:
        self.cache, self.report, self.opts = cache, report, opts
        self.failed: dict[str, str] = {}
        self.progress = progress
        self._pbar = None
        self._t0 = 0.0

    def _record(self, shard: Shard | None, failed: dict[str, str], frames_used: int, done: int) -> None:
        self.failed.update(failed)
        before = self.report.encoded
        if shard is not None and shard.keys:
            self.cache.put(shard)
            self.report.encoded += len(shard.keys)
            self.report.frames_encoded += frames_used
        if self._pbar is not None:
            self._pbar.update(done)
            el = max(time.time() - self._t0, 1e-9)
            self._pbar.set_postfix_str(f"{self.report.frames_encoded / el:.1f} frames/s, {len(self.failed)} failed")
        for c in range(before + 1, self.report.encoded + 1):
            test_pause(f"encoded:{c}")

    def run(self, jobs: list[tuple[str, str, float | None, float | None]], *, model: Any, device: Any,
            precision: str, checkpoint: str, sha256: str) -> None:
        if not jobs:
            return
        from tqdm.auto import tqdm

        self._t0 = time.time()
        self._pbar = tqdm(total=len(jobs), unit="video", desc="encode", disable=not self.progress, dynamic_ncols=True,
                          file=sys.stderr)
        try:
            if self.opts.engine == "dask":
                from .distributed import run_dask

                def on_result(res: dict[str, Any]) -> None:
                    shard = Shard(res["keys"], res["frames"], res["vbar"], res["masks"]) if res["keys"] else None
                    self._record(shard, res["failed"], res["frames_used"], len(res["keys"]) + len(res["failed"]))

                run_dask(
                    jobs, checkpoint=checkpoint, sha256=sha256, device=self.opts.device, precision=precision,
                    batch_size=self.opts.batch_size, shard_size=self.opts.shard_size, scheduler=self.opts.scheduler,
                    n_workers=self.opts.dask_workers, on_result=on_result, decode_timeout=self.opts.decode_timeout,
                )
            else:
                from training.video import iter_decoded

                from .encode import encode_batch

                cfg = model.cfg
                for batch in iter_decoded(
                    jobs, max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size,
                    batch_size=self.opts.batch_size, num_workers=self.opts.workers, timeout=self.opts.decode_timeout,
                ):
                    failed = {k: r for k, r in batch["failed"]}
                    shard, bad, nf = encode_batch(model, device, precision, batch)
                    failed.update(bad)
                    self._record(shard, failed, nf, len(batch["keys"]) + len(batch["failed"]))
        finally:
            self.report.encode_s = round(time.time() - self._t0, 3)
            self._pbar.close()
            self._pbar = None
        el = max(self.report.encode_s, 1e-9)
        self.report.videos_per_s = round(self.report.encoded / el, 3)
        self.report.frames_per_s = round(self.report.frames_encoded / el, 3)


# ------------------------------------------------------------------------------------------ commands
def _assign_ids(todo: list[Clip], kept: list[dict[str, Any]], prev_by_seg: dict[tuple, dict[str, Any]],
                next_id: int) -> tuple[list[Clip], list[Skip], int]:
    used: dict[int, str] = {int(r["id"]): r["path"] for r in kept}
    ok: list[Clip] = []
    skipped: list[Skip] = []
    for c in todo:  # explicit manifest ids first
        if c.explicit_id:
            if c.id in used:
                skipped.append(Skip(c.path, f"duplicate id {c.id} (already used by {used[c.id]})", c.start, c.end, c.source))
                continue
            used[int(c.id)] = c.path
        ok.append(c)
    for c in ok:  # then the id the same file and window had before
        if not c.explicit_id:
            r = prev_by_seg.get(c.seg)
            c.id = int(r["id"]) if r is not None and int(r["id"]) not in used else None
            if c.id is not None:
                used[c.id] = c.path
    nxt = max([next_id, *(i + 1 for i in used)]) if used else next_id
    for c in ok:
        if c.id is None:
            c.id = nxt
            used[nxt] = c.path
            nxt += 1
    return ok, skipped, nxt


def _dedupe(clips: list[Clip]) -> tuple[list[Clip], list[Skip]]:
    seen: dict[tuple, Clip] = {}
    out: list[Clip] = []
    skipped: list[Skip] = []
    for c in clips:
        k = c.seg
        if k in seen:
            first = seen[k]
            skipped.append(Skip(c.path, f"duplicate entry: same file and window as {first.source or first.path}", c.start, c.end, c.source))
            continue
        seen[k] = c
        out.append(c)
    return out, skipped


def _skip(c: Clip, reason: str) -> dict[str, Any]:
    return Skip(c.path, reason, c.start, c.end, c.source).to_dict()


def build(checkpoint: str | os.PathLike | None, videos: str | os.PathLike, out: str | os.PathLike,
          opts: BuildOptions | None = None, *, mode: str = "build") -> RunReport:
    """`gare-index build` (mode="build": the new version holds exactly the given videos) and `add`
    (mode="add": the current version plus new or changed files, by checksum). Writes INDEX/report.json."""
    opts = opts or BuildOptions()
    opts.validate()
    if mode not in ("build", "add"):
        raise ValueError(f"mode must be build or add, got {mode!r}")
    t0 = time.time()
    root = Path(out).expanduser().absolute()
    root.mkdir(parents=True, exist_ok=True)
    report = RunReport(command=mode, index=str(root), engine=opts.engine)
    try:
        with index_lock(root, BUILD_LOCK, blocking=False):
            _build_locked(checkpoint, videos, root, opts, mode, report)
    except BaseException as e:
        report.error = f"{type(e).__name__}: {e}" if not isinstance(e, (IndexFormatError, ValueError)) else str(e)
        report.finish(t0)
        if isinstance(e, Exception):
            _write_report_logged(root, report)
        raise
    report.finish(t0)
    _write_report_logged(root, report)
    return report


def _build_locked(checkpoint: Any, videos: Any, root: Path, opts: BuildOptions, mode: str, report: RunReport) -> None:
    from training.checkpoint import load_model
    from training.model import resolve_device

    _clean_staging(root)
    prev = _open_current(root, required=mode == "add")
    report.previous_version = prev.name if prev is not None else None
    pman = prev.manifest if prev is not None else {}
    if checkpoint is None:
        if prev is None:
            raise ValueError("--checkpoint is required to build a new index")
        checkpoint = pman["checkpoint"]["path"]
    ckpt_path = Path(checkpoint).expanduser().absolute()
    if not ckpt_path.is_file():
        raise ValueError(f"--checkpoint {checkpoint}: no such file")
    sha = file_sha256(ckpt_path)
    if mode == "add" and pman.get("checkpoint", {}).get("sha256") != sha:
        raise IndexMismatchError(
            f"index {root} was built with checkpoint sha256 {pman.get('checkpoint', {}).get('sha256')} "
            f"({pman.get('checkpoint', {}).get('path')}); {ckpt_path} has sha256 {sha}. "
            "`add` must use the same checkpoint; rebuild with `gare-index build` to change it"
        )
    precision = opts.precision or (pman.get("precision", "fp32") if mode == "add" else "fp32")
    if mode == "add" and precision != pman.get("precision", "fp32"):
        raise ValueError(f"the index was built with --precision {pman.get('precision')}; add must use the same (got {precision})")
    store_kv = opts.store_kv if opts.store_kv is not None else (bool(pman.get("kv")) if mode == "add" else False)
    if mode == "add" and store_kv != bool(pman.get("kv")):
        raise ValueError(f"the index was built {'with' if pman.get('kv') else 'without'} --store-kv; add must keep it")
    segment = opts.segment if opts.segment is not None else ((pman.get("segment") or {}).get("seconds") if mode == "add" else None)
    overlap = opts.overlap if opts.segment is not None else ((pman.get("segment") or {}).get("overlap", 0.0) if mode == "add" else 0.0)

    device = resolve_device(opts.device)
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("--precision fp16 needs a CUDA device; use bf16 on CPU")
    model, ckpt = load_model(ckpt_path, device)
    cfg = model.cfg
    f, d = cfg.max_frames, cfg.embed_dim
    if prev is not None and mode == "add" and (prev.max_frames, prev.dim) != (f, d):
        raise IndexFormatError(f"{root}: index has f={prev.max_frames}, d={prev.dim}; the model has f={f}, d={d}")
    post = _postprocess_setup(opts, mode, pman, model, ckpt, precision)

    # ---- what to index
    clips, skipped, ignored = discover(videos)
    report.ignored = [s.to_dict() for s in ignored]
    prev_rows = prev.all_metadata() if prev is not None else []
    known = {r["path"]: r for r in prev_rows}
    clips, sk = scan(clips, known, threads=opts.scan_threads, progress=_progress_enabled(opts.progress))
    skipped += sk
    clips, sk = expand_segments(clips, segment, overlap)
    skipped += sk
    clips, sk = _dedupe(clips)
    skipped += sk
    report.skipped = [s.to_dict() for s in skipped]

    prev_by_seg = {seg_of(r["path"], r["start"], r["end"]): r for r in prev_rows}
    if mode == "build":
        todo, kept = clips, []
    else:
        todo = []
        for c in clips:
            r = prev_by_seg.get(c.seg)
            if r is not None and r["checksum"] == c.checksum and (not c.explicit_id or c.id == r["id"]):
                report.unchanged += 1
            else:
                todo.append(c)
        todo_segs = {c.seg for c in todo}
        kept = [r for r in prev_rows if seg_of(r["path"], r["start"], r["end"]) not in todo_segs]
    next_id = int(pman.get("next_id", 0))
    todo, sk, next_id = _assign_ids(todo, kept, prev_by_seg, next_id)
    report.skipped += [s.to_dict() for s in sk]

    # ---- where each clip's features come from
    same_model = prev is not None and pman.get("checkpoint", {}).get("sha256") == sha and pman.get("precision", "fp32") == precision
    prev_by_key: dict[str, int] = {}
    if same_model:
        rows_of = prev.rows(np.array([r["id"] for r in prev_rows], dtype=np.int64)) if prev_rows else []
        for r, row in zip(prev_rows, rows_of, strict=True):
            prev_by_key.setdefault(f"{r['checksum']}|{fmt_time(r['start'])}|{fmt_time(r['end'])}", int(row))
    cache = WorkCache(root, model_key(sha, precision), info={"checkpoint": str(ckpt_path), "sha256": sha, "precision": precision})
    cached = cache.index()
    jobs: dict[str, tuple[str, str, float | None, float | None]] = {}
    for c in todo:
        k = c.cache_key
        if k not in prev_by_key and k not in cached and k not in jobs:
            jobs[k] = (k, c.path, c.start, c.end)
    n_cached_keys = len({c.cache_key for c in todo if c.cache_key not in prev_by_key and c.cache_key in cached})
    log.info("%d clips to index: %d to encode, %d in the work cache, %d reused from %s",
             len(todo), len(jobs), n_cached_keys, len(todo) - len(jobs) - n_cached_keys, report.previous_version)

    enc = _Encoder(cache=cache, report=report, opts=opts, progress=_progress_enabled(opts.progress))
    enc.run(list(jobs.values()), model=model, device=device, precision=precision, checkpoint=str(ckpt_path), sha256=sha)

    # ---- drop failures (every window of a video with a failed window: nothing partial enters)
    stat_changed: set[str] = set()
    first_clip = {}
    for c in todo:
        first_clip.setdefault(c.path, c)
    for p in {jobs[k][1] for k in jobs if k not in enc.failed}:
        c0 = first_clip[p]
        try:
            st = os.stat(p)
            if int(st.st_size) != c0.size or float(st.st_mtime) != c0.mtime:
                stat_changed.add(p)
        except OSError:
            stat_changed.add(p)
    bad_paths: dict[str, str] = {}
    for c in todo:
        if c.cache_key in enc.failed:
            bad_paths.setdefault(c.path, enc.failed[c.cache_key])
        elif c.path in stat_changed:
            bad_paths.setdefault(c.path, "file changed while it was being indexed")
    entries: list[_Entry] = []
    cached = cache.index()
    prev_ids_by_seg = {seg_of(r["path"], r["start"], r["end"]): int(r["id"]) for r in prev_rows}
    n_from_todo = 0
    for c in todo:
        if c.path in bad_paths:
            reason = bad_paths[c.path] if c.cache_key in enc.failed or c.path in stat_changed else (
                f"another window of this video failed: {bad_paths[c.path]}")
            if mode == "add" and c.seg in prev_ids_by_seg:
                reason += " (its previous entry was removed)"
            report.skipped.append(_skip(c, reason))
            continue
        k = c.cache_key
        if k in prev_by_key:
            src: tuple = ("prev", prev_by_key[k])
            report.from_index += 1
        else:
            shard_path, row = cached[k]
            src = ("shard", shard_path, row)
            if k not in jobs:
                report.from_cache += 1
        entries.append(_Entry(_meta_row(c, 0), src))
        n_from_todo += 1
        if mode == "add" and c.seg in prev_ids_by_seg:
            report.updated += 1
        else:
            report.added += 1
    todo_ids = np.array(sorted(e.meta["id"] for e in entries), dtype=np.int64)
    kept_ids = np.array([r["id"] for r in kept], dtype=np.int64)
    kept_rows = prev.rows(kept_ids) if kept else []
    for r, row in zip(kept, kept_rows, strict=True):
        entries.append(_Entry(dict(r), ("prev", int(row))))
    entries.sort(key=lambda e: e.meta["id"])

    if not entries:
        raise ValueError(f"nothing could be indexed from {videos} ({len(report.skipped)} skipped; see {root / REPORT_FILE})")
    if mode == "add" and prev is not None and n_from_todo == 0 and len(entries) == prev.n:
        report.n_videos = prev.n
        report.notes.append("index is up to date: no new or changed files; no new version written")
        return

    staging = root / WORK_DIR / f".staging-{os.getpid()}"
    try:
        arrays = _assemble(entries, f, d, prev, cache, staging, _kv_fn(model) if store_kv else None)
        for e, u in zip(entries, arrays["masks"].sum(axis=1), strict=True):
            e.meta["frames_used"] = int(u)
        invgc_m = None
        if post["invgc"]:  # before the biases: the served biases take their candidates from the stage-1 vectors
            arrays["ann_units"], invgc_m = _invgc_vectors(arrays["units"], entries, prev, mode, post)
        report.invgc = invgc_m
        score = opts.bias_score or (bias_score_of(pman) if mode == "add" and pman else "served")
        served = _served_inputs(model, arrays, opts.bias_k if mode != "add" or opts.bias_score else
                                int(((pman.get("biases") or {}).get("served") or {}).get("k") or opts.bias_k)) \
            if score == "served" else None
        gamma, queue = checkpoint_gamma_and_queue(ckpt, raw=True)
        ckpt_queue = queue  # the sample queries of the stage-1 tuning (raw rows; traffic may be mixed into `queue` below)
        tinfo = None
        if mode == "add" and (pman.get("biases") or {}).get("traffic"):
            queue, tinfo = _carried_traffic(queue, pman["biases"], prev.dim, report)
        arrays["biases"], binfo = compute_biases(arrays["units"], gamma, queue, opts.n_iters, served=served)
        if tinfo is not None:
            binfo = _traffic_binfo(binfo, tinfo)
        if binfo["source"] == "none":
            report.notes.append("the checkpoint has no text query queue: video biases are zero")
        report.biases = binfo
        report.ncl_stage1 = post["ncl_stage1"] is not None
        stage1 = arrays.get("ann_units", arrays["units"])
        ids = arrays["ids"]
        requested = opts.index_type or (pman.get("index_type_requested", "auto") if mode == "add" else "auto")
        t_ann = time.time()
        if mode == "add" and prev is not None:
            # the new ANN = the previous one - every id not kept + the new and changed clips
            drop = np.setdiff1d(np.asarray(prev.ids), kept_ids)
            new_rows = np.flatnonzero(np.isin(ids, todo_ids))
            ann, ainfo = _make_ann(stage1, ids, opts, prev, requested, incremental=True,
                                   drop_ids=drop, new_rows=new_rows)
        else:
            ann, ainfo = _make_ann(stage1, ids, opts, None, requested, incremental=False,
                                   drop_ids=np.zeros(0, np.int64), new_rows=np.zeros(0, np.int64))
        ann, ainfo = _tune_stage1(ann, ainfo, stage1, ids, arrays, model, ckpt_queue, opts, requested,
                                   time.time() - t_ann)
        report.stage1 = ainfo.get(STAGE1_KEY)
        report.index_type = ann.params.index_type
        extra = {
            "checkpoint": {"path": str(ckpt_path), "sha256": sha, "model_config": cfg.to_dict()},
            "precision": precision,
            "sampling": {"max_frames": cfg.max_frames, "video_framerate": cfg.video_framerate, "image_size": cfg.image_size},
            "segment": {"seconds": segment, "overlap": overlap} if segment else None,
            "index_type_requested": requested,
            "biases": binfo,
            "next_id": int(max(next_id, int(ids.max()) + 1 if ids.size else 0)),
            "builder": {"command": mode, "engine": opts.engine},
            "invgc": invgc_m,
            "ncl_stage1": post["ncl_stage1"],
            **ainfo,
        }
        name = write_version(root, arrays, [e.meta for e in entries], extra, ann=ann, keep=opts.keep)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report.version = name
    report.n_videos = len(entries)
    cache.clear()  # its features are in the current version now


def _tune_stage1(ann: AnnIndex, ainfo: dict[str, Any], units: np.ndarray, ids: np.ndarray, arrays: dict[str, Any],
                 model: Any, queue: np.ndarray | None, opts: BuildOptions, requested: str, build_s: float,
                 ) -> tuple[AnnIndex, dict[str, Any]]:
    """Meet the recall target and choose the default K (indexer.stage1_tune); ainfo gains manifest["stage1"]."""
    if not opts.stage1.enabled:
        return ann, {**ainfo, STAGE1_KEY: None}
    from .stage1_tune import encode_captions, tune_version_ann

    caps = encode_captions(model, list(opts.tune_captions)) if opts.tune_captions else None
    def arr(name: str) -> np.ndarray:  # a fresh array, or the previous version's file (memmapped)
        v = arrays[name]
        return np.load(v.path, mmap_mode="r", allow_pickle=False) if isinstance(v, ExistingFile) else v

    tuned, entry = tune_version_ann(units if not isinstance(units, ExistingFile) else np.load(units.path, mmap_mode="r"), ids, frames=arr("frames"), masks=arr("masks"), biases=arr("biases"),
                                    model=model, queue=queue, captions=caps, ann=ann, build_s=build_s,
                                    requested_type=requested, options=opts.stage1,
                                    progress=_progress_enabled(opts.progress))
    same = tuned.cpu_index is ann.cpu_index
    return tuned, {**ainfo, "ann_params": tuned.params.to_dict(),
                   "ann_trained_n": ainfo.get("ann_trained_n") if same else int(units.shape[0]), STAGE1_KEY: entry}


def _postprocess_setup(opts: BuildOptions, mode: str, pman: dict[str, Any], model: Any, ckpt: Any,
                       precision: str) -> dict[str, Any]:
    """What post-processing this run applies; for a new InvGC build, the (r_g, r_q) search runs here, before
    anything is encoded (a missing validation set fails the run early)."""
    from .invgc_select import select_invgc
    from .postprocess import invgc_refs

    if mode == "add":
        inv_prev, ncl_prev = pman.get("invgc"), pman.get("ncl_stage1")
        if opts.invgc is not None and bool(opts.invgc) != bool(inv_prev):
            raise ValueError(f"the index was built {'with' if inv_prev else 'without'} --invgc; add keeps it "
                             "(rebuild with `gare-index build` to change it)")
        if opts.invgc_r_g is not None or opts.invgc_val is not None:
            raise ValueError("add corrects new videos with the InvGC values recorded in the index; "
                             "--invgc-val/--invgc-r-g/--invgc-r-q are for build")
        if opts.ncl_stage1 is not None and bool(opts.ncl_stage1) != bool(ncl_prev):
            raise ValueError(f"the index was built {'with' if ncl_prev else 'without'} --ncl-stage1; add keeps it "
                             "(rebuild with `gare-index build` to change it)")
        post: dict[str, Any] = {"invgc": dict(inv_prev) if inv_prev else None,
                                "ncl_stage1": {"c": float(ncl_prev.get("c", 1.0))} if ncl_prev else None}
        if post["invgc"]:
            post["refs"] = invgc_refs(ckpt)
        return post
    if not opts.invgc and (opts.invgc_r_g is not None or opts.invgc_val is not None):
        raise ValueError("--invgc-val / --invgc-r-g / --invgc-r-q need --invgc")
    post = {"invgc": None, "ncl_stage1": {"c": float(opts.ncl_c)} if opts.ncl_stage1 else None}
    if opts.invgc:
        refs = invgc_refs(ckpt)
        if opts.invgc_r_g is not None:
            sel: dict[str, Any] = {"method": "given", "r_g": float(opts.invgc_r_g), "r_q": float(opts.invgc_r_q)}
        else:
            t0 = time.time()
            sel = select_invgc(model, ckpt, opts.invgc_val, k_percent=opts.invgc_k, grid=opts.invgc_grid,
                               precision=precision, batch_size=opts.batch_size, num_workers=opts.workers, refs=refs)
            sel["seconds"] = round(time.time() - t0, 3)
        post["invgc"] = {"r_g": float(sel["r_g"]), "r_q": float(sel["r_q"]), "k_percent": float(opts.invgc_k),
                         "selection": sel, "n_train_videos": int(refs[0].shape[0]), "n_train_queries": int(refs[1].shape[0])}
        post["refs"] = refs
    return post


def _invgc_vectors(units: np.ndarray, entries: list[_Entry], prev: IndexVersion | None, mode: str,
                   post: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """The InvGC-corrected stage-1 vectors of every entry and the manifest's `invgc` record.

    build: LocalAdj's centring means come from this gallery (the result is training.invgc.invgc of the
    units) and are recorded. add: rows carried from the previous version keep their vectors; new ones are
    corrected with the recorded r_g, r_q, k and means (the correction of an item depends only on the item)."""
    from .postprocess import invgc_apply, invgc_means

    Gh, Qh = post["refs"]
    inv = dict(post["invgc"])
    k = float(inv["k_percent"])
    t0 = time.time()
    if mode == "add":
        if (int(inv["n_train_videos"]), int(inv["n_train_queries"])) != (Gh.shape[0], Qh.shape[0]):
            raise IndexMismatchError("the checkpoint's training queues differ in size from the ones the index's InvGC used")
        out = np.empty_like(units)
        todo = np.ones(len(entries), dtype=bool)
        if prev is not None and prev.ann_units is not None:
            dst = np.array([i for i, e in enumerate(entries) if e.src[0] == "prev"], dtype=np.int64)
            if dst.size:
                src = np.array([entries[i].src[1] for i in dst], dtype=np.int64)
                order = np.argsort(src, kind="stable")
                out[dst[order]] = np.asarray(prev.ann_units[src[order]], dtype=np.float32)
                todo[dst] = False
        rows = np.flatnonzero(todo)
        if rows.size:
            out[rows] = invgc_apply(units[rows], Gh, Qh, inv["r_g"], inv["r_q"], inv["mean_g"], inv["mean_q"], k)
        log.info("InvGC: corrected %d new vectors in %.1fs (r_g=%g, r_q=%g)", rows.size, time.time() - t0, inv["r_g"], inv["r_q"])
        return out, inv
    mean_g, mean_q = invgc_means(units, Gh, Qh, k)
    out = invgc_apply(units, Gh, Qh, inv["r_g"], inv["r_q"], mean_g, mean_q, k)
    inv.update(mean_g=mean_g, mean_q=mean_q, n_gallery_for_means=int(units.shape[0]),
               refs="checkpoint queues: 'video' (training videos, Ĝ) and 'text' (training queries, Q̂)",
               applied_to="ann_units.npy (stage 1: ann.faiss and ann_ncl.faiss); units.npy/norms.npy unchanged")
    log.info("InvGC: corrected %d vectors in %.1fs (r_g=%g, r_q=%g, k=%g%%)", units.shape[0], time.time() - t0,
             inv["r_g"], inv["r_q"], k)
    return out, inv


def _traffic_binfo(binfo: dict[str, Any], tinfo: dict[str, Any]) -> dict[str, Any]:
    out = dict(binfo)
    if out.get("source") != "none":
        out["source"] = "traffic" if tinfo.get("train_queries", 0) == 0 else "checkpoint-queue+traffic"
    out["traffic"] = tinfo
    return out


def _mixed_queue(queue: np.ndarray | None, bank_path: str | os.PathLike, weight: float, d: int
                 ) -> tuple[np.ndarray, dict[str, Any]]:
    from .postprocess import load_query_bank, mix_queues

    bank, info = load_query_bank(bank_path, d)
    # the bank holds unit rows; psi needs |t|: scale them to the training queue's mean norm (no effect on the
    # dual-tower biases, which normalise every row)
    scale = float(np.linalg.norm(queue, axis=1).mean()) if queue is not None and len(queue) else 1.0
    mixed, minfo = mix_queues(queue, bank * np.float32(scale), weight)
    return mixed, {**info, **minfo, "bank_scale": round(scale, 6)}


def _carried_traffic(queue: np.ndarray | None, prev_binfo: dict[str, Any], d: int, report: RunReport
                     ) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """add/remove after `biases --from-traffic`: recompute with the same bank file when it is still readable,
    else fall back to the checkpoint's queue (and say so in the report)."""
    t = prev_binfo["traffic"]
    try:
        mixed, info = _mixed_queue(queue, t["file"], float(t["traffic_weight"]), d)
    except ValueError as e:
        report.notes.append(f"the biases came from the query bank {t.get('file')}, which cannot be used any more ({e}); "
                            "they were recomputed from the checkpoint's queue: run `gare-index biases --from-traffic` again")
        return queue, None
    if info["sha256"] != t.get("sha256"):
        report.notes.append(f"the query bank {t['file']} changed since the last `biases --from-traffic`; its current content was used")
    return mixed, info


def _prev_files(prev: IndexVersion, names: Sequence[str]) -> dict[str, ExistingFile]:
    files = prev.manifest["files"]
    return {n: ExistingFile(prev.path / f"{n}.npy", files[f"{n}.npy"]["sha256"]) for n in names if f"{n}.npy" in files}


def _biases_for(prev: IndexVersion, arrays: dict[str, Any], checkpoint: str | os.PathLike | None, n_iters: int | None,
                *, traffic: str | os.PathLike | None = None, traffic_weight: float = 0.5,
                report: RunReport | None = None, carry_traffic: bool = False, score: str | None = None,
                k: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Recompute the biases of a gallery (`arrays`: units, norms, frames, masks, optional ann_units) with the
    index's checkpoint (its queue and logit scale), mixed with a bank of served queries when `traffic` is given
    (or when the previous biases came from one: remove). `score`/`k`: default the previous version's."""
    from training.checkpoint import load_model, read_checkpoint

    units = np.asarray(arrays["units"], dtype=np.float32)
    score = score or bias_score_of(prev.manifest)
    if score not in ("served", "dual"):
        raise ValueError(f"--bias-score must be served or dual, got {score!r}")
    k = k or int((((prev.manifest.get("biases") or {}).get("served")) or {}).get("k") or 256)

    ck = prev.manifest.get("checkpoint") or {}
    iters = n_iters or int((prev.manifest.get("biases") or {}).get("n_iters") or 4)
    path = Path(checkpoint).expanduser().absolute() if checkpoint else Path(ck.get("path", ""))
    if traffic is not None:  # validate the bank before anything else: a bad file changes nothing
        from .postprocess import load_query_bank

        load_query_bank(traffic, prev.dim)
    if not path.is_file():
        if (prev.manifest.get("biases") or {}).get("source") == "none" and not checkpoint and traffic is None:
            info = dict(prev.manifest.get("biases") or {}, n_iters=iters)
            return np.zeros(units.shape[0], np.float32), info
        raise ValueError(f"cannot recompute the NCL biases: checkpoint {path} not found; pass --checkpoint")
    sha = file_sha256(path)
    if ck.get("sha256") and sha != ck["sha256"]:
        raise IndexMismatchError(
            f"index {prev.root} was built with checkpoint sha256 {ck['sha256']} ({ck.get('path')}); {path} has sha256 {sha}"
        )
    gamma, queue = checkpoint_gamma_and_queue(read_checkpoint(path), raw=True)
    tinfo = None
    if traffic is not None:
        queue, tinfo = _mixed_queue(queue, traffic, traffic_weight, prev.dim)
    elif carry_traffic and (prev.manifest.get("biases") or {}).get("traffic") and report is not None:
        queue, tinfo = _carried_traffic(queue, prev.manifest["biases"], prev.dim, report)
    served = None
    if score == "served" and queue is not None and len(units):
        import torch

        model, _ = load_model(path, "cuda" if torch.cuda.is_available() else "cpu")
        served = _served_inputs(model, arrays, k)
    b, info = compute_biases(units, gamma, queue, iters, served=served)
    return b, (info if tinfo is None else _traffic_binfo(info, tinfo))


def remove(out: str | os.PathLike, items: Sequence[str], *, checkpoint: str | os.PathLike | None = None,
           keep: int = 3, n_iters: int | None = None) -> RunReport:
    """`gare-index remove`: drop ids (integers) or paths (every window of that file) and recompute biases."""
    t0 = time.time()
    root = Path(out).expanduser().absolute()
    report = RunReport(command="remove", index=str(root))
    try:
        with index_lock(root, BUILD_LOCK, blocking=False):
            prev = open_index(root, use_gpu=False)
            report.previous_version = prev.name
            rows = prev.all_metadata()
            by_path: dict[str, list[int]] = defaultdict(list)
            for r in rows:
                by_path[r["path"]].append(int(r["id"]))
            idset = {int(r["id"]) for r in rows}
            doomed: set[int] = set()
            unknown: list[str] = []
            for it in items:
                s = str(it).strip()
                if s.lstrip("-").isdigit():
                    (doomed.add(int(s)) if int(s) in idset else unknown.append(s))
                else:
                    p = os.path.abspath(os.path.expanduser(s))
                    (doomed.update(by_path[p]) if p in by_path else unknown.append(s))
            if unknown:
                raise ValueError(f"not in index {prev.name}: {unknown}")
            keep_rows = [r for r in rows if int(r["id"]) not in doomed]
            entries = [_Entry(dict(r), ("prev", int(row)))
                       for r, row in zip(keep_rows, prev.rows(np.array([r["id"] for r in keep_rows], np.int64)), strict=True)]
            staging = root / WORK_DIR / f".staging-{os.getpid()}"
            try:
                arrays = _assemble(entries, prev.max_frames, prev.dim, prev, None, staging,
                                   _no_kv if prev.kv is not None else None)
                if prev.ann_units is not None:  # InvGC vectors are per item: the kept rows keep theirs
                    src = np.array([e.src[1] for e in entries], dtype=np.int64)
                    arrays["ann_units"] = np.asarray(prev.ann_units[src], dtype=np.float32).reshape(len(entries), prev.dim)
                arrays["biases"], binfo = _biases_for(prev, arrays, checkpoint, n_iters, report=report,
                                                      carry_traffic=True)
                requested = prev.manifest.get("index_type_requested", "auto")
                ann, ainfo = _make_ann(arrays.get("ann_units", arrays["units"]), arrays["ids"], BuildOptions(), prev,
                                       requested, incremental=True,
                                       drop_ids=np.array(sorted(doomed), np.int64), new_rows=np.zeros(0, np.int64))
                extra = _carry_manifest(prev.manifest) | {"biases": binfo, **ainfo, "builder": {"command": "remove"}}
                name = write_version(root, arrays, [e.meta for e in entries], extra, ann=ann, keep=keep)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            report.version, report.n_videos, report.removed, report.biases = name, len(entries), len(doomed), binfo
            report.index_type = ann.params.index_type
            report.invgc, report.ncl_stage1 = prev.manifest.get("invgc"), bool(prev.manifest.get("ncl_stage1"))
    except Exception as e:
        report.error = str(e)
        report.finish(t0)
        _write_report_logged(root, report)
        raise
    report.finish(t0)
    _write_report_logged(root, report)
    return report


def _no_kv(frames16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    raise RuntimeError("K/V are copied from the previous version; nothing should be recomputed")


def _carry_manifest(m: dict[str, Any]) -> dict[str, Any]:
    """Manifest fields a derived version keeps (checkpoint binding, sampling, ANN choice, ...)."""
    keys = ("checkpoint", "precision", "sampling", "segment", "index_type_requested", "ann_params", "ann_trained_n",
            "next_id", "biases", "invgc", "ncl_stage1", "stage1")
    return {k: m[k] for k in keys if k in m}


def recompute_biases(out: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None, keep: int = 3,
                     n_iters: int | None = None, traffic: str | os.PathLike | None = None,
                     traffic_weight: float = 0.5, score: str | None = "served", k: int | None = None) -> RunReport:
    """`gare-index biases`: a new version with recomputed NCL biases; every other file is hard-linked
    (ann_ncl.faiss, which folds the biases into stage 1, is rebuilt).

    `traffic`: a float32 (n, d) .npy bank of served query embeddings (`--from-traffic`), mixed with the
    checkpoint's training queue so that a fraction `traffic_weight` of the queue is traffic (indexer.postprocess.mix_queues)."""
    t0 = time.time()
    root = Path(out).expanduser().absolute()
    report = RunReport(command="biases", index=str(root))
    try:
        with index_lock(root, BUILD_LOCK, blocking=False):
            prev = open_index(root, use_gpu=False)
            report.previous_version = prev.name
            if not 0.0 <= traffic_weight <= 1.0:
                raise ValueError(f"--traffic-weight must be in [0, 1], got {traffic_weight}")
            feats = {"units": prev.units, "norms": prev.norms, "frames": prev.frames, "masks": prev.masks,
                     "ann_units": prev.ann_units}
            b, binfo = _biases_for(prev, feats, checkpoint, n_iters, traffic=traffic, traffic_weight=traffic_weight,
                                   report=report, score=score, k=k)
            arrays: dict[str, Any] = _prev_files(prev, ["ids", "norms", "units", "frames", "masks", "keys", "values",
                                                        "ann_units"])
            arrays["biases"] = b
            files = prev.manifest["files"]
            extra = _carry_manifest(prev.manifest) | {"biases": binfo, "builder": {"command": "biases"}}
            name = write_version(
                root, arrays, ExistingFile(prev.path / "meta.sqlite", files["meta.sqlite"]["sha256"]), extra,
                ann=ExistingFile(prev.path / "ann.faiss", files["ann.faiss"]["sha256"]), keep=keep,
            )
            report.version, report.n_videos, report.biases = name, prev.n, binfo
            report.index_type = prev.manifest.get("index_type")
            report.invgc, report.ncl_stage1 = prev.manifest.get("invgc"), bool(prev.manifest.get("ncl_stage1"))
    except Exception as e:
        report.error = str(e)
        report.finish(t0)
        _write_report_logged(root, report)
        raise
    report.finish(t0)
    _write_report_logged(root, report)
    return report


# ------------------------------------------------------------------------------------------ stats
def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stats(out: str | os.PathLike) -> dict[str, Any]:
    from .store import list_versions

    root = Path(out).expanduser().absolute()
    with open_index(root, use_gpu=False) as v:
        m = v.manifest
        files = {k: int(x["bytes"]) for k, x in m["files"].items()}
        total = sum(files.values())
        meta = v.all_metadata()
        n = v.n
        return {
            "index": str(root),
            "version": v.name,
            "versions": list_versions(root),
            "created": m.get("created"),
            "n": n,
            "distinct_files": len({r["path"] for r in meta}),
            "segments": sum(1 for r in meta if r["start"] is not None or r["end"] is not None),
            "total_duration_s": round(sum(float(r["duration"] or 0) for r in meta if r["start"] is None)
                                      + sum(float(r["end"] - r["start"]) for r in meta if r["start"] is not None and r["end"] is not None), 3),
            "dim": v.dim,
            "max_frames": v.max_frames,
            "mean_frames_used": round(float(np.asarray(v.masks).sum(axis=1).mean()), 3) if n else 0.0,
            "index_type": m.get("index_type"),
            "index_type_requested": m.get("index_type_requested"),
            "ann_params": m.get("ann_params"),
            "kv": bool(m.get("kv")),
            # padded rows: features kept, v̄ over all rows, psi attends to them (checkpoints imported from the authors)
            "reference_padding": v.reference_padding,
            "precision": m.get("precision"),
            "checkpoint": m.get("checkpoint", {}).get("path"),
            "checkpoint_sha256": m.get("checkpoint", {}).get("sha256"),
            "biases": m.get("biases"),
            "invgc": None if not m.get("invgc") else {k: v for k, v in m["invgc"].items() if k != "selection"}
            | {"selection": {k: v for k, v in (m["invgc"].get("selection") or {}).items() if k != "tried"}},
            "ncl_stage1": m.get("ncl_stage1"),
            "stage1": None if not m.get(STAGE1_KEY) else {k: v for k, v in m[STAGE1_KEY].items() if k != "trials"},
            "default_candidates": (m.get(STAGE1_KEY) or {}).get("default_candidates"),
            "bytes": files,
            "bytes_total": total,
            "bytes_per_video": round(total / n, 1) if n else None,
            "work_bytes": _dir_bytes(root / WORK_DIR) if (root / WORK_DIR).is_dir() else 0,
            "all_versions_bytes": _dir_bytes(root / VERSIONS_DIR),
            "manifest": str(v.path / MANIFEST_FILE),
        }
