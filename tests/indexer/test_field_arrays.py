"""The filter columns written with a version (gare_index.store.field_arrays, fields/*.npy): the masks they give equal
those of the columns read from meta.sqlite on random filters; a version written without them still filters the same;
a version that links its predecessor's meta.sqlite links the arrays too."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import gare_index.store.writer as writer_mod
from gare_index.filters import FieldTable, compile_filter, evaluate
from gare_index.npy_staging import ExistingFile
from gare_index.store import open_index, write_version
from tests.indexer.test_filters import _records, _spec

N = 300
USER_FIELDS = {"channel": "string", "tags": "tags", "year": "number", "published": "date"}


def _write(root, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    recs = _records(random.Random(seed), N)
    f, d = 2, 8
    ids = np.arange(N, dtype=np.int64) * 3 + 1  # ids are not rows
    units = rng.standard_normal((N, d)).astype(np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    arrays = {"ids": ids, "norms": np.ones(N, np.float32), "units": units,
              "frames": np.repeat(units[:, None, :], f, 1).astype(np.float16), "masks": np.ones((N, f), np.uint8),
              "biases": np.zeros(N, np.float32)}
    rows = []
    for i, r in zip(ids, recs, strict=True):
        rows.append({"id": int(i), "path": f"{r['folder']}/{i}.mp4", "size": int(i) % 7 or None, "mtime": 1.6e9 + 1000 * int(i),
                     "checksum": f"c{i}", "duration": None if i % 11 == 0 else float(i % 13), "fps": 8.0, "frames_used": f,
                     "start": None, "end": None, "channel": r["channel"], "year": r["year"], "published": r["published"],
                     "tags": None if r["tags"] is None else json.dumps(r["tags"])})
    write_version(root, arrays, rows, {"index_type": "flat", "fields": USER_FIELDS})


def _sqlite_table(v) -> FieldTable:
    """The reference: every column read from meta.sqlite (what a version without fields/ arrays uses)."""
    schema = v.field_schema
    return FieldTable(v.n, schema, lambda name: v._meta.field_column(name, schema[name], v.ids))


def _random_specs(count: int) -> list[dict]:
    rng = random.Random(7)
    out = [_spec(rng) for _ in range(count)]
    # the built-in columns too: numbers with missing values, dates, paths
    out += [{"duration": {"$gte": 6}}, {"duration": {"$ne": 3}}, {"mtime": {"$lt": 1.6e9 + 1000 * 200}},
            {"size": {"$in": [1, 2]}}, {"path": {"$prefix": "/v/a"}}, {"id": {"$nin": [1, 4, 7]}}]
    return out


def test_arrays_written_and_masks_equal_sqlite(tmp_path):
    root = tmp_path / "INDEX"
    _write(root)
    with open_index(root, verify=True) as v:
        names = [k for k in v.manifest.files if k.startswith("fields/")]
        for fld in (*USER_FIELDS, "folder", "duration", "mtime", "path"):
            assert any(k.startswith(f"fields/{fld}.") for k in names), (fld, names)
        ref = _sqlite_table(v)
        for fld, kind in v.field_schema.items():  # the columns themselves, part by part
            a, b = v._field_column(fld, kind), ref.column(fld)
            assert isinstance(a.values if kind in ("number", "date") else a.codes, np.memmap), fld
            for part in ("values", "codes", "owner", "vocab"):
                x, y = getattr(a, part), getattr(b, part)
                assert (x is None) == (y is None), (fld, part)
                if x is not None:
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{fld}.{part}")
        hits = 0
        for spec in _random_specs(150):
            f = compile_filter(spec, v.field_schema)
            got, want = v.filter_mask(f), evaluate(f, ref)
            np.testing.assert_array_equal(got, want, err_msg=json.dumps(spec))
            hits += int(0 < want.sum() < N)
        assert hits > 50  # the filters are not all trivial


def test_version_without_arrays_still_filters(tmp_path, monkeypatch):
    with_arrays, without = tmp_path / "A", tmp_path / "B"
    _write(with_arrays)
    monkeypatch.setattr(writer_mod, "write_field_arrays", lambda *a, **k: {})  # a version written before fields/
    _write(without)
    with open_index(with_arrays) as va, open_index(without) as vb:
        assert not any(k.startswith("fields/") for k in vb.manifest.files)
        assert not (vb.path / "fields").exists() or not any((vb.path / "fields").iterdir())
        for spec in _random_specs(60):
            fa, fb = compile_filter(spec, va.field_schema), compile_filter(spec, vb.field_schema)
            np.testing.assert_array_equal(va.filter_mask(fa), vb.filter_mask(fb), err_msg=json.dumps(spec))


@pytest.mark.parametrize("same_ids", [True, False])
def test_linked_meta_links_or_recomputes_the_arrays(tmp_path, same_ids):
    root = tmp_path / "INDEX"
    _write(root)
    with open_index(root) as v1:
        n = v1.n if same_ids else v1.n - 1  # a different ids.npy: the arrays cannot be linked
        arrays = {k: np.asarray(getattr(v1, k))[:n] for k in ("ids", "norms", "units", "frames", "masks", "biases")}
        meta = ExistingFile(v1.path / "meta.sqlite", v1.manifest.files["meta.sqlite"].sha256)
        old = {k: e.sha256 for k, e in v1.manifest.files.items() if k.startswith("fields/")}
        if not same_ids:  # meta.sqlite's rows must match the ids: drop the last one from a copy
            import shutil
            import sqlite3
            cp = tmp_path / "meta.sqlite"
            shutil.copyfile(v1.path / "meta.sqlite", cp)
            with sqlite3.connect(cp) as c:
                last = int(v1.ids[-1])
                c.execute("DELETE FROM videos WHERE id = ?", (last,))
                c.execute("DELETE FROM fields WHERE id = ?", (last,))
            meta = ExistingFile(cp, None)
        write_version(root, arrays, meta, {"index_type": "flat", "fields": USER_FIELDS})
    with open_index(root, verify=True) as v2:
        new = {k: e.sha256 for k, e in v2.manifest.files.items() if k.startswith("fields/")}
        assert set(new) == set(old)
        assert (new == old) == same_ids
        ref = _sqlite_table(v2)
        for spec in _random_specs(40):
            f = compile_filter(spec, v2.field_schema)
            np.testing.assert_array_equal(v2.filter_mask(f), evaluate(f, ref), err_msg=json.dumps(spec))
