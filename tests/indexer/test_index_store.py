"""gare_index.store: the on-disk contract with the service (write_version / open_index / gc / verify), without a model.
`pytest -s` prints the recall@10 of every index type read back through the format."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gare_index.ann_eval import exact_search, perturbed_queries, recall_at_k
from gare_index.ann_params import INDEX_TYPES
from gare_index.store import (
    FORMAT_VERSION,
    ExistingFile,
    IndexFormatError,
    IndexMismatchError,
    IndexVersion,
    current_version_name,
    gc,
    list_versions,
    open_index,
    verify_index,
    write_version,
)

SHA = "a" * 64


def synth_arrays(n: int, d: int = 16, f: int = 4, seed: int = 0, ids: np.ndarray | None = None, vectors=None):
    rng = np.random.default_rng(seed)
    ids = np.arange(10, 10 + 3 * n, 3, dtype=np.int64) if ids is None else ids
    masks = np.zeros((n, f), np.uint8)
    lengths = rng.integers(1, f + 1, size=n)
    for i, k in enumerate(lengths):
        masks[i, :k] = 1
    frames = rng.standard_normal((n, f, d)).astype(np.float16) * masks[:, :, None]
    vbar = frames.astype(np.float32).sum(1) / lengths[:, None] if vectors is None else vectors * 2.0
    norms = np.linalg.norm(vbar, axis=1).astype(np.float32)
    units = (vbar / norms[:, None]).astype(np.float32)
    arrays = {"ids": ids, "norms": norms, "units": units, "frames": frames, "masks": masks,
              "biases": rng.standard_normal(n).astype(np.float32) * 0.01}
    meta = [{"id": int(i), "path": f"/videos/{i}.mp4", "size": 100 + int(i), "mtime": 1.5, "checksum": f"c{i}",
             "duration": 2.0, "fps": 8.0, "frames_used": int(k), "start": None, "end": None} for i, k in zip(ids, lengths, strict=True)]
    return arrays, meta


def extra(index_type: str = "flat") -> dict:
    return {"checkpoint": {"path": "/ckpt.safetensors", "sha256": SHA, "model_config": {}},
            "index_type": index_type, "biases": {"gamma": 0.01, "n_iters": 4, "n_queries": 0, "source": "none"}}


def test_round_trip_reader_api(tmp_path):
    arrays, meta = synth_arrays(50)
    name = write_version(tmp_path, arrays, meta, extra())
    assert name == "v000001" and current_version_name(tmp_path) == name and list_versions(tmp_path) == [name]
    v = open_index(tmp_path, expect_checkpoint_sha=SHA, verify=True)
    assert isinstance(v, IndexVersion)
    assert (v.n, v.dim, v.max_frames) == (50, 16, 4)
    assert v.manifest["format"] == "gare-index" and v.manifest["format_version"] == FORMAT_VERSION
    assert v.manifest["frame_dtype"] == "float16" and v.manifest["invgc"] is None
    assert set(v.manifest["files"]) >= {"ann.faiss", "ids.npy", "norms.npy", "units.npy", "frames.npy", "masks.npy",
                                       "biases.npy", "meta.sqlite"}
    assert isinstance(v.frames, np.memmap) and v.frames.dtype == np.float16
    np.testing.assert_array_equal(v.ids, arrays["ids"])
    np.testing.assert_array_equal(np.asarray(v.frames), arrays["frames"])
    np.testing.assert_array_equal(v.masks, arrays["masks"])
    np.testing.assert_allclose(v.biases, arrays["biases"])
    # rows: vectorised lookup through the sorted index
    q = arrays["ids"][[7, 3, 3, 49]]
    np.testing.assert_array_equal(v.rows(q), [7, 3, 3, 49])
    with pytest.raises(KeyError, match="11"):
        v.rows(np.array([11]))
    np.testing.assert_array_equal(v.rows(np.array([11, 13]), missing="mask"), [-1, 1])
    np.testing.assert_allclose(v.vbar(np.array([0, 1])), arrays["units"][:2] * arrays["norms"][:2, None], rtol=1e-6)
    # metadata in the requested order; path_of
    md = v.metadata([13, 10])
    assert [m["id"] for m in md] == [13, 10] and md[0]["path"] == "/videos/13.mp4" and md[0]["status"] == "ok"
    assert set(md[0]) == {"id", "path", "size", "mtime", "checksum", "duration", "fps", "frames_used", "start", "end", "status"}
    assert v.path_of(13) == Path("/videos/13.mp4") and v.path_of(11) is None
    with pytest.raises(KeyError):
        v.metadata([11])
    # the ANN answers with video ids
    scores, ids = v.ann.search(arrays["units"][:5], 1)
    np.testing.assert_array_equal(ids[:, 0], arrays["ids"][:5])
    v.close()


def test_metadata_is_thread_safe(tmp_path):
    arrays, meta = synth_arrays(200)
    write_version(tmp_path, arrays, meta, extra())
    v = open_index(tmp_path)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(50):
                ids = rng.choice(arrays["ids"], size=8)
                assert [m["id"] for m in v.metadata(ids)] == list(ids)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_checkpoint_mismatch_names_both_hashes(tmp_path):
    arrays, meta = synth_arrays(5)
    write_version(tmp_path, arrays, meta, extra())
    other = "b" * 64
    with pytest.raises(IndexMismatchError) as ei:
        open_index(tmp_path, expect_checkpoint_sha=other)
    assert SHA in str(ei.value) and other in str(ei.value)
    assert isinstance(ei.value, IndexFormatError)


def test_format_version_and_corruption(tmp_path):
    arrays, meta = synth_arrays(20)
    name = write_version(tmp_path, arrays, meta, extra())
    vdir = tmp_path / "versions" / name
    # flip bytes inside frames.npy (same size): only verify=True notices, and names the file
    data = bytearray((vdir / "frames.npy").read_bytes())
    data[-5] ^= 0xFF
    (vdir / "frames.npy").write_bytes(bytes(data))
    open_index(tmp_path).close()
    with pytest.raises(IndexFormatError, match="frames.npy"):
        open_index(tmp_path, verify=True)
    assert any("frames.npy" in p for p in verify_index(tmp_path))
    # a truncated file is caught without hashing
    (vdir / "biases.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(IndexFormatError, match="biases.npy"):
        open_index(tmp_path)
    # an unknown format version is refused with a clear message
    m = json.loads((vdir / "manifest.json").read_text())
    m["format_version"] = 99
    (vdir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match="format version 99"):
        open_index(tmp_path)
    with pytest.raises(IndexFormatError, match="no such index directory"):
        open_index(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexFormatError, match="no CURRENT file"):
        open_index(tmp_path / "empty")


def test_versions_switch_atomically_and_gc(tmp_path):
    names = []
    for i in range(5):
        arrays, meta = synth_arrays(10 + i, seed=i)
        names.append(write_version(tmp_path, arrays, meta, extra(), keep=3))
    assert names == [f"v00000{i}" for i in range(1, 6)]
    assert list_versions(tmp_path) == names[-3:]  # keep=3
    assert open_index(tmp_path).n == 14
    # CURRENT pointing at an old version is never collected
    (tmp_path / "CURRENT").write_text(names[2] + "\n")
    assert gc(tmp_path, keep=1) == [names[3]]
    assert list_versions(tmp_path) == [names[2], names[4]]
    assert open_index(tmp_path).n == 12
    # a half-written version (a killed writer) is ignored by readers and cleaned by the next writer
    (tmp_path / "versions" / ".tmp-v000006").mkdir()
    (tmp_path / "versions" / ".tmp-v000006" / "ids.npy").write_bytes(b"junk")
    assert ".tmp-v000006" not in list_versions(tmp_path)
    arrays, meta = synth_arrays(3)
    assert write_version(tmp_path, arrays, meta, extra()) == "v000006"
    assert not (tmp_path / "versions" / ".tmp-v000006").exists()


def test_write_version_validates(tmp_path):
    arrays, meta = synth_arrays(6)
    with pytest.raises(ValueError, match="metadata rows"):
        write_version(tmp_path, arrays, meta[:-1], extra())
    bad = dict(arrays, ids=np.array([1, 1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="unique"):
        write_version(tmp_path, bad, meta, extra())
    with pytest.raises(ValueError, match="masks has shape"):
        write_version(tmp_path, dict(arrays, frames=arrays["frames"][:, :2]), meta, extra())
    assert list_versions(tmp_path) == []  # nothing was written


def test_linked_files_are_shared_not_copied(tmp_path):
    arrays, meta = synth_arrays(30)
    write_version(tmp_path, arrays, meta, extra())
    v1 = open_index(tmp_path)
    files = v1.manifest["files"]
    linked = {k: ExistingFile(v1.path / f"{k}.npy", files[f"{k}.npy"]["sha256"]) for k in ("ids", "norms", "units", "frames", "masks")}
    linked["biases"] = np.zeros(30, np.float32)
    write_version(tmp_path, linked, ExistingFile(v1.path / "meta.sqlite", files["meta.sqlite"]["sha256"]),
                  extra() | {"ann_params": v1.manifest["ann_params"]},
                  ann=ExistingFile(v1.path / "ann.faiss", files["ann.faiss"]["sha256"]))
    v2 = open_index(tmp_path, verify=True)
    for f in ("frames.npy", "units.npy", "ann.faiss", "meta.sqlite"):
        assert (v2.path / f).stat().st_ino == (v1.path / f).stat().st_ino
    assert not v2.biases.any() and v2.metadata([10])[0]["path"] == "/videos/10.mp4"
    assert verify_index(tmp_path) == []


@pytest.mark.parametrize("index_type", INDEX_TYPES)
def test_recall_of_each_type_through_the_format(tmp_path, index_type):
    from gare_index.ann_eval import clustered_vectors

    n, d = 4000, 32
    x = clustered_vectors(n, d, 60, seed=0, spread=0.5)
    arrays, meta = synth_arrays(n, d=d, f=2, vectors=x)
    params = {"index_type": index_type, "pq_m": 4 if index_type == "ivfpq" else None}
    write_version(tmp_path, arrays, meta, extra(index_type) | {"ann_params": params})
    v = open_index(tmp_path)
    assert v.manifest["index_type"] == index_type
    q = perturbed_queries(x, 200, seed=1, noise=0.25)
    _, pos = exact_search(x, q, 10)
    t0 = time.perf_counter()
    _, got = v.search(q, 10)
    ms = 1000 * (time.perf_counter() - t0) / len(q)
    r = recall_at_k(got, arrays["ids"][pos], 10)
    print(f"\n{index_type:6s} recall@10 vs exact = {r:.3f}  ({ms:.3f} ms/query, n={n}, d={d})")
    assert r >= {"flat": 1.0, "ivf": 0.9, "hnsw": 0.9, "ivfpq": 0.85}[index_type]
    assert verify_index(tmp_path, rehash=False) == []
