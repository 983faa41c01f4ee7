"""gare.sinkhorn: the log-domain chunked NCL biases against the float64 formula, overflow safety,
shift invariance, NCL eq. 13 (uniform summed retrieval probabilities) and eq. 5 (normalisation error)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gare.sinkhorn import (
    normalization_error,
    sinkhorn_biases,
    sinkhorn_biases_naive,
    summed_retrieval_probabilities,
)


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1)


def _clustered(n: int, d: int, n_clusters: int, spread: float, seed: int) -> torch.Tensor:
    """Unit vectors near a few centres: realistic, high cosines (up to ~0.95)."""
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(n_clusters, d, generator=g), dim=1)
    assign = torch.randint(0, n_clusters, (n,), generator=g)
    return F.normalize(centres[assign] + spread * torch.randn(n, d, generator=g) / math.sqrt(d), dim=1)


@pytest.mark.parametrize("n_q,n_g", [(7, 13), (40, 25), (64, 300)])
@pytest.mark.parametrize("gamma", [1.0, 0.05, 0.01])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_log_domain_matches_naive(n_q, n_g, gamma, chunk):
    q, g = _unit(n_q, 16, 0), _unit(n_g, 16, 1)
    a_ref, b_ref = sinkhorn_biases_naive(q.double() @ g.double().T, gamma)
    a, b = sinkhorn_biases(q, g, gamma, chunk=chunk)
    assert a.shape == (n_q,) and b.shape == (n_g,)
    assert a.dtype == b.dtype == torch.float32 and a.device.type == b.device.type == "cpu"
    torch.testing.assert_close(a.double(), a_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(b.double(), b_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("n_iters", [1, 2, 10])
def test_matches_naive_for_other_iteration_counts(n_iters):
    q, g = _unit(30, 8, 2), _unit(50, 8, 3)
    a_ref, b_ref = sinkhorn_biases_naive(q.double() @ g.double().T, 0.1, n_iters)
    a, b = sinkhorn_biases(q, g, 0.1, n_iters, chunk=17)
    torch.testing.assert_close(a.double(), a_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(b.double(), b_ref, atol=1e-4, rtol=0)


def test_numpy_inputs_and_block_cap():
    q, g = _unit(20, 8, 4), _unit(33, 8, 5)
    a_ref, b_ref = sinkhorn_biases(q, g, 0.05, chunk=33)
    # numpy gallery (e.g. a memmap) and a block cap that forces 2-column chunks
    a, b = sinkhorn_biases(q.numpy(), g.numpy(), 0.05, block_elems=40)
    torch.testing.assert_close(a, a_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, b_ref, atol=1e-5, rtol=0)


def test_hand_computed_2x2():
    # M = exp(S / gamma) = [[1, 2], [3, 4]], one iteration, worked by hand:
    # beta0 = 1 / colsum = (1/4, 1/6); alpha = 1 / (M beta0) = (12/7, 12/17);
    # beta = 1 / (alpha^T M) = (119/456, 119/744); normalised: alpha = (17/24, 7/24), beta = (0.62, 0.38).
    gamma = 0.5
    S = gamma * torch.log(torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
    a, b = sinkhorn_biases_naive(S, gamma, n_iters=1)
    a_hand = gamma * torch.log(torch.tensor([17 / 24, 7 / 24], dtype=torch.float64))
    b_hand = gamma * torch.log(torch.tensor([0.62, 0.38], dtype=torch.float64))
    torch.testing.assert_close(a, a_hand)
    torch.testing.assert_close(b, b_hand)
    # the chunked version on embeddings whose inner products are S: queries = I, gallery = S^T
    a2, b2 = sinkhorn_biases(torch.eye(2), S.T.float(), gamma, n_iters=1, chunk=1)
    torch.testing.assert_close(a2.double(), a_hand, atol=1e-6, rtol=0)
    torch.testing.assert_close(b2.double(), b_hand, atol=1e-6, rtol=0)


def test_uniform_similarities_give_uniform_biases():
    q = torch.tensor([[1.0, 0.0]] * 3)
    g = torch.tensor([[1.0, 0.0]] * 5)
    a, b = sinkhorn_biases(q, g, 0.01)
    torch.testing.assert_close(a, torch.full((3,), 0.01 * math.log(1 / 3)))
    torch.testing.assert_close(b, torch.full((5,), 0.01 * math.log(1 / 5)))


def test_gamma_001_realistic_cosines_no_overflow():
    q = _clustered(64, 32, 4, 0.3, seed=6)
    g = _clustered(200, 32, 4, 0.3, seed=6)  # same centres: high text-video cosines
    S = q @ g.T
    assert S.max() > 0.9  # exp(0.9 / 0.01) = exp(90) > float32 max (~exp(88.7))
    assert not torch.isfinite(torch.exp(S / 0.01)).all()  # the naive float32 formula overflows
    a, b = sinkhorn_biases(q, g, 0.01, chunk=37)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    a_ref, b_ref = sinkhorn_biases_naive(S.double(), 0.01)  # float64 still copes with exp(100)
    torch.testing.assert_close(a.double(), a_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(b.double(), b_ref, atol=1e-4, rtol=0)
    # the biases exponentiate to a proper distribution
    assert abs(torch.exp(b.double() / 0.01).sum().item() - 1) < 1e-4


@settings(max_examples=25, deadline=None)
@given(
    shift=st.floats(min_value=-3.0, max_value=3.0, allow_nan=False),
    gamma=st.sampled_from([1.0, 0.1, 0.02]),
    seed=st.integers(0, 10_000),
)
def test_biases_invariant_to_constant_shift(shift, gamma, seed):
    q, g = _unit(9, 6, seed), _unit(14, 6, seed + 1)
    a0, b0 = sinkhorn_biases(q, g, gamma, chunk=5)
    # S + shift = [q, 1] . [g, shift]
    q2 = torch.cat([q, torch.ones(9, 1)], 1)
    g2 = torch.cat([g, torch.full((14, 1), shift)], 1)
    a1, b1 = sinkhorn_biases(q2, g2, gamma, chunk=5)
    torch.testing.assert_close(a1, a0, atol=1e-4, rtol=0)
    torch.testing.assert_close(b1, b0, atol=1e-4, rtol=0)
    S = (q @ g.T).double()
    a_ref, b_ref = sinkhorn_biases_naive(S + shift, gamma)
    torch.testing.assert_close(b1.double(), b_ref, atol=1e-4, rtol=0)


def _probs_ref(q, g, gamma, b=None):
    L = (q.double() @ g.double().T + (0 if b is None else b.double()[None, :])) / gamma
    return torch.softmax(L, dim=1).sum(0)


@pytest.mark.parametrize("n_q,n_g", [(50, 50), (120, 40), (30, 90)])
def test_summed_probabilities_definition(n_q, n_g):
    q, g = _unit(n_q, 8, 7), _unit(n_g, 8, 8)
    b = 0.01 * torch.randn(n_g, generator=torch.Generator().manual_seed(0))
    raw = summed_retrieval_probabilities(q, g, 0.05, b, chunk=13, rescale=False)
    torch.testing.assert_close(raw, _probs_ref(q, g, 0.05, b), atol=1e-5, rtol=1e-5)
    assert abs(raw.sum().item() - n_q) < 1e-4  # every query's probabilities sum to 1
    r = summed_retrieval_probabilities(q, g, 0.05, b, chunk=13)
    torch.testing.assert_close(r, raw * n_g / n_q)
    assert abs(r.mean().item() - 1) < 1e-6  # the N/Q rescaling makes the mean exactly 1
    err = normalization_error(q, g, 0.05, b, chunk=13)
    assert err == pytest.approx(torch.mean(torch.abs(1 - r)).item())


@pytest.mark.parametrize("n_q,n_g", [(200, 200), (400, 150), (150, 400)])
def test_biases_equalise_summed_probabilities(n_q, n_g):
    # queue queries and gallery around shared centres, unevenly populated: some videos over-represented
    q = _clustered(n_q, 16, 8, 0.6, seed=9)
    g = _clustered(n_g, 16, 8, 0.6, seed=10)
    gamma = 0.05
    r0 = summed_retrieval_probabilities(q, g, gamma)
    err0 = normalization_error(q, g, gamma)
    _, b = sinkhorn_biases(q, g, gamma, chunk=64)
    r4 = summed_retrieval_probabilities(q, g, gamma, b)
    err4 = normalization_error(q, g, gamma, b)
    assert err0 > 0.2
    assert err4 < err0 / 3
    assert r4.std() < r0.std() / 3
    # run to convergence: every video's (N/Q-scaled) summed probability is 1 (NCL eq. 13)
    _, b50 = sinkhorn_biases(q, g, gamma, n_iters=50, chunk=64)
    r50 = summed_retrieval_probabilities(q, g, gamma, b50)
    assert r50.std() < 1e-3 and (r50 - 1).abs().max() < 1e-2
    assert normalization_error(q, g, gamma, b50) < 1e-3
    # square case (Q = N): the raw (unscaled) sums are the paper's, and they are ~1
    if n_q == n_g:
        raw = summed_retrieval_probabilities(q, g, gamma, b50, rescale=False)
        assert (raw - 1).abs().max() < 1e-2


def test_input_validation():
    q, g = _unit(3, 4, 0), _unit(5, 4, 1)
    with pytest.raises(ValueError):
        sinkhorn_biases(q, g, 0.0)
    with pytest.raises(ValueError):
        sinkhorn_biases(q, _unit(5, 3, 1), 0.1)
    with pytest.raises(ValueError):
        sinkhorn_biases(q, g, 0.1, chunk=0)
    with pytest.raises(ValueError):
        sinkhorn_biases(q[:0], g, 0.1)
    with pytest.raises(ValueError):
        summed_retrieval_probabilities(q, g, 0.1, torch.zeros(4))
    a, b = sinkhorn_biases(q, g[:0], 0.1)
    assert a.shape == (3,) and b.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    q, g = _unit(300, 32, 0), _unit(1000, 32, 1)
    a, b = sinkhorn_biases(q, g, 0.01, chunk=256)
    a2, b2 = sinkhorn_biases(q.cuda(), g, 0.01, chunk=256)  # gallery chunks moved to the queries' device
    assert a2.device.type == "cpu"
    torch.testing.assert_close(a2, a, atol=1e-4, rtol=0)
    torch.testing.assert_close(b2, b, atol=1e-4, rtol=0)
    e = normalization_error(q.cuda(), g.cuda(), 0.01, b.cuda())
    assert e == pytest.approx(normalization_error(q, g, 0.01, b), abs=1e-4)


def test_naive_agrees_with_fig4_pseudocode_shape():
    S = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (4, 6)))
    a, b = sinkhorn_biases_naive(S, 0.2)
    assert a.dtype == torch.float64 and a.shape == (4,) and b.shape == (6,)
    # alpha and beta were normalised to sum 1
    assert abs(torch.exp(a / 0.2).sum().item() - 1) < 1e-12
    assert abs(torch.exp(b / 0.2).sum().item() - 1) < 1e-12


def test_bias_fold_makes_inner_product_equal_cos_plus_bias():
    from gare.sinkhorn import fold_biases, fold_query

    rng = np.random.default_rng(0)
    units = rng.normal(size=(50, 8)).astype(np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    q = rng.normal(size=(4, 8)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    b = rng.normal(scale=0.05, size=50).astype(np.float32)
    for c in (1.0, 0.1, 10.0):
        ip = fold_query(q, c) @ fold_biases(units, b, c).T
        np.testing.assert_allclose(ip, q @ units.T + b[None, :], atol=1e-6)
    with pytest.raises(ValueError):
        fold_biases(units, b[:3])
