"""gare_build.tuning (recall, coverage, queries): recall-target tuning of stage 1, checked against exact search."""

from __future__ import annotations

import numpy as np
import pytest

from gare_build.tuning.coverage import choose_candidates, cosine_scorer, coverage_at_k
from gare_build.tuning.ladder import TuneConfig
from gare_build.tuning.measure import exact_topk, recall_of_topk
from gare_build.tuning.queries import sample_queries
from gare_build.tuning.recall import RecallTargetError, tune_ann
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_eval import clustered_vectors, exact_search, perturbed_queries
from gare_index.ann_params import AnnParams

N, D = 12_000, 32
LOOSE_MS = 1000.0  # latency budget far above any search here (the shared test machine is noisy)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = clustered_vectors(N, D, 300, seed=3, spread=1.2)
    q = perturbed_queries(x, 600, seed=4, noise=0.6)
    fresh = perturbed_queries(x, 300, seed=5, noise=0.6)  # never seen by the tuner
    return x, q, fresh


def _independent_recall(ann: AnnIndex, x: np.ndarray, q: np.ndarray, k: int, K: int) -> float:
    _, gt = exact_search(x, q, k)  # numpy reference, not the tuner's faiss ground truth
    _, got = ann.search(q, K)
    hits = sum(len(set(g) & set(t)) for g, t in zip(got, gt, strict=True))
    return hits / gt.size


def test_exact_topk_matches_numpy_reference_across_blocks(data):
    x, q, _ = data
    s_ref, i_ref = exact_search(x, q[:50], 10)
    s, i = exact_topk(x, q[:50], 10, block=1000)  # 12 gallery blocks merged by the result heap
    np.testing.assert_allclose(s, s_ref, rtol=1e-5, atol=1e-5)
    assert (i == i_ref).mean() > 0.99  # equal up to float ties


def test_recall_of_topk_hand_computed():
    exact = np.array([[1, 2], [3, 4]])
    ann = np.array([[2, 9, 1], [7, 3, -1]])
    assert recall_of_topk(ann, exact) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="2 ANN rows for 1 queries"):
        recall_of_topk(ann, exact[:1])


def test_tuner_raises_nprobe_until_the_target_holds(data):
    x, q, fresh = data
    ids = np.arange(N, dtype=np.int64)
    p = AnnParams("ivf", nlist=150, nprobe=1)
    ann = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
    cfg = TuneConfig(target=0.995, k=10, candidates=10, latency_budget_ms=LOOSE_MS, n_queries=600,
                     latency_queries=5, index_types=("ivf",))
    first = _independent_recall(ann, x, fresh, 10, 10)
    assert first < 0.9, f"the starting setting must miss the target for this test to mean anything ({first})"
    tuned, res = tune_ann(x, q, query_source="test", config=cfg, ann=ann)
    assert res.met and res.recall >= 0.995 and res.index_type == "ivf"
    assert res.params["nprobe"] > 1 and tuned.params.nprobe == res.params["nprobe"]
    assert _independent_recall(tuned, x, fresh, 10, 10) >= 0.99  # fresh queries, numpy ground truth
    assert res.query_source == "test" and res.n_tune_queries + res.n_holdout_queries == 600
    assert res.trials and res.tuning_s > 0
    # the nprobe read off the cell ranks is the smallest that works: one less misses the aim on the tune half
    d = res.to_dict()
    assert d["params"]["index_type"] == "ivf" and "message" in d


def test_tuner_raises_hnsw_ef_search(data):
    x, q, fresh = data
    cfg = TuneConfig(target=0.999, k=10, candidates=10, latency_budget_ms=LOOSE_MS, n_queries=400,
                     latency_queries=5, index_types=("hnsw",))
    p = AnnParams("hnsw", hnsw_m=4, ef_construction=16, ef_search=10)  # a deliberately weak graph
    ann = AnnIndex(build_index(x, np.arange(N), p, use_gpu=False), p)
    first = _independent_recall(ann, x, fresh, 10, 10)
    assert first < 0.999
    tuned, res = tune_ann(x, q, config=cfg, ann=ann)
    assert res.met and tuned.params.ef_search > 10
    assert _independent_recall(tuned, x, fresh, 10, 10) >= 0.99


