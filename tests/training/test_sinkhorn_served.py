"""gare.sinkhorn, biases of the served score (issue 17): the dense form against NCL Fig. 4 in float64,
the sparse forms against the same formula on the matrix they stand for, hand-computed values, stage-1
candidates against a full sort, and the normalisation error of an explicit score matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gare.sinkhorn import (
    normalization_error,
    served_score_matrix,
    sinkhorn_biases,
    sinkhorn_biases_dense,
    sinkhorn_biases_naive,
)
from gare.sinkhorn_sparse import (
    normalization_error_scores,
    score_candidates,
    sinkhorn_biases_sparse,
    stage1_candidates,
)


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1)


def _served(q: torch.Tensor, g: torch.Tensor, seed: int = 9) -> torch.Tensor:
    """A stand-in for psi: the cosine plus a pair-specific increment (|.| ~ 0.1, like psi's deviation)."""
    gen = torch.Generator().manual_seed(seed)
    return q @ g.T + 0.1 * torch.randn(q.shape[0], g.shape[0], generator=gen)


def _matrix_scorer(S: torch.Tensor):
    return lambda qi, rows: S[torch.as_tensor(qi)][:, torch.as_tensor(rows)]


def _pair_scorer(S: torch.Tensor):
    return lambda qi, rows: S[torch.as_tensor(qi), torch.as_tensor(rows)]


def _hybrid(S_served, S_dual, rows, fill_value=None):
    """The matrix a sparse form stands for: served scores on the candidates, S_dual (or -inf) elsewhere."""
    H = S_dual.clone() if fill_value is None else torch.full_like(S_served, fill_value)
    for i in range(rows.shape[0]):
        r = rows[i][rows[i] >= 0]
        H[i, r] = S_served[i, r]
    return H


@pytest.mark.parametrize("gamma", [0.5, 0.05, 0.01])
@pytest.mark.parametrize("chunk", [3, 1000])
def test_dense_served_matches_fig4(gamma, chunk):
    q, g = _unit(30, 16, 0), _unit(45, 16, 1)
    S = _served(q, g)
    Sm = served_score_matrix(_matrix_scorer(S), 30, 45, chunk=chunk)
    torch.testing.assert_close(Sm, S)
    a_ref, b_ref = sinkhorn_biases_naive(S.double(), gamma)  # float64 exp(S / 0.01) fits: |S| < 1.5
    a, b = sinkhorn_biases_dense(Sm, gamma, chunk=chunk)
    torch.testing.assert_close(b.double(), b_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(a.double(), a_ref, atol=1e-4, rtol=0)


def test_dense_on_cosines_is_the_dual_tower_biases():
    q, g = _unit(25, 8, 2), _unit(40, 8, 3)
    _, b_dual = sinkhorn_biases(q, g, 0.05)
    _, b = sinkhorn_biases_dense(q @ g.T, 0.05, chunk=7)
    torch.testing.assert_close(b, b_dual, atol=1e-5, rtol=0)


def test_dense_refuses_oversized_matrix():
    with pytest.raises(ValueError, match="sparse"):
        served_score_matrix(lambda qi, rows: None, 1000, 1000, max_elems=10_000)


def test_sparse_hand_computed_2x2():
    # present entries M = exp(S / gamma) = [[1, -], [3, 4]] (entry (0, 1) absent), one iteration by hand:
    # beta0 = 1 / colsum = (1/4, 1/4); alpha = 1 / (M beta0) = (4, 4/7); beta = 1 / (alpha^T M) = (7/40, 7/16);
    # normalised: alpha = (7/8, 1/8), beta = (2/7, 5/7).
    gamma = 0.5
    rows = torch.tensor([[0, -1], [0, 1]])
    scores = gamma * torch.log(torch.tensor([[1.0, 1.0], [3.0, 4.0]], dtype=torch.float64))
    scores[0, 1] = math.nan  # no candidate: its score is never read
    a, b, info = sinkhorn_biases_sparse(rows, scores, 2, gamma, n_iters=1, fill="none")
    torch.testing.assert_close(a.double(), gamma * torch.log(torch.tensor([7 / 8, 1 / 8], dtype=torch.float64)),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(b.double(), gamma * torch.log(torch.tensor([2 / 7, 5 / 7], dtype=torch.float64)),
                               atol=1e-6, rtol=0)
    assert info == {"fill": "none", "n_entries": 3, "n_queries": 2, "k": 2, "n_uncovered": 0}


@pytest.mark.parametrize("fill", ["dual", "none"])
@pytest.mark.parametrize("k,chunk", [(5, 7), (12, 1000), (40, 3)])
def test_sparse_matches_fig4_on_the_matrix_it_stands_for(fill, k, chunk):
    q, g = _unit(60, 16, 4), _unit(40, 16, 5)
    S = _served(q, g)
    cos, rows = stage1_candidates(q, g, k, chunk=chunk)
    sc = score_candidates(_pair_scorer(S), rows, chunk=17)
    a, b, info = sinkhorn_biases_sparse(rows, sc, 40, 0.05, fill=fill, queries=q, gallery=g, chunk=chunk)
    H = _hybrid(S, q @ g.T, rows, None if fill == "dual" else -math.inf)
    if info["n_uncovered"]:
        pytest.skip("an uncovered column: tested separately")
    a_ref, b_ref = sinkhorn_biases_naive(H.double(), 0.05)
    torch.testing.assert_close(b.double(), b_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(a.double(), a_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fill", ["dual", "none"])
def test_sparse_with_every_row_a_candidate_is_the_dense_form(fill):
    q, g = _unit(50, 16, 6), _unit(30, 16, 7)
    S = _served(q, g)
    _, rows = stage1_candidates(q, g, 30)
    sc = score_candidates(_pair_scorer(S), rows)
    _, b, info = sinkhorn_biases_sparse(rows, sc, 30, 0.02, fill=fill, queries=q, gallery=g)
    _, b_dense = sinkhorn_biases_dense(S, 0.02)
    assert info["n_uncovered"] == 0 and info["n_entries"] == 50 * 30
    torch.testing.assert_close(b, b_dense, atol=1e-5, rtol=0)


def test_sparse_none_uncovered_video_gets_the_largest_bias():
    q, g = _unit(20, 8, 8), _unit(10, 8, 9)
    S = _served(q, g)
    # video 3 is never a candidate
    rows = torch.stack([torch.roll(torch.tensor([j for j in range(10) if j != 3]), i)[:4] for i in range(20)])
    sc = score_candidates(_pair_scorer(S), rows)
    _, b, info = sinkhorn_biases_sparse(rows, sc, 10, 0.05, fill="none")
    assert info["n_uncovered"] == 1
    assert torch.isfinite(b).all()
    others = torch.cat([b[:3], b[4:]])
    assert float(b[3]) == pytest.approx(float(others.max()))
    # the covered columns are Fig. 4 on the matrix without column 3 (the normalising constant aside)
    H = _hybrid(S, S, rows, -math.inf)
    _, b_ref = sinkhorn_biases_naive(torch.cat([H[:, :3], H[:, 4:]], 1).double(), 0.05)
    d = others.double() - b_ref
    torch.testing.assert_close(d, torch.full_like(d, float(d[0])), atol=1e-4, rtol=0)


def test_sparse_input_validation():
    rows = torch.tensor([[0, 1], [1, 1]])
    with pytest.raises(ValueError, match="twice"):
        sinkhorn_biases_sparse(rows, torch.zeros(2, 2), 3, 0.1, fill="none")
    with pytest.raises(ValueError, match="fill"):
        sinkhorn_biases_sparse(torch.tensor([[0]]), torch.zeros(1, 1), 3, 0.1, fill="cos")
    with pytest.raises(ValueError, match=r"\[-1, 3\)"):
        sinkhorn_biases_sparse(torch.tensor([[5]]), torch.zeros(1, 1), 3, 0.1, fill="none")
    with pytest.raises(ValueError, match="nan"):
        sinkhorn_biases_sparse(torch.tensor([[0]]), torch.tensor([[math.nan]]), 3, 0.1, fill="none")
    with pytest.raises(ValueError, match="queries"):
        sinkhorn_biases_sparse(torch.tensor([[0]]), torch.zeros(1, 1), 3, 0.1, fill="dual")


@pytest.mark.parametrize("k,chunk", [(1, 4), (7, 5), (50, 1000)])
def test_stage1_candidates_is_a_full_sort(k, chunk):
    q, g = _unit(13, 8, 10), _unit(37, 8, 11)
    s, r = stage1_candidates(q, g, k, chunk=chunk)
    full = (q @ g.T).sort(dim=1, descending=True)
    kk = min(k, 37)
    assert s.shape == r.shape == (13, kk)
    torch.testing.assert_close(s, full.values[:, :kk])
    torch.testing.assert_close(torch.gather(q @ g.T, 1, r), full.values[:, :kk])


def test_score_candidates_gathers_and_marks_missing():
    S = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rows = torch.tensor([[3, 0], [-1, 2], [1, -1]])
    out = score_candidates(_pair_scorer(S), rows, chunk=2)
    assert out[0].tolist() == [3.0, 0.0] and out[1, 1] == 6.0 and out[2, 0] == 9.0
    assert math.isnan(out[1, 0]) and math.isnan(out[2, 1])


def test_normalization_error_scores_matches_embedding_form():
    q, g = _unit(30, 8, 12), _unit(20, 8, 13)
    _, b = sinkhorn_biases(q, g, 0.05)
    assert normalization_error_scores(q @ g.T, 0.05) == pytest.approx(normalization_error(q, g, 0.05), abs=1e-6)
    assert normalization_error_scores(q @ g.T, 0.05, b) == pytest.approx(normalization_error(q, g, 0.05, b), abs=1e-6)


def test_served_biases_normalise_the_served_score_not_the_cosine():
    # NCL eq. 13 on the served matrix: biases fitted to S normalise S (queue error ~0); biases fitted to the
    # cosine do not normalise S as well.
    q, g = _unit(400, 16, 14), _unit(50, 16, 15)
    S = _served(q, g, seed=3)
    _, b_served = sinkhorn_biases_dense(S, 0.05, n_iters=20)
    _, b_dual = sinkhorn_biases(q, g, 0.05, n_iters=20)
    e_none = normalization_error_scores(S, 0.05)
    e_served = normalization_error_scores(S, 0.05, b_served)
    e_dual = normalization_error_scores(S, 0.05, b_dual)
    assert e_served < 0.02
    assert e_served < e_dual and e_served < e_none


def test_numpy_inputs_accepted():
    q, g = _unit(20, 8, 16), _unit(15, 8, 17)
    S = _served(q, g)
    _, rows = stage1_candidates(q.numpy(), g.numpy(), 5)
    sc = score_candidates(_pair_scorer(S), rows.numpy())
    _, b1, _ = sinkhorn_biases_sparse(rows.numpy(), sc.numpy(), 15, 0.05, fill="dual", queries=q.numpy(),
                                      gallery=g.numpy())
    _, b2, _ = sinkhorn_biases_sparse(rows, sc, 15, 0.05, fill="dual", queries=q, gallery=g)
    torch.testing.assert_close(b1, b2)
    assert np.isfinite(b1.numpy()).all()


def test_pair_scorer_from_matrix_scores_each_pair():
    S = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    calls = []

    def matrix(qi, rows):
        calls.append(len(qi))
        return S[torch.as_tensor(qi)][:, torch.as_tensor(rows)]

    from gare.sinkhorn_sparse import pair_scorer_from_matrix

    qi, rows = np.array([2, 0, 2, 3, 0]), np.array([4, 1, 0, 3, 1])
    out = pair_scorer_from_matrix(matrix)(qi, rows)
    assert out.tolist() == [S[2, 4], S[0, 1], S[2, 0], S[3, 3], S[0, 1]]
    assert calls == [1, 1, 1]  # one call per distinct query


def _encoded(model, n_videos: int, seed: int):
    from gare.encoded_set import EncodedSet

    g = torch.Generator().manual_seed(seed)
    f, d = model.cfg.max_frames, model.cfg.embed_dim
    frames = torch.randn(n_videos, f, d, generator=g)
    mask = torch.ones(n_videos, f, dtype=torch.long)
    mask[0, f // 2:] = 0  # one clip with padded frames
    vbar = (frames * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return EncodedSet(t=torch.randn(n_videos, d, generator=g), frames=frames, mask=mask, vbar=vbar,
                      caption_clip=np.arange(n_videos))


def test_eval_served_biases_are_fig4_on_the_psi_matrix(tiny_model):
    from gare_train.evaluate import served_biases_encoded

    enc = _encoded(tiny_model, 12, 20)
    queue = torch.randn(40, tiny_model.cfg.embed_dim, generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        S = tiny_model.score(queue, enc.frames, enc.mask, vbar=enc.vbar)
    _, b_ref = sinkhorn_biases_naive(S.double(), 0.05)
    b, info = served_biases_encoded(tiny_model, enc, queue, 0.05)
    assert info["form"] == "dense" and info["pairs"] == 40 * 12
    torch.testing.assert_close(b.double(), b_ref, atol=1e-4, rtol=0)
    # the sparse form with every video a candidate is the same matrix
    b_sp, info_sp = served_biases_encoded(tiny_model, enc, queue, 0.05, dense_max_pairs=0, k=12)
    assert info_sp["form"] == "sparse" and info_sp["pairs"] == 40 * 12
    torch.testing.assert_close(b_sp.double(), b_ref, atol=1e-4, rtol=0)
    # and with fewer candidates it is the hybrid matrix (psi on the top 4 by cosine, the cosine elsewhere)
    qn, vn = F.normalize(queue, dim=-1), F.normalize(enc.vbar, dim=-1)
    _, rows = stage1_candidates(qn, vn, 4)
    _, b_h = sinkhorn_biases_naive(_hybrid(S, qn @ vn.T, rows).double(), 0.05)
    b_4, _ = served_biases_encoded(tiny_model, enc, queue, 0.05, dense_max_pairs=0, k=4)
    torch.testing.assert_close(b_4.double(), b_h, atol=1e-4, rtol=0)


def test_eval_reports_three_psi_rows_with_their_normalisation_errors(tiny_model):
    from gare_train.evaluate import evaluate_encoded

    enc = _encoded(tiny_model, 10, 22)
    queue = torch.randn(30, tiny_model.cfg.embed_dim, generator=torch.Generator().manual_seed(23))
    res = evaluate_encoded(tiny_model, enc, queue)
    assert {"+ psi", "+ psi + NCL(dual)", "+ psi + NCL(served)"} <= set(res["rows"])
    ncl = res["ncl"]
    gamma = ncl["gamma"]
    with torch.no_grad():
        psi = tiny_model.score(enc.t, enc.frames, enc.mask, vbar=enc.vbar)
    assert ncl["norm_err_test_psi"] == pytest.approx(normalization_error_scores(psi, gamma), abs=1e-6)
    assert ncl["served"]["form"] == "dense"
    for key in ("norm_err_test_psi_dual", "norm_err_test_psi_served"):
        assert 0.0 <= ncl[key] < 10
