"""An opened index version: :class:`IndexVersion` (memmapped arrays, FAISS, SQLite), whose
:meth:`IndexVersion.search` is the single way into stage 1; :mod:`gare_index.store.reader` opens one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gare.sinkhorn import fold_query
from gare_index.ann import AnnIndex
from gare_index.fields import Column
from gare_index.filter_cache import FilterCache, FilterRows, id_bitmap
from gare_index.filters import FieldTable, Filter, compile_filter, evaluate, schema_of
from gare_index.frame_quant import FRAME_SCALES_ARRAY, QuantFrames
from gare_index.ncl_ann import Stage1Unavailable
from gare_index.store.field_arrays import load_column
from gare_index.store.file_check import CheckReport
from gare_index.store.format import ANN_NCL_FILE, MMAP_ARRAYS
from gare_index.store.manifest import IndexManifest
from gare_index.store.meta_rows import MetaRows


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
    check_report: CheckReport | None = None  # the file check this version passed when opened (open_version(check=))
    _sorted_ids: np.ndarray = field(init=False, repr=False)
    _sorted_rows: np.ndarray = field(init=False, repr=False)
    _lut: np.ndarray | None = field(init=False, repr=False, default=None)  # id -> row (-1: none) for compact ids
    _meta: MetaRows = field(init=False, repr=False)  # meta.sqlite, opened on first use
    _table: FieldTable | None = field(init=False, repr=False, default=None)  # filter columns, built on first use
    _ids_are_rows: bool = field(init=False, repr=False, default=False)  # ids == arange(n): no removal yet
    filter_cache: FilterCache = field(init=False, repr=False, default_factory=FilterCache)  # filter -> rows passing

    def __post_init__(self) -> None:
        self._meta = MetaRows(self.path, self.name)
        if self.dim < 0:
            self.dim = int(self.units.shape[1]) if self.units.ndim == 2 else self.manifest.dim
        if self.max_frames < 0:
            self.max_frames = int(self.frames.shape[1]) if self.frames.ndim == 3 else self.manifest.max_frames
        ids = np.asarray(self.ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self._sorted_ids, self._sorted_rows = ids[order], order.astype(np.int64)
        self._ids_are_rows = bool(ids.size == 0 or (int(ids[0]) == 0 and int(ids[-1]) == ids.size - 1
                                                    and bool((np.diff(ids) == 1).all())))
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

    def search_filtered(self, queries: np.ndarray, k: int, rows: np.ndarray, *, ncl_stage1: bool = False,
                        widen: int = 1, bits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
        """Stage 1 with a filter inside the ANN: as :meth:`search`, among the rows (n,) bool that pass only, the
        ANN `widen` times broader (:meth:`gare_index.ann.AnnIndex.search_subset`); the third value says whether
        that search saw every passing row (then a shorter answer means fewer rows pass). `bits`: the passing ids
        as a packed bitmap (:meth:`id_bitmap` of `rows`) when the caller has it already."""
        q = np.ascontiguousarray(np.atleast_2d(np.asarray(queries, dtype=np.float32)))
        if q.shape[0] == 0:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64), True
        if bits is None:
            bits = self.id_bitmap(rows)
        if not ncl_stage1:
            scores, ids, full = self.ann.search_subset(q, int(k), bits=bits, widen=widen)
            return np.asarray(scores, dtype=np.float32), np.asarray(ids, dtype=np.int64), full
        self.check_stage1(ncl_stage1=True)
        scores, ids, full = self.ann_ncl.search_subset(fold_query(q, self.ncl_c), int(k), bits=bits, widen=widen)
        scores = np.asarray(scores, dtype=np.float32).copy()
        ids = np.asarray(ids, dtype=np.int64)
        ok = ids >= 0
        if ok.any():
            scores[ok] -= np.asarray(self.biases, dtype=np.float32)[self.rows(ids[ok])]
        return scores, ids, full

    def scan_fraction(self, *, ncl_stage1: bool = False) -> float | None:
        """The share of the rows one unfiltered stage-1 search reads (:meth:`gare_index.ann.AnnIndex.scan_fraction`
        of the index it searches)."""
        ann = self.ann_ncl if ncl_stage1 and self.ann_ncl is not None else self.ann
        return ann.scan_fraction()

    def id_bitmap(self, rows: np.ndarray) -> np.ndarray:
        """The ids of the rows (n,) bool as a packed bitmap, bit i = id i (faiss's IDSelectorBitmap layout)."""
        return id_bitmap(rows, np.asarray(self.ids, dtype=np.int64), ids_are_rows=self._ids_are_rows)

    def metadata(self, ids: Sequence[int] | np.ndarray) -> list[dict]:
        """SQLite rows as dicts, in the order of `ids` (an id may repeat). Unknown ids raise KeyError."""
        return self._meta.metadata(ids)

    def path_of(self, video_id: int) -> Path | None:
        return self._meta.path_of(video_id)

    @property
    def field_schema(self) -> dict[str, str]:
        """Every field a filter may name here: the built-in ones and the index's own (name -> type)."""
        return schema_of(self._meta.fields())

    def compile_filter(self, spec: object) -> Filter:
        """A filter object checked against this version's fields (FilterError naming the problem)."""
        return compile_filter(spec, self.field_schema)

    def filter_mask(self, f: Filter) -> np.ndarray:
        """The rows (n,) bool, in ids.npy order, that pass the compiled filter `f` (read-only: copy to edit)."""
        return self.filter_rows(f)[0].mask

    def filter_rows(self, f: Filter) -> tuple[FilterRows, bool]:
        """(what `f` passes here: mask, id bitmap, rows; whether it came from :attr:`filter_cache`). The columns
        a filter reads are loaded from the version's fields/ arrays (or meta.sqlite) once per version and kept."""
        return self.filter_cache.get(f.text, lambda: self._evaluate(f))

    def _evaluate(self, f: Filter) -> FilterRows:
        if self._table is None:
            schema = self.field_schema
            self._table = FieldTable(self.n, schema, lambda name: self._field_column(name, schema[name]))
        mask = np.asarray(evaluate(f, self._table), dtype=bool)
        mask.setflags(write=False)
        return FilterRows(mask, self.id_bitmap(mask), int(np.count_nonzero(mask)))

    def _field_column(self, name: str, kind: str) -> Column:
        # the version's fields/ arrays (memory-mapped) when it has them, else a scan of meta.sqlite
        col = load_column(self.path, self.manifest.files or {}, name, kind, self.n)
        return col if col is not None else self._meta.field_column(name, kind, self.ids)

    def all_metadata(self) -> list[dict]:
        return self._meta.all_metadata()

    def close(self) -> None:
        self._meta.close()
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
