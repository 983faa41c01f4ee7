"""Reading a version's metadata rows (meta.sqlite, read-only): :class:`MetaRows`, shared by the opened version
(:class:`gare_index.store.index_version.IndexVersion`) and the service's metadata-only view of a version (an HTTP
worker of the shared engine), so that both answer the same rows the same way."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gare_index.fields import BUILTIN_FIELDS, FIELDS_TABLE, Column, date_seconds, stored_value
from gare_index.store.format import META_COLUMNS, META_FILE

_CHUNK = 500  # ids per SELECT ... IN (...): under SQLite's default limit of bound parameters


class MetaRows:
    """The ``videos`` table of ``<version dir>/meta.sqlite``, opened read-only on first use (one connection,
    shared by threads under a lock); ``name`` names the version in errors."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = Path(path), name
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._fields: dict[str, str] | None = None  # the index's own fields (name -> type), read on first use

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            uri = f"file:{(self.path / META_FILE).as_posix()}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
        return self._conn

    def fields(self) -> dict[str, str]:
        """The index's own fields, name -> type (the ``field_types`` table; {} for an index without fields)."""
        with self._lock:
            return dict(self._field_types())

    def _field_types(self) -> dict[str, str]:
        if self._fields is None:
            db = self._db()
            has = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'field_types'").fetchone()
            self._fields = {} if has is None else {str(r[0]): str(r[1]) for r in
                                                   db.execute("SELECT name, type FROM field_types ORDER BY name")}
        return self._fields

    def _select(self, db: sqlite3.Connection, chunk: list[int]) -> Any:
        """The rows of `chunk`'s ids: the videos columns, then the fields (LEFT JOIN: every video has a row)."""
        cols = ", ".join(f'v."{c}"' for c in META_COLUMNS)
        fields = self._field_types()
        if fields:
            cols += ", " + ", ".join(f'f."{k}" AS "{k}"' for k in fields)
            frm = f'videos v LEFT JOIN {FIELDS_TABLE} f ON f."id" = v."id"'
        else:
            frm = "videos v"
        return db.execute(f'SELECT {cols} FROM {frm} WHERE v."id" IN ({",".join("?" * len(chunk))})', chunk)

    def _row(self, row: sqlite3.Row) -> dict:
        d = dict(row)
        for k, t in self._field_types().items():
            d[k] = stored_value(t, d.get(k))
        return d

    def metadata(self, ids: Sequence[int] | np.ndarray) -> list[dict]:
        """SQLite rows as dicts (the videos columns and the index's own fields, tags as lists), in the order of
        `ids` (an id may repeat). Unknown ids raise KeyError."""
        want = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        if not want:
            return []
        uniq = sorted(set(want))
        found: dict[int, dict] = {}
        with self._lock:
            db = self._db()
            for s in range(0, len(uniq), _CHUNK):
                for row in self._select(db, uniq[s : s + _CHUNK]):
                    found[int(row["id"])] = self._row(row)
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
            rows = [dict(r) for r in self._db().execute(f"SELECT {cols} FROM videos ORDER BY id")]
            fields = self._field_types()
            if fields:
                fq = ", ".join(f'"{k}"' for k in fields)
                vals = {int(r[0]): r for r in self._db().execute(f'SELECT "id", {fq} FROM {FIELDS_TABLE}')}
                for r in rows:
                    got = vals.get(int(r["id"]))
                    for j, (k, t) in enumerate(fields.items(), 1):
                        r[k] = None if got is None else stored_value(t, got[j])
        return rows

    def field_column(self, name: str, kind: str, ids: np.ndarray) -> Column:
        """Field `name` (built-in or the index's own, of type `kind`) over the rows of `ids` (n,) int64 (ids.npy
        order) as a filter reads it (:class:`gare_index.fields.Column`). SQLite does the grouping: one scan of
        the column (non-null values only), tags split into (id, tag) pairs by json_each, strings and dates
        decoded once per distinct value, so that a 1M-row column loads in about a second."""
        fields = self._field_types()
        if name == "folder":
            src, col = "videos", "path"
        elif name in BUILTIN_FIELDS:
            src, col = "videos", name
        elif name in fields:
            src, col = FIELDS_TABLE, name
        else:
            raise KeyError(f"index {self.name} has no field {name!r}")
        ids = np.asarray(ids, dtype=np.int64)
        n = int(ids.size)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]

        def rows_of(got: np.ndarray) -> np.ndarray:  # ids -> row positions (every id of the db is a row)
            pos = np.clip(np.searchsorted(sorted_ids, got), 0, max(n - 1, 0))
            if n == 0 or not np.array_equal(sorted_ids[pos], got):
                raise KeyError(f"index {self.name}: meta.sqlite has ids that ids.npy does not")
            return order[pos]

        with self._lock:
            db = self._db()
            if kind == "tags":
                pairs = db.execute(f'SELECT t."id", j.value FROM {src} t, json_each(t."{col}") j '
                                   f'WHERE t."{col}" IS NOT NULL').fetchall()
            else:
                pairs = db.execute(f'SELECT "id", "{col}" FROM {src} WHERE "{col}" IS NOT NULL').fetchall()
        rows = rows_of(np.fromiter((p[0] for p in pairs), np.int64, len(pairs)))
        if kind in ("number", "date"):
            vals = np.full(n, np.nan, dtype=np.float64)
            if kind == "date" and src == FIELDS_TABLE:  # ISO text: each distinct value parsed once
                secs = {v: date_seconds(v) for v in {p[1] for p in pairs}}
                vals[rows] = np.fromiter((secs[p[1]] for p in pairs), np.float64, len(pairs))
            else:
                vals[rows] = np.fromiter((p[1] for p in pairs), np.float64, len(pairs))
            return Column(name, kind, n, values=vals)
        texts = (p[1].rpartition("/")[0] or "/" for p in pairs) if name == "folder" else (str(p[1]) for p in pairs)
        texts = list(texts)
        vocab = sorted(set(texts))
        code_of = {v: i for i, v in enumerate(vocab)}
        codes = np.fromiter((code_of[v] for v in texts), np.int32, len(texts))
        voc = np.array(vocab, dtype=object)
        if kind == "tags":
            return Column(name, kind, n, codes=codes, owner=rows, vocab=voc)
        full = np.full(n, -1, dtype=np.int32)
        full[rows] = codes
        return Column(name, kind, n, codes=full, vocab=voc)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
