"""Stage 1 of build/add, the plan: bind the run to a checkpoint and precision, load the model, decide the
post-processing (InvGC, NCL stage 1: :func:`postprocess_setup`), find the clips to index and decide where each
clip's features come from (the current version, the work/ cache of an interrupted run, or the encoder). Nothing
is encoded or written here."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gare.checkpoint import file_sha256, load_model
from gare.model import resolve_device
from gare_build.discover import Clip, Skip, discover, expand_segments, fmt_time, scan, seg_of
from gare_build.invgc_fit import invgc_refs, select_invgc
from gare_build.pipeline.options import BuildOptions, RunReport, progress_enabled
from gare_build.resumable_work import WorkCache, model_key
from gare_index.fields import coerce_row, ignored_columns, merge_schema, stored_value
from gare_index.frame_quant import DEFAULT_FRAME_DTYPE, check_frame_dtype
from gare_index.store import (
    WORK_DIR,
    IndexFormatError,
    IndexMismatchError,
    IndexVersion,
    current_version_name,
    open_index,
)

log = logging.getLogger(__name__)

Job = tuple[str, str, float | None, float | None]  # (cache key, path, start, end)


@dataclass
class Plan:
    """What one build/add run does, decided before anything is encoded."""

    mode: str  # "build" | "add"
    root: Path
    prev: IndexVersion | None  # the current version (None for a first build)
    pman: dict[str, Any]  # its manifest ({} without one)
    ckpt_path: Path
    sha: str  # the checkpoint's sha256
    precision: str
    store_kv: bool
    segment: float | None
    frames_dtype: str  # how frames.npy is stored: "float16" | "int8"
    overlap: float
    device: Any
    model: Any
    ckpt: Any
    post: dict[str, Any]  # the post-processing applied (postprocess_setup)
    prev_rows: list[dict[str, Any]]  # metadata rows of the current version
    todo: list[Clip]  # clips that enter the new version with new features (ids assigned)
    kept: list[dict[str, Any]]  # rows of the current version kept as they are (add)
    next_id: int
    prev_by_key: dict[str, int]  # cache key -> row of the current version with the same features
    cache: WorkCache
    jobs: dict[str, Job]  # cache key -> what the encoder must run
    fields: dict[str, str] = dataclasses.field(default_factory=dict)  # the new version's own fields (name -> type)
    fields_changed: bool = False  # add: an unchanged clip's manifest gave other field values than its row has

    @property
    def f(self) -> int:
        return int(self.model.cfg.max_frames)

    @property
    def d(self) -> int:
        return int(self.model.cfg.embed_dim)


def clean_staging(root: Path) -> None:
    """Remove the staging folders an interrupted run left under INDEX/work/."""
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


def skip_record(c: Clip, reason: str) -> dict[str, Any]:
    """The report's record of a clip left out of the new version, with the reason."""
    return Skip(c.path, reason, c.start, c.end, c.source).to_dict()


def postprocess_setup(opts: BuildOptions, mode: str, pman: dict[str, Any], model: Any, ckpt: Any,
                       precision: str) -> dict[str, Any]:
    """What post-processing this run applies; for a new InvGC build, the (r_g, r_q) search runs here, before
    anything is encoded (a missing validation set fails the run early)."""
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


