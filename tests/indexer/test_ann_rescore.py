"""The exact re-scoring of an IVF-PQ shortlist (``gare_index.rescore.rescore`` over ``VectorStore.scores``, as ``AnnIndex`` calls it) against a naive
reference: every candidate's vector looked up one by one, scored, and fully sorted (stable: ties keep the
shortlist's order), with exact ties, missing ids, -1 padding, added rows and ids that are not row numbers."""

from __future__ import annotations

import numpy as np
import pytest

from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams
from gare_index.rescore import rank_keys


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _naive(vecs: dict[int, np.ndarray], q: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    out_s = np.full((len(q), k), -np.inf, np.float32)
    out_i = np.full((len(q), k), -1, np.int64)
    for i in range(len(q)):
        sc = np.array([np.float32(vecs[c] @ q[i]) if c in vecs else -np.inf for c in cand[i]], np.float32)
        order = np.argsort(-sc, kind="stable")[:k]
        for j, o in enumerate(order):
            if np.isfinite(sc[o]):
                out_s[i, j], out_i[i, j] = sc[o], cand[i, o]
    return out_s, out_i


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    n, d = 3000, 32
    x = _unit(rng.standard_normal((n, d)))
    x[10] = x[11] = x[12] = x[500]  # exact duplicates: tied scores
    ids = np.arange(n, dtype=np.int64) * 7 + 3  # ids are not row numbers
    p = AnnParams("ivfpq", nlist=16, nprobe=16, pq_m=8, fastscan=True, rescore=4)
    ann = AnnIndex(build_index(x, ids, p), p, x, vector_ids=ids)
    return rng, x, ids, ann


def test_rescore_equals_a_naive_stable_sort(setup):
    rng, x, ids, ann = setup
    vecs = {int(i): x[r] for r, i in enumerate(ids)}
    extra = _unit(rng.standard_normal((5, x.shape[1])))
    extra_ids = np.array([10**6 + i for i in range(4)] + [int(ids[42])], np.int64)  # the last replaces a base row
    ann.add(extra, extra_ids)
    vecs.update({int(i): v for i, v in zip(extra_ids, extra, strict=True)})
    q = _unit(rng.standard_normal((40, x.shape[1])))
    q[3] = x[500]  # its top 4 are the 4 identical vectors
    for kk, k in ((64, 16), (16, 16), (8, 16), (300, 256)):
        cand = rng.choice(np.concatenate([ids, extra_ids, [5, 10**9]]), size=(len(q), kk))  # 5, 10**9: unknown
        cand[:, -1] = -1
        cand[3, :4] = ids[[12, 10, 500, 11]]  # ties, listed out of row order
        got_s, got_i = ann._rescore(q, cand, k)
        want_s, want_i = _naive(vecs, q, cand, k)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_allclose(got_s, want_s, rtol=0, atol=1e-6)
    assert list(got_i[3, :4]) == list(ids[[12, 10, 500, 11]])  # ties kept in shortlist order


def test_rank_keys_order_scores_then_columns():
    sc = np.array([[0.5, -0.0, 0.0, -np.inf, 0.5, -1.25, 3e-39, -3e-39, np.inf]], np.float32)
    order = np.argsort(rank_keys(sc)[0])
    want = np.array(sorted(range(sc.shape[1]), key=lambda j: (-float(sc[0, j]), j)))
    np.testing.assert_array_equal(order, want)
