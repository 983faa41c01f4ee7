"""The filter columns of a version as typed arrays (``fields/`` in the version directory), written with the version
so that the first filtered search memory-maps them instead of scanning meta.sqlite.

One column per field a filter may name (the built-in ones and the index's own, :func:`gare_index.filters.schema_of`),
in ids.npy row order, the layout of :class:`gare_index.fields.Column`::

    fields/<name>.values.npy        number / date: (n,) float64, NaN when missing (dates as seconds since the epoch)
    fields/<name>.codes.npy         string: (n,) int32 into the vocabulary, -1 when missing;
                                    tags: (m,) int32, one per (row, tag) pair
    fields/<name>.owner.npy         tags: (m,) int64, the row of each pair
    fields/<name>.vocab.npy         string / tags: the sorted vocabulary as UTF-8 bytes (b,) uint8, back to back
    fields/<name>.vocab_offsets.npy (u + 1,) int64: string i is vocab[offsets[i]:offsets[i + 1]]

Every file is listed in the manifest's ``files`` with its size and sha256 like the other files of the version. The
arrays are computed from the version's own meta.sqlite by the same reader a version without them uses
(:meth:`MetaRows.field_column`), so both give the same columns. A version without ``fields/`` (written before
them) still filters: its columns load from meta.sqlite.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gare_index.fields import BUILTIN_FIELDS, Column
from gare_index.npy_staging import ExistingFile
from gare_index.store.meta_rows import MetaRows

log = logging.getLogger(__name__)

FIELDS_DIR = "fields"
_PARTS = ("values", "codes", "owner", "vocab", "vocab_offsets")


def field_file(name: str, part: str) -> str:
    """The manifest's name of one array of field `name` (``fields/<name>.<part>.npy``)."""
    return f"{FIELDS_DIR}/{name}.{part}.npy"


def _vocab_arrays(vocab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u,) str -> (UTF-8 bytes (b,) uint8, offsets (u + 1,) int64)."""
    enc = [str(s).encode("utf-8") for s in vocab]
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    if enc:
        offsets[1:] = np.cumsum(np.fromiter((len(b) for b in enc), np.int64, len(enc)))
    return np.frombuffer(b"".join(enc), dtype=np.uint8).copy(), offsets


def _vocab_of(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_vocab_arrays`: (u,) object array of str."""
    raw = np.asarray(blob).tobytes()
    off = np.asarray(offsets).tolist()
    return np.array([raw[off[i]:off[i + 1]].decode("utf-8") for i in range(len(off) - 1)], dtype=object)


def column_arrays(col: Column) -> dict[str, np.ndarray]:
    """The arrays (part -> array) that store `col`."""
    if col.kind in ("number", "date"):
        return {"values": np.asarray(col.values, dtype=np.float64)}
    out = {"codes": np.asarray(col.codes, dtype=np.int32)}
    if col.kind == "tags":
        out["owner"] = np.asarray(col.owner, dtype=np.int64)
    out["vocab"], out["vocab_offsets"] = _vocab_arrays(col.vocab)
    return out


def write_field_arrays(tmp: Path, name: str, ids: np.ndarray, write_npy: Any, prev: ExistingFile | None = None, ids_sha256: str | None = None
                       ) -> dict[str, dict[str, Any]]:
    """Write ``tmp/fields/*.npy`` for the version being written in `tmp` (meta.sqlite already there) and return
    their manifest entries (file name -> {bytes, sha256}). `write_npy(dst, value, dtype)` is the writer's (temp
    file fsynced, hashed while written). `prev`: the previous version's meta.sqlite when this version links it
    unchanged; its ``fields/`` arrays are linked too when the previous ids.npy has the sha256 `ids_sha256` (same
    rows in the same order), else they are computed again."""
    (tmp / FIELDS_DIR).mkdir(exist_ok=True)
    if prev is not None and ids_sha256:
        linked = _link_previous(tmp, Path(prev.path).parent, ids_sha256, write_npy)
        if linked is not None:
            return linked
    ids = np.asarray(ids, dtype=np.int64)
    meta = MetaRows(tmp, name)
    files: dict[str, dict[str, Any]] = {}
    try:
        schema = {**BUILTIN_FIELDS, **meta.fields()}  # the index's own fields as meta.sqlite's field_types has them
        for fname, kind in schema.items():
            col = meta.field_column(fname, kind, ids)
            for part, arr in column_arrays(col).items():
                rel = field_file(fname, part)
                files[rel] = write_npy(tmp / rel, arr, arr.dtype)
    finally:
        meta.close()
    return files


def _link_previous(tmp: Path, prev_dir: Path, ids_sha256: str, write_npy: Any) -> dict[str, dict[str, Any]] | None:
    try:
        pm = json.loads((prev_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    pfiles = pm.get("files") or {}
    if (pfiles.get("ids.npy") or {}).get("sha256") != ids_sha256:
        return None
    mine = {k: v for k, v in pfiles.items() if k.startswith(FIELDS_DIR + "/")}
    if not mine:
        return None
    # with the recorded fast hash too: a linked column is not read again to hash it
    return {k: write_npy(tmp / k, ExistingFile(prev_dir / k, v.get("sha256"), v.get("fast_hash")), np.dtype(np.uint8))
            for k, v in mine.items()}


def load_column(path: Path, files: Mapping[str, Any], name: str, kind: str, n: int) -> Column | None:
    """Field `name` of the version in `path` from its ``fields/`` arrays (memory-mapped), or None when the version
    has none for it (written before them): the caller then reads meta.sqlite."""
    def arr(part: str) -> np.ndarray | None:
        rel = field_file(name, part)
        if rel not in files:
            return None
        return np.load(path / rel, mmap_mode="r", allow_pickle=False)

    if kind in ("number", "date"):
        values = arr("values")
        return None if values is None else Column(name, kind, n, values=values)
    codes, blob, offsets = arr("codes"), arr("vocab"), arr("vocab_offsets")
    if codes is None or blob is None or offsets is None:
        return None
    vocab = _vocab_of(blob, offsets)
    if kind == "tags":
        owner = arr("owner")
        if owner is None:
            return None
        return Column(name, kind, n, codes=codes, owner=owner, vocab=vocab)
    return Column(name, kind, n, codes=codes, vocab=vocab)
