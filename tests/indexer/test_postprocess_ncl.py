"""NCL biases inside stage 1 (`--ncl-stage1`, ann_ncl.faiss): the folded inner-product search equals a brute-force
argsort of cos + b, stays correct after add / remove / biases, and the pure stage-1 function."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gare_build.cli import main
from gare_index.ncl_ann import build_ncl_ann, exact_ncl_topk
from gare_index.store import open_index, verify_index, write_version
from tests.indexer.postprocess_support import D, copy_index, unit


def _arrays(n: int, seed: int, bias_scale: float = 0.05):
    rng = np.random.default_rng(seed)
    units = unit(rng.standard_normal((n, D)) + 0.3)
    f = 2
    arrays = {"ids": np.arange(5, 5 + 2 * n, 2, dtype=np.int64), "norms": np.full(n, 2.0, np.float32), "units": units,
              "frames": np.repeat(units[:, None, :], f, 1).astype(np.float16), "masks": np.ones((n, f), np.uint8),
              "biases": (bias_scale * rng.standard_normal(n)).astype(np.float32)}
    meta = [{"id": int(i), "path": f"/v/{i}.mp4", "size": 1, "mtime": 1.0, "checksum": str(i), "duration": 1.0, "fps": 1.0,
             "frames_used": f, "start": None, "end": None} for i in arrays["ids"]]
    return arrays, meta


def _check_exact(v, queries: np.ndarray, k: int) -> None:
    scores, ids = v.search_ncl(queries, k)
    want_s, want_i = exact_ncl_topk(v.stage1_units, v.biases, v.ids, queries, k)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, atol=1e-5)
    # the pure stage-1 function: the same candidates, scores = the cosines (rank() adds b once)
    cos, ids2 = v.search(queries, k, ncl_stage1=True)
    np.testing.assert_array_equal(ids2, want_i)
    np.testing.assert_allclose(cos, np.einsum("qkd,qd->qk", np.asarray(v.stage1_units)[v.rows(ids2)], queries), atol=1e-5)


@pytest.mark.parametrize("c", [1.0, 0.25])
def test_folded_flat_search_is_exact_argsort_of_cos_plus_b(tmp_path, c):
    arrays, meta = _arrays(300, seed=1)
    write_version(tmp_path, arrays, meta, {"index_type": "flat", "ncl_stage1": {"c": c}})
    v = open_index(tmp_path, verify=True)
    m = v.manifest["ncl_stage1"]
    assert (m["c"], m["dim"], m["index_type"], m["stage1_vectors"]) == (c, D + 1, "flat", "units")
    assert "ann_ncl.faiss" in m["file"] and "ann_ncl.faiss" in v.manifest["files"] and v.ann_ncl.ntotal == 300
    q = unit(np.random.default_rng(2).standard_normal((25, D)) + 0.3)
    _check_exact(v, q, 20)
    # the biases matter: the folded top-20 differs from the plain cosine top-20
    _, plain = v.search(q, 20)
    assert (plain != v.search_ncl(q, 20)[1]).any()
    assert verify_index(tmp_path) == []
    # asking more than n pads with -1, like the plain ANN
    s, i = v.search_ncl(q[:2], 310)
    assert (i[:, 300:] == -1).all() and np.isneginf(s[:, 300:]).all()


def test_ivf_folded_search_with_every_cell_probed_is_exact(tmp_path):
    arrays, meta = _arrays(800, seed=4)
    write_version(tmp_path, arrays, meta, {"index_type": "ivf", "ann_params": {"index_type": "ivf", "nlist": 8, "nprobe": 8},
                                           "ncl_stage1": {"c": 1.0}})
    v = open_index(tmp_path)
    assert v.manifest["ncl_stage1"]["index_type"] == "ivf"
    _check_exact(v, unit(np.random.default_rng(5).standard_normal((10, D)) + 0.3), 15)
    assert verify_index(tmp_path) == []


def test_no_folded_index_is_a_clear_error(tmp_path):
    arrays, meta = _arrays(20, seed=0)
    write_version(tmp_path, arrays, meta, {"index_type": "flat"})
    v = open_index(tmp_path)
    assert v.ann_ncl is None and v.manifest["ncl_stage1"] is None
    with pytest.raises(ValueError, match="--ncl-stage1"):
        v.search_ncl(arrays["units"][:1], 3)


def test_verify_catches_a_folded_index_with_stale_biases(tmp_path):
    arrays, meta = _arrays(50, seed=0)
    stale = build_ncl_ann(arrays["units"], arrays["biases"] + 0.01, arrays["ids"], {"index_type": "flat"})
    write_version(tmp_path, arrays, meta, {"index_type": "flat"}, ann_ncl=stale)
    assert any("stale biases" in p for p in verify_index(tmp_path))


def test_folded_index_follows_add_remove_and_biases(postprocess_env, tmp_path):
    sh = postprocess_env
    out = tmp_path / "INDEX"
    vids = sorted(sh["videos"].glob("*.mp4"))
    first = tmp_path / "first.csv"
    first.write_text("video\n" + "".join(f"{p}\n" for p in vids[:10]))
    assert main(["build", "--checkpoint", str(sh["checkpoint"]), "--videos", str(first), "--out", str(out), "--workers", "0",
                 "--no-progress", "--ncl-stage1"]) == 0
    q = unit(np.random.default_rng(0).standard_normal((12, D)))
    v1 = open_index(out)
    assert v1.manifest["ncl_stage1"]["c"] == 1.0 and json.loads((out / "report.json").read_text())["ncl_stage1"]
    _check_exact(v1, q, 8)

    assert main(["add", "--videos", str(sh["videos"]), "--out", str(out), "--workers", "0", "--no-progress"]) == 0
    v2 = open_index(out)
    assert v2.n == len(vids) and v2.ann_ncl.ntotal == v2.n and v2.manifest["ncl_stage1"]["c"] == 1.0
    assert not np.allclose(v2.biases[v2.rows(v1.ids)], v1.biases)  # every bias moved: the gallery changed
    _check_exact(v2, q, 8)
    assert verify_index(out) == []

    assert main(["remove", "--out", str(out), str(int(v2.ids[3])), str(int(v2.ids[-1]))]) == 0
    v3 = open_index(out)
    assert v3.n == v2.n - 2 and v3.ann_ncl.ntotal == v3.n
    _check_exact(v3, q, 8)
    assert verify_index(out) == []

    assert main(["biases", "--out", str(out), "--n-iters", "2"]) == 0
    v4 = open_index(out)
    assert not np.allclose(v4.biases, v3.biases)
    f3, f4 = v3.manifest["files"], v4.manifest["files"]
    assert f4["ann.faiss"] == f3["ann.faiss"] and f4["ann_ncl.faiss"] != f3["ann_ncl.faiss"]  # only the folded one is rebuilt
    _check_exact(v4, q, 8)
    assert verify_index(out) == []

    # add keeps the setting; asking to change it fails and changes nothing
    assert main(["add", "--videos", str(sh["videos"]), "--out", str(out), "--no-ncl-stage1", "--workers", "0"]) == 1
    assert open_index(out).name == v4.name


def test_shared_index_two_stage_with_folded_candidates(postprocess_env, tmp_path):
    """The folded candidates go through gare_search's psi stage and rank like the plain ones."""
    from gare.checkpoint import load_model
    from gare_search import rerank as R
    from gare_search import search as S

    sh = postprocess_env
    v = open_index(copy_index(sh["index"], tmp_path / "I"))
    model, _ = load_model(sh["checkpoint"])
    t = S.encode_queries(model, ["a red circle moves left", "two blue squares"])
    u = S.unit_rows(t)
    cos, ids = v.search(u, 5, ncl_stage1=True)
    want = exact_ncl_topk(v.units, v.biases, v.ids, u, 5)[1]
    np.testing.assert_array_equal(ids, want)
    psi = R.psi_scores(model, v, t, list(ids))
    for i in range(2):
        hits = S.rank(cos[i], ids[i], psi[i], v.biases[v.rows(ids[i])], S.SearchOptions(k=5, candidates=5, ncl=True))
        got = {h.id: h.score for h in hits}
        for j, vid in enumerate(ids[i]):
            assert got[int(vid)] == pytest.approx(float(psi[i][j] + v.biases[v.rows([vid])[0]]), abs=1e-6)


