"""InvGC with LocalAdj against a naive, loop-by-loop implementation of eq. 7-9."""

from __future__ import annotations

import math

import numpy as np
import torch

from gare.invgc import invgc, n_neighbours, select_r


def naive_invgc(G, Gh, Qh, r_g, r_q, k_percent):
    G, Gh, Qh = (np.asarray(x, dtype=np.float64) for x in (G, Gh, Qh))

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    G, Gh, Qh = unit(G), unit(Gh), unit(Qh)

    def local_adj(ref):
        S = np.zeros((len(G), len(ref)))
        kk = max(1, math.ceil(len(ref) * k_percent / 100))
        for i in range(len(G)):
            sims = [float(G[i] @ ref[j]) for j in range(len(ref))]
            threshold = sorted(sims, reverse=True)[kk - 1]  # P_i: the k%-largest similarity
            for j, s in enumerate(sims):
                if s >= threshold:
                    S[i, j] = s
        kept = S != 0
        S[kept] -= S[kept].mean()  # edge weights minus their mean
        return S

    a = unit(G - r_g * local_adj(Gh) @ Gh)
    b = unit(G - r_q * local_adj(Qh) @ Qh)
    return unit(0.5 * (a + b))


def test_invgc_matches_naive_formula():
    g = torch.Generator().manual_seed(0)
    G, Gh, Qh = torch.randn(23, 8, generator=g), torch.randn(150, 8, generator=g), torch.randn(230, 8, generator=g)
    for r_g, r_q, k in [(0.3, 0.2, 1.0), (0.0, 0.5, 5.0), (1.0, 0.0, 10.0)]:
        ours = invgc(G, Gh, Qh, r_g, r_q, k_percent=k, chunk=5)
        ref = naive_invgc(G, Gh, Qh, r_g, r_q, k)
        np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5)
    assert torch.allclose(invgc(G, Gh, Qh, 0.0, 0.0), torch.nn.functional.normalize(G, dim=-1), atol=1e-6)
    assert n_neighbours(150, 1.0) == 2 and n_neighbours(50, 1.0) == 1


def test_invgc_reduces_degeneration_on_clustered_data():
    g = torch.Generator().manual_seed(1)
    centres = torch.nn.functional.normalize(torch.randn(5, 32, generator=g), dim=-1)
    pick = torch.randint(0, 5, (400,), generator=g)
    pts = torch.nn.functional.normalize(centres[pick] + 0.15 * torch.randn(400, 32, generator=g), dim=-1)
    G, Gh, Qh = pts[:100], pts[100:250], pts[250:]

    def nn_sim(x):  # Δ_deg: mean similarity to the nearest other gallery item
        s = x @ x.T
        s.fill_diagonal_(-2)
        return float(s.max(1).values.mean())

    assert nn_sim(invgc(G, Gh, Qh, 0.3, 0.3, k_percent=5)) < nn_sim(G)


def test_select_r_picks_the_best_pair_and_records_the_search():
    g = torch.Generator().manual_seed(2)
    G, Gh, Qh = torch.randn(20, 8, generator=g), torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g)
    target = invgc(G, Gh, Qh, 0.2, 0.05)

    def score(corrected):  # highest when the correction equals the (0.2, 0.05) one
        return -float((corrected - target).abs().sum())

    res = select_r(G, Gh, Qh, score, grid=(0.0, 0.05, 0.2))
    assert (res["r_g"], res["r_q"]) == (0.2, 0.05)
    assert len(res["tried"]) == 9 and res["baseline"] == res["tried"][0]["score"]