def test_recall_at_K_uses_the_candidate_depth(data):
    """recall@K of the top-10 with K = 64: HNSW's efSearch starts at K, so the first trial already holds."""
    x, q, _ = data
    cfg = TuneConfig(target=0.99, k=10, candidates=64, latency_budget_ms=LOOSE_MS, n_queries=200,
                     latency_queries=3, index_types=("hnsw",))
    tuned, res = tune_ann(x, q, config=cfg)
    assert res.candidates == 64 and res.params["ef_search"] >= 64
    _, gt = exact_search(x, q, 10)
    _, got = tuned.search(q, 64)
    assert recall_of_topk(got, gt) >= 0.99


def test_budget_that_cannot_be_met_fails_clearly(data):
    x, q, _ = data
    # a ceiling at the budget turns recall first off: the budget is the hard limit (tests/indexer/test_tune_recall_first.py
    # covers the ceiling above it)
    cfg = TuneConfig(target=0.995, k=10, candidates=10, latency_budget_ms=1e-6, latency_ceiling_ms=1e-6, n_queries=200,
                     latency_queries=3, index_types=("ivf",), nlist=100)
    with pytest.raises(RecallTargetError) as ei:
        tune_ann(x, q, config=cfg)
    msg = str(ei.value)
    assert "NOT met" in msg and "p50 <= 1e-06 ms" in msg and "To change" in msg and "ivf" in msg
    assert ei.value.result.met is False and ei.value.result.trials
    ann, res = tune_ann(x, q, config=TuneConfig(**{**cfg.__dict__, "strict": False}))
    assert res.met is False and ann is None and "NOT met" in res.message


def test_small_gallery_goes_flat_and_is_exact(data):
    x, q, _ = data
    tuned, res = tune_ann(x[:5000], q[:100], config=TuneConfig(latency_budget_ms=LOOSE_MS, latency_queries=3))
    assert res.index_type == "flat" and res.recall == 1.0 and res.met
    assert res.query_source.startswith("caller")


def test_sample_queries_prefers_queue_then_captions_then_perturbed(data):
    x, _, _ = data
    rng = np.random.default_rng(0)
    queue, caps = rng.standard_normal((50, D)), rng.standard_normal((30, D))
    q, src = sample_queries(x, queue=queue, captions=caps, n=20)
    assert src.startswith("ncl-queue") and q.shape == (20, D)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, rtol=1e-5)
    q, src = sample_queries(x, queue=np.zeros((0, D)), captions=caps)
    assert src.startswith("manifest-captions") and q.shape == (30, D)
    q, src = sample_queries(x, n=40)
    assert src.startswith("perturbed-gallery") and q.shape == (40, D)
    with pytest.raises(ValueError, match="d=7"):
        sample_queries(x, captions=np.ones((3, 7)))


def test_coverage_of_an_exact_scorer_equals_recall_and_picks_smallest_K(data):
    x, q, _ = data
    ids = np.arange(N, dtype=np.int64)
    p = AnnParams("ivf", nlist=150, nprobe=10)
    ann = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
    ks = (10, 20, 50)
    cov = coverage_at_k(ann, q[:100], cosine_scorer(x), ids, ks, block=5000, target=0.5)
    _, gt = exact_search(x, q[:100], 10)
    _, got = ann.search(q[:100], 50)
    for k in ks:
        assert cov.coverage[k] == pytest.approx(recall_of_topk(got[:, :k], gt))
    expected = next((k for k in ks if cov.coverage[k] >= 0.5), None)
    assert cov.chosen_K == choose_candidates(cov, 0.5) == expected
    assert choose_candidates(cov, cov.coverage[20]) in (10, 20)  # the smallest K that reaches it
    assert choose_candidates(cov, cov.coverage[50] + 1e-9) is None or cov.coverage[50] < 1.0

    # a scorer that ranks differently from the ANN (cosine + a per-video bias): coverage grows with K
    bias = np.random.default_rng(1).normal(0, 0.3, N).astype(np.float32)
    flat = AnnIndex(build_index(x, ids, AnnParams("flat"), use_gpu=False), AnnParams("flat"))

    def biased(qb: np.ndarray, gid: np.ndarray) -> np.ndarray:
        return qb @ x[gid].T + bias[gid]

    cov = coverage_at_k(flat, q[:60], biased, ids, (10, 100, 1000), block=4096)
    scores = q[:60] @ x.T + bias
    truth = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    _, got = exact_search(x, q[:60], 1000)
    for k in (10, 100, 1000):
        assert cov.coverage[k] == pytest.approx(recall_of_topk(got[:, :k], truth))
    assert cov.coverage[10] < cov.coverage[1000]
    assert choose_candidates(cov, 2.0) is None


