"""IVF indexes built on another's trained coarse quantiser (``build_index(coarse_from=...)``), as the tuner builds
IVF-PQ after IVF-Flat: the same cells as a k-means run would not give twice, the same answers as the donor where
the scores are exact, and a clear error for a quantiser that does not fit."""

from __future__ import annotations

import numpy as np
import pytest

from gare_build.tuning.ladder import TuneConfig, build_candidate
from gare_build.tuning.recall import tune_ann
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_eval import clustered_vectors, perturbed_queries
from gare_index.ann_params import AnnParams

N, D = 6_000, 32


@pytest.fixture(scope="module")
def data():
    x = clustered_vectors(N, D, 120, seed=7, spread=1.2)
    return x, np.arange(N, dtype=np.int64) + 100


def _cells(index) -> np.ndarray:
    import faiss

    ivf = faiss.extract_index_ivf(index)
    return ivf.quantizer.reconstruct_n(0, ivf.nlist)


def _lists(index) -> list[list[int]]:
    import faiss

    ivf = faiss.extract_index_ivf(index)
    inv = ivf.invlists
    return [sorted(faiss.rev_swig_ptr(inv.get_ids(c), inv.list_size(c)).tolist()) for c in range(ivf.nlist)]


def test_ivf_on_a_copied_quantiser_equals_its_donor(data):
    x, ids = data
    p = AnnParams("ivf", nlist=60, nprobe=7, coarse="flat")
    donor = build_index(x, ids, p, use_gpu=False)
    other = build_index(x[::-1].copy(), ids[::-1].copy(), p, use_gpu=False, coarse_from=donor)
    np.testing.assert_array_equal(_cells(other), _cells(donor))
    assert _lists(other) == _lists(donor)  # same cells, same members (added in another order)
    q = perturbed_queries(x, 50, seed=1, noise=0.5)
    s1, i1 = AnnIndex(donor, p).search(q, 20)
    s2, i2 = AnnIndex(other, p).search(q, 20)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, rtol=0, atol=1e-6)


def test_ivfpq_on_a_copied_quantiser_probes_the_same_cells(data):
    x, ids = data
    p = AnnParams("ivf", nlist=60, coarse="flat")
    donor = build_index(x, ids, p, use_gpu=False)
    pq = AnnParams("ivfpq", nlist=60, pq_m=8, fastscan=True, coarse="flat")
    index = build_index(x, ids, pq, use_gpu=False, coarse_from=donor)
    np.testing.assert_array_equal(_cells(index), _cells(donor))
    assert _lists(index) == _lists(donor)


def test_a_quantiser_that_does_not_fit_is_refused(data):
    x, ids = data
    donor = build_index(x, ids, AnnParams("ivf", nlist=60, coarse="flat"), use_gpu=False)
    with pytest.raises(ValueError, match="60 cells in d=32.*needs a trained flat one of 40 cells"):
        build_index(x, ids, AnnParams("ivf", nlist=40, coarse="flat"), use_gpu=False, coarse_from=donor)
    with pytest.raises(ValueError, match="needs a trained hnsw one"):
        build_index(x, ids, AnnParams("ivf", nlist=60, coarse="hnsw"), use_gpu=False, coarse_from=donor)


def test_the_tuner_builds_ivfpq_on_the_ivf_cells(data):
    x, ids = data
    q = perturbed_queries(x, 200, seed=2, noise=0.6)
    # a latency budget no IVF-Flat setting meets cannot be arranged reliably on a shared machine; a target above
    # what the ladder's IVF-Flat reaches at its nprobe cap (1% of the cells) sends the tuner on to IVF-PQ
    cfg = TuneConfig(target=0.999, k=10, candidates=10, latency_budget_ms=1000.0, n_queries=200, latency_queries=3,
                     index_types=("ivf", "ivfpq-fs"), nlist=60, max_nprobe_frac=0.02, strict=False)
    _, res = tune_ann(x, q, ids=ids, config=cfg)
    assert [(b["index_type"], b["coarse_from"]) for b in res.builds] == [("ivf", None), ("ivfpq-fs", "ivf")]
    ivf, lent = build_candidate("ivf", x, ids, cfg, False)
    pq, lent2 = build_candidate("ivfpq-fs", x, ids, cfg, False, built=[ivf])
    assert (lent, lent2) == (None, "ivf")
    np.testing.assert_array_equal(_cells(pq.cpu_index), _cells(ivf.cpu_index))
    assert _lists(pq.cpu_index) == _lists(ivf.cpu_index)
    hnsw, lent3 = build_candidate("hnsw", x, ids, cfg, False, built=[ivf, pq])
    assert lent3 is None and hnsw.params.index_type == "hnsw"


def test_a_given_index_is_not_built_again_and_lends_its_cells(data):
    x, ids = data
    q = perturbed_queries(x, 200, seed=3, noise=0.6)
    cfg = TuneConfig(target=0.999, k=10, candidates=10, latency_budget_ms=1000.0, n_queries=200, latency_queries=3,
                     index_types=("ivf", "ivfpq-fs"), nlist=60, max_nprobe_frac=0.02, strict=False)
    p = AnnParams("ivf", nlist=60, coarse="flat")
    given = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
    _, res = tune_ann(x, q, ids=ids, config=cfg, ann=given, build_s=1.0)
    # the ladder's "ivf" rung is the given index (same cells, same quantiser kind): skipped, not rebuilt
    assert [(b["index_type"], b.get("coarse_from")) for b in res.builds] == [("ivf", None), ("ivfpq-fs", "ivf")]
    assert res.builds[0]["given"] is True
    other = AnnParams("ivf", nlist=30, coarse="flat")  # other cells: the ladder's rung is a different index
    given2 = AnnIndex(build_index(x, ids, other, use_gpu=False), other)
    _, res2 = tune_ann(x, q, ids=ids, config=cfg, ann=given2, build_s=1.0)
    assert [b["index_type"] for b in res2.builds] == ["ivf", "ivf", "ivfpq-fs"]
