"""A library's own fields at index time: a CSV / JSONL manifest's columns recorded in the index (manifest, meta.sqlite),
kept across add and remove, returned with every row, shown by stats; a refused add changes nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gare_build.build import BuildOptions, build, remove
from gare_build.pipeline.stats import stats
from gare_index.fields import FieldError, date_seconds
from gare_index.filters import FilterError
from gare_index.store import open_index, verify_index


def opts(**kw) -> BuildOptions:
    return BuildOptions(**{"batch_size": 4, "workers": 0, "progress": False, **kw})


def _tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file of the index except the run report (which records the refused run)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "report.json"}


def _rows(names: list[str]) -> list[dict]:
    out = []
    for i, n in enumerate(names):
        out.append({"video": n, "channel": ["news", "sport", "music"][i % 3], "tags": "|".join(["a", "b", "c"][: i % 3 + 1]),
                    "year": str(2015 + i), "published": f"2020-0{1 + i % 9}-15" if i % 4 else ""})
    return out


def _write_csv(path: Path, rows: list[dict]) -> Path:
    cols = list(rows[0])
    path.write_text(",".join(cols) + "\n" + "".join(",".join(str(r.get(c, "")) for c in cols) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def fielded(tmp_path_factory, ckpt, corpus):
    root = tmp_path_factory.mktemp("fields")
    names = sorted(p.name for p in corpus.glob("*.mp4"))
    vids = root / "v"
    vids.mkdir()
    for n in names:
        (vids / n).symlink_to(corpus / n)
    rows = _rows(names)
    _write_csv(vids / "first.csv", rows[:8])
    out = root / "INDEX"
    build(ckpt, vids / "first.csv", out, opts(fields={"tags": "tags"}))  # a|b|c would be inferred a string
    return out, vids, names, rows


def test_fields_are_recorded_and_returned(fielded):
    out, vids, names, rows = fielded
    with open_index(out, verify=True) as v:
        assert v.manifest.fields == {"channel": "string", "published": "date", "tags": "tags", "year": "number"}
        md = {Path(r["path"]).name: r for r in v.all_metadata()}
        assert v.metadata(v.ids[:2])[0]["channel"] in ("news", "sport", "music")
        for r in rows[:8]:
            got = md[r["video"]]
            assert got["channel"] == r["channel"]
            assert got["tags"] == sorted(r["tags"].split("|"))
            assert got["year"] == float(r["year"])
            assert got["published"] == (r["published"] or None)
        # filters see the built-in fields too: folder, duration, mtime
        mask = v.filter_mask(v.compile_filter({"year": {"$gte": 2019}, "tags": {"$in": ["c"]}}))
        want = [float(md[Path(p["path"]).name]["year"]) >= 2019 and "c" in md[Path(p["path"]).name]["tags"]
                for p in v.metadata(v.ids)]
        assert mask.tolist() == want and 0 < sum(want) < v.n
        assert v.filter_mask(v.compile_filter({"folder": {"$prefix": str(vids)}})).all()
        assert v.filter_mask(v.compile_filter({"mtime": {"$gt": "2000-01-01"}, "duration": {"$gt": 0}})).all()
        with pytest.raises(FilterError, match="unknown field 'chanel'"):
            v.compile_filter({"chanel": "news"})
    st = stats(out)
    assert st["fields"] == "channel:string, published:date, tags:tags, year:number"
    assert st["field_values"] == {"channel": 8, "published": 6, "tags": 8, "year": 8}
    assert st["builtin_fields"]["duration"] == "number"


def test_a_refused_add_changes_nothing(fielded, ckpt):
    out, vids, names, rows = fielded
    before = _tree_digest(out)
    bad_col = [dict(r, studio="x") for r in rows[8:10]]
    with pytest.raises(FieldError, match=r"columns \['studio'\]"):
        build(ckpt, _write_csv(vids / "bad1.csv", bad_col), out, opts(), mode="add")
    bad_type = [dict(r, year="nineteen") for r in rows[8:10]]
    with pytest.raises(FieldError, match="field 'year' is a number; got 'nineteen'"):
        build(ckpt, _write_csv(vids / "bad2.csv", bad_type), out, opts(), mode="add")
    with pytest.raises(FieldError, match="year: number in the index, string here"):
        build(ckpt, _write_csv(vids / "ok.csv", rows[8:10]), out, opts(fields={"year": "string"}), mode="add")
    assert _tree_digest(out) == before


def test_fields_survive_add_and_remove(fielded, ckpt, tmp_path):
    out, vids, names, rows = fielded
    work = tmp_path / "INDEX"
    shutil.copytree(out, work, symlinks=True)
    # JSONL: tags as lists, numbers as numbers; one unchanged video gets a new channel
    jl = vids / "more.jsonl"
    more = [{"video": r["video"], "channel": r["channel"], "tags": r["tags"].split("|"), "year": int(r["year"])}
            for r in rows[8:]] + [{"video": rows[0]["video"], "channel": "renamed"}]
    jl.write_text("".join(json.dumps(r) + "\n" for r in more))
    build(ckpt, jl, work, opts(), mode="add")
    with open_index(work, verify=True) as v:
        md = {Path(r["path"]).name: r for r in v.all_metadata()}
        assert len(md) == 12
        assert md[rows[0]["video"]]["channel"] == "renamed"
        assert md[rows[0]["video"]]["year"] == 2015.0  # a column the add did not give keeps its value
        assert md[rows[9]["video"]]["tags"] == sorted(rows[9]["tags"].split("|"))
        assert md[rows[9]["video"]]["published"] is None
        gone = v.metadata(v.ids[:1])[0]
    remove(work, [gone["path"]])
    assert verify_index(work) == []
    with open_index(work) as v:
        md2 = {Path(r["path"]).name: r for r in v.all_metadata()}
        assert len(md2) == 11 and v.manifest.fields == {"channel": "string", "published": "date", "tags": "tags",
                                                        "year": "number"}
        for name, r in md2.items():
            assert {k: r[k] for k in ("channel", "tags", "year", "published")} == {
                k: md[name][k] for k in ("channel", "tags", "year", "published")}
        col = v.filter_mask(v.compile_filter({"published": {"$gte": "2020-03-01"}}))
        want = np.array([r["published"] is not None and date_seconds(r["published"]) >= date_seconds("2020-03-01")
                         for r in v.metadata(v.ids)])
        assert np.array_equal(col, want)
