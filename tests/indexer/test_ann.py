"""gare_index.ann: recall of every FAISS index type against brute force on clustered unit vectors, ids,
save/load, incremental remove/add, and the automatic type choice (the recall table people compare is
bench/index_ann*.py: a benchmark, not a test)."""

from __future__ import annotations

import time

import faiss
import numpy as np
import pytest

from gare_index.ann import AnnIndex, build_index
from gare_index.ann_eval import clustered_vectors, exact_search, perturbed_queries, recall_at_k
from gare_index.ann_params import (
    FLAT_MAX,
    INDEX_TYPES,
    IVFPQ_MIN,
    AnnParams,
    choose_index_type,
    default_nlist,
    default_nprobe,
    default_pq_m,
)

N, D, N_CLUSTERS, N_QUERIES, K = 20_000, 64, 200, 300, 10
RECALL_FLOORS = {"flat": 1.0, "ivf": 0.9, "hnsw": 0.9, "ivfpq": 0.85}


@pytest.fixture(scope="module")
def data():
    x = clustered_vectors(N, D, N_CLUSTERS, seed=0, spread=0.5)
    q = perturbed_queries(x, N_QUERIES, seed=1, noise=0.25)
    ids = np.arange(N, dtype=np.int64) * 7 + 1000  # not row positions: the index must map them
    ex_scores, ex_pos = exact_search(x, q, K)
    return x, q, ids, ex_scores, ids[ex_pos]


@pytest.fixture(scope="module")
def built(data):
    x, q, ids, _, exact_ids = data
    out = {}
    for t in INDEX_TYPES:
        params = AnnParams(t)
        t0 = time.perf_counter()
        ann = AnnIndex(build_index(x, ids, params, use_gpu=False), params, x, vector_ids=ids)
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        scores, got = ann.search(q, K)
        t_search = time.perf_counter() - t0
        out[t] = dict(
            ann=ann,
            scores=scores,
            ids=got,
            recall=recall_at_k(got, exact_ids, K),
            build_s=t_build,
            search_ms=1000 * t_search / len(q),
        )
    return out


def test_vectors_are_unit_and_clustered(data):
    x, q, *_ = data
    assert x.dtype == np.float32 and x.shape == (N, D)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-5)
    # clustered, not uniform: a query's best match is far above the uniform-random level (~1/sqrt(d))
    assert np.median((q @ x.T).max(1)) > 0.7


@pytest.mark.parametrize("index_type", INDEX_TYPES)
def test_recall_floor(built, index_type):
    r = built[index_type]
    assert r["recall"] >= RECALL_FLOORS[index_type], (index_type, r["recall"])
    assert r["ids"].dtype == np.int64 and r["scores"].dtype == np.float32
    assert r["ids"].shape == r["scores"].shape == (N_QUERIES, K)
    # scores are sorted descending and every id is one of ours
    assert np.all(np.diff(r["scores"], axis=1) <= 1e-6)
    assert np.isin(r["ids"], built["flat"]["ids"]).mean() > 0.5


def test_flat_is_exact(built, data):
    _, _, _, ex_scores, exact_ids = data
    r = built["flat"]
    assert r["recall"] == 1.0
    np.testing.assert_array_equal(r["ids"], exact_ids)
    np.testing.assert_allclose(r["scores"], ex_scores, atol=1e-5)


def test_rescored_ivfpq_beats_raw_pq(built, data):
    x, q, ids, _, exact_ids = data
    raw = AnnIndex(built["ivfpq"]["ann"].cpu_index, AnnParams("ivfpq"), None)  # no vectors: no rescoring
    _, got = raw.search(q, K)
    r_raw = recall_at_k(got, exact_ids, K)
    assert built["ivfpq"]["recall"] > r_raw
    # rescored scores are exact inner products
    s, i = built["ivfpq"]["scores"], built["ivfpq"]["ids"]
    rows = (i - 1000) // 7
    np.testing.assert_allclose(s, np.einsum("qkd,qd->qk", x[rows], q), atol=1e-5)


