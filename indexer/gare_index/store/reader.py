"""Reading an index: CURRENT, versions, manifests, and opening a version as an
:class:`gare_index.store.index_version.IndexVersion` (its arrays checked against the manifest, FAISS, SQLite).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gare.checkpoint import file_sha256
from gare_index.ann import AnnIndex
from gare_index.ann_gpu import GpuIndexError
from gare_index.ann_params import AnnParams
from gare_index.frame_quant import FRAME_SCALES_ARRAY, QuantFrames
from gare_index.metadb import check_meta_db
from gare_index.ncl_ann import FoldedRows
from gare_index.store.fast_hash import sha256_and_fast_hash
from gare_index.store.file_check import BackgroundCheck, CheckReport, IndexCheckError
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
    MMAP_ARRAYS,
    OPTIONAL_ARRAYS,
    VERSIONS_DIR,
    IndexFormatError,
    IndexMismatchError,
    expected_shape,
    version_number,
)
from gare_index.store.index_version import IndexVersion
from gare_index.store.manifest import FileEntry, IndexManifest, parse_manifest
from gare_index.store.seal import seal_status, unsealed_warning

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ reading
def current_version_name(root: str | os.PathLike) -> str:
    root = Path(root)
    cur = root / CURRENT_FILE
    try:
        name = cur.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise IndexFormatError(f"{root}: no {CURRENT_FILE} file; not a gare index (create one with gare-index build)") from None
    if version_number(name) is None:
        raise IndexFormatError(f"{cur}: {name!r} is not a version name (expected e.g. 'v000001')")
    return name


def list_versions(root: str | os.PathLike) -> list[str]:
    """Complete versions under INDEX/versions, oldest first (unfinished .tmp-* directories excluded)."""
    vdir = Path(root) / VERSIONS_DIR
    if not vdir.is_dir():
        return []
    names = [p.name for p in vdir.iterdir() if p.is_dir() and version_number(p.name) is not None]
    return sorted(names, key=lambda n: version_number(n) or 0)


def read_manifest(path: Path) -> IndexManifest:
    """The manifest of the version directory `path`, validated (IndexFormatError naming the file and every bad field)."""
    return _read_manifest_bytes(Path(path))[0]


def _read_manifest_bytes(path: Path) -> tuple[IndexManifest, bytes]:
    """(the manifest of the version directory `path`, the bytes it was parsed from)."""
    mpath = path / MANIFEST_FILE
    try:
        data = mpath.read_bytes()
    except FileNotFoundError:
        raise IndexFormatError(f"{mpath}: missing") from None
    return manifest_from_bytes(mpath, data), data


def manifest_from_bytes(mpath: Path, data: bytes) -> IndexManifest:
    """The manifest whose file `mpath` holds the bytes `data`, validated as :func:`read_manifest` does."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexFormatError(f"{mpath}: not valid JSON ({e})") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise IndexFormatError(f"{mpath}: format is {raw.get('format') if isinstance(raw, dict) else None!r}, expected {FORMAT!r}")
    fv = raw.get("format_version")
    if fv != FORMAT_VERSION:
        raise IndexFormatError(
            f"{mpath}: index format version {fv!r} is not supported by this reader (it reads version {FORMAT_VERSION}); "
            "rebuild the index with this gare-index"
        )
    try:
        return parse_manifest(raw)
    except ValueError as e:
        raise IndexFormatError(f"{mpath}: {e}") from None


def _check_checkpoint(manifest: IndexManifest, where: str, expect_sha: str | None) -> None:
    if expect_sha is None:
        return
    ck = manifest.checkpoint
    have = None if ck is None else ck.sha256
    if have != expect_sha:
        raise IndexMismatchError(
            f"index {where} was built with checkpoint sha256 {have} ({None if ck is None else ck.path}), but the checkpoint in use has "
            f"sha256 {expect_sha}; rebuild the index with this checkpoint (gare-index build) or use the checkpoint it was built with"
        )


def file_hash_problems(path: Path, files: Mapping[str, FileEntry], *, rehash: bool) -> list[str]:
    """Every file of `files` present in `path` at its size; `rehash`: and matching both hashes its entry records."""
    problems = []
    for fname, info in sorted(files.items()):
        p = path / fname
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != info.bytes:
            problems.append(f"{p}: {size} bytes, manifest says {info.bytes}")
            continue
        if not rehash:
            continue
        if info.fast_hash:  # both recorded hashes must hold: one read gives both
            sha, fast = sha256_and_fast_hash(p)
        else:
            sha, fast = file_sha256(p), None
        if sha != info.sha256:
            problems.append(f"{p}: sha256 does not match the manifest (file corrupted or modified)")
        elif fast is not None and fast != info.fast_hash:
            problems.append(f"{p}: fast hash {fast} does not match the manifest's {info.fast_hash} (the manifest "
                            "was altered, or the file)")
    return problems


