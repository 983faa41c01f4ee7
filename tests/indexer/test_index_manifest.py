"""manifest.json as the typed IndexManifest (gare_index/store/manifest.py): read and written through the model,
byte-compatible with the indexes written before it, strict about unknown keys and bad or missing fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gare_index.store import (
    MANIFEST_FILE,
    FileEntry,
    IndexFormatError,
    IndexManifest,
    list_versions,
    open_index,
    read_manifest,
    verify_index,
    write_version,
)
from tests.indexer.support import reseal
from tests.indexer.test_index_store import extra, synth_arrays

# A complete index written by `gare_build.build.build` of main at commit 78f2e78, before the manifest had a model
# (4 synthetic 1-s mp4 files at 4 fps, the gare-test-tiny model with a 64-row text queue, --ncl-stage1):
#   cd <main checkout> && PYTHONPATH=$PWD python -c "build(ckpt, videos, out, BuildOptions(workers=0,
#   progress=False, ncl_stage1=True))"   (see the commit that added this folder for the exact script)
OLD_INDEX = Path(__file__).parent / "data" / "index-main-78f2e78"


def _written(tmp_path: Path, **more) -> Path:
    arrays, meta = synth_arrays(12)
    write_version(tmp_path, arrays, meta, extra() | more)
    return tmp_path


def _edit_manifest(root: Path, change) -> Path:
    vdir = root / "versions" / list_versions(root)[-1]
    m = json.loads((vdir / MANIFEST_FILE).read_text())
    change(m)
    (vdir / MANIFEST_FILE).write_text(json.dumps(m, indent=1, sort_keys=True))
    reseal(vdir)  # refused for what it says, not for breaking its seal
    return vdir / MANIFEST_FILE


def test_an_index_written_before_the_model_opens_unchanged(tmp_path):
    root = shutil.copytree(OLD_INDEX, tmp_path / "old")
    text = (root / "versions" / "v000001" / MANIFEST_FILE).read_text(encoding="utf-8")
    with open_index(root, verify=True) as v:
        m = v.manifest
        assert isinstance(m, IndexManifest) and m.n == v.n == 4 and m.dim == 64 and m.max_frames == 6
        assert isinstance(m.files["ann.faiss"], FileEntry) and m.files["ann.faiss"].bytes == 1146
        assert m.checkpoint.sha256 == json.loads(text)["checkpoint"]["sha256"] == v.checkpoint_sha256
        assert m.ncl_stage1["c"] == 1.0 and v.ann_ncl is not None and m.psi_fold["floats_per_video"] > 0
        assert m.to_json() == text  # the model gives back the file byte for byte
        assert m.to_dict() == json.loads(text)
        # dict-style reads still work for scripts written against the JSON
        assert m["biases"]["source"] == "checkpoint-queue" and m["segment"] is None and "synthetic" not in m
        assert m.get("synthetic", "absent") == "absent"
        assert m["checkpoint"]["model_config"]["backbone"] == "gare-test-tiny"
        q = np.asarray(v.units[:2])
        _, ids = v.search(q, 2)
        assert ids[:, 0].tolist() == np.asarray(v.ids[:2]).tolist()  # each unit vector finds itself
    assert verify_index(root) == []


def test_round_trip_through_the_model(tmp_path):
    root = _written(tmp_path, segment={"seconds": 4, "overlap": 1.5}, next_id=40,
                    biases={"gamma": 0.01, "n_iters": 4, "n_queries": 0, "source": "none", "my_note": [1, 2]})
    text = (root / "versions" / "v000001" / MANIFEST_FILE).read_text(encoding="utf-8")
    m = read_manifest(root / "versions" / "v000001")
    assert m.to_json() == text and IndexManifest.model_validate(m.to_dict()) == m
    raw = json.loads(text)
    assert raw["segment"] == {"seconds": 4, "overlap": 1.5} and isinstance(raw["segment"]["seconds"], int)  # 4 stays 4
    assert m.segment.seconds == 4 and m.segment.overlap == 1.5 and m.next_id == 40
    assert m.biases["my_note"] == [1, 2]  # an open record: tools may add fields
    core = {n for n in m.files if not n.startswith("fields/")}
    assert core == {f"{k}.npy" for k in ("ids", "norms", "units", "frames", "masks", "biases")} | {
        "ann.faiss", "meta.sqlite"}
    # each metadata column is also written as filter arrays (fields/NAME.*), one record per file
    columns = {n.split("/")[1].split(".")[0] for n in m.files if n.startswith("fields/")}
    assert {"path", "folder", "start", "end", "duration"} <= columns
    for name, entry in m.files.items():
        assert entry.bytes == (root / "versions" / "v000001" / name).stat().st_size
    # a derived version that carries fields over from the read model writes the same JSON for them
    arrays, meta = synth_arrays(12)
    write_version(root, arrays, meta, {k: m[k] for k in ("checkpoint", "segment", "biases", "index_type")})
    m2 = read_manifest(root / "versions" / "v000002")
    assert m2.checkpoint == m.checkpoint and m2.segment == m.segment and m2.biases == m.biases


@pytest.mark.parametrize("change, named", [
    (lambda m: m.update(n="twelve"), "n: Input should be a valid integer"),
    (lambda m: m.update(kv="yes"), "kv: Input should be a valid boolean"),
    (lambda m: m.pop("dim"), "dim: required field missing"),
    (lambda m: m.pop("files"), "files: required field missing"),
    (lambda m: m.update(frobnicate=1), "frobnicate: unknown field"),
    (lambda m: m["files"]["ids.npy"].update(bytes="160"), "files.ids.npy.bytes: Input should be a valid integer"),
    (lambda m: m["files"]["ids.npy"].pop("sha256"), "files.ids.npy.sha256: required field missing"),
    (lambda m: m["checkpoint"].update(owner="me"), "checkpoint.owner: unknown field"),
    (lambda m: m.update(biases=[1]), "biases: Input should be a valid dictionary"),
    (lambda m: m.update(frame_dtype="float32"), "frame_dtype: Input should be 'float16'"),
])
def test_a_bad_manifest_is_refused_naming_the_field(tmp_path, change, named):
    path = _edit_manifest(_written(tmp_path), change)
    with pytest.raises(IndexFormatError) as e:
        open_index(tmp_path)
    assert str(path) in str(e.value) and named in str(e.value)
    assert any(named in p for p in verify_index(tmp_path))


def test_format_version_is_checked_first(tmp_path):
    _edit_manifest(_written(tmp_path), lambda m: m.update(format_version=2, frobnicate=1))
    with pytest.raises(IndexFormatError, match="index format version 2 is not supported.*reads version 1"):
        open_index(tmp_path)


def test_write_version_refuses_a_bad_manifest_and_writes_nothing(tmp_path):
    arrays, meta = synth_arrays(12)
    with pytest.raises(ValueError, match=r"unknown manifest fields \['frobnicate'\]"):
        write_version(tmp_path, arrays, meta, extra() | {"frobnicate": 1})
    with pytest.raises(ValueError, match="checkpoint.sha256: Input should be a valid string"):
        write_version(tmp_path, arrays, meta, extra() | {"checkpoint": {"sha256": 5}})
    with pytest.raises(ValueError, match="next_id: Input should be a valid integer"):
        write_version(tmp_path, arrays, meta, extra() | {"next_id": 1.5})
    assert list_versions(tmp_path) == [] and not (tmp_path / "CURRENT").exists()
    assert list((tmp_path / "versions").iterdir()) == []  # no temporary directory left behind