@pytest.mark.parametrize("index_type", INDEX_TYPES)
def test_save_load_roundtrip(built, data, tmp_path, index_type):
    x, q, ids, *_ = data
    ann = built[index_type]["ann"]
    path = tmp_path / "sub" / f"{index_type}.faiss"
    ann.save(path)
    assert path.exists() and not list(path.parent.glob(".*tmp*"))
    loaded = AnnIndex.load(path, None, x, use_gpu=False, vector_ids=ids)  # params recovered from the file
    assert loaded.params.index_type == index_type and loaded.ntotal == N
    s, i = loaded.search(q, K)
    np.testing.assert_array_equal(i, built[index_type]["ids"])
    np.testing.assert_allclose(s, built[index_type]["scores"], atol=1e-6)
    # memory-mapped read-only (the service's workers share it through the page cache): same answers
    mapped = AnnIndex.load(path, None, x, use_gpu=False, vector_ids=ids, mmap=True)
    s2, i2 = mapped.search(q, K)
    np.testing.assert_array_equal(i2, built[index_type]["ids"])
    np.testing.assert_allclose(s2, built[index_type]["scores"], atol=1e-6)
    # explicit params must agree with the file
    wrong = "flat" if index_type != "flat" else "ivf"
    with pytest.raises(ValueError, match="holds"):
        AnnIndex.load(path, AnnParams(wrong), use_gpu=False)


def test_params_recovered_from_index(built):
    p = AnnParams.from_index(built["ivf"]["ann"].cpu_index)
    assert (p.index_type, p.nlist, p.nprobe) == ("ivf", default_nlist(N), default_nprobe(default_nlist(N)))
    p = AnnParams.from_index(built["hnsw"]["ann"].cpu_index)
    assert (p.index_type, p.hnsw_m, p.ef_search, p.ef_construction) == ("hnsw", 32, 128, 200)
    p = AnnParams.from_index(built["ivfpq"]["ann"].cpu_index)
    assert p.index_type == "ivfpq" and p.pq_m == default_pq_m(D) == 16


@pytest.mark.parametrize("index_type", ["flat", "ivf", "ivfpq"])
def test_remove_then_add_restores(data, built, index_type):
    x, q, ids, *_ = data
    params = AnnParams(index_type)
    # a copy of the module's built index (an IVF-PQ build trains for seconds): this test changes it
    ann = AnnIndex(faiss.clone_index(built[index_type]["ann"].cpu_index), params, x, vector_ids=ids)
    s0, i0 = ann.search(q, K)
    gone = np.unique(i0[:50, :3])  # some true top results
    rows = (gone - 1000) // 7
    assert ann.remove_ids(gone) == gone.size
    assert ann.ntotal == N - gone.size
    s1, i1 = ann.search(q, K)
    assert not np.isin(i1, gone).any()
    ann.add(x[rows], gone)
    assert ann.ntotal == N
    s2, i2 = ann.search(q, K)
    np.testing.assert_array_equal(i2, i0)
    np.testing.assert_allclose(s2, s0, atol=1e-6)
    assert ann.remove_ids(np.array([-5, 3], dtype=np.int64)) == 0  # unknown ids: nothing removed


