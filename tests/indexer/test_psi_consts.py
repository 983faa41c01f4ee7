"""psi's per-video constants in the index (issue 12): built, carried by add/remove, verified, upgraded, and
the folded rerank equal to the fused and model references on a real built index (tiny model, real mp4s)."""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from gare.psi_fold_videos import packed_width
from gare_index import psi_consts
from gare_search import query as Q
from gare_search import rerank as R
from gare_search import search as S
from tests.indexer.support import reseal
from tests.psi_reference import REFERENCES, exhaustive_fused, psi_scores_fused
from tests.service.support import build_index, copy_index


def test_built_index_stores_valid_constants(model_and_index):
    from gare_index.store import verify_index

    model, version, sh = model_and_index
    info = version.manifest["psi_fold"]
    w = packed_width(version.max_frames)
    assert version.psi_consts.shape == (version.n, w) and version.psi_consts.dtype == np.float32
    assert info["fingerprint"] == psi_consts.fold_of(model).fingerprint
    assert info["checkpoint_sha256"] == version.checkpoint_sha256
    assert info["bytes_per_video"] == 4 * w and info["floats_per_video"] == w
    assert 0 < version.manifest["files"]["psi_consts.npy"]["bytes"] - 4 * w * version.n <= 128  # + the .npy header
    assert verify_index(sh["index"], psi_sample=version.n) == []


def test_fold_equals_the_references_on_all_candidates(model_and_index):
    """psi scores of every gallery entry for 4 queries: fold == fused == model within 1e-5; a batch shares the
    constants (ragged K per query)."""
    model, version, sh = model_and_index
    t = Q.encode_queries(model, sh["captions"][:4])
    ids = np.asarray(version.ids)
    cands = [ids, ids[::-1][:7], ids[3:9], ids[:1]]
    got = {"fold": R.psi_scores(model, version, t, cands)}
    got.update({name: ref(model, version, t, cands) for name, ref in REFERENCES.items()})
    for i in range(4):
        assert np.std(got["fold"][0]) > 1e-3
        for impl in ("fused", "model"):
            np.testing.assert_allclose(got["fold"][i], got[impl][i], atol=1e-5, rtol=0, err_msg=impl)
    ex = R.exhaustive_psi(model, version, t, block=5)
    np.testing.assert_allclose(ex, exhaustive_fused(model, version, t), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ex[0], got["model"][0], atol=1e-5, rtol=0)


def test_cpu_kernel_reads_the_index_and_equals_the_torch_fold(model_and_index, monkeypatch):
    """The default CPU rerank (the compiled kernel over the memory-mapped arrays) against the torch fold over
    gathered rows (numba reported missing) and fused: equal within 1e-5, ragged K, repeated candidates."""
    from gare import psi_fold_cpu

    model, version, sh = model_and_index
    assert R.kernel_reads(version, version.psi_consts) and isinstance(version.frames, np.memmap)
    t = Q.encode_queries(model, sh["captions"][:3])
    ids = np.asarray(version.ids)
    cands = [ids[::-1], ids[2:5], np.concatenate([ids[:2], ids[:2]])]
    kernel = R.psi_scores(model, version, t, cands)
    monkeypatch.setattr(psi_fold_cpu, "_AVAILABLE", False)
    assert not R.kernel_reads(version, version.psi_consts)
    torch_fold = R.psi_scores(model, version, t, cands)
    fused = psi_scores_fused(model, version, t, cands)
    for i in range(3):
        assert len(kernel[i]) == len(cands[i]) and np.std(kernel[0]) > 1e-3
        np.testing.assert_allclose(kernel[i], torch_fold[i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(kernel[i], fused[i], atol=1e-5, rtol=0)


def _strip_constants(index, tmp_path):
    """A copy of the index whose current version is what a pre-issue-12 gare-index wrote (no psi constants)."""
    from gare_index.store import ExistingFile, open_index, write_version

    root = copy_index(index, tmp_path / "old")
    with open_index(root) as v:
        files = v.manifest["files"]
        arrays = {k: ExistingFile(v.path / f"{k}.npy") for k in ("ids", "norms", "units", "frames", "masks", "biases")}
        extra = {k: v.manifest[k] for k in ("checkpoint", "precision", "sampling", "ann_params", "biases", "next_id")}
        write_version(root, arrays, ExistingFile(v.path / "meta.sqlite"), extra,
                      ann=ExistingFile(v.path / "ann.faiss", files["ann.faiss"]["sha256"]))
    return root


def test_old_index_is_folded_in_memory_with_a_log_line_then_upgrade(model_and_index, tmp_path, caplog):
    """An index without psi constants is served by the fold all the same: its constants are folded in memory
    when it is prepared (one WARNING naming `gare-index upgrade`, not repeated), and the answers equal the
    upgraded index's."""
    from gare_build.cli import main
    from gare_index.store import open_index, verify_index

    model, version, sh = model_and_index
    root = _strip_constants(sh["index"], tmp_path)
    text = sh["captions"][3]
    with open_index(root) as old:
        assert old.psi_consts is None and "psi_fold" not in old.manifest
        assert verify_index(root) == []  # an old index is still a valid index (the search falls back)
        with caplog.at_level(logging.WARNING, logger="gare_index.psi_consts"):
            R.prepare(model, old)
            a = S.search(model, old, text, S.SearchOptions(k=5, candidates=10))
            S.search(model, old, text, S.SearchOptions(k=5, candidates=10))
        warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("psi rerank")]
        assert len(warned) == 1 and "in memory" in warned[0] and "gare-index upgrade" in warned[0], caplog.text
        b = S.search(model, version, text, S.SearchOptions(k=5, candidates=10))
        assert [h.id for h in a.hits] == [h.id for h in b.hits]
        np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], atol=1e-5)
        name_before = old.name
    assert main(["upgrade", "--out", str(root)]) == 0
    with open_index(root) as new:
        assert new.name != name_before and R.fold_usable(model, new)
        np.testing.assert_array_equal(np.asarray(new.psi_consts), np.asarray(version.psi_consts))
        for k in ("frames.npy", "ann.faiss", "meta.sqlite"):  # hard-linked, unchanged
            assert new.manifest["files"][k]["sha256"] == version.manifest["files"][k]["sha256"]
    assert verify_index(root, psi_sample=100) == []
    assert main(["upgrade", "--out", str(root)]) == 0  # already valid: no new version
    with open_index(root) as again:
        assert again.name == new.name