def plan(checkpoint: Any, videos: Any, root: Path, opts: BuildOptions, mode: str, report: RunReport) -> Plan:
    """The plan of a build (mode="build") or add (mode="add") run; fills report's ignored/skipped/unchanged."""
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
    have_dtype = pman.get("frame_dtype", DEFAULT_FRAME_DTYPE)
    frames_dtype = check_frame_dtype(opts.frames_dtype) if opts.frames_dtype else (have_dtype if mode == "add" else DEFAULT_FRAME_DTYPE)
    if mode == "add" and frames_dtype != have_dtype:
        raise ValueError(f"the index stores {have_dtype} frames; add keeps them (got --frames-dtype {frames_dtype}): "
                         "rebuild with `gare-index build --frames-dtype` to change it")
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
    post = postprocess_setup(opts, mode, pman, model, ckpt, precision)

    # ---- what to index
    if opts.clips is not None:  # discovered and scanned by the caller (copies: ids are assigned below)
        clips, skipped, ignored = [dataclasses.replace(c) for c in opts.clips], [], []
    else:
        clips, skipped, ignored = discover(videos)
    report.ignored = [s.to_dict() for s in ignored]
    fields = resolve_fields(clips, pman.get("fields") if prev is not None else None, opts.fields, adding=mode == "add")
    prev_rows = prev.all_metadata() if prev is not None else []
    known = {r["path"]: r for r in prev_rows}
    if opts.clips is None:
        clips, sk = scan(clips, known, threads=opts.scan_threads, progress=progress_enabled(opts.progress))
        skipped += sk
    clips, sk = expand_segments(clips, segment, overlap)
    skipped += sk
    clips, sk = _dedupe(clips)
    skipped += sk
    report.skipped = [s.to_dict() for s in skipped]

    prev_by_seg = {seg_of(r["path"], r["start"], r["end"]): r for r in prev_rows}
    fields_changed = False
    if mode == "build":
        todo, kept = clips, []
    else:
        todo = []
        for c in clips:
            r = prev_by_seg.get(c.seg)
            if r is not None and r["checksum"] == c.checksum and (not c.explicit_id or c.id == r["id"]):
                report.unchanged += 1
                if c.fields is not None:  # an unchanged video keeps its features; its manifest's fields win
                    for k, v in c.fields.items():
                        if r.get(k) != stored_value(fields[k], v):
                            r[k], fields_changed = v, True
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
    jobs: dict[str, Job] = {}
    for c in todo:
        k = c.cache_key
        if k not in prev_by_key and k not in cached and k not in jobs:
            jobs[k] = (k, c.path, c.start, c.end)
    n_cached_keys = len({c.cache_key for c in todo if c.cache_key not in prev_by_key and c.cache_key in cached})
    log.info("%d clips to index: %d to encode, %d in the work cache, %d reused from %s",
             len(todo), len(jobs), n_cached_keys, len(todo) - len(jobs) - n_cached_keys, report.previous_version)
    return Plan(mode=mode, root=root, prev=prev, pman=pman, ckpt_path=ckpt_path, sha=sha, precision=precision,
                store_kv=store_kv, frames_dtype=frames_dtype, segment=segment, overlap=overlap, device=device, model=model, ckpt=ckpt, post=post,
                prev_rows=prev_rows, todo=todo, kept=kept, next_id=next_id, prev_by_key=prev_by_key, cache=cache,
                jobs=jobs, fields=fields, fields_changed=fields_changed)


def resolve_fields(clips: list[Clip], prev: dict[str, str] | None, declared: Any, *, adding: bool) -> dict[str, str]:
    """The new version's own fields (name -> type) and every clip's values as stored (``clip.fields``, in place):
    the current version's schema (``prev``), ``--fields`` (``declared``) and the manifest's columns (types
    inferred where not declared). On an add, a new column, another type or a value of the wrong type is a
    FieldError that names it, raised before anything is scanned or written."""
    raw = [c.fields for c in clips if c.fields]
    ignored = ignored_columns(raw, dict(declared or {}))
    if ignored:  # captions and nested objects are not filterable fields: kept out, said once (declare to keep)
        log.warning("manifest columns left out of the index's fields: %s",
                    "; ".join(f"{k} ({why})" for k, why in sorted(ignored.items())))
        for c in clips:
            if c.fields:
                c.fields = {k: v for k, v in c.fields.items() if k not in ignored} or None
        raw = [c.fields for c in clips if c.fields]
    schema = merge_schema(prev, dict(declared or {}), raw, adding=adding)
    for c in clips:
        if c.fields:
            c.fields = coerce_row(schema, c.fields, c.source or c.path)
    return schema
