"""gare.retrieval_metrics: blocked strict-greater ranks against a brute-force python argsort, multi-caption
video-to-text, ties, hand cases, the summary statistics and the markdown table."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gare.retrieval_metrics import format_table, rank_summary, ranks_t2v, ranks_v2t, retrieval_metrics


def _brute_t2v(sim: np.ndarray, tv: np.ndarray) -> np.ndarray:
    """Sort each row (descending, stable); the rank of the gt video is 1 + its position after moving
    every tied competitor behind it (ties count in the query's favour)."""
    out = []
    for i in range(sim.shape[0]):
        row = [float(v) for v in sim[i]]
        gt = row[tv[i]]
        order = sorted(range(len(row)), key=lambda j: (-row[j], j != tv[i]))
        out.append(order.index(tv[i]) + 1)
        assert out[-1] == 1 + sum(v > gt for v in row)
    return np.array(out)


def _brute_v2t(sim: np.ndarray, tv: np.ndarray) -> np.ndarray:
    """For each video: sort its column; rank = the best (smallest) 1-based rank of any of its captions,
    each caption's rank taken with its ties in its favour; -1 for videos without captions."""
    out = []
    for j in range(sim.shape[1]):
        col = [float(v) for v in sim[:, j]]
        best = None
        for i in np.flatnonzero(tv == j):
            order = sorted(range(len(col)), key=lambda k, i=i: (-col[k], k != i))
            r = order.index(i) + 1
            best = r if best is None else min(best, r)
        out.append(-1 if best is None else best)
    return np.array(out)


def _random_case(n_t, n_v, seed, ties=False, multi=False):
    rng = np.random.default_rng(seed)
    if ties:
        sim = rng.integers(0, 4, size=(n_t, n_v)).astype(np.float32) / 4  # many exact ties
    else:
        sim = rng.standard_normal((n_t, n_v)).astype(np.float32)
    if multi:
        tv = rng.integers(0, n_v, size=n_t)
    else:
        assert n_t == n_v
        tv = rng.permutation(n_v)
    return sim, tv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("block", [1, 7, 1024])
def test_ranks_match_brute_force(seed, ties, multi, block):
    n_t, n_v = (60, 25) if multi else (30, 30)
    sim, tv = _random_case(n_t, n_v, seed, ties=ties, multi=multi)
    np.testing.assert_array_equal(ranks_t2v(sim, tv, block=block), _brute_t2v(sim, tv))
    np.testing.assert_array_equal(ranks_v2t(sim, tv, block=block), _brute_v2t(sim, tv))
    # torch input (float64 too) gives the same answer
    np.testing.assert_array_equal(
        ranks_t2v(torch.from_numpy(sim).double(), tv, block=block), _brute_t2v(sim, tv)
    )


def test_hand_case_single_caption():
    sim = np.array(
        [
            [0.9, 0.1, 0.2],  # text 0 -> video 0: rank 1
            [0.5, 0.4, 0.6],  # text 1 -> video 1: two higher -> rank 3
            [0.3, 0.3, 0.3],  # text 2 -> video 2: all tied -> rank 1
        ]
    )
    tv = np.array([0, 1, 2])
    assert ranks_t2v(sim, tv).tolist() == [1, 3, 1]
    # columns: video 0 gt 0.9 (top) -> 1; video 1 gt 0.4 (0.1 and 0.3 below) -> 1; video 2 gt 0.3 (0.6 above) -> 2
    assert ranks_v2t(sim, tv).tolist() == [1, 1, 2]
    m = retrieval_metrics(sim, tv)
    assert m["t2v"] == {
        "R1": pytest.approx(200 / 3),
        "R5": 100.0,
        "R10": 100.0,
        "R50": 100.0,
        "MdR": 1.0,
        "MnR": pytest.approx(5 / 3),
    }
    assert m["v2t"]["R1"] == pytest.approx(200 / 3) and m["v2t"]["MdR"] == 1.0
    assert m["v2t"]["MnR"] == pytest.approx(4 / 3)


def test_hand_case_multi_caption():
    # texts 0, 1 describe video 0; text 2 describes video 1; video 2 has no caption
    sim = np.array(
        [
            [0.2, 0.9, 0.0],
            [0.7, 0.1, 0.5],
            [0.8, 0.3, 0.4],
        ]
    )
    tv = np.array([0, 0, 1])
    # t2v: text 0 -> v0 has 0.9 above -> 2; text 1 -> v0 top -> 1; text 2 -> v1 has 0.8, 0.4 above -> 3
    assert ranks_t2v(sim, tv).tolist() == [2, 1, 3]
    # v2t: video 0 column (0.2, 0.7, 0.8): captions 0 (rank 3) and 1 (rank 2) -> 2;
    #      video 1 column (0.9, 0.1, 0.3): caption 2 has 0.9 above -> 2; video 2: no caption -> -1
    assert ranks_v2t(sim, tv).tolist() == [2, 2, -1]
    m = retrieval_metrics(sim, tv)
    assert m["v2t"]["R1"] == 0.0 and m["v2t"]["R5"] == 100.0 and m["v2t"]["MnR"] == 2.0  # 2 videos ranked


def test_rank_summary_values():
    r = np.array([1, 2, 5, 6, 10, 11, 50, 51, 100, 1])
    s = rank_summary(r)
    assert s["R1"] == pytest.approx(20.0)
    assert s["R5"] == pytest.approx(40.0)
    assert s["R10"] == pytest.approx(60.0)
    assert s["R50"] == pytest.approx(80.0)
    assert s["MdR"] == pytest.approx(8.0)  # median of an even count: mean of 6 and 10
    assert s["MnR"] == pytest.approx(23.7)
    assert np.isnan(rank_summary(np.array([-1]))["R1"])


def test_perfect_and_worst():
    n = 64
    sim = np.eye(n)
    m = retrieval_metrics(sim, np.arange(n))
    for d in ("t2v", "v2t"):
        assert m[d]["R1"] == 100.0 and m[d]["MdR"] == 1.0 and m[d]["MnR"] == 1.0
    m = retrieval_metrics(-np.eye(n), np.arange(n))
    assert m["t2v"]["R50"] == 0.0 and m["t2v"]["MdR"] == n


def test_normalisation_error_option():
    sim, tv = _random_case(40, 40, 0)
    m = retrieval_metrics(sim, tv, gamma=0.05)
    assert set(m) == {"t2v", "v2t", "norm_err"}
    L = torch.from_numpy(sim).double() / 0.05
    ref = torch.mean(torch.abs(1 - torch.softmax(L, 1).sum(0))).item()
    assert m["norm_err"]["t2v"] == pytest.approx(ref)
    assert set(retrieval_metrics(sim, tv)) == {"t2v", "v2t"}


def test_validation():
    with pytest.raises(ValueError):
        retrieval_metrics(np.zeros((3, 2)), np.array([0, 1]))
    with pytest.raises(ValueError):
        retrieval_metrics(np.zeros((2, 2)), np.array([0, 2]))
    with pytest.raises(ValueError):
        retrieval_metrics(np.zeros(4), np.array([0]))


def test_10k_square_is_fast():
    """10k x 10k in blocks (O(block x n) memory, no sort): right R@1 both ways, and a hang guard far above the
    blocked computation's time (a per-row sort or a Python loop over the pairs would trip it)."""
    import torch

    n = 10_000
    sim = torch.rand((n, n), generator=torch.Generator().manual_seed(0))  # torch fills it faster than numpy
    sim.diagonal().add_(0.5)  # the right video first for about half the texts
    want_t2v = 100 * (sim.argmax(1) == torch.arange(n)).double().mean().item()
    want_v2t = 100 * (sim.argmax(0) == torch.arange(n)).double().mean().item()
    t0 = time.perf_counter()
    m = retrieval_metrics(sim, np.arange(n))
    assert time.perf_counter() - t0 < 60  # hang guard
    assert 0 < m["t2v"]["R1"] < 100 and 0 < m["v2t"]["R1"] < 100
    assert m["t2v"]["R1"] == pytest.approx(want_t2v) and m["v2t"]["R1"] == pytest.approx(want_v2t)


def test_format_table():
    m = retrieval_metrics(np.eye(4), np.arange(4))
    table = format_table({"GARE": m, "flat": {"R1": 44.5, "MdR": 2.0, "note": "x"}})
    lines = table.splitlines()
    assert lines[0].startswith("| method | t2v R1 | t2v R5 |")
    assert lines[1].startswith("|---|---:|")
    assert lines[2].startswith("| GARE | 100.0 | 100.0 |")
    assert "| flat |" in lines[3] and "44.5" in lines[3] and "| x |" in lines[3]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
