"""Writing an index version: arrays, FAISS files and SQLite into versions/.tmp-*, fsync, rename, switch CURRENT;
removing stale temporaries and old versions (gc).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
import shutil
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams, choose_index_type
from gare_index.fields import FIELDS_TABLE, check_name, sql_type
from gare_index.frame_quant import (
    FRAME_SCALES_ARRAY,
    QuantFrames,
    check_frame_dtype,
    frame_dtype_of,
    quantize_to,
)
from gare_index.ncl_ann import build_ncl_ann, ncl_ann_params
from gare_index.npy_staging import ExistingFile
from gare_index.store.fast_hash import fast_file_hash, sha256_and_fast_hash
from gare_index.store.field_arrays import write_field_arrays
from gare_index.store.format import (
    ANN_FILE,
    ANN_NCL_FILE,
    ARRAY_SPECS,
    CURRENT_FILE,
    FORMAT,
    FORMAT_VERSION,
    FRAME_NP_DTYPES,
    MANIFEST_FILE,
    META_COLUMNS,
    META_FILE,
    META_SQL_TYPES,
    OPTIONAL_ARRAYS,
    TMP_PREFIX,
    VERSIONS_DIR,
    WORK_DIR,
    HashingWriter,
    IndexFormatError,
    atomic_write_text,
    expected_shape,
    fsync_dir,
    index_lock,
    test_pause,
    version_name,
    version_number,
)
from gare_index.store.manifest import IndexManifest, parse_manifest
from gare_index.store.reader import current_version_name, list_versions
from gare_index.store.seal import write_sealed_manifest

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ writing
def _create_meta_db(path: Path, rows: Iterable[Mapping[str, Any]], fields: Mapping[str, str] | None = None) -> int:
    """meta.sqlite: the ``videos`` table (META_COLUMNS) and, when the index has its own fields (name -> type,
    gare_index.fields), the ``fields`` table (id + one column per field, the stored values of each row) and
    ``field_types`` (the schema, so that a reader of the file alone knows how to decode them)."""
    cols = ", ".join(f'"{c}" {META_SQL_TYPES[c]}' for c in META_COLUMNS)
    fields = dict(fields or {})
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute(f"CREATE TABLE videos ({cols})")
        conn.execute('CREATE INDEX videos_path ON videos ("path")')
        conn.execute('CREATE INDEX videos_checksum ON videos ("checksum")')
        qcols = ", ".join(f'"{c}"' for c in META_COLUMNS)
        sql = f"INSERT INTO videos ({qcols}) VALUES ({','.join('?' * len(META_COLUMNS))})"
        fsql = None
        if fields:
            fcols = ", ".join(f'"{check_name(k)}" {sql_type(t)}' for k, t in fields.items())
            conn.execute(f'CREATE TABLE {FIELDS_TABLE} ("id" INTEGER PRIMARY KEY, {fcols})')
            conn.execute("CREATE TABLE field_types (name TEXT PRIMARY KEY, type TEXT NOT NULL)")
            conn.executemany("INSERT INTO field_types VALUES (?, ?)", list(fields.items()))
            fq = ", ".join(f'"{k}"' for k in fields)
            fsql = f"INSERT INTO {FIELDS_TABLE} (\"id\", {fq}) VALUES ({','.join('?' * (len(fields) + 1))})"
        count = 0
        batch: list[tuple] = []
        fbatch: list[tuple] = []
        for r in rows:
            batch.append(tuple(r.get(c) for c in META_COLUMNS))
            if fsql is not None:
                fbatch.append((r.get("id"), *(_stored(t, r.get(k)) for k, t in fields.items())))
            count += 1
            if len(batch) >= 10_000:
                conn.executemany(sql, batch)
                batch.clear()
                if fsql is not None:
                    conn.executemany(fsql, fbatch)
                    fbatch.clear()
        if batch:
            conn.executemany(sql, batch)
        if fsql is not None and fbatch:
            conn.executemany(fsql, fbatch)
        conn.commit()
    finally:
        conn.close()
    return count


def _stored(kind: str, value: Any) -> Any:
    """A row's field value as the fields table stores it: tags read back from a version (a list) go back to their
    JSON text; every other value is stored as the builder coerced it (gare_index.fields.coerce)."""
    if kind == "tags" and isinstance(value, list):
        return json.dumps(sorted(set(value)), ensure_ascii=False)
    return value


def _array_header(value: Any) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(value, ExistingFile):
        arr = np.load(value.path, mmap_mode="r", allow_pickle=False)
        return tuple(arr.shape), arr.dtype
    return tuple(np.shape(value)), np.asarray(value[:0] if np.ndim(value) else value).dtype


def _write_npy(dst: Path, value: Any, dtype: np.dtype) -> dict[str, Any]:
    if isinstance(value, ExistingFile):
        src = Path(value.path)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        with open(dst, "rb+") as fh:
            os.fsync(fh.fileno())
        if value.sha256 is None:
            sha, fast = sha256_and_fast_hash(dst)
        else:
            sha = value.sha256
            fast = value.fast_hash or _recorded_fast_hash(src, sha) or fast_file_hash(dst)
        return {"bytes": dst.stat().st_size, "sha256": sha, "fast_hash": fast}
    arr = np.asarray(value)
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    with open(dst, "wb") as raw:
        w = HashingWriter(raw)
        np.save(w, arr, allow_pickle=False)
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": w.nbytes, "sha256": w.h.hexdigest(), "fast_hash": w.fast.hexdigest()}


def _recorded_fast_hash(src: Path, sha256: str) -> str | None:
    """The fast hash the manifest next to `src` (a file of a previous version) records for it, when that manifest
    records the same sha256 and size as the caller vouches for (no re-read of a linked file of GBs); else None."""
    try:
        files = json.loads((src.parent / MANIFEST_FILE).read_text(encoding="utf-8")).get("files") or {}
        entry = files.get(src.name) or {}
        if entry.get("sha256") == sha256 and entry.get("bytes") == src.stat().st_size:
            fast = entry.get("fast_hash")
            return fast if isinstance(fast, str) else None
    except (OSError, ValueError, AttributeError):
        pass
    return None


def _file_entry(path: Path) -> dict[str, Any]:
    """The manifest entry of a file written whole by another library (FAISS, SQLite): both hashes, one read."""
    sha, fast = sha256_and_fast_hash(path)
    return {"bytes": path.stat().st_size, "sha256": sha, "fast_hash": fast}


def _write_ann(tmp: Path, ann: Any, ann_params_d: Mapping[str, Any] | None, index_type: str | None,
               arrays: Mapping[str, Any], ids: np.ndarray, n: int) -> AnnParams:
    if ann is None:
        params = AnnParams.from_dict(ann_params_d) if ann_params_d else AnnParams(index_type or choose_index_type(n))
        units = _array_value(arrays.get("ann_units", arrays["units"]))  # the stage-1 vectors
        ann = AnnIndex(build_index(np.asarray(units, dtype=np.float32), ids, params, use_gpu=False), params)
    if not isinstance(ann, AnnIndex):
        ann = AnnIndex(ann, AnnParams.from_dict(ann_params_d) if ann_params_d else None)
    if ann.ntotal != n:
        raise ValueError(f"write_version: the ANN index holds {ann.ntotal} vectors for {n} ids")
    ann.save(tmp / ANN_FILE)
    with open(tmp / ANN_FILE, "rb+") as fh:
        os.fsync(fh.fileno())
    return ann.params


def _array_value(value: Any) -> np.ndarray:
    return np.load(value.path, mmap_mode="r", allow_pickle=False) if isinstance(value, ExistingFile) else value


def _write_ann_ncl(tmp: Path, ann_ncl: Any, ncl: Mapping[str, Any], arrays: Mapping[str, Any], ids: np.ndarray,
                   n: int, d: int, main_params: AnnParams) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write ann_ncl.faiss (linked, given, or built over [stage-1 ; b / c]); returns (file entry, manifest entry)."""
    c = float(ncl.get("c", 1.0))
    if not c > 0:
        raise ValueError(f"write_version: ncl_stage1 c must be > 0, got {c}")
    if isinstance(ann_ncl, ExistingFile):
        if not ncl.get("ann_params"):
            raise ValueError("write_version: a linked ann_ncl.faiss needs manifest_extra['ncl_stage1']['ann_params']")
        entry = _write_npy(tmp / ANN_NCL_FILE, ann_ncl, np.dtype(np.uint8))
        params = dict(ncl["ann_params"])
    else:
        if ann_ncl is None:
            params = ncl_ann_params(ncl.get("ann_params") or main_params.to_dict(), d)
            ann_ncl = build_ncl_ann(_array_value(arrays.get("ann_units", arrays["units"])), _array_value(arrays["biases"]),
                                    ids, params, c)
        if not isinstance(ann_ncl, AnnIndex):
            ann_ncl = AnnIndex(ann_ncl)
        if ann_ncl.ntotal != n or (n and ann_ncl.d != d + 1):
            raise ValueError(f"write_version: ann_ncl holds {ann_ncl.ntotal} vectors of d={ann_ncl.d} for {n} ids of d+1={d + 1}")
        ann_ncl.save(tmp / ANN_NCL_FILE)
        with open(tmp / ANN_NCL_FILE, "rb+") as fh:
            os.fsync(fh.fileno())
        entry = _file_entry(tmp / ANN_NCL_FILE)
        params = ann_ncl.params.to_dict()
    info = {k: v for k, v in ncl.items() if k not in ("c", "ann_params")}
    info.update({"c": c, "index_type": params["index_type"], "ann_params": params, "dim": d + 1, "file": ANN_NCL_FILE,
                 "stage1_vectors": "ann_units" if "ann_units" in arrays else "units"})
    return entry, info


