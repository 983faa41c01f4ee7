"""InvGC as an index-time option (`gare-index build --invgc`): the corrected stage-1 vectors, what the manifest
records, `add`/`remove` on a corrected index, ivfpq re-scoring with the corrected vectors, psi untouched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gare.invgc import invgc
from gare_build.cli import main
from gare_build.invgc_fit import invgc_apply, invgc_means
from gare_index.store import list_versions, open_index, verify_index, write_version
from tests.indexer.postprocess_support import D, copy_index, make_checkpoint_with_queues, queues, unit


def test_invgc_apply_is_training_invgc_and_per_item():
    rng = np.random.default_rng(0)
    G = unit(rng.standard_normal((40, 16)) + 0.7)  # a cone, as real embeddings are
    Gh = torch.from_numpy(unit(rng.standard_normal((150, 16)) + 0.7))
    Qh = torch.from_numpy(unit(rng.standard_normal((230, 16)) + 0.7))
    for k in (1.0, 5.0):
        mg, mq = invgc_means(G, Gh, Qh, k)
        got = invgc_apply(G, Gh, Qh, 0.3, 0.2, mg, mq, k, chunk=7)
        want = invgc(torch.from_numpy(G), Gh, Qh, 0.3, 0.2, k_percent=k).numpy()
        np.testing.assert_allclose(got, want, atol=2e-6)
        assert np.abs(got - G).max() > 0.01  # the correction is not trivial
        # with fixed means, the correction of a row depends on nothing else
        np.testing.assert_allclose(invgc_apply(G[5:9], Gh, Qh, 0.3, 0.2, mg, mq, k), got[5:9], atol=1e-6)


def _manifest(index) -> dict:
    return open_index(index).manifest


def test_build_add_remove_with_invgc(postprocess_env, tmp_path):
    sh = postprocess_env
    vids = sorted(sh["videos"].glob("*.mp4"))
    first = tmp_path / "first.csv"
    first.write_text("video\n" + "".join(f"{p}\n" for p in vids[:9]))
    out = tmp_path / "INDEX"
    rc = main(["build", "--checkpoint", str(sh["checkpoint"]), "--videos", str(first), "--out", str(out), "--workers", "0",
               "--no-progress", "--invgc", "--invgc-r-g", "0.3", "--invgc-r-q", "0.2", "--invgc-k", "2"])
    assert rc == 0
    v = open_index(out)
    inv = v.manifest["invgc"]
    assert (inv["r_g"], inv["r_q"], inv["k_percent"]) == (0.3, 0.2, 2.0)
    assert (inv["n_train_videos"], inv["n_train_queries"]) == (300, 256) and inv["selection"]["method"] == "given"
    assert set(v.manifest["files"]) >= {"ann_units.npy", "units.npy", "norms.npy", "ann.faiss"}
    Gh, Qh = queues(sh["checkpoint"])
    units = np.array(v.units)
    want = invgc(torch.from_numpy(units), Gh, Qh, 0.3, 0.2, k_percent=2.0).numpy()
    np.testing.assert_allclose(v.ann_units, want, atol=2e-6)
    assert np.abs(want - units).max() > 2e-3  # not the identity
    assert (inv["mean_g"], inv["mean_q"]) == pytest.approx(invgc_means(units, Gh, Qh, 2.0))
    # units/norms (psi's v̄) are the plain build's; the ANN holds the corrected vectors
    plain = open_index(sh["index"])
    by_name = {Path(m["path"]).name: m["id"] for m in plain.all_metadata()}
    mine = {Path(m["path"]).name: m["id"] for m in v.all_metadata()}
    pr = plain.rows(np.array([by_name[k] for k in sorted(mine)]))
    vr = v.rows(np.array([mine[k] for k in sorted(mine)]))
    np.testing.assert_array_equal(np.asarray(v.units)[vr], np.asarray(plain.units)[pr])
    np.testing.assert_array_equal(v.norms[vr], plain.norms[pr])
    import faiss

    stored = faiss.downcast_index(faiss.downcast_index(v.ann.cpu_index).index).reconstruct_n(0, v.n)
    np.testing.assert_allclose(stored, np.asarray(v.ann_units)[v.rows(faiss.vector_to_array(faiss.downcast_index(v.ann.cpu_index).id_map))], atol=0)
    scores, ids = v.search(np.asarray(v.ann_units), 1)
    np.testing.assert_array_equal(ids[:, 0], v.ids)
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)
    assert verify_index(out) == []
    before = np.array(v.ann_units)
    before_ids = np.array(v.ids)

    # add: old rows keep their vectors, new rows get the recorded correction (means included)
    rc = main(["add", "--videos", str(sh["videos"]), "--out", str(out), "--workers", "0", "--no-progress"])
    assert rc == 0
    v2 = open_index(out)
    assert v2.n == len(vids) and v2.manifest["invgc"] == inv
    np.testing.assert_array_equal(np.asarray(v2.ann_units)[v2.rows(before_ids)], before)
    new = np.setdiff1d(v2.ids, before_ids)
    assert new.size == len(vids) - 9
    nr = v2.rows(new)
    np.testing.assert_allclose(np.asarray(v2.ann_units)[nr],
                               invgc_apply(np.asarray(v2.units)[nr], Gh, Qh, 0.3, 0.2, inv["mean_g"], inv["mean_q"], 2.0),
                               atol=1e-6)
    _, ids = v2.search(np.asarray(v2.ann_units), 1)
    np.testing.assert_array_equal(ids[:, 0], v2.ids)
    assert verify_index(out) == []

    # remove: the remaining rows keep their corrected vectors
    gone = [int(v2.ids[0]), int(new[0])]
    assert main(["remove", "--out", str(out), *map(str, gone)]) == 0
    v3 = open_index(out)
    assert v3.n == v2.n - 2 and v3.manifest["invgc"] == inv and v3.ann.ntotal == v3.n
    np.testing.assert_array_equal(np.asarray(v3.ann_units), np.asarray(v2.ann_units)[v2.rows(v3.ids)])
    assert verify_index(out) == []

    # psi is unaffected: with every video a candidate, the reranked scores are the plain index's
    from gare.checkpoint import load_model
    from gare_search import search as S

    model, _ = load_model(sh["checkpoint"])
    plain3 = copy_index(sh["index"], tmp_path / "plain3")  # the same videos, ids and checkpoint, no InvGC
    assert main(["remove", "--out", str(plain3), *map(str, gone)]) == 0
    p3 = open_index(plain3)
    np.testing.assert_array_equal(p3.ids, v3.ids)
    opts = S.SearchOptions(k=v3.n, candidates=64, rerank=True, ncl=True)
    a = S.search(model, v3, "a red circle moves left", opts)
    b = S.search(model, p3, "a red circle moves left", opts)
    assert len(a.hits) == v3.n
    np.testing.assert_allclose(np.array(sorted((h.id, h.psi_score, h.bias) for h in a.hits)),
                               np.array(sorted((h.id, h.psi_score, h.bias) for h in b.hits)), atol=1e-6)
    np.testing.assert_array_equal(v3.biases, p3.biases)  # the biases use the plain vectors


def test_selection_on_validation_is_recorded_and_add_keeps_the_setting(postprocess_env, tmp_path):
    sh = postprocess_env
    out = copy_index(sh["index"], tmp_path / "INDEX")
    rc = main(["build", "--checkpoint", str(sh["checkpoint"]), "--videos", str(sh["videos"]), "--out", str(out),
               "--workers", "0", "--no-progress", "--invgc", "--invgc-val", str(sh["corpus"]), "--invgc-grid", "0,0.1,0.5"])
    assert rc == 0
    m = _manifest(out)
    sel = m["invgc"]["selection"]
    assert sel["method"] == "grid" and len(sel["tried"]) == 9
    assert {(t["r_g"], t["r_q"]) for t in sel["tried"]} == {(a, b) for a in (0, 0.1, 0.5) for b in (0, 0.1, 0.5)}
    best = max(t["score"] for t in sel["tried"])
    assert sel["score"] == best and (m["invgc"]["r_g"], m["invgc"]["r_q"]) == (sel["r_g"], sel["r_q"])
    assert "carved from the training split (fraction 0.25, seed 0)" in sel["validation"] and sel["n_val_videos"] >= 2
    report = json.loads((out / "report.json").read_text())
    assert report["invgc"]["r_g"] == sel["r_g"] and report["from_index"] == 14 and report["encoded"] == 0
    # the InvGC build dropped the folded index (not asked for): build holds exactly what it is given
    assert m["ncl_stage1"] is None and "ann_ncl.faiss" not in m["files"]
    n_versions = len(list_versions(out))
    assert main(["add", "--videos", str(sh["videos"]), "--out", str(out), "--no-invgc", "--workers", "0"]) == 1
    with pytest.raises(SystemExit) as e:  # a build-only flag
        main(["add", "--videos", str(sh["videos"]), "--out", str(out), "--invgc-val", "x"])
    assert e.value.code == 2
    assert len(list_versions(out)) == n_versions


def test_invgc_needs_the_video_queue_and_validation_data(postprocess_env, tmp_path, capsys):
    sh = postprocess_env
    ck = make_checkpoint_with_queues(tmp_path / "noq.safetensors", video_queue=False)
    rc = main(["build", "--checkpoint", str(ck), "--videos", str(sh["videos"]), "--out", str(tmp_path / "I1"),
               "--workers", "0", "--no-progress", "--invgc", "--invgc-r-g", "0.1", "--invgc-r-q", "0.1"])
    assert rc == 1 and "queues 'video' and 'text'" in capsys.readouterr().err
    assert not (tmp_path / "I1" / "CURRENT").exists()
    rc = main(["build", "--checkpoint", str(sh["checkpoint"]), "--videos", str(sh["videos"]), "--out", str(tmp_path / "I2"),
               "--workers", "0", "--no-progress", "--invgc", "--invgc-val", str(tmp_path)])
    assert rc == 1 and "not a caption manifest" in capsys.readouterr().err
    rc = main(["build", "--checkpoint", str(sh["checkpoint"]), "--videos", str(sh["videos"]), "--out", str(tmp_path / "I3"),
               "--workers", "0", "--no-progress", "--invgc-r-g", "0.1", "--invgc-r-q", "0.1"])
    assert rc == 1 and "need --invgc" in capsys.readouterr().err


def test_ivfpq_rescoring_uses_the_vectors_the_ann_was_built_on(tmp_path):
    rng = np.random.default_rng(3)
    n, f = 600, 2
    units = unit(rng.standard_normal((n, D)))
    corrected = unit(units + 0.5 * unit(rng.standard_normal((n, D))))
    frames = np.repeat(units[:, None, :], f, 1).astype(np.float16)
    arrays = {"ids": np.arange(n, dtype=np.int64), "norms": np.ones(n, np.float32), "units": units, "frames": frames,
              "masks": np.ones((n, f), np.uint8), "biases": np.zeros(n, np.float32), "ann_units": corrected}
    meta = [{"id": i, "path": f"/v/{i}.mp4", "size": 1, "mtime": 1.0, "checksum": str(i), "duration": 1.0, "fps": 1.0,
             "frames_used": f, "start": None, "end": None} for i in range(n)]
    write_version(tmp_path, arrays, meta, {"index_type": "ivfpq", "ann_params": {"index_type": "ivfpq", "nlist": 4, "nprobe": 4,
                                                                                "rescore": 8}, "ncl_stage1": {"c": 1.0}})
    v = open_index(tmp_path)
    q = corrected[:20] + 0.05 * rng.standard_normal((20, D)).astype(np.float32)
    q = unit(q)
    scores, ids = v.search(q, 5)
    exact = np.take_along_axis(q @ corrected.T, np.argsort(-(q @ corrected.T), 1)[:, :5], 1)
    # the shortlist is re-scored exactly against ann_units (not units): the scores are the corrected cosines
    np.testing.assert_allclose(scores, np.einsum("qkd,qd->qk", corrected[ids], q), atol=1e-5)
    assert (ids[:, 0] == np.arange(20)).mean() >= 0.95 and np.abs(scores[:, 0] - exact[:, 0]).max() < 1e-5
    s2, i2 = v.search_ncl(q, 5)  # the folded index re-scores against [ann_units ; b]
    np.testing.assert_allclose(s2, np.einsum("qkd,qd->qk", corrected[i2], q), atol=1e-5)
    assert v.manifest["ncl_stage1"]["stage1_vectors"] == "ann_units" and v.manifest["ncl_stage1"]["index_type"] == "ivfpq"
    assert verify_index(tmp_path) == []