def test_stale_or_corrupt_constants_are_refused_and_reported(model_and_index, tmp_path):
    from gare_index.store import open_index, verify_index

    model, version, sh = model_and_index
    root = copy_index(sh["index"], tmp_path / "stale")
    with open_index(root) as v:
        path = v.path
    man = json.loads((path / "manifest.json").read_text())
    man["psi_fold"]["fingerprint"] = "0" * 64  # constants of other psi weights
    (path / "manifest.json").write_text(json.dumps(man))
    reseal(path)
    with open_index(root) as v:
        assert not R.fold_usable(model, v)
        assert "stale" in psi_consts.fold_status(v, psi_consts.fold_of(model))
        assert any("fingerprint" in p for p in verify_index(root, rehash=False))
    man["psi_fold"]["fingerprint"] = psi_consts.fold_of(model).fingerprint
    (path / "manifest.json").write_text(json.dumps(man))
    reseal(path)
    arr = np.load(path / "psi_consts.npy", mmap_mode="r+")
    arr[3, -1] += 1.0  # one constant of row 3 (same file size: only the recomputation or the hash sees it)
    arr.flush()
    del arr
    probs = verify_index(root, rehash=False, psi_sample=version.n)
    assert any("rows [3]" in p and "recomputation" in p for p in probs), probs


def test_add_and_remove_keep_constants_aligned(model_and_index, tmp_path):
    import shutil

    from gare_build.build import BuildOptions, build, remove
    from gare_index.store import open_index, verify_index

    model, version, sh = model_and_index
    vids = sorted(sh["videos"].glob("*.mp4"))
    lib = tmp_path / "lib"
    lib.mkdir()
    for p in vids[:10]:
        shutil.copy(p, lib / p.name)
    root = build_index(sh["checkpoint"], lib, tmp_path / "idx")
    for p in vids[10:]:
        shutil.copy(p, lib / p.name)
    build(str(sh["checkpoint"]), str(lib), str(root), BuildOptions(workers=0, progress=False), mode="add")
    with open_index(root) as v:
        assert v.n == len(vids)
        doomed = [str(int(i)) for i in np.asarray(v.ids)[[1, 7, 12]]]
    assert verify_index(root, psi_sample=len(vids)) == []
    remove(str(root), doomed)
    with open_index(root) as v:
        assert v.n == len(vids) - 3 and v.manifest.get("psi_fold")
        t = Q.encode_queries(model, sh["captions"][:2])
        ex = R.exhaustive_psi(model, v, t)
        np.testing.assert_allclose(ex, exhaustive_fused(model, v, t), atol=1e-5, rtol=0)
    assert verify_index(root, psi_sample=len(vids)) == []


def test_compute_rows_uses_the_served_vbar(model_and_index):
    """The constants are folded with v̄ = norm * unit (SPEC §4), not the mean of the float16 frames."""
    model, version, sh = model_and_index
    fold = psi_consts.fold_of(model)
    out = np.empty_like(np.asarray(version.psi_consts))
    psi_consts.compute_rows(fold, version.frames, version.masks, version.units, version.norms, out, device="cpu")
    np.testing.assert_allclose(out, np.asarray(version.psi_consts), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(torch.from_numpy(out[:, packed_width(version.max_frames) - 1])).all()


def test_rerank_device_cpu_on_a_cpu_model_is_the_same_kernel(model_and_index):
    """RerankSettings(device="cpu") changes nothing for a model on the CPU (both are the compiled kernel): the same floats,
    one query and a ragged batch (the CUDA case, where it moves t and keeps the rows in place, is in test_cuda.py)."""
    model, version, sh = model_and_index
    t = Q.encode_queries(model, sh["captions"][:3])
    ids = np.asarray(version.ids)
    cands = [ids[::-1], ids[2:5], ids[:4]]
    want = R.psi_scores(model, version, t, cands), R.psi_scores(model, version, t[:1], [ids[1:6]])
    on_cpu = R.RerankSettings(device="cpu")
    got = (R.psi_scores(model, version, t, cands, settings=on_cpu),
           R.psi_scores(model, version, t[:1], [ids[1:6]], settings=on_cpu))
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert np.array_equal(a, b)