def _next_version_number(root: Path) -> int:
    vdir = root / VERSIONS_DIR
    best = 0
    if vdir.is_dir():
        for p in vdir.iterdir():
            name = p.name[len(TMP_PREFIX):] if p.name.startswith(TMP_PREFIX) else p.name
            num = version_number(name)
            if num is not None:
                best = max(best, num)
    return best + 1


def remove_stale_tmp(root: str | os.PathLike) -> list[str]:
    """Delete versions/.tmp-* left behind by a killed writer (call with the index lock held)."""
    vdir = Path(root) / VERSIONS_DIR
    removed = []
    if vdir.is_dir():
        for p in vdir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    if removed:
        log.info("removed unfinished version directories left by an interrupted run: %s", removed)
    return removed


def switch_current(root: str | os.PathLike, name: str) -> None:
    root = Path(root)
    if not (root / VERSIONS_DIR / name).is_dir():
        raise IndexFormatError(f"{root}: cannot switch CURRENT to missing version {name}")
    atomic_write_text(root / CURRENT_FILE, name + "\n")


def write_version(
    root: str | os.PathLike,
    arrays: Mapping[str, Any],
    metadata_rows: Iterable[Mapping[str, Any]] | ExistingFile,
    manifest_extra: Mapping[str, Any],
    *,
    ann: AnnIndex | Any | None = None,
    keep: int | None = 3,
    file_hashes: Mapping[str, str] | None = None,
    ann_ncl: AnnIndex | ExistingFile | None = None,
    protect: Iterable[str] = (),
) -> str:
    """Write a complete new version and make it current; returns its name ("v000004").

    `arrays`: ids, norms, units, frames, masks, biases (optionally keys, values) as numpy arrays (any
    dtype castable to the format's) or :class:`ExistingFile`. Frames are float16, or int8 (a
    :class:`~gare_index.frame_quant.QuantFrames`, or int8 frames with ``frame_scales``);
    ``manifest_extra["frame_dtype"] = "int8"`` quantises float frames per frame here. `metadata_rows`: one mapping per id with the
    META_COLUMNS (status defaults to "ok"). `manifest_extra`: checkpoint, biases, ann_params, ... merged into
    the manifest. `ann`: an AnnIndex or faiss index over (units, ids); built from `ann_params` (or the
    automatic type) when None; over `ann_units` (InvGC-corrected stage-1 vectors) when that array is given.
    `manifest_extra["ncl_stage1"] = {"c": ..., "ann_params"?: ...}` also writes ann_ncl.faiss, the folded
    NCL stage-1 index: `ann_ncl` (an AnnIndex or the previous version's file) or, when None, built here
    over [stage-1 vectors ; biases / c]. Old versions beyond the newest `keep` are removed (never CURRENT, nor
    a version in `protect`: a shard's versions that live generations name, gare_index.shards.live_versions).
    """
    root = Path(root)
    arrays, frame_dtype, quant_dir = _frames_as_stored(root, arrays, manifest_extra.get("frame_dtype"))
    try:
        return _write_version(root, arrays, metadata_rows, manifest_extra, frame_dtype, ann=ann, keep=keep,
                              file_hashes=file_hashes, ann_ncl=ann_ncl, protect=protect)
    finally:
        if quant_dir is not None:
            shutil.rmtree(quant_dir, ignore_errors=True)


