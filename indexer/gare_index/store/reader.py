"""Reading an index: CURRENT, versions, manifests and :class:`IndexVersion` (memmapped arrays, FAISS, SQLite),
whose :meth:`IndexVersion.search` is the single way into stage 1.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gare.checkpoint import file_sha256
from gare.sinkhorn import fold_query
from gare_index.ann import AnnIndex
from gare_index.ann_gpu import GpuIndexError
from gare_index.ann_params import AnnParams
from gare_index.frame_quant import FRAME_SCALES_ARRAY, QuantFrames
from gare_index.metadb import check_meta_db
from gare_index.ncl_ann import FoldedRows, Stage1Unavailable
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
from gare_index.store.manifest import FileEntry, IndexManifest, parse_manifest

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
    mpath = Path(path) / MANIFEST_FILE
    try:
        raw = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IndexFormatError(f"{mpath}: missing") from None
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


def _hash_problems(path: Path, files: Mapping[str, FileEntry], *, rehash: bool) -> list[str]:
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
        if rehash and file_sha256(p) != info.sha256:
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
    """One opened, immutable index version. Arrays are in `ids` row order; `frames` is a float16 memmap, or for
    an int8 index (manifest frame_dtype "int8") a :class:`QuantFrames` whose slices are float32."""

    root: Path
    name: str
    path: Path
    manifest: IndexManifest
    ids: np.ndarray
    norms: np.ndarray
    units: np.ndarray
    frames: np.ndarray | QuantFrames
    masks: np.ndarray
    biases: np.ndarray
    ann: AnnIndex
    dim: int = -1
    max_frames: int = -1
    keys: np.ndarray | None = None  # psi's per-video K (n, f, d) float16 when the index stores them
    values: np.ndarray | None = None
    ann_units: np.ndarray | None = None  # InvGC-corrected stage-1 vectors (ann.faiss is built on them), memmap
    ann_ncl: AnnIndex | None = None  # FAISS over [stage-1 vector ; b / c] (--ncl-stage1), else None
    psi_consts: np.ndarray | None = None  # psi folded per video (n, 10f+5f²+2) float32 memmap (gare_index.psi_consts)
    _sorted_ids: np.ndarray = field(init=False, repr=False)
    _sorted_rows: np.ndarray = field(init=False, repr=False)
    _lut: np.ndarray | None = field(init=False, repr=False, default=None)  # id -> row (-1: none) for compact ids
    _conn: sqlite3.Connection | None = field(init=False, repr=False, default=None)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.dim < 0:
            self.dim = int(self.units.shape[1]) if self.units.ndim == 2 else self.manifest.dim
        if self.max_frames < 0:
            self.max_frames = int(self.frames.shape[1]) if self.frames.ndim == 3 else self.manifest.max_frames
        ids = np.asarray(self.ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self._sorted_ids, self._sorted_rows = ids[order], order.astype(np.int64)
        # ids are 0..next_id with gaps left by removals: a dense table (8 bytes per id up to the largest) turns the
        # per-request id -> row lookup (K = 256 ids) into one gather, ~5x the binary search
        if ids.size and int(self._sorted_ids[0]) >= 0 and int(self._sorted_ids[-1]) < 4 * ids.size + 1024:
            lut = np.full(int(self._sorted_ids[-1]) + 1, -1, dtype=np.int64)
            lut[self._sorted_ids] = self._sorted_rows
            self._lut = lut

    @property
    def frame_dtype(self) -> str:
        """How frames.npy is stored: "float16" or "int8" (then with per-frame scales, :attr:`frame_scales`)."""
        return self.manifest.frame_dtype

    @property
    def frame_scales(self) -> np.ndarray | None:
        """The int8 frames' per-frame scales (n, f) float32 memmap, or None for float16 frames."""
        return self.frames.scales if isinstance(self.frames, QuantFrames) else None

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
        return self.manifest.checkpoint_sha256

    @property
    def reference_padding(self) -> bool:
        """The checkpoint's ``reference_padding`` (manifest ``checkpoint.model_config``; False when absent).

        True (imported from the authors' code): ``frames.npy`` keeps the padded rows' features, v̄ is the mean
        over all ``max_frames`` rows and psi attends over all rows; the pooling still uses ``masks``."""
        cfg = (None if self.manifest.checkpoint is None else self.manifest.checkpoint.model_cfg) or {}
        return bool(cfg.get("reference_padding", False))

    def rows(self, ids: np.ndarray, *, missing: str = "raise") -> np.ndarray:
        """Row positions (int64) of `ids`. Unknown ids raise KeyError, or give -1 with missing="mask"."""
        if missing not in ("raise", "mask"):
            raise ValueError(f"missing must be 'raise' or 'mask', got {missing!r}")
        q = np.asarray(ids, dtype=np.int64)
        lut = self._lut
        if lut is not None and q.size and 0 <= int(q.min()) and int(q.max()) < lut.size:
            rows = lut[q]
            if missing == "raise" and (rows < 0).any():
                bad = np.unique(q[rows < 0])
                raise KeyError(f"ids not in index {self.name}: {bad[:20].tolist()}{' ...' if bad.size > 20 else ''}")
            return rows
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
        return float((self.manifest.ncl_stage1 or {}).get("c", 1.0))

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
        if isinstance(self.frames, QuantFrames):
            f = self.frames
            self.frames = QuantFrames(np.empty((0, *f.q.shape[1:]), np.int8), np.empty((0, f.q.shape[1]), np.float32))
        for name in MMAP_ARRAYS:
            if name == FRAME_SCALES_ARRAY:
                continue
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
    mmap_ann: bool = False,
) -> IndexVersion:
    """Open a named version (open_index opens the one CURRENT names).

    ``mmap_ann=True`` memory-maps the FAISS indexes read-only (``AnnIndex.load(mmap=True)``): for serving
    processes that share them through the page cache; never for a version that will be modified."""
    root = Path(root)
    path = root / VERSIONS_DIR / name
    if not path.is_dir():
        raise IndexFormatError(f"{path}: version directory missing")
    manifest = read_manifest(path)
    _check_checkpoint(manifest, f"{root} ({name})", expect_checkpoint_sha)
    files = manifest.files
    if not files:
        raise IndexFormatError(f"{path / MANIFEST_FILE}: no 'files' table")
    problems = _hash_problems(path, files, rehash=verify)
    if problems:
        raise IndexFormatError("; ".join(problems))

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
) -> IndexVersion:
    """Open the version CURRENT names (``mmap_ann``: see :func:`open_version`).

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
                        mmap_ann=mmap_ann)
