"""The on-disk index format (a contract with the service) and its reader and writers.

Layout (see docs/index-format.md)::

    INDEX/
      CURRENT                      the current version's directory name ("v000003"), switched atomically
      versions/v000003/            immutable once renamed into place
         manifest.json             format, version, checkpoint binding, shapes, ANN params, biases, file hashes
         ann.faiss                 FAISS index over the unit vectors, ids = video ids (int64)
         ids.npy (n,) int64        row order of every array below (ascending ids)
         norms.npy (n,) float32    |v̄|
         units.npy (n,d) float32   v̄/|v̄|
         frames.npy (n,f,d) float16 frame features F (padded rows zero), opened with mmap_mode="r"
         masks.npy (n,f) uint8
         biases.npy (n,) float32   NCL video biases b_j (zeros when the checkpoint has no query queue)
         keys.npy, values.npy      optional (n,f,d) float16: psi's per-video K/V projections (--store-kv)
         ann_units.npy (n,d) float32 optional: InvGC-corrected stage-1 vectors (--invgc); ann.faiss is built on
                                   them instead of units.npy (see docs/postprocessing.md)
         ann_ncl.faiss             optional (--ncl-stage1): FAISS over [stage-1 vector ; b_j / c] (NCL biases folded)
         meta.sqlite               table videos(id, path, size, mtime, checksum, duration, fps, frames_used,
                                   start, end, status)
      work/                        resumable encoder state; never read by the service
      report.json                  the last run's skipped files with reasons

Readers: :func:`open_index` (the service), :func:`current_version_name`, :func:`list_versions`.
Writers: :func:`write_version` writes ``versions/.tmp-<name>``, fsyncs every file, renames the directory to
its final name and then switches ``CURRENT`` (temp file + ``os.replace``), so a reader sees either the old
version or the new one, and a writer killed at any moment leaves the previous version intact.
:func:`gc` removes old versions (never the current one).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.atomic import atomic_write
from training.checkpoint import file_sha256
from training.sinkhorn import fold_biases, fold_query

from .ann import AnnIndex, AnnParams, build_index, choose_index_type
from .ncl_ann import NCL_ANN_FILE, FoldedRows, Stage1Unavailable, build_ncl_ann, ncl_ann_params

log = logging.getLogger(__name__)

FORMAT = "gare-index"
FORMAT_VERSION = 1

CURRENT_FILE = "CURRENT"
VERSIONS_DIR = "versions"
WORK_DIR = "work"
REPORT_FILE = "report.json"
MANIFEST_FILE = "manifest.json"
ANN_FILE = "ann.faiss"
ANN_NCL_FILE = NCL_ANN_FILE  # optional: stage 1 with the NCL biases folded in (--ncl-stage1)
META_FILE = "meta.sqlite"
LOCK_FILE = ".lock"

# name -> (dtype, number of dimensions); row count is n for all of them.
ARRAY_SPECS: dict[str, tuple[np.dtype, int]] = {
    "ids": (np.dtype(np.int64), 1),
    "norms": (np.dtype(np.float32), 1),
    "units": (np.dtype(np.float32), 2),
    "frames": (np.dtype(np.float16), 3),
    "masks": (np.dtype(np.uint8), 2),
    "biases": (np.dtype(np.float32), 1),
}
OPTIONAL_ARRAYS: dict[str, tuple[np.dtype, int]] = {
    "keys": (np.dtype(np.float16), 3),
    "values": (np.dtype(np.float16), 3),
    "ann_units": (np.dtype(np.float32), 2),  # InvGC-corrected stage-1 vectors (n, d)
}
_MMAP_ARRAYS = ("frames", "units", "keys", "values", "ann_units")
_ROW_DIM_ARRAYS = ("units", "ann_units")  # 2-D arrays of width d (the others are (n, f))
META_COLUMNS: tuple[str, ...] = (
    "id", "path", "size", "mtime", "checksum", "duration", "fps", "frames_used", "start", "end", "status",
)
_META_SQL_TYPES = {
    "id": "INTEGER PRIMARY KEY", "path": "TEXT NOT NULL", "size": "INT", "mtime": "REAL", "checksum": "TEXT",
    "duration": "REAL", "fps": "REAL", "frames_used": "INT", "start": "REAL", "end": "REAL", "status": "TEXT",
}
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_TMP_PREFIX = ".tmp-"

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "IndexFormatError",
    "IndexMismatchError",
    "IndexVersion",
    "ExistingFile",
    "open_index",
    "current_version_name",
    "list_versions",
    "write_version",
    "gc",
    "verify_index",
    "version_name",
    "index_lock",
]


class IndexFormatError(Exception):
    """The directory is not a readable gare index (missing/corrupt file, unknown format version, ...)."""


class IndexMismatchError(IndexFormatError):
    """The index was built with another checkpoint than the one it is used with."""


def version_name(number: int) -> str:
    return f"v{int(number):06d}"


def _version_number(name: str) -> int | None:
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------------ test hook
def test_pause(stage: str) -> None:
    """Deterministic crash points for the kill tests (no effect unless GARE_INDEX_TEST_PAUSE names `stage`).

    ``GARE_INDEX_TEST_PAUSE=<stage>`` (comma-separated list allowed) makes the process, on reaching
    ``stage``, create the file named by ``GARE_INDEX_TEST_PAUSE_FILE`` (if set) and sleep for
    ``GARE_INDEX_TEST_PAUSE_SECONDS`` (default 3600) so that a test can SIGKILL it right there.
    Stages: ``encoded:<N>`` (after the work-cache batch that brings this run to >= N encoded clips is
    committed), ``write`` (a version's files are written into versions/.tmp-*, before the rename),
    ``switch`` (the version directory is in place, CURRENT not yet switched).
    """
    want = os.environ.get("GARE_INDEX_TEST_PAUSE")
    if not want or stage not in {s.strip() for s in want.split(",")}:
        return
    marker = os.environ.get("GARE_INDEX_TEST_PAUSE_FILE")
    if marker:
        Path(marker).write_text(f"{os.getpid()} {stage}\n")
    log.warning("GARE_INDEX_TEST_PAUSE: pausing at %s", stage)
    time.sleep(float(os.environ.get("GARE_INDEX_TEST_PAUSE_SECONDS", "3600")))


# ------------------------------------------------------------------------------------------ fs helpers
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (training.atomic.atomic_write: temp file, fsync, os.replace, fsync dir)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


class _HashingWriter:
    """File wrapper for np.save: hashes and counts what is written (numpy streams in ~16 MiB chunks)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.h = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes | memoryview) -> int:
        self.h.update(data)
        self.nbytes += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


