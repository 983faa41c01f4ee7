"""Reading a version's metadata rows (meta.sqlite, read-only): :class:`MetaRows`, shared by the opened version
(:class:`gare_index.store.index_version.IndexVersion`) and the service's metadata-only view of a version (an HTTP
worker of the shared engine), so that both answer the same rows the same way."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gare_index.store.format import META_COLUMNS, META_FILE

_CHUNK = 500  # ids per SELECT ... IN (...): under SQLite's default limit of bound parameters


class MetaRows:
    """The ``videos`` table of ``<version dir>/meta.sqlite``, opened read-only on first use (one connection,
    shared by threads under a lock); ``name`` names the version in errors."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = Path(path), name
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

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
            for s in range(0, len(uniq), _CHUNK):
                chunk = uniq[s : s + _CHUNK]
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
