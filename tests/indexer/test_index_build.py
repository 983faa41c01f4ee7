"""gare-index end to end on real mp4 files with the tiny model: build, what the index holds, add / remove /
biases / verify / stats / gc, segments, index types through the build, K/V storage, checkpoint binding."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gare.checkpoint import file_sha256, load_model, read_checkpoint
from gare.sinkhorn import sinkhorn_biases, sinkhorn_biases_naive
from gare.video import load_frames
from gare_build.build import BuildOptions, build
from gare_build.cli import main
from gare_index import ann_params as ann_mod
from gare_index.store import IndexMismatchError, list_versions, open_index, verify_index
from tests.indexer.support import copy_videos, make_checkpoint, make_long_video


def served_reference(model, ck, v, gamma: float) -> np.ndarray:
    """NCL Fig. 4 (float64) on the dense psi matrix of the raw queue texts x every indexed video."""
    with torch.no_grad():
        S = model.score(ck.queues["text"].float(), torch.from_numpy(np.asarray(v.frames, np.float32)),
                        torch.from_numpy(np.asarray(v.masks)), vbar=torch.from_numpy(v.vbar(np.arange(v.n))))
    _, b = sinkhorn_biases_naive(S.double(), gamma, 4)
    return b.numpy()


def opts(**kw) -> BuildOptions:
    base = dict(batch_size=4, workers=0, progress=False)
    base.update(kw)
    return BuildOptions(**base)


@pytest.fixture(scope="module")
def built(tmp_path_factory, ckpt, corpus):
    out = tmp_path_factory.mktemp("index") / "INDEX"
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(out),
               "--batch-size", "4", "--workers", "2", "--no-progress"])
    assert rc == 0
    return out


def test_build_writes_the_contract(built, ckpt, corpus):
    report = json.loads((built / "report.json").read_text())
    assert report["status"] == "ok" and report["exit_code"] == 0 and report["encoded"] == 12 and report["skipped"] == []
    assert report["videos_per_s"] > 0 and report["frames_per_s"] > 0
    sha = file_sha256(ckpt)
    v = open_index(built, expect_checkpoint_sha=sha, verify=True)
    m = v.manifest
    assert m["checkpoint"]["sha256"] == sha and m["checkpoint"]["path"] == str(ckpt)
    assert m["checkpoint"]["model_config"]["backbone"] == "gare-test-tiny"
    assert (m["n"], m["dim"], m["max_frames"], m["frame_dtype"]) == (12, 64, 6, "float16")
    assert m["index_type"] == "flat" and m["index_type_requested"] == "auto"
    assert m["biases"]["source"] == "checkpoint-queue" and m["biases"]["n_queries"] == 256 and m["biases"]["n_iters"] == 4
    np.testing.assert_array_equal(v.ids, np.arange(12))
    paths = sorted(str(p) for p in corpus.glob("*.mp4"))
    md = v.metadata(v.ids)
    assert sorted(r["path"] for r in md) == paths
    assert all(r["status"] == "ok" and len(r["checksum"]) == 64 and r["fps"] == 8.0 and r["duration"] == 2.0 for r in md)
    assert [r["frames_used"] for r in md] == v.masks.sum(1).tolist()

    # the stored features are the model's: F (float16), v̄ = norm * unit, the masks
    model, ck = load_model(ckpt)
    cfg = model.cfg
    rows = v.rows(np.array([0, 5]))
    clips = [load_frames(v.path_of(i), max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size)
             for i in (0, 5)]
    with torch.no_grad():
        F, vbar = model.encode_video(torch.stack([c[0] for c in clips]), torch.stack([c[1] for c in clips]))
    np.testing.assert_allclose(np.asarray(v.frames[rows], np.float32), F.numpy(), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(v.vbar(rows), vbar.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(v.masks[rows], torch.stack([c[1] for c in clips]).numpy())
    np.testing.assert_allclose(np.linalg.norm(v.units, axis=1), 1.0, atol=1e-6)

    # biases: SPEC §5, fitted to the served score (psi of the checkpoint's queue texts against the stored
    # features), gamma = 1 / exp(logit_scale); 12 videos < K = 256 candidates: the dense, exact Fig. 4
    gamma = float(1 / torch.exp(ck.state_dict["clip.logit_scale"]))
    assert m["biases"]["gamma"] == pytest.approx(gamma)
    assert m["biases"]["score"] == "served" and m["biases"]["served"]["form"] == "dense"
    np.testing.assert_allclose(v.biases, served_reference(model, ck, v, gamma), atol=2e-4)

    # the ANN finds every video by its own vector; the reranker inputs work with model.score
    _, ids = v.search(np.asarray(v.units), 1)
    np.testing.assert_array_equal(ids[:, 0], v.ids)
    t = torch.nn.functional.normalize(torch.randn(3, 64), dim=1)
    with torch.no_grad():
        s_idx = model.score(t, torch.from_numpy(np.array(v.frames[rows])), torch.from_numpy(v.masks[rows]),
                            vbar=torch.from_numpy(v.vbar(rows)))
        s_ref = model.score(t, F, torch.stack([c[1] for c in clips]), vbar=vbar)
    np.testing.assert_allclose(s_idx.numpy(), s_ref.numpy(), atol=5e-3)
    v.close()
    assert main(["verify", "--out", str(built)]) == 0


def test_stats(built, capsys):
    assert main(["stats", "--out", str(built), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["n"] == 12 and st["distinct_files"] == 12 and st["bytes_per_video"] > 0
    assert st["total_duration_s"] == pytest.approx(24.0) and st["index_type"] == "flat"


def test_other_checkpoint_is_refused(built, ckpt, corpus, tmp_path, capsys):
    other = make_checkpoint(tmp_path / "other.safetensors", seed=7)
    sha_other, sha = file_sha256(other), file_sha256(ckpt)
    with pytest.raises(IndexMismatchError) as ei:
        open_index(built, expect_checkpoint_sha=sha_other)
    assert sha in str(ei.value) and sha_other in str(ei.value)
    capsys.readouterr()
    assert main(["add", "--checkpoint", str(other), "--videos", str(corpus), "--out", str(built), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert sha in err and sha_other in err
    assert main(["verify", "--out", str(built), "--checkpoint", str(other)]) == 1
    assert main(["verify", "--out", str(built), "--checkpoint", str(ckpt)]) == 0


def test_add_remove_biases_gc(tmp_path, ckpt, corpus):
    vids = copy_videos(corpus, tmp_path / "lib", [f"video{i}.mp4" for i in range(6)])
    out = tmp_path / "INDEX"
    r1 = build(ckpt, vids, out, opts())
    assert (r1.encoded, r1.n_videos, r1.exit_code) == (6, 6, 0)
    v1 = open_index(out)
    by_path = {r["path"]: r["id"] for r in v1.all_metadata()}

    # two new files, one changed file (new content under an old name), and a copy of an indexed video
    shutil.copy2(corpus / "video6.mp4", vids / "video6.mp4")
    shutil.copy2(corpus / "video7.mp4", vids / "video7.mp4")
    shutil.copy2(corpus / "video8.mp4", vids / "video2.mp4")
    shutil.copy2(corpus / "video0.mp4", vids / "copy_of_0.mp4")
    r2 = build(None, vids, out, opts(), mode="add")
    assert (r2.added, r2.updated, r2.unchanged, r2.n_videos) == (3, 1, 5, 9)
    assert r2.encoded == 3 and r2.from_index == 1  # the copy's features come from video0 by checksum
    v2 = open_index(out)
    md2 = {r["path"]: r for r in v2.all_metadata()}
    assert md2[str(vids / "video2.mp4")]["id"] == by_path[str(vids / "video2.mp4")]  # a changed file keeps its id
    assert {md2[str(vids / n)]["id"] for n in ("video6.mp4", "video7.mp4", "copy_of_0.mp4")} == {6, 7, 8}
    # unchanged rows are bit-identical; the changed one is new
    for p in ("video0.mp4", "video1.mp4"):
        i = by_path[str(vids / p)]
        np.testing.assert_array_equal(v2.frames[v2.rows(np.array([i]))], v1.frames[v1.rows(np.array([i]))])
    i2 = by_path[str(vids / "video2.mp4")]
    assert not np.array_equal(v2.units[v2.rows(np.array([i2]))], v1.units[v1.rows(np.array([i2]))])
    copy_id = md2[str(vids / "copy_of_0.mp4")]["id"]
    np.testing.assert_array_equal(v2.units[v2.rows(np.array([copy_id]))],
                                  v2.units[v2.rows(np.array([by_path[str(vids / "video0.mp4")]]))])
    # the incrementally updated ANN holds exactly the new gallery, and the biases were recomputed for it
    scores, ids = v2.search(np.array(v2.units), 9)
    assert sorted(ids[0].tolist()) == sorted(v2.ids.tolist())
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)
    assert v2.biases.shape == (9,) and not np.allclose(v2.biases[:6], v1.biases[:6])
    assert verify_index(out) == []

    # nothing new: no new version
    r3 = build(None, vids, out, opts(), mode="add")
    assert r3.version is None and r3.n_videos == 9 and "up to date" in r3.notes[0]

    # remove by id and by path; biases recomputed; everything consistent
    assert main(["remove", "--out", str(out), "0", str(vids / "video7.mp4")]) == 0
    v3 = open_index(out)
    id7 = md2[str(vids / "video7.mp4")]["id"]
    assert v3.n == 7 and 0 not in v3.ids and id7 not in v3.ids and v3.ann.ntotal == 7
    assert main(["remove", "--out", str(out), "12345"]) == 1  # unknown ids are an error, nothing changes
    assert open_index(out).name == v3.name
    # add/remove recomputed the served biases of the whole gallery, as a build from scratch would
    model, ck = load_model(ckpt)
    gamma = v3.manifest["biases"]["gamma"]
    assert v2.manifest["biases"]["score"] == v3.manifest["biases"]["score"] == "served"
    np.testing.assert_allclose(v2.biases, served_reference(model, ck, v2, gamma), atol=2e-4)
    np.testing.assert_allclose(v3.biases, served_reference(model, ck, v3, gamma), atol=2e-4)
    assert main(["biases", "--out", str(out)]) == 0
    v4 = open_index(out, verify=True)
    np.testing.assert_allclose(v4.biases, v3.biases, atol=1e-7)
    assert (v4.path / "frames.npy").stat().st_ino == (v3.path / "frames.npy").stat().st_ino  # linked, not copied
    assert verify_index(out) == []
    assert len(list_versions(out)) == 3  # keep=3
    assert main(["gc", "--out", str(out), "--keep", "1"]) == 0
    assert list_versions(out) == [v4.name]
    assert main(["verify", "--out", str(out)]) == 0


def test_segments(tmp_path, ckpt):
    lib = tmp_path / "long"
    make_long_video(lib / "long.mp4", seconds=12.0, fps=4.0)
    out = tmp_path / "INDEX"
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(lib), "--out", str(out), "--segment", "4",
               "--overlap", "1", "--workers", "0", "--no-progress"])
    assert rc == 0
    v = open_index(out)
    md = v.metadata(v.ids)
    assert [(r["start"], r["end"]) for r in md] == [(0.0, 4.0), (3.0, 7.0), (6.0, 10.0), (9.0, 12.0)]
    assert all(r["path"] == str(lib / "long.mp4") and r["duration"] == 12.0 for r in md)
    assert v.manifest.segment.to_dict() == {"seconds": 4.0, "overlap": 1.0}
    assert all(u == 4 for u in v.masks.sum(1)) or all(u >= 3 for u in v.masks.sum(1))
    assert len({tuple(np.round(u, 4)) for u in np.asarray(v.units)}) == 4  # windows differ
    # the window's features are those of load_frames(start, end)
    model, _ = load_model(ckpt)
    fr, mk = load_frames(lib / "long.mp4", max_frames=6, framerate=1.0, image_size=32, start=3.0, end=7.0)
    with torch.no_grad():
        _, vbar = model.encode_video(fr[None], mk[None])
    np.testing.assert_allclose(v.vbar(v.rows(np.array([md[1]["id"]]))), vbar.numpy(), rtol=1e-5, atol=1e-6)
    assert verify_index(out) == []


def test_index_types_through_the_build(tmp_path, ckpt, corpus, monkeypatch):
    out = tmp_path / "INDEX"
    r = build(ckpt, corpus, out, opts())
    assert r.index_type == "flat"  # auto, 12 videos
    for t in ("ivf", "hnsw", "ivfpq"):
        r = build(ckpt, corpus, out, opts(index_type=t))
        assert r.encoded == 0 and r.from_index == 12  # features reused from the previous version
        v = open_index(out)
        assert v.manifest["index_type"] == t and v.manifest["index_type_requested"] == t
        _, ids = v.search(np.array(v.units), 4)  # (ivfpq re-scores 4 x 4 PQ candidates exactly)
        assert (ids[:, 0] == v.ids).mean() >= 0.9, t
    # auto follows choose_index_type of the library size (thresholds lowered so 12 videos count as large)
    monkeypatch.setattr(ann_mod, "FLAT_MAX", 5)
    r = build(ckpt, corpus, out, opts())
    assert r.index_type == "ivf" and open_index(out).manifest["index_type_requested"] == "auto"
    monkeypatch.setattr(ann_mod, "IVFPQ_MIN", 10)
    assert build(ckpt, corpus, out, opts()).index_type == "ivfpq"
    assert verify_index(out) == []


def test_store_kv_and_no_queue(tmp_path, corpus):
    ck = make_checkpoint(tmp_path / "noqueue.safetensors", queue=False, seed=3)
    assert "text" not in read_checkpoint(ck).queues
    lib = copy_videos(corpus, tmp_path / "lib", ["video0.mp4", "video1.mp4", "video2.mp4"])
    out = tmp_path / "INDEX"
    r = build(ck, lib, out, opts(store_kv=True, precision="bf16"))
    assert r.exit_code == 0 and any("no text query queue" in n for n in r.notes)
    v = open_index(out, verify=True)
    assert v.manifest["biases"]["source"] == "none" and not v.biases.any()
    assert v.manifest["kv"] is True and v.manifest["precision"] == "bf16" and v.kv is not None
    assert v.keys.shape == v.frames.shape and v.keys.dtype == np.float16
    model, _ = load_model(ck)
    t = torch.nn.functional.normalize(torch.randn(4, 64), dim=1)
    fr, mk = torch.from_numpy(np.array(v.frames)), torch.from_numpy(np.array(v.masks))
    kv = tuple(torch.from_numpy(np.array(a)) for a in v.kv)
    with torch.no_grad():
        s_kv = model.score(t, fr, mk, vbar=torch.from_numpy(v.vbar(np.arange(v.n))), kv=kv)
        s_ref = model.score(t, fr, mk, vbar=torch.from_numpy(v.vbar(np.arange(v.n))))
    np.testing.assert_allclose(s_kv.numpy(), s_ref.numpy(), atol=2e-3)
    # add keeps the K/V setting and the precision; remove carries K/V over
    shutil.copy2(corpus / "video3.mp4", lib / "video3.mp4")
    r2 = build(None, lib, out, opts(), mode="add")
    assert r2.added == 1 and open_index(out).kv is not None
    assert main(["remove", "--out", str(out), "1"]) == 0
    v3 = open_index(out, verify=True)
    assert v3.n == 3 and v3.kv is not None and verify_index(out) == []
    with pytest.raises(ValueError, match="precision"):
        build(None, lib, out, opts(precision="fp32"), mode="add")


def test_concurrent_runs_are_refused(tmp_path, ckpt, corpus):
    from gare_build.build import BUILD_LOCK
    from gare_index.store import IndexFormatError, index_lock

    out = tmp_path / "INDEX"
    with index_lock(out, BUILD_LOCK, blocking=False):
        with pytest.raises(IndexFormatError, match="another gare-index process"):
            build(ckpt, corpus, out, opts())
    assert not (out / "CURRENT").exists()


def test_bias_score_dual_and_sparse_served(tmp_path, ckpt, corpus):
    """--bias-score dual keeps the dual-tower biases (and add carries the choice); --bias-k below the gallery
    size gives the sparse served form: psi on each queue query's top K, the cosine elsewhere."""
    vids = copy_videos(corpus, tmp_path / "lib", [f"video{i}.mp4" for i in range(5)])
    out = tmp_path / "INDEX"
    assert build(ckpt, vids, out, opts(bias_score="dual")).exit_code == 0
    v = open_index(out)
    _, ck = load_model(ckpt)
    gamma = v.manifest["biases"]["gamma"]
    assert v.manifest["biases"]["score"] == "dual"
    q = torch.nn.functional.normalize(ck.queues["text"].float(), dim=1)
    _, b = sinkhorn_biases(q, torch.from_numpy(np.array(v.units)), gamma, n_iters=4)
    np.testing.assert_allclose(v.biases, b.numpy(), rtol=1e-5, atol=1e-6)
    shutil.copy2(corpus / "video6.mp4", vids / "video6.mp4")
    assert build(None, vids, out, opts(), mode="add").exit_code == 0
    v2 = open_index(out)
    assert v2.manifest["biases"]["score"] == "dual"  # an add keeps the index's choice
    _, b2 = sinkhorn_biases(q, torch.from_numpy(np.array(v2.units)), gamma, n_iters=4)
    np.testing.assert_allclose(v2.biases, b2.numpy(), rtol=1e-5, atol=1e-6)

    # recompute as served, sparse (K = 2 of 6)
    assert main(["biases", "--out", str(out), "--bias-score", "served", "--bias-k", "2"]) == 0
    v3 = open_index(out, verify=True)
    bi = v3.manifest["biases"]
    assert bi["score"] == "served" and bi["served"]["form"] == "sparse" and bi["served"]["k"] == 2
    model, _ = load_model(ckpt)
    raw = ck.queues["text"].float()
    units = torch.from_numpy(np.array(v3.units))
    with torch.no_grad():
        S = model.score(raw, torch.from_numpy(np.asarray(v3.frames, np.float32)), torch.from_numpy(np.asarray(v3.masks)),
                        vbar=torch.from_numpy(v3.vbar(np.arange(v3.n))))
    H = q @ units.T
    top = H.topk(2, dim=1).indices
    H.scatter_(1, top, S.gather(1, top))
    _, b_ref = sinkhorn_biases_naive(H.double(), gamma, 4)
    np.testing.assert_allclose(v3.biases, b_ref.numpy(), atol=2e-4)