def test_hnsw_remove_rebuilds(data):
    x, q, ids, *_ = data
    sub, sub_ids = x[:5000], ids[:5000]
    params = AnnParams("hnsw", ef_construction=100)
    ann = AnnIndex(build_index(sub, sub_ids, params, use_gpu=False), params, None)
    _, i0 = ann.search(q, K)
    gone = np.unique(i0[:20, :2])
    assert ann.remove_ids(gone) == gone.size  # faiss cannot delete from HNSW: rebuilt from stored vectors
    assert ann.ntotal == 5000 - gone.size
    _, i1 = ann.search(q, K)
    assert not np.isin(i1, gone).any()
    ann.add(sub[(gone - 1000) // 7], gone)
    _, i2 = ann.search(q, K)
    _, ex = exact_search(sub, q, K)
    assert recall_at_k(i2, sub_ids[ex], K) >= 0.9


def test_ivfpq_rescore_sees_added_vectors(data):
    x, q, ids, *_ = data
    params = AnnParams("ivfpq", nlist=64)
    n0 = 12_000
    ann = AnnIndex(build_index(x[:n0], ids[:n0], params, use_gpu=False), params, x[:n0], vector_ids=ids[:n0])
    ann.add(x[n0:], ids[n0:])  # not in the base store: kept in memory for rescoring
    s, i = ann.search(q, K)
    _, ex = exact_search(x, q, K)
    assert recall_at_k(i, ids[ex], K) >= 0.85
    rows = (i - 1000) // 7
    np.testing.assert_allclose(s, np.einsum("qkd,qd->qk", x[rows], q), atol=1e-5)


def test_missing_results_and_edge_cases():
    x = clustered_vectors(5, 8, 2, seed=3)
    ann = AnnIndex(build_index(x, np.arange(5), AnnParams("flat"), use_gpu=False), AnnParams("flat"))
    s, i = ann.search(x[:2], 8)
    assert (i[:, 5:] == -1).all() and np.isneginf(s[:, 5:]).all()
    assert (i[:, 0] == [0, 1]).all()
    s, i = ann.search(np.zeros((0, 8), np.float32), 3)
    assert s.shape == i.shape == (0, 3)
    with pytest.raises(ValueError):
        ann.search(x, 0)
    with pytest.raises(ValueError):
        ann.search(np.zeros((1, 4), np.float32), 1)
    empty = AnnIndex(
        build_index(np.zeros((0, 8), np.float32), np.zeros(0, np.int64), AnnParams("flat")), AnnParams("flat")
    )
    s, i = empty.search(x[:1], 2)
    assert (i == -1).all()
    with pytest.raises(ValueError):
        AnnParams("lsh")
    with pytest.raises(ValueError):
        build_index(np.zeros((0, 8), np.float32), np.zeros(0, np.int64), AnnParams("ivf"))


@pytest.mark.skipif(faiss.get_num_gpus() > 0, reason="checks the CPU-only behaviour")
def test_use_gpu_true_without_gpu_is_an_error():
    x = clustered_vectors(50, 8, 2, seed=3)
    with pytest.raises(RuntimeError, match="GPU"):
        build_index(x, np.arange(50), AnnParams("flat"), use_gpu=True)
    # auto mode quietly stays on the CPU
    assert build_index(x, np.arange(50), AnnParams("flat"), use_gpu=None).ntotal == 50


def test_choose_index_type_thresholds():
    assert choose_index_type(0) == "flat"
    assert choose_index_type(FLAT_MAX - 1) == "flat"
    assert choose_index_type(FLAT_MAX) == "ivf"
    assert choose_index_type(IVFPQ_MIN - 1) == "ivf"
    assert choose_index_type(IVFPQ_MIN) == "ivfpq"
    assert (FLAT_MAX, IVFPQ_MIN) == (50_000, 5_000_000)
    with pytest.raises(ValueError):
        choose_index_type(-1)


def test_default_nlist_and_pq_m():
    assert default_nlist(20_000) == 20_000 // 39  # 4 sqrt(n) = 566 clipped to n // 39 = 512
    assert default_nlist(1_000_000) == 4000
    assert default_nlist(10) == 1
    assert default_pq_m(512) == 128 and default_pq_m(64) == 16 and 512 % default_pq_m(512) == 0


def test_exact_search_and_recall_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 16)).astype(np.float32)
    q = rng.standard_normal((7, 16)).astype(np.float32)
    s, p = exact_search(x, q, 5, block=3)
    sim = q @ x.T
    for r in range(7):
        ref = np.argsort(-sim[r], kind="stable")[:5]
        np.testing.assert_array_equal(p[r], ref)
        np.testing.assert_allclose(s[r], sim[r, ref], rtol=1e-6)
    # ties broken by lower position; k capped at n
    s, p = exact_search(np.ones((3, 2), np.float32), np.ones((1, 2), np.float32), 10)
    assert p.tolist() == [[0, 1, 2]]
    assert recall_at_k(
        np.array([[1, 2, 3], [4, 5, -1]]), np.array([[3, 2, 9], [4, 6, 7]]), 3
    ) == pytest.approx(3 / 6)