@pytest.mark.parametrize("params", [
    AnnParams("ivf", nlist=64, nprobe=8, coarse="hnsw"),
    AnnParams("ivfpq", nlist=64, nprobe=8, pq_m=8, fastscan=True, rescore=8, coarse="flat"),
])
def test_new_index_variants_round_trip_and_match_exact(tmp_path, data, params):
    x, q, _ = data
    ids = np.arange(N, dtype=np.int64)
    ann = AnnIndex(build_index(x, ids, params, use_gpu=False), params, x)
    ann.save(tmp_path / "ann.faiss")
    found = AnnIndex.load(tmp_path / "ann.faiss", vectors=x, use_gpu=False).params  # recovered from the file
    for key in ("index_type", "nlist", "nprobe", "coarse", "fastscan"):
        assert getattr(found, key) == getattr(params, key), key
    back = AnnIndex.load(tmp_path / "ann.faiss", params, vectors=x, use_gpu=False)  # + query-time knobs (rescore)
    _, gt = exact_search(x, q[:100], 10)
    _, got = back.search(q[:100], 10)
    np.testing.assert_array_equal(got, ann.search(q[:100], 10)[1])
    assert recall_of_topk(got, gt) > 0.5  # approximate, but clearly searching the right neighbourhood


def test_hnsw_bisects_efsearch_when_a_doubling_breaks_the_budget(data, monkeypatch):
    """The search strategy under a latency that grows with efSearch: the measured p50 is replaced by a known
    function of efSearch (0.01 ms per unit; a budget of 3 ms admits efSearch <= 300), so the test is not timed.
    After efSearch 160 -> 320 breaks the budget the tuner tries between them, not stopping at 160."""
    import gare_build.tuning.recall as recall_mod

    monkeypatch.setattr(recall_mod, "p50_ms", lambda a, q, K, n, gpu: 0.01 * a.params.ef_search)
    x, q, _ = data
    cfg = TuneConfig(target=1.0, k=10, candidates=10, latency_budget_ms=3.0, latency_ceiling_ms=3.0, n_queries=200,
                     latency_queries=1, index_types=("hnsw",), strict=False)  # recall first off: the budget binds
    p = AnnParams("hnsw", hnsw_m=4, ef_construction=16, ef_search=10)  # a weak graph: recall 1.0 needs a deep search
    ann = AnnIndex(build_index(x, np.arange(N), p, use_gpu=False), p)
    _, res = tune_ann(x, q, config=cfg, ann=ann)
    mine = [t for t in res.trials if t.params["hnsw_m"] == 4]  # the given graph's trials (then the ladder's M=32 rung)
    efs = [t.params["ef_search"] for t in mine]
    assert efs[:6] == [10, 20, 40, 80, 160, 320], efs  # doubling until the budget breaks (the premise)
    assert all(t.recall < 1.0 for t in mine), "the weak graph reached the aim: no bisection to test"
    # bisection between 160 (within budget) and 320 (over it): 240, 280, 300, then the interval is small enough
    assert efs[6:] == [240, 280, 300], efs
    assert [t.params["hnsw_m"] for t in res.trials[len(mine):]] == [32] * (len(res.trials) - len(mine))