@contextlib.contextmanager
def index_lock(root: str | os.PathLike, name: str = LOCK_FILE, *, blocking: bool = True) -> Iterator[None]:
    """An exclusive flock on INDEX/<name> (released by the kernel if the process dies)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            raise IndexFormatError(f"{root}: another gare-index process is working on this index") from None
        yield
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ reading
def current_version_name(root: str | os.PathLike) -> str:
    root = Path(root)
    cur = root / CURRENT_FILE
    try:
        name = cur.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise IndexFormatError(f"{root}: no {CURRENT_FILE} file; not a gare index (create one with gare-index build)") from None
    if _version_number(name) is None:
        raise IndexFormatError(f"{cur}: {name!r} is not a version name (expected e.g. 'v000001')")
    return name


def list_versions(root: str | os.PathLike) -> list[str]:
    """Complete versions under INDEX/versions, oldest first (unfinished .tmp-* directories excluded)."""
    vdir = Path(root) / VERSIONS_DIR
    if not vdir.is_dir():
        return []
    names = [p.name for p in vdir.iterdir() if p.is_dir() and _version_number(p.name) is not None]
    return sorted(names, key=lambda n: _version_number(n) or 0)


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = Path(path) / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IndexFormatError(f"{mpath}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexFormatError(f"{mpath}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexFormatError(f"{mpath}: format is {manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r}")
    fv = manifest.get("format_version")
    if fv != FORMAT_VERSION:
        raise IndexFormatError(
            f"{mpath}: index format version {fv!r} is not supported by this reader (it reads version {FORMAT_VERSION}); "
            "rebuild the index with this gare-index"
        )
    return manifest


def _check_checkpoint(manifest: dict[str, Any], where: str, expect_sha: str | None) -> None:
    if expect_sha is None:
        return
    ck = manifest.get("checkpoint") or {}
    have = ck.get("sha256")
    if have != expect_sha:
        raise IndexMismatchError(
            f"index {where} was built with checkpoint sha256 {have} ({ck.get('path')}), but the checkpoint in use has "
            f"sha256 {expect_sha}; rebuild the index with this checkpoint (gare-index build) or use the checkpoint it was built with"
        )


def _hash_problems(path: Path, files: Mapping[str, Mapping[str, Any]], *, rehash: bool) -> list[str]:
    problems = []
    for fname, info in sorted(files.items()):
        p = path / fname
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != info.get("bytes"):
            problems.append(f"{p}: {size} bytes, manifest says {info.get('bytes')}")
            continue
        if rehash and file_sha256(p) != info.get("sha256"):
            problems.append(f"{p}: sha256 does not match the manifest (file corrupted or modified)")
    return problems


def _load_array(path: Path, name: str, mmap: bool) -> np.ndarray:
    p = path / f"{name}.npy"
    try:
        return np.load(p, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise IndexFormatError(f"{p}: missing") from None
    except (ValueError, OSError, EOFError) as e:
        raise IndexFormatError(f"{p}: unreadable ({e})") from e


@dataclass(eq=False)
class IndexVersion:
    """One opened, immutable index version. Arrays are in `ids` row order; `frames` is a float16 memmap."""

    root: Path
    name: str
    path: Path
    manifest: dict
    ids: np.ndarray
    norms: np.ndarray
    units: np.ndarray
    frames: np.ndarray
    masks: np.ndarray
    biases: np.ndarray
    ann: AnnIndex
    dim: int = -1
    max_frames: int = -1
    keys: np.ndarray | None = None  # psi's per-video K (n, f, d) float16 when the index stores them
    values: np.ndarray | None = None
    ann_units: np.ndarray | None = None  # InvGC-corrected stage-1 vectors (ann.faiss is built on them), memmap
    ann_ncl: AnnIndex | None = None  # FAISS over [stage-1 vector ; b / c] (--ncl-stage1), else None
    _sorted_ids: np.ndarray = field(init=False, repr=False)
    _sorted_rows: np.ndarray = field(init=False, repr=False)
    _conn: sqlite3.Connection | None = field(init=False, repr=False, default=None)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.dim < 0:
            self.dim = int(self.units.shape[1]) if self.units.ndim == 2 else int(self.manifest.get("dim", 0))
        if self.max_frames < 0:
            self.max_frames = int(self.frames.shape[1]) if self.frames.ndim == 3 else int(self.manifest.get("max_frames", 0))
        ids = np.asarray(self.ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self._sorted_ids, self._sorted_rows = ids[order], order.astype(np.int64)

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def kv(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(K, V) for model.score(..., kv=) when the index stores them, else None."""
        if self.keys is None or self.values is None:
            return None
        return self.keys, self.values

    @property
    def checkpoint_sha256(self) -> str | None:
        return (self.manifest.get("checkpoint") or {}).get("sha256")

    def rows(self, ids: np.ndarray, *, missing: str = "raise") -> np.ndarray:
        """Row positions (int64) of `ids`. Unknown ids raise KeyError, or give -1 with missing="mask"."""
        if missing not in ("raise", "mask"):
            raise ValueError(f"missing must be 'raise' or 'mask', got {missing!r}")
        q = np.asarray(ids, dtype=np.int64)
        if self._sorted_ids.size == 0:
            found = np.zeros(q.shape, dtype=bool)
            rows = np.full(q.shape, -1, dtype=np.int64)
        else:
            pos = np.clip(np.searchsorted(self._sorted_ids, q), 0, self._sorted_ids.size - 1)
            found = self._sorted_ids[pos] == q
            rows = np.where(found, self._sorted_rows[pos], -1)
        if missing == "raise" and not found.all():
            bad = np.unique(q[~found])
            raise KeyError(f"ids not in index {self.name}: {bad[:20].tolist()}{' ...' if bad.size > 20 else ''}")
        return rows

    @property
    def stage1_units(self) -> np.ndarray:
        """The vectors stage 1 searches: the InvGC-corrected ones when the index has them, else `units`."""
        return self.units if self.ann_units is None else self.ann_units

    @property
    def ncl_c(self) -> float:
        """The fold constant c of ann_ncl.faiss ([v̂ ; b / c] . [t̂ ; c] = cos + b)."""
        return float((self.manifest.get("ncl_stage1") or {}).get("c", 1.0))

    @property
    def has_ncl_stage1(self) -> bool:
        """Whether the index has the folded NCL stage 1 (ann_ncl.faiss, built with --ncl-stage1)."""
        return self.ann_ncl is not None

    def check_stage1(self, *, ncl_stage1: bool) -> None:
        """Raise :class:`Stage1Unavailable` when the asked stage 1 is one this index does not have."""
        if ncl_stage1 and self.ann_ncl is None:
            raise Stage1Unavailable(f"index version {self.name} was built without --ncl-stage1 (no {ANN_NCL_FILE}); "
                                    "ncl_stage1 is not available")

    def search_ncl(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw folded ANN: top-k by cos(t, v̂_j) + b_j over unit queries (q, d).

        Returns (scores = cos + b, ids), missing results id -1 (verification and tests read the folded
        scores; a search goes through :meth:`search` with ``ncl_stage1=True``)."""
        self.check_stage1(ncl_stage1=True)
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        if q.shape[1] != self.dim:
            raise ValueError(f"queries have d={q.shape[1]}, index has d={self.dim}")
        return self.ann_ncl.search(fold_query(q, self.ncl_c), k)

    def vbar(self, rows: np.ndarray) -> np.ndarray:
        """Un-normalised v̄ = norm * unit for row positions (float32)."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.asarray(self.units[rows], dtype=np.float32) * self.norms[rows, None]

    def search(self, queries: np.ndarray, k: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Stage 1, the single way in: (stage-1 cosines (q, k) float32, ids (q, k) int64), missing results id -1.

        ``ncl_stage1=False``: ANN top-k by cos(t, v̂_j) over unit queries (q, d). ``ncl_stage1=True``: the
        candidates are the top k by cos(t, v̂_j) + b_j (ann_ncl.faiss; :class:`Stage1Unavailable` when the
        index has none) and the returned scores are the folded score minus b_j, so a ranking that adds the
        biases adds b_j exactly once."""
        q = np.ascontiguousarray(np.atleast_2d(np.asarray(queries, dtype=np.float32)))
        if q.shape[0] == 0:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        if not ncl_stage1:
            scores, ids = self.ann.search(q, int(k))
            return np.asarray(scores, dtype=np.float32), np.asarray(ids, dtype=np.int64)
        scores, ids = self.search_ncl(q, int(k))
        scores = np.asarray(scores, dtype=np.float32).copy()
        ids = np.asarray(ids, dtype=np.int64)
        ok = ids >= 0
        if ok.any():
            scores[ok] -= np.asarray(self.biases, dtype=np.float32)[self.rows(ids[ok])]
        return scores, ids

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            uri = f"file:{(self.path / META_FILE).as_posix()}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
        return self._conn

    def metadata(self, ids: Sequence[int] | np.ndarray) -> list[dict]:
        """SQLite rows as dicts, in the order of `ids` (an id may repeat). Unknown ids raise KeyError."""
        want = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        if not want:
            return []
        uniq = sorted(set(want))
        found: dict[int, dict] = {}
        cols = ", ".join(f'"{c}"' for c in META_COLUMNS)
        with self._lock:
            db = self._db()
            for s in range(0, len(uniq), 500):
                chunk = uniq[s : s + 500]
                sql = f"SELECT {cols} FROM videos WHERE id IN ({','.join('?' * len(chunk))})"
                for row in db.execute(sql, chunk):
                    found[int(row["id"])] = dict(row)
        missing = [i for i in uniq if i not in found]
        if missing:
            raise KeyError(f"ids not in index {self.name}: {missing[:20]}")
        return [dict(found[i]) for i in want]

    def path_of(self, video_id: int) -> Path | None:
        with self._lock:
            row = self._db().execute("SELECT path FROM videos WHERE id = ?", (int(video_id),)).fetchone()
        return None if row is None else Path(row[0])

    def all_metadata(self) -> list[dict]:
        cols = ", ".join(f'"{c}"' for c in META_COLUMNS)
        with self._lock:
            return [dict(r) for r in self._db().execute(f"SELECT {cols} FROM videos ORDER BY id")]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        for name in _MMAP_ARRAYS:
            arr = getattr(self, name, None)
            mm = getattr(arr, "_mmap", None)
            if mm is not None:
                # Other views may still reference the map; dropping ours is enough (closed when unreferenced).
                setattr(self, name, np.empty((0,) + tuple(arr.shape[1:]), dtype=arr.dtype))

    def __enter__(self) -> IndexVersion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_version(
    root: str | os.PathLike,
    name: str,
    *,
    expect_checkpoint_sha: str | None = None,
    verify: bool = False,
    use_gpu: bool | None = None,
) -> IndexVersion:
    """Open a named version (open_index opens the one CURRENT names)."""
    root = Path(root)
    path = root / VERSIONS_DIR / name
    if not path.is_dir():
        raise IndexFormatError(f"{path}: version directory missing")
    manifest = read_manifest(path)
    _check_checkpoint(manifest, f"{root} ({name})", expect_checkpoint_sha)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise IndexFormatError(f"{path / MANIFEST_FILE}: no 'files' table")
    problems = _hash_problems(path, files, rehash=verify)
    if problems:
        raise IndexFormatError("; ".join(problems))

    n, d, f = int(manifest["n"]), int(manifest["dim"]), int(manifest["max_frames"])
    arrays: dict[str, np.ndarray] = {}
    for aname, (dtype, ndim) in {**ARRAY_SPECS, **OPTIONAL_ARRAYS}.items():
        if aname in OPTIONAL_ARRAYS and f"{aname}.npy" not in files:
            continue
        arr = _load_array(path, aname, mmap=aname in _MMAP_ARRAYS)
        expect = {1: (n,), 2: (n, d if aname in _ROW_DIM_ARRAYS else f), 3: (n, f, d)}[ndim]
        if arr.shape != expect or arr.dtype != dtype:
            raise IndexFormatError(
                f"{path / (aname + '.npy')}: {arr.dtype} {arr.shape}, manifest implies {dtype} {expect}"
            )
        arrays[aname] = arr
    params = AnnParams.from_dict(manifest.get("ann_params") or {"index_type": manifest.get("index_type", "flat")})
    stage1 = arrays.get("ann_units", arrays["units"])  # ivfpq re-scores with the vectors the ANN was built on
    try:
        ann = AnnIndex.load(path / ANN_FILE, params, stage1, use_gpu, vector_ids=arrays["ids"])
    except (RuntimeError, ValueError) as e:
        raise IndexFormatError(f"{path / ANN_FILE}: unreadable ({e})") from e
    if ann.ntotal != n or (n and ann.d != d):
        raise IndexFormatError(f"{path / ANN_FILE}: holds {ann.ntotal} vectors of d={ann.d}, manifest says n={n}, d={d}")
    ann_ncl = None
    if ANN_NCL_FILE in files:
        ncl = manifest.get("ncl_stage1") or {}
        nparams = AnnParams.from_dict(ncl.get("ann_params") or {"index_type": "flat"})
        try:
            ann_ncl = AnnIndex.load(path / ANN_NCL_FILE, nparams, FoldedRows(stage1, arrays["biases"], float(ncl.get("c", 1.0))),
                                    use_gpu, vector_ids=arrays["ids"])
        except (RuntimeError, ValueError) as e:
            raise IndexFormatError(f"{path / ANN_NCL_FILE}: unreadable ({e})") from e
        if ann_ncl.ntotal != n or (n and ann_ncl.d != d + 1):
            raise IndexFormatError(f"{path / ANN_NCL_FILE}: holds {ann_ncl.ntotal} vectors of d={ann_ncl.d}, "
                                   f"manifest says n={n}, d+1={d + 1}")
    version = IndexVersion(
        root=root, name=name, path=path, manifest=manifest,
        ids=arrays["ids"], norms=arrays["norms"], units=arrays["units"], frames=arrays["frames"],
        masks=arrays["masks"], biases=arrays["biases"], ann=ann, dim=d, max_frames=f,
        keys=arrays.get("keys"), values=arrays.get("values"), ann_units=arrays.get("ann_units"), ann_ncl=ann_ncl,
    )
    # Sizes alone do not prove the metadata is a database: a same-size junk file would pass them and then
    # fail every search. One cheap query (no full re-hash) catches it at open/reload time.
    try:
        rows = version._db().execute("SELECT count(*) FROM videos").fetchone()[0]
    except sqlite3.Error as e:
        version.close()
        raise IndexFormatError(f"{path / META_FILE}: not a readable index database ({e})") from e
    if rows != n:
        version.close()
        raise IndexFormatError(f"{path / META_FILE}: holds {rows} videos, manifest says n={n}")
    return version


def open_index(
    root: str | os.PathLike,
    *,
    expect_checkpoint_sha: str | None = None,
    verify: bool = False,
    use_gpu: bool | None = None,
) -> IndexVersion:
    """Open the version CURRENT names.

    `verify=True` re-hashes every file against manifest["files"] (IndexFormatError naming the bad file);
    without it, presence and byte sizes are still checked. `expect_checkpoint_sha` that differs from the
    manifest's checkpoint hash raises IndexMismatchError naming both hashes. `use_gpu=None` searches
    flat/IVF indexes on the GPU when faiss has one.
    """
    root = Path(root)
    if not root.is_dir():
        raise IndexFormatError(f"{root}: no such index directory")
    name = current_version_name(root)
    return open_version(root, name, expect_checkpoint_sha=expect_checkpoint_sha, verify=verify, use_gpu=use_gpu)


# ------------------------------------------------------------------------------------------ writing
@dataclass(frozen=True)
class ExistingFile:
    """An array already on disk (a staged .npy, or a file of a previous version) to link into a version.

    `sha256` may be given when known (files of an immutable previous version) to skip re-hashing.
    """

    path: Path
    sha256: str | None = None


def _create_meta_db(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    cols = ", ".join(f'"{c}" {_META_SQL_TYPES[c]}' for c in META_COLUMNS)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute(f"CREATE TABLE videos ({cols})")
        conn.execute('CREATE INDEX videos_path ON videos ("path")')
        conn.execute('CREATE INDEX videos_checksum ON videos ("checksum")')
        qcols = ", ".join(f'"{c}"' for c in META_COLUMNS)
        sql = f"INSERT INTO videos ({qcols}) VALUES ({','.join('?' * len(META_COLUMNS))})"
        count = 0
        batch: list[tuple] = []
        for r in rows:
            batch.append(tuple(r.get(c) for c in META_COLUMNS))
            count += 1
            if len(batch) >= 10_000:
                conn.executemany(sql, batch)
                batch.clear()
        if batch:
            conn.executemany(sql, batch)
        conn.commit()
    finally:
        conn.close()
    return count


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
        sha = value.sha256 or file_sha256(dst)
        return {"bytes": dst.stat().st_size, "sha256": sha}
    arr = np.asarray(value)
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    with open(dst, "wb") as raw:
        w = _HashingWriter(raw)
        np.save(w, arr, allow_pickle=False)
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": w.nbytes, "sha256": w.h.hexdigest()}


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
        entry = {"bytes": (tmp / ANN_NCL_FILE).stat().st_size, "sha256": file_sha256(tmp / ANN_NCL_FILE)}
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
            name = p.name[len(_TMP_PREFIX):] if p.name.startswith(_TMP_PREFIX) else p.name
            num = _version_number(name)
            if num is not None:
                best = max(best, num)
    return best + 1


def remove_stale_tmp(root: str | os.PathLike) -> list[str]:
    """Delete versions/.tmp-* left behind by a killed writer (call with the index lock held)."""
    vdir = Path(root) / VERSIONS_DIR
    removed = []
    if vdir.is_dir():
        for p in vdir.iterdir():
            if p.name.startswith(_TMP_PREFIX):
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
) -> str:
    """Write a complete new version and make it current; returns its name ("v000004").

    `arrays`: ids, norms, units, frames, masks, biases (optionally keys, values) as numpy arrays (any
    dtype castable to the format's) or :class:`ExistingFile`. `metadata_rows`: one mapping per id with the
    META_COLUMNS (status defaults to "ok"). `manifest_extra`: checkpoint, biases, ann_params, ... merged into
    the manifest. `ann`: an AnnIndex or faiss index over (units, ids); built from `ann_params` (or the
    automatic type) when None; over `ann_units` (InvGC-corrected stage-1 vectors) when that array is given.
    `manifest_extra["ncl_stage1"] = {"c": ..., "ann_params"?: ...}` also writes ann_ncl.faiss, the folded
    NCL stage-1 index: `ann_ncl` (an AnnIndex or the previous version's file) or, when None, built here
    over [stage-1 vectors ; biases / c]. Old versions beyond the newest `keep` are removed (never CURRENT).
    """
    root = Path(root)
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
        ndim = (ARRAY_SPECS.get(k) or OPTIONAL_ARRAYS[k])[1]
        expect = {1: (n,), 2: (n, d if k in _ROW_DIM_ARRAYS else f), 3: (n, f, d)}[ndim]
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

    extra = dict(manifest_extra)
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
        tmp = vdir / f"{_TMP_PREFIX}{name}"
        tmp.mkdir()
        try:
            files: dict[str, dict[str, Any]] = {}
            for k, v in arrays.items():
                dtype = (ARRAY_SPECS.get(k) or OPTIONAL_ARRAYS[k])[0]
                if isinstance(v, ExistingFile) and v.sha256 is None and k in file_hashes:
                    v = ExistingFile(v.path, file_hashes[k])
                files[f"{k}.npy"] = _write_npy(tmp / f"{k}.npy", v, dtype)

            # ANN index
            if isinstance(ann, ExistingFile):
                if not ann_params_d:
                    raise ValueError("write_version: a linked ann.faiss needs manifest_extra['ann_params']")
                files[ANN_FILE] = _write_npy(tmp / ANN_FILE, ann, np.dtype(np.uint8))
                params = AnnParams.from_dict(ann_params_d)
            else:
                params = _write_ann(tmp, ann, ann_params_d, index_type, arrays, ids, n)
                files[ANN_FILE] = {"bytes": (tmp / ANN_FILE).stat().st_size, "sha256": file_sha256(tmp / ANN_FILE)}
            ncl_info = None
            if ncl_req:
                files[ANN_NCL_FILE], ncl_info = _write_ann_ncl(tmp, ann_ncl, ncl_req, arrays, ids, n, d, params)

            if rows is None:
                files[META_FILE] = _write_npy(tmp / META_FILE, metadata_rows, np.dtype(np.uint8))
            else:
                _create_meta_db(tmp / META_FILE, rows)
                with open(tmp / META_FILE, "rb+") as fh:
                    os.fsync(fh.fileno())
                files[META_FILE] = {"bytes": (tmp / META_FILE).stat().st_size, "sha256": file_sha256(tmp / META_FILE)}


            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "version": number,
                "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "checkpoint": None,
                "n": int(n),
                "dim": int(d),
                "max_frames": int(f),
                "frame_dtype": "float16",
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
            atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True, default=str))
            _fsync_dir(tmp)
            test_pause("write")
            os.rename(tmp, vdir / name)
            _fsync_dir(vdir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        test_pause("switch")
        switch_current(root, name)
        log.info("wrote index version %s (%d videos) and made it current", name, n)
        if keep is not None:
            _gc_locked(root, keep)
    return name


def _gc_locked(root: Path, keep: int) -> list[str]:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    versions = list_versions(root)
    try:
        cur = current_version_name(root)
    except IndexFormatError:
        cur = None
    doomed = [v for v in versions[:-keep] if v != cur] if len(versions) > keep else []
    for v in doomed:
        shutil.rmtree(root / VERSIONS_DIR / v, ignore_errors=True)
    if doomed:
        log.info("removed old index versions %s (keeping the newest %d and %s)", doomed, keep, cur)
    return doomed


def gc(root: str | os.PathLike, keep: int = 3) -> list[str]:
    """Remove all but the newest `keep` versions (never the current one) and unfinished .tmp dirs."""
    root = Path(root)
    with index_lock(root):
        remove_stale_tmp(root)
        return _gc_locked(root, keep)


# ------------------------------------------------------------------------------------------ verify
def _faiss_ids(ann: AnnIndex) -> np.ndarray:
    """Every id stored in the FAISS index (IDMap id_map or IVF inverted lists)."""
    import faiss

    outer = faiss.downcast_index(ann.cpu_index)
    if isinstance(outer, faiss.IndexIDMap):
        return faiss.vector_to_array(outer.id_map).astype(np.int64)
    if isinstance(outer, faiss.IndexIVF):
        invlists = outer.invlists
        out = []
        for lst in range(outer.nlist):
            size = invlists.list_size(lst)
            if size:
                out.append(faiss.rev_swig_ptr(invlists.get_ids(lst), size).copy())
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)
    raise IndexFormatError(f"cannot list the ids of a {type(outer).__name__}")


def _ncl_problems(v: IndexVersion) -> list[str]:
    """ann_ncl.faiss holds every id and, for a flat index, exactly [stage-1 vector ; b / c] (stale biases show)."""
    import faiss

    assert v.ann_ncl is not None
    try:
        fids = _faiss_ids(v.ann_ncl)
    except IndexFormatError as e:
        return [f"{ANN_NCL_FILE}: {e}"]
    ids = np.asarray(v.ids)
    if fids.size != v.n or not np.array_equal(np.sort(fids), np.sort(ids)):
        return [f"{ANN_NCL_FILE}: holds {fids.size} ids that differ from the {v.n} in ids.npy"]
    outer = faiss.downcast_index(v.ann_ncl.cpu_index)
    if v.n and isinstance(outer, faiss.IndexIDMap) and isinstance(faiss.downcast_index(outer.index), faiss.IndexFlat):
        stored = faiss.downcast_index(outer.index).reconstruct_n(0, v.n)
        rows = v.rows(fids)
        want = fold_biases(np.asarray(v.stage1_units[rows], np.float32), np.asarray(v.biases)[rows], v.ncl_c)
        if not np.allclose(stored, want, atol=1e-6):
            return [f"{ANN_NCL_FILE}: its vectors are not [stage-1 vector ; bias / c] of this version (stale biases?)"]
    return []


def verify_index(
    root: str | os.PathLike,
    *,
    name: str | None = None,
    rehash: bool = True,
    expect_checkpoint_sha: str | None = None,
    check_files: bool = False,
) -> list[str]:
    """Problems found in a version (CURRENT by default); an empty list means it is consistent.

    Checks: manifest, file sizes and (rehash) sha256; array shapes and dtypes; ids unique and equal across
    ids.npy, FAISS and SQLite; norms positive and finite, units of unit length; at least one frame per
    video and padded frame rows zero; biases finite. `check_files` also re-checks every indexed video
    file's size and mtime on disk (a changed file is reported, not an error of the index itself).
    """
    root = Path(root)
    try:
        name = name or current_version_name(root)
        v = open_version(root, name, verify=rehash, expect_checkpoint_sha=expect_checkpoint_sha, use_gpu=False)
    except IndexFormatError as e:
        return [str(e)]
    problems: list[str] = []
    with v:
        n = v.n
        ids = np.asarray(v.ids)
        if np.unique(ids).size != n:
            problems.append(f"ids.npy: {n - np.unique(ids).size} duplicate ids")
        if n > 1 and not np.all(np.diff(ids) > 0):
            problems.append("ids.npy: ids are not in ascending order")
        try:
            fids = _faiss_ids(v.ann)
            if fids.size != n or not np.array_equal(np.sort(fids), np.sort(ids)):
                problems.append(f"ann.faiss: holds {fids.size} ids that differ from the {n} in ids.npy")
        except IndexFormatError as e:
            problems.append(str(e))
        if v.ann_ncl is not None:
            problems += _ncl_problems(v)
        try:
            meta = v.all_metadata()
        except sqlite3.Error as e:
            problems.append(f"meta.sqlite: {e}")
            meta = []
        else:
            mids = np.array([m["id"] for m in meta], dtype=np.int64)
            if mids.size != n or not np.array_equal(np.sort(mids), np.sort(ids)):
                problems.append(f"meta.sqlite: {mids.size} rows whose ids differ from the {n} in ids.npy")
        norms = np.asarray(v.norms)
        if n and not (np.all(np.isfinite(norms)) and np.all(norms > 0)):
            problems.append("norms.npy: non-positive or non-finite norms")
        step = 65536
        for s in range(0, n, step):
            u = np.asarray(v.units[s : s + step], dtype=np.float64)
            if not np.all(np.abs(np.linalg.norm(u, axis=1) - 1.0) < 1e-3):
                problems.append(f"units.npy: rows {s}..{s + len(u) - 1} include vectors that are not unit length")
                break
        if v.ann_units is not None:
            for s in range(0, n, step):
                u = np.asarray(v.ann_units[s : s + step], dtype=np.float64)
                if not (np.all(np.isfinite(u)) and np.all(np.abs(np.linalg.norm(u, axis=1) - 1.0) < 1e-3)):
                    problems.append(f"ann_units.npy: rows {s}..{s + len(u) - 1} include vectors that are not finite unit vectors")
                    break
        masks = np.asarray(v.masks)
        if n and masks.sum(axis=1).min() < 1:
            problems.append("masks.npy: some videos have no frame")
        for s in range(0, n, 4096):
            fr = np.asarray(v.frames[s : s + 4096])
            pad = masks[s : s + 4096] == 0
            if pad.any() and np.abs(fr[pad]).max() > 0:
                problems.append(f"frames.npy: padded frame rows are not zero (rows {s}..)")
                break
            if not np.all(np.isfinite(fr)):
                problems.append(f"frames.npy: non-finite values (rows {s}..)")
                break
        if not np.all(np.isfinite(np.asarray(v.biases))):
            problems.append("biases.npy: non-finite biases")
        if meta and int(v.manifest.get("n", -1)) != len(meta):
            problems.append(f"manifest.json: n={v.manifest.get('n')} but meta.sqlite has {len(meta)} rows")
        if meta:
            fu = {int(m["id"]): m.get("frames_used") for m in meta}
            rows = v.rows(ids)
            used = masks[rows].sum(axis=1)
            bad = [int(i) for i, u in zip(ids, used, strict=True) if fu.get(int(i)) is not None and fu[int(i)] != int(u)]
            if bad:
                problems.append(f"meta.sqlite: frames_used disagrees with masks.npy for ids {bad[:10]}")
        if check_files:
            for m in meta:
                p = Path(m["path"])
                try:
                    st = p.stat()
                except OSError:
                    problems.append(f"video {m['id']}: {p} is gone")
                    continue
                if st.st_size != m["size"] or abs(st.st_mtime - float(m["mtime"])) > 1e-6:
                    problems.append(f"video {m['id']}: {p} changed since it was indexed")
    return problems
