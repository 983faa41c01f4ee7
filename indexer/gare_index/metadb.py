"""The check that a version's metadata database (meta.sqlite) is the one its manifest describes.

Kept as one self-contained function (no import from the rest of the package) so that every reader of an
index version (open, reload, verify, `gare-serve --check`) runs the same check, whatever module holds them.
A damaged meta.sqlite must be refused when the version is opened: the service reads SQLite lazily, per
search, so a damage found there would fail every request (HTTP 500) instead of the reload.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SQLITE_MAGIC = b"SQLite format 3\x00"
_ID_MOD = 2_147_483_647  # ids are folded mod this prime into a checksum that SQLite can sum without overflow


def check_meta_db(
    path: str | os.PathLike,
    *,
    n: int,
    columns: Sequence[str],
    ids: np.ndarray | None = None,
    sha256: str | None = None,
) -> list[str]:
    """Problems with the metadata database at `path`; an empty list means it is usable.

    Checks, cheapest first: the SQLite header; the file's sha256 against `sha256` (the manifest's; this is
    what catches flipped bytes, which SQLite itself may read without complaint); that the file opens
    read-only and has a table ``videos`` with exactly `columns`; that it holds `n` rows; and, with `ids`
    (the version's ids.npy, shape (n,) int64), that the rows' ids are those ids (count, min, max and a
    modular sum: one scan inside SQLite, no Python loop over rows).
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
            if head != SQLITE_MAGIC:
                return [f"{p}: not an SQLite database (header {head[:16]!r})"]
            if sha256 is not None:
                h = hashlib.sha256(head)
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                if h.hexdigest() != sha256:
                    return [f"{p}: sha256 does not match the manifest (file corrupted or modified)"]
    except OSError as e:
        return [f"{p}: unreadable ({e})"]
    try:
        conn = sqlite3.connect(f"file:{p.as_posix()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        return [f"{p}: cannot be opened as a database ({e})"]
    try:
        have = [r[1] for r in conn.execute("PRAGMA table_info(videos)")]
        if not have:
            return [f"{p}: no table 'videos'"]
        if sorted(have) != sorted(columns):
            missing = sorted(set(columns) - set(have))
            extra = sorted(set(have) - set(columns))
            return [f"{p}: table 'videos' has the wrong columns (missing {missing}, unexpected {extra})"]
        cols = ", ".join(f'"{c}"' for c in columns)
        conn.execute(f"SELECT {cols} FROM videos LIMIT 1").fetchall()  # every column readable
        count, lo, hi, fold = conn.execute(f"SELECT count(*), min(id), max(id), sum(((id % {_ID_MOD}) + {_ID_MOD}) % {_ID_MOD}) FROM videos").fetchone()
    except sqlite3.Error as e:
        return [f"{p}: not a readable index database ({e})"]
    finally:
        conn.close()
    if count != n:
        return [f"{p}: holds {count} videos, manifest says n={n}"]
    if ids is not None and n:
        a = np.asarray(ids, dtype=np.int64)
        want = (int(a.min()), int(a.max()), int((a % _ID_MOD).sum()))
        if (lo, hi, fold) != want:
            return [f"{p}: its {count} row ids differ from the {n} in ids.npy (min/max/checksum {(lo, hi, fold)} vs {want})"]
    return []
