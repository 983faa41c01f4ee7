"""NCL's training-time adjustment (gare_train.ncl_logits): the paper's per-batch biases against the float64 Fig. 4
reference, the normalisation they buy (NCL Eq. 13), and gradients that reach the scores only."""

from __future__ import annotations

import pytest
import torch

from gare.sinkhorn import sinkhorn_biases_naive
from gare_train.ncl_logits import batch_adjusted, queue_adjusted


def _scores(b: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, b, generator=g, dtype=torch.float32) * 0.2 + 0.3 * torch.eye(b)  # cosine-like, diagonal ahead


def test_batch_adjusted_adds_the_fig4_biases_of_the_batch_scores():
    s = _scores()
    gamma = 0.05
    a, b = sinkhorn_biases_naive(s.double(), gamma, 4)
    want = s.double() + a[:, None] + b[None, :]
    torch.testing.assert_close(batch_adjusted(s, gamma, 4).double(), want, rtol=0, atol=1e-5)
    # a hand-sized case: two texts, two videos, the second video preferred by both texts
    s2 = torch.tensor([[0.1, 0.5], [0.2, 0.6]])
    adj = batch_adjusted(s2, 0.1, 4)
    a2, b2 = sinkhorn_biases_naive(s2.double(), 0.1, 4)
    assert b2[1] < b2[0]  # the popular video is pushed down
    torch.testing.assert_close(adj.double(), s2.double() + a2[:, None] + b2[None, :], rtol=0, atol=1e-5)


def test_batch_adjusted_normalises_retrieval_probabilities():
    """NCL Eq. 13: with the adjusted scores, every video's t2v probabilities summed over the batch's texts -> 1."""
    s = _scores(8, seed=1)
    gamma = 0.05
    before = torch.softmax(s.double() / gamma, dim=1).sum(0)
    after = torch.softmax(batch_adjusted(s, gamma, 50).double() / gamma, dim=1).sum(0)
    assert (after - 1).abs().max() < 1e-3 < (before - 1).abs().max()


def test_gradients_reach_the_scores_only():
    s = _scores().requires_grad_(True)
    w = torch.randn(6, 6)
    (batch_adjusted(s, 0.05, 4) * w).sum().backward()
    torch.testing.assert_close(s.grad, w)  # the biases are constants of the step


def test_queue_mode_adds_video_biases_of_the_queue_and_batch_cosines():
    g = torch.Generator().manual_seed(2)
    t, v, q = (torch.randn(n, 8, generator=g) for n in (4, 4, 10))
    s = torch.randn(4, 4, generator=g)
    qn = torch.nn.functional.normalize(torch.cat([q, t]), dim=-1)
    vn = torch.nn.functional.normalize(v, dim=-1)
    _, b = sinkhorn_biases_naive((qn @ vn.T).double(), 0.07, 4)
    torch.testing.assert_close(queue_adjusted(s, q, t, v, 0.07, 4).double(), s.double() + b[None, :], rtol=0, atol=1e-5)


def test_bad_gamma_is_refused():
    with pytest.raises(ValueError, match="gamma must be > 0"):
        batch_adjusted(_scores(), 0.0, 4)
