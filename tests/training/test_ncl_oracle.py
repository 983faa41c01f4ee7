"""Issue 28, must-have 1: do NCL's Sinkhorn biases move the right videos the right way? Hand-checkable galleries
whose popularity is known by construction, ranked with the biases fitted to the queries themselves (the
oracle bank), as `bench/ncl_oracle.py` does on the corpora.

* a hub: one video scores higher than the true video for every caption (popularity N by construction). The
  oracle biases push the hub down and every other video up, R@1 goes from 1/N to N/N, and the summed
  retrieval probabilities become 1 (NCL eq. 13).
* an unpopular video (no caption prefers it): its bias goes up, the others' down.
* no popularity at all (every video's summed probability is 1 by construction, a doubly stochastic score
  matrix): the biases are all equal and no ranking changes.
* near-duplicates the score cannot tell apart (what corpus 2 has three times more of): both captions prefer
  one twin; the biases can only swap which caption is right (R@1 stays 1 of 2), so on such pairs the oracle
  moves R@1 by chance: the mechanism behind the oracle's R@1 churn on the corpora.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gare.retrieval_metrics import ranks_t2v
from gare.sinkhorn import sinkhorn_biases_dense
from gare.sinkhorn_sparse import normalization_error_scores

GAMMA = 0.05


def _r1(S: torch.Tensor, b: torch.Tensor | None = None) -> float:
    S = S.double() if b is None else S.double() + b.double()[None, :]
    return float(np.mean(ranks_t2v(S, np.arange(S.shape[0])) == 1))


def _hub_matrix(n: int = 6) -> torch.Tensor:
    """(n, n+1) scores: caption i's true video is i (score 0.5), video n is a hub scored 0.55 by every caption,
    other pairs 0.2. Popularity by construction: the hub takes almost every caption's probability."""
    S = torch.full((n, n + 1), 0.2, dtype=torch.float64)
    S[torch.arange(n), torch.arange(n)] = 0.5
    S[:, n] = 0.55
    return S


def test_hub_is_pushed_down_and_r1_recovers():
    n = 6
    S = _hub_matrix(n)
    assert _r1(S[:, :n]) == 1.0  # without the hub every caption is right
    assert _r1(S) == 0.0  # the hub wins every caption
    _, b = sinkhorn_biases_dense(S, GAMMA, n_iters=50)
    b = b.double()
    hub, others = float(b[n]), b[:n]
    # the hub's bias is the lowest by more than its lead over the true videos (0.05): it drops below them
    assert hub < float(others.min()) - 0.05
    assert float(others.max() - others.min()) < 1e-6  # the n symmetric videos are treated alike
    assert _r1(S, b) == 1.0
    # NCL eq. 13 on the oracle bank: every video's summed probability ~ its target (rescaled to 1)
    assert normalization_error_scores(S, GAMMA) > 0.5
    assert normalization_error_scores(S, GAMMA, b) < 0.05


def test_bias_is_added_not_subtracted():
    """The sign: the biases are added to the score (NCL eq. 12); subtracting them makes the hub win harder."""
    S = _hub_matrix(5)
    b = sinkhorn_biases_dense(S, GAMMA, n_iters=50)[1].double()
    assert _r1(S, b) == 1.0 and _r1(S, -b) == 0.0


def test_unpopular_video_is_pushed_up():
    """Video 0 is every caption's second choice and nobody's first: it gets the largest bias."""
    g = torch.Generator().manual_seed(3)
    S = 0.3 + 0.01 * torch.randn(8, 8, generator=g, dtype=torch.float64)
    S[:, 0] -= 0.1
    b = sinkhorn_biases_dense(S, GAMMA, n_iters=50)[1].double()
    assert int(torch.argmax(b)) == 0
    assert float(b[0] - b[1:].max()) > 0.05  # about its 0.1 deficit, less what the noise decides


def test_no_popularity_no_change():
    """A circulant score matrix: every video's summed probability is exactly 1 already (each column holds the same
    values), so the oracle biases are equal and the ranking is the one without them."""
    n = 7
    base = torch.tensor([0.6, 0.3, 0.25, 0.2, 0.1, 0.05, 0.0], dtype=torch.float64)
    S = torch.stack([torch.roll(base, i) for i in range(n)])
    b = sinkhorn_biases_dense(S, GAMMA, n_iters=4)[1].double()
    assert float(b.max() - b.min()) < 1e-6
    assert abs(float(b.mean()) - GAMMA * math.log(1.0 / n)) < 1e-6  # beta normalised to sum 1: b = gamma log(1/n)
    assert torch.equal(torch.argsort(S + b[None, :], dim=1, descending=True), torch.argsort(S, dim=1, descending=True))


def test_indistinguishable_near_duplicates_only_swap_the_hit():
    """Twins A (0) and A' (1): both captions score A a little higher. Without biases caption 0 is right and
    caption 1 wrong; the oracle lowers A (two captions' mass) and raises A', which can only move the hit
    from caption 0 to caption 1: R@1 stays 1 of 2 at best, and the one that is right is decided by a margin
    the score does not have."""
    S = torch.tensor([[0.60, 0.59, 0.1, 0.1],
                      [0.60, 0.58, 0.1, 0.1],
                      [0.1, 0.1, 0.6, 0.2],
                      [0.1, 0.1, 0.2, 0.6]], dtype=torch.float64)
    r0 = ranks_t2v(S, np.arange(4))
    b = sinkhorn_biases_dense(S, GAMMA, n_iters=50)[1].double()
    r = ranks_t2v(S + b[None, :], np.arange(4))
    assert list(r0[:2]) == [1, 2]
    assert float(b[0]) < float(b[1])  # the popular twin goes down
    assert (r[:2] == 1).sum() <= 1  # no bias can make both twins' captions right: one column cannot win both ways
    assert list(r[2:]) == [1, 1]  # the distinct videos keep their hits