def _load_array(path: Path, name: str, mmap: bool) -> np.ndarray:
    p = path / f"{name}.npy"
    try:
        return np.load(p, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise IndexFormatError(f"{p}: missing") from None
    except (ValueError, OSError, EOFError) as e:
        raise IndexFormatError(f"{p}: unreadable ({e})") from e


def open_version(
    root: str | os.PathLike,
    name: str,
    *,
    expect_checkpoint_sha: str | None = None,
    verify: bool = False,
    use_gpu: bool | None = None,
    mmap_ann: bool = False,
    check: bool | BackgroundCheck = False,
) -> IndexVersion:
    """Open a named version (open_index opens the one CURRENT names).

    ``mmap_ann=True`` memory-maps the FAISS indexes read-only (``AnnIndex.load(mmap=True)``): for serving
    processes that share them through the page cache; never for a version that will be modified.
    ``check=True`` re-hashes every file against the manifest's fast hashes (gare_index.store.file_check) on
    background threads while the version opens, and returns only when they match (:class:`IndexCheckError`
    naming every bad file otherwise); a :class:`BackgroundCheck` of this version's directory started earlier is
    waited for instead (another one is ignored and a check started here). ``verify=True`` (sha256) makes it
    redundant. Both hold the manifest's bytes to their seal (gare_index.store.seal) first, before anything it says
    is used (its checkpoint binding too): a mismatch is an :class:`IndexCheckError` (check) or an
    :class:`IndexFormatError` (verify) naming manifest.json."""
    root = Path(root)
    path = root / VERSIONS_DIR / name
    if not path.is_dir():
        raise IndexFormatError(f"{path}: version directory missing")
    manifest, data = _read_manifest_bytes(path)
    if check or verify:  # the bytes just parsed, so the manifest in use is the sealed one
        seal = seal_status(path, data)
        if not seal.ok:
            if isinstance(check, BackgroundCheck) and check.path.resolve() == path.resolve():
                check.cancel()  # this version will not be served: its files need not be read
            if verify:
                raise IndexFormatError(seal.problem)
            raise IndexCheckError(CheckReport(path, [seal.problem]))
        if seal.state == "unsealed" and verify:  # a check says so itself (file_check)
            log.warning("%s", unsealed_warning(path))
    _check_checkpoint(manifest, f"{root} ({name})", expect_checkpoint_sha)
    files = manifest.files
    if not files:
        raise IndexFormatError(f"{path / MANIFEST_FILE}: no 'files' table")
    problems = file_hash_problems(path, files, rehash=verify)
    if problems:
        raise IndexFormatError("; ".join(problems))
    pending: BackgroundCheck | None = None
    if check and not verify:
        same = isinstance(check, BackgroundCheck) and check.path.resolve() == path.resolve()
        pending = check if same else BackgroundCheck(path, files)
    try:
        version = _open_checked_files(root, name, path, manifest, use_gpu=use_gpu, mmap_ann=mmap_ann)
    except IndexFormatError as e:
        # an altered file may also fail a later step of the open (ids against SQLite, FAISS unreadable):
        # the check names the file that changed, which is the cause
        if pending is not None and not (report := pending.wait()).ok:
            raise IndexCheckError(report) from e
        raise
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        report = pending.wait()
        if not report.ok:
            version.close()
            raise IndexCheckError(report)
        version.check_report = report
    return version


def _open_checked_files(root: Path, name: str, path: Path, manifest: IndexManifest, *, use_gpu: bool | None,
                        mmap_ann: bool) -> IndexVersion:
    """open_version once the manifest and the files' presence and sizes are checked."""
    files = manifest.files
    n, d, f = manifest.n, manifest.dim, manifest.max_frames
    arrays: dict[str, np.ndarray] = {}
    for aname, (dtype, _ndim) in {**ARRAY_SPECS, **OPTIONAL_ARRAYS}.items():
        if aname in OPTIONAL_ARRAYS and f"{aname}.npy" not in files:
            continue
        arr = _load_array(path, aname, mmap=aname in MMAP_ARRAYS)
        expect = expected_shape(aname, n, d, f)
        if aname == "frames":
            dtype = FRAME_NP_DTYPES[manifest.frame_dtype]
        if arr.shape != expect or arr.dtype != dtype:
            raise IndexFormatError(
                f"{path / (aname + '.npy')}: {arr.dtype} {arr.shape}, manifest implies {dtype} {expect}"
            )
        arrays[aname] = arr
    if (manifest.frame_dtype == "int8") != (FRAME_SCALES_ARRAY in arrays):
        raise IndexFormatError(f"{path}: frame_dtype {manifest.frame_dtype} and {FRAME_SCALES_ARRAY}.npy "
                               f"({'present' if FRAME_SCALES_ARRAY in arrays else 'missing'}) do not go together")
    frames = arrays["frames"]
    if manifest.frame_dtype == "int8":
        frames = QuantFrames(frames, arrays[FRAME_SCALES_ARRAY])
    params = AnnParams.from_dict(manifest.ann_params or {"index_type": manifest.index_type})
    stage1 = arrays.get("ann_units", arrays["units"])  # ivfpq re-scores with the vectors the ANN was built on
    try:
        ann = AnnIndex.load(path / ANN_FILE, params, stage1, use_gpu, vector_ids=arrays["ids"], mmap=mmap_ann)
    except GpuIndexError as e:  # the GPU clone is made here, at open: its error names the index and the way out
        raise IndexFormatError(f"{path / ANN_FILE}: {e}") from e
    except (RuntimeError, ValueError) as e:
        raise IndexFormatError(f"{path / ANN_FILE}: unreadable ({e})") from e
    if ann.ntotal != n or (n and ann.d != d):
        raise IndexFormatError(f"{path / ANN_FILE}: holds {ann.ntotal} vectors of d={ann.d}, manifest says n={n}, d={d}")
    ann_ncl = None
    if ANN_NCL_FILE in files:
        ncl = manifest.ncl_stage1 or {}
        nparams = AnnParams.from_dict(ncl.get("ann_params") or {"index_type": "flat"})
        try:
            ann_ncl = AnnIndex.load(path / ANN_NCL_FILE, nparams, FoldedRows(stage1, arrays["biases"], float(ncl.get("c", 1.0))),
                                    use_gpu, vector_ids=arrays["ids"], mmap=mmap_ann)
        except GpuIndexError as e:
            raise IndexFormatError(f"{path / ANN_NCL_FILE}: {e}") from e
        except (RuntimeError, ValueError) as e:
            raise IndexFormatError(f"{path / ANN_NCL_FILE}: unreadable ({e})") from e
        if ann_ncl.ntotal != n or (n and ann_ncl.d != d + 1):
            raise IndexFormatError(f"{path / ANN_NCL_FILE}: holds {ann_ncl.ntotal} vectors of d={ann_ncl.d}, "
                                   f"manifest says n={n}, d+1={d + 1}")
    version = IndexVersion(
        root=root, name=name, path=path, manifest=manifest,
        ids=arrays["ids"], norms=arrays["norms"], units=arrays["units"], frames=frames,
        masks=arrays["masks"], biases=arrays["biases"], ann=ann, dim=d, max_frames=f,
        keys=arrays.get("keys"), values=arrays.get("values"), ann_units=arrays.get("ann_units"), ann_ncl=ann_ncl,
        psi_consts=arrays.get("psi_consts"),
    )
    # Sizes alone do not prove the metadata is a database, and SQLite is read lazily (per search): check it
    # now, so that a damaged meta.sqlite fails this open (and a reload) instead of every later request.
    problems = check_meta_db(path / META_FILE, n=n, columns=META_COLUMNS, ids=arrays["ids"],
                             sha256=files[META_FILE].sha256 if META_FILE in files else None)
    if problems:
        version.close()
        raise IndexFormatError("; ".join(problems))
    return version


def open_index(
    root: str | os.PathLike,
    *,
    expect_checkpoint_sha: str | None = None,
    verify: bool = False,
    use_gpu: bool | None = None,
    mmap_ann: bool = False,
    check: bool | BackgroundCheck = False,
) -> IndexVersion:
    """Open the version CURRENT names (``mmap_ann``, ``check``: see :func:`open_version`).

    `verify=True` re-hashes every file against manifest["files"] (IndexFormatError naming the bad file);
    without it, presence and byte sizes are still checked. `expect_checkpoint_sha` that differs from the
    manifest's checkpoint hash raises IndexMismatchError naming both hashes. `use_gpu=None` searches
    flat/IVF indexes on the GPU when faiss has one and `gare_index.ann.gpu_plan` allows (True: required). The
    GPU copy is made here, so an index the GPU cannot take fails this call (IndexFormatError with the
    GpuIndexError's message: the index, its parameters, what to do), not the first search.
    """
    root = Path(root)
    if not root.is_dir():
        raise IndexFormatError(f"{root}: no such index directory")
    name = current_version_name(root)
    return open_version(root, name, expect_checkpoint_sha=expect_checkpoint_sha, verify=verify, use_gpu=use_gpu,
                        mmap_ann=mmap_ann, check=check)