def _frames_as_stored(root: Path, arrays: Mapping[str, Any], requested: str | None) -> tuple[dict[str, Any], str, Path | None]:
    """(arrays with frames as written: float16, or int8 + frame_scales; the frame dtype; a scratch directory to
    remove after the write or None). Float frames are quantised here when `requested` is "int8" (per frame,
    gare_index.frame_quant); int8 frames go with their scales; QuantFrames are split into the two files."""
    arrays = dict(arrays)
    quant_dir = None
    fr = arrays.get("frames")
    if fr is None:
        return arrays, check_frame_dtype(requested or "float16"), None
    have = frame_dtype_of(fr)
    if requested is not None and check_frame_dtype(requested) == "int8" and have != "int8":
        quant_dir = root / WORK_DIR / f".staging-frames-int8-{os.getpid()}"
        shutil.rmtree(quant_dir, ignore_errors=True)
        src = np.load(fr.path, mmap_mode="r", allow_pickle=False) if isinstance(fr, ExistingFile) else fr
        fr, have = quantize_to(src, quant_dir if np.prod(src.shape) > 1 << 26 else None), "int8"
    if requested is not None and check_frame_dtype(requested) != have:
        raise ValueError(f"write_version: frame_dtype {requested!r} asked for {have} frames (an int8 index cannot take "
                         "float16 frames back; rebuild with --frames-dtype float16)")
    if isinstance(fr, QuantFrames):
        arrays["frames"], arrays[FRAME_SCALES_ARRAY] = fr.files if fr.files else (fr.q, fr.scales)
    elif have == "int8" and FRAME_SCALES_ARRAY not in arrays:
        raise ValueError(f"write_version: int8 frames need {FRAME_SCALES_ARRAY} (their per-frame scales)")
    if have != "int8" and FRAME_SCALES_ARRAY in arrays:
        raise ValueError(f"write_version: {FRAME_SCALES_ARRAY} goes with int8 frames only, got {have} frames")
    return arrays, have, quant_dir