def test_service_ncl_stage1_flag(service_env, tmp_path):
    """The API's ncl_stage1 equals the offline folded search, and a plain index refuses it with 409."""
    from fastapi.testclient import TestClient

    from gare.checkpoint import load_model
    from gare_build.cli import main as index_main
    from gare_index.store import open_index
    from gare_search import search as S
    from gare_serve.app import create_app
    from tests.service.support import settings

    sh = service_env
    with TestClient(create_app(settings(sh["index"]))) as c:
        r = c.post("/v1/search", json={"query": "a red circle", "k": 3, "ncl_stage1": True})
        assert r.status_code == 409 and "ncl-stage1" in r.json()["detail"]
    folded = tmp_path / "folded"
    assert index_main(["build", "--checkpoint", str(sh["checkpoint"]), "--videos", str(sh["videos"]), "--out", str(folded),
                       "--ncl-stage1", "--no-progress"]) in (0, 3)
    model, _ = load_model(sh["checkpoint"])
    v = open_index(folded)
    try:
        for rerank in (True, False):
            opts = S.SearchOptions(k=4, candidates=5, rerank=rerank, ncl=True, ncl_stage1=True)
            offline = S.search_batch(model, v, ["a blue square moves up"], opts)[0]
            with TestClient(create_app(settings(folded))) as c:
                body = c.post("/v1/search", json={"query": "a blue square moves up", "k": 4, "candidates": 5,
                                                  "rerank": rerank, "ncl_stage1": True}).json()
            assert [h["id"] for h in body["results"]] == [h.id for h in offline.hits]
            # stage 1 chose by cos + b: the candidates are the brute-force top 5 of that score
            t = S.unit_rows(S.encode_queries(model, ["a blue square moves up"]))
            cos = t @ np.asarray(v.units).T  # no InvGC here: the stage-1 vectors are the units
            top5 = set(v.ids[np.argsort(-(cos[0] + v.biases))[:5]].tolist())
            assert {h.id for h in offline.hits} <= top5
    finally:
        v.close()
