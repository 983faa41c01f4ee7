"""Videos -> index versions: `build`, `add`, `remove` and `biases` (the work behind `gare-index`).

build/add run four named stages, one module each in ``gare_build/pipeline/``:

1. ``plan``     bind the run to a checkpoint and precision, load the model, find the clips and decide where each
                clip's features come from: the current version (same checkpoint and precision, same file
                content and window), the work/ cache of an interrupted run, or the encoder;
2. ``encode``   run the encoder (local decode worker processes + a batched encoder, or Dask workers) and turn
                the plan into the new version's entries, dropping failed videos;
3. ``assemble`` gather the entries' features into the new arrays (staged on disk);
4. ``finish``   NCL biases (``biases``), optional InvGC vectors (``invgc``), the ANN index, the manifest, then
                :func:`gare_index.store.write_version` (a complete new version, then an atomic switch of CURRENT).

`remove` and `biases` reuse assembly, biases and the writer. Every command writes INDEX/report.json
(``options.RunReport``) through :func:`reported`, which ``gare_build.upgrade`` and ``gare_build.retune`` use
too, as they use :func:`prev_files` and :func:`carry_manifest` to derive a version from the current one. Optional
post-processing: docs/postprocessing.md, :mod:`gare_build.invgc_fit`, :mod:`gare_build.ncl_queues`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gare_build.pipeline.assemble import Entry, assemble
from gare_build.pipeline.biases import biases_for, compute_biases
from gare_build.pipeline.encode import Encoder, collect_entries, kv_fn
from gare_build.pipeline.finish import finish, make_ann
from gare_build.pipeline.options import BUILD_LOCK, BuildOptions, RunReport, progress_enabled, write_report
from gare_build.pipeline.plan import clean_staging, plan
from gare_build.pipeline.stats import stats
from gare_index import psi_consts
from gare_index.store import (
    REPORT_FILE,
    WORK_DIR,
    ExistingFile,
    IndexFormatError,
    IndexManifest,
    IndexVersion,
    index_lock,
    open_index,
    write_version,
)

# the commands, the helpers of commands that derive a version, and what their callers pass or read (options, lock,
# report; `stats` and `compute_biases` are the other commands' entry points, kept beside them for one import)
__all__ = ["build", "remove", "recompute_biases", "stats", "compute_biases", "reported", "prev_files", "carry_manifest",
           "BuildOptions", "BUILD_LOCK", "RunReport"]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ run report
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


@contextlib.contextmanager
def reported(root: Path, report: RunReport) -> Iterator[RunReport]:
    """The one run-report handling of every command: time the run, record its outcome (an error as the
    report's error) and write INDEX/report.json, on success and on failure, then re-raise."""
    t0 = time.time()
    try:
        yield report
    except BaseException as e:
        report.error = f"{type(e).__name__}: {e}" if not isinstance(e, (IndexFormatError, ValueError)) else str(e)
        report.finish(t0)
        if isinstance(e, Exception):  # not on KeyboardInterrupt/SystemExit: the process is going away
            _write_report_logged(root, report)
        raise
    report.finish(t0)
    _write_report_logged(root, report)


# ------------------------------------------------------------------------------------------ build / add
def build(checkpoint: str | os.PathLike | None, videos: str | os.PathLike, out: str | os.PathLike,
          opts: BuildOptions | None = None, *, mode: str = "build") -> RunReport:
    """`gare-index build` (mode="build": the new version holds exactly the given videos) and `add`
    (mode="add": the current version plus new or changed files, by checksum). Writes INDEX/report.json."""
    opts = opts or BuildOptions()
    opts.validate()
    if mode not in ("build", "add"):
        raise ValueError(f"mode must be build or add, got {mode!r}")
    root = Path(out).expanduser().absolute()
    root.mkdir(parents=True, exist_ok=True)
    report = RunReport(command=mode, index=str(root), engine=opts.engine)
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        _build_locked(checkpoint, videos, root, opts, mode, report)
    return report


def _build_locked(checkpoint: Any, videos: Any, root: Path, opts: BuildOptions, mode: str, report: RunReport) -> None:
    """plan -> encode -> assemble -> finish, under the index's build lock."""
    clean_staging(root)
    p = plan(checkpoint, videos, root, opts, mode, report)
    enc = Encoder(cache=p.cache, report=report, opts=opts, progress=progress_enabled(opts.progress))
    enc.run(list(p.jobs.values()), model=p.model, device=p.device, precision=p.precision, checkpoint=str(p.ckpt_path),
            sha256=p.sha)
    entries, todo_ids, kept_ids, n_from_todo = collect_entries(p, enc, report)
    if not entries:
        raise ValueError(f"nothing could be indexed from {videos} ({len(report.skipped)} skipped; see {root / REPORT_FILE})")
    if mode == "add" and p.prev is not None and n_from_todo == 0 and len(entries) == p.prev.n and not p.fields_changed:
        report.n_videos = p.prev.n
        report.notes.append("index is up to date: no new or changed files; no new version written")
        return
    staging = root / WORK_DIR / f".staging-{os.getpid()}"
    try:
        arrays = assemble(entries, p.f, p.d, p.prev, p.cache, staging, kv_fn(p.model) if p.store_kv else None,
                          frames_dtype=p.frames_dtype)
        name = finish(p, entries, arrays, opts, report, todo_ids=todo_ids, kept_ids=kept_ids, staging=staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report.version = name
    report.n_videos = len(entries)
    p.cache.clear()  # its features are in the current version now


# ------------------------------------------------------------------------------------------ remove / biases
def prev_files(prev: IndexVersion, names: Sequence[str]) -> dict[str, ExistingFile]:
    """The current version's files ``names`` (those it has) as ExistingFile links for the new version."""
    files = prev.manifest.files
    if "frames" in names:  # int8 frames go with their per-frame scales (gare_index.frame_quant)
        names = [*names, "frame_scales"]
    return {n: ExistingFile(prev.path / f"{n}.npy", files[f"{n}.npy"]["sha256"]) for n in names if f"{n}.npy" in files}


def remove(out: str | os.PathLike, items: Sequence[str], *, checkpoint: str | os.PathLike | None = None,
           keep: int = 3, n_iters: int | None = None, defer_biases: bool = False) -> RunReport:
    """`gare-index remove`: drop ids (integers) or paths (every window of that file) and recompute biases
    (`defer_biases`: leave them zero, recorded "deferred": the caller fits them, as BuildOptions.defer_biases)."""
    root = Path(out).expanduser().absolute()
    report = RunReport(command="remove", index=str(root))
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
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
        entries = [Entry(dict(r), ("prev", int(row)))
                   for r, row in zip(keep_rows, prev.rows(np.array([r["id"] for r in keep_rows], np.int64)), strict=True)]
        staging = root / WORK_DIR / f".staging-{os.getpid()}"
        try:
            arrays = assemble(entries, prev.max_frames, prev.dim, prev, None, staging,
                               _no_kv if prev.kv is not None else None)
            if prev.ann_units is not None:  # InvGC vectors are per item: the kept rows keep theirs
                src = np.array([e.src[1] for e in entries], dtype=np.int64)
                arrays["ann_units"] = np.asarray(prev.ann_units[src], dtype=np.float32).reshape(len(entries), prev.dim)
            # the kept rows' psi constants first: the served biases' psi scores read them
            psi_consts.carry(arrays, prev, np.array([e.src[1] for e in entries], dtype=np.int64))
            if defer_biases:
                arrays["biases"], binfo = np.zeros(len(entries), np.float32), {"source": "deferred"}
            else:
                arrays["biases"], binfo = biases_for(prev, arrays, checkpoint, n_iters, report=report,
                                                      carry_traffic=True)
            requested = prev.manifest.index_type_requested or "auto"
            ann, ainfo = make_ann(arrays.get("ann_units", arrays["units"]), arrays["ids"], BuildOptions(), prev,
                                   requested, incremental=True,
                                   drop_ids=np.array(sorted(doomed), np.int64), new_rows=np.zeros(0, np.int64))
            extra = carry_manifest(prev.manifest) | {"biases": binfo, **ainfo, "builder": {"command": "remove"}}
            name = write_version(root, arrays, [e.meta for e in entries], extra, ann=ann, keep=keep)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        report.version, report.n_videos, report.removed, report.biases = name, len(entries), len(doomed), binfo
        report.index_type = ann.params.index_type
        report.invgc, report.ncl_stage1 = prev.manifest.invgc, bool(prev.manifest.ncl_stage1)
    return report


def _no_kv(frames16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    raise RuntimeError("K/V are copied from the previous version; nothing should be recomputed")


def carry_manifest(m: IndexManifest) -> dict[str, Any]:
    """Manifest fields a derived version keeps (checkpoint binding, sampling, ANN choice, ...), as JSON."""
    keys = ("checkpoint", "precision", "sampling", "segment", "index_type_requested", "ann_params", "ann_trained_n",
            "next_id", "biases", "invgc", "ncl_stage1", "psi_fold", "stage1", "fields")
    d = m.to_dict()
    return {k: d[k] for k in keys if k in d}


def recompute_biases(out: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None, keep: int = 3,
                     n_iters: int | None = None, traffic: str | os.PathLike | None = None,
                     traffic_weight: float = 0.5, score: str | None = "served", k: int | None = None,
                     queue_kind: str | None = None, captions: str | os.PathLike | None = None,
                     ncl_val: str | os.PathLike | None = None,
                     gamma_factors: Sequence[float] | None = None) -> RunReport:
    """`gare-index biases`: a new version with recomputed NCL biases; every other file is hard-linked
    (ann_ncl.faiss, which folds the biases into stage 1, is rebuilt).

    `traffic`: a float32 (n, d) .npy bank of served query embeddings (`--from-traffic`), mixed with the
    checkpoint's training queue so that a fraction `traffic_weight` of the queue is traffic (gare_build.ncl_queues.mix_queues)."""
    root = Path(out).expanduser().absolute()
    report = RunReport(command="biases", index=str(root))
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        prev = open_index(root, use_gpu=False)
        report.previous_version = prev.name
        if not 0.0 <= traffic_weight <= 1.0:
            raise ValueError(f"--traffic-weight must be in [0, 1], got {traffic_weight}")
        feats = {"units": prev.units, "norms": prev.norms, "frames": prev.frames, "masks": prev.masks,
                 "ann_units": prev.ann_units, "psi_consts": prev.psi_consts}
        b, binfo = biases_for(prev, feats, checkpoint, n_iters, traffic=traffic, traffic_weight=traffic_weight,
                               report=report, score=score, k=k, queue_kind=queue_kind, captions=captions,
                               ncl_val=ncl_val, gamma_factors=gamma_factors)
        arrays: dict[str, Any] = prev_files(prev, ["ids", "norms", "units", "frames", "masks", "keys", "values",
                                                    "ann_units", "psi_consts"])
        arrays["biases"] = b
        files = prev.manifest.files
        extra = carry_manifest(prev.manifest) | {"biases": binfo, "builder": {"command": "biases"}}
        name = write_version(
            root, arrays, ExistingFile(prev.path / "meta.sqlite", files["meta.sqlite"].sha256), extra,
            ann=ExistingFile(prev.path / "ann.faiss", files["ann.faiss"].sha256), keep=keep,
        )
        report.version, report.n_videos, report.biases = name, prev.n, binfo
        report.index_type = prev.manifest.index_type
        report.invgc, report.ncl_stage1 = prev.manifest.invgc, bool(prev.manifest.ncl_stage1)
    return report