def _write_version(root: Path, arrays: Mapping[str, Any], metadata_rows: Iterable[Mapping[str, Any]] | ExistingFile,
                   manifest_extra: Mapping[str, Any], frame_dtype: str, *, ann: Any, keep: int | None,
                   file_hashes: Mapping[str, str] | None, ann_ncl: Any, protect: Iterable[str]) -> str:
    missing = [k for k in ARRAY_SPECS if k not in arrays]
    if missing:
        raise ValueError(f"write_version: arrays missing {missing}")
    unknown = [k for k in arrays if k not in ARRAY_SPECS and k not in OPTIONAL_ARRAYS]
    if unknown:
        raise ValueError(f"write_version: unknown arrays {unknown}")
    if ("keys" in arrays) != ("values" in arrays):
        raise ValueError("write_version: keys and values go together")
    shapes = {k: _array_header(v) for k, v in arrays.items()}
    n = shapes["ids"][0][0] if shapes["ids"][0] else 0
    if len(shapes["units"][0]) != 2 or len(shapes["frames"][0]) != 3:
        raise ValueError(f"write_version: units must be (n, d) and frames (n, f, d); got {shapes['units'][0]}, {shapes['frames'][0]}")
    d = shapes["units"][0][1]
    f = shapes["frames"][0][1]
    for k, (shape, _) in shapes.items():
        expect = expected_shape(k, n, d, f)
        if shape != expect:
            raise ValueError(f"write_version: {k} has shape {shape}, expected {expect}")
    ids = np.asarray(np.load(arrays["ids"].path) if isinstance(arrays["ids"], ExistingFile) else arrays["ids"], dtype=np.int64)
    if np.unique(ids).size != n:
        raise ValueError("write_version: ids are not unique")
    if isinstance(metadata_rows, ExistingFile):
        rows = None  # an unchanged meta.sqlite of a previous version (linked, not re-checked)
    else:
        rows = [dict(r) for r in metadata_rows]
        for r in rows:
            r.setdefault("status", "ok")
        if len(rows) != n or (n and not np.array_equal(np.sort(np.array([int(r["id"]) for r in rows], dtype=np.int64)), np.sort(ids))):
            raise ValueError(f"write_version: {len(rows)} metadata rows do not match the {n} ids")

    # manifest fields given as models (read from a previous version) are written as the JSON they were read from
    extra = {k: v.to_dict() if hasattr(v, "to_dict") and hasattr(v, "model_fields_set") else v
             for k, v in manifest_extra.items()}
    unknown = sorted(k for k in extra if IndexManifest._attr(k) is None)
    if unknown:  # before anything is written (the manifest is validated again, whole, before it is written)
        raise ValueError(f"write_version: unknown manifest fields {unknown} (not part of format_version {FORMAT_VERSION})")
    extra.pop("frame_dtype", None)  # decided by _frames_as_stored
    ann_params_d = extra.pop("ann_params", None)
    index_type = extra.pop("index_type", None)
    ncl_req = extra.pop("ncl_stage1", None)
    if ann_ncl is not None and not ncl_req:
        ncl_req = {"c": 1.0}
    file_hashes = dict(file_hashes or {})

    with index_lock(root):
        remove_stale_tmp(root)
        number = _next_version_number(root)
        name = version_name(number)
        vdir = root / VERSIONS_DIR
        vdir.mkdir(parents=True, exist_ok=True)
        tmp = vdir / f"{TMP_PREFIX}{name}"
        tmp.mkdir()
        try:
            files: dict[str, dict[str, Any]] = {}
            for k, v in arrays.items():
                dtype = FRAME_NP_DTYPES[frame_dtype] if k == "frames" else (ARRAY_SPECS.get(k) or OPTIONAL_ARRAYS[k])[0]
                if isinstance(v, ExistingFile) and v.sha256 is None and k in file_hashes:
                    v = dataclasses.replace(v, sha256=file_hashes[k])
                files[f"{k}.npy"] = _write_npy(tmp / f"{k}.npy", v, dtype)

            # ANN index
            if isinstance(ann, ExistingFile):
                if not ann_params_d:
                    raise ValueError("write_version: a linked ann.faiss needs manifest_extra['ann_params']")
                files[ANN_FILE] = _write_npy(tmp / ANN_FILE, ann, np.dtype(np.uint8))
                params = AnnParams.from_dict(ann_params_d)
            else:
                params = _write_ann(tmp, ann, ann_params_d, index_type, arrays, ids, n)
                files[ANN_FILE] = _file_entry(tmp / ANN_FILE)
            ncl_info = None
            if ncl_req:
                files[ANN_NCL_FILE], ncl_info = _write_ann_ncl(tmp, ann_ncl, ncl_req, arrays, ids, n, d, params)

            if rows is None:
                files[META_FILE] = _write_npy(tmp / META_FILE, metadata_rows, np.dtype(np.uint8))
            else:
                _create_meta_db(tmp / META_FILE, rows, extra.get("fields"))
                with open(tmp / META_FILE, "rb+") as fh:
                    os.fsync(fh.fileno())
                files[META_FILE] = _file_entry(tmp / META_FILE)
            # the filter columns as typed arrays (fields/*.npy), so that a filtered search need not scan meta.sqlite
            files.update(write_field_arrays(tmp, name, ids, _write_npy,
                                            metadata_rows if rows is None else None, files["ids.npy"]["sha256"]))

            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "version": number,
                "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "checkpoint": None,
                "n": int(n),
                "dim": int(d),
                "max_frames": int(f),
                "frame_dtype": frame_dtype,
                "kv": "keys" in arrays,
                "index_type": params.index_type,
                "ann_params": params.to_dict(),
                "biases": {"gamma": None, "n_iters": 4, "n_queries": 0, "source": "none"},
                "invgc": None,
                "ncl_stage1": None,
            }
            manifest.update(extra)
            manifest["ncl_stage1"] = ncl_info
            manifest["files"] = files
            # through JSON first: what the writer has always written (numpy scalars as strings, tuples as lists)
            try:
                typed = parse_manifest(json.loads(json.dumps(manifest, default=str)))
            except ValueError as e:
                raise ValueError(f"write_version: the manifest is not valid: {e}") from None
            write_sealed_manifest(tmp, typed.to_json())  # manifest.json and its seal (gare_index.store.seal)
            fsync_dir(tmp)
            test_pause("write")
            os.rename(tmp, vdir / name)
            fsync_dir(vdir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        test_pause("switch")
        switch_current(root, name)
        log.info("wrote index version %s (%d videos) and made it current", name, n)
        if keep is not None:
            _gc_locked(root, keep, protect)
    return name


def _gc_locked(root: Path, keep: int, protect: Iterable[str] = ()) -> list[str]:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    versions = list_versions(root)
    try:
        cur = current_version_name(root)
    except IndexFormatError:
        cur = None
    keep_also = {cur, *protect}
    doomed = [v for v in versions[:-keep] if v not in keep_also] if len(versions) > keep else []
    for v in doomed:
        shutil.rmtree(root / VERSIONS_DIR / v, ignore_errors=True)
    if doomed:
        log.info("removed old index versions %s (keeping the newest %d and %s)", doomed, keep, cur)
    return doomed


def gc(root: str | os.PathLike, keep: int = 3, *, protect: Iterable[str] = ()) -> list[str]:
    """Remove all but the newest `keep` versions (never the current one, nor those in `protect`: a shard's
    versions named by live generations) and unfinished .tmp dirs."""
    root = Path(root)
    with index_lock(root):
        remove_stale_tmp(root)
        return _gc_locked(root, keep, protect)
