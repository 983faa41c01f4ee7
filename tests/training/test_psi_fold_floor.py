"""The rerank at its floor (issue 29): int8 frames with per-frame scales, the candidates split over threads,
subnormal softmax weights, and the per-query cache of the query-side fold, each against the plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare import psi_fold as pf
from gare import psi_fold_cpu as pc
from gare import psi_fold_queries as pfq
from gare import psi_fold_videos as pfv
from tests.training.test_psi_fold import TOL, random_psi, reference


def _int8(frames: torch.Tensor) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """frames (n, f, d) -> (q int8, scale (n, f) float32, the float32 frames they stand for)."""
    x = frames.float().numpy()
    scale = (np.abs(x).max(-1) / 127.0).astype(np.float32)
    q = np.rint(x / np.where(scale > 0, scale, 1.0)[..., None]).clip(-127, 127).astype(np.int8)
    return q, scale, torch.from_numpy(q.astype(np.float32) * scale[..., None])


@pytest.mark.parametrize("with_vbar", [False, True])
def test_int8_frames_score_as_their_dequantized_float32_frames(with_vbar):
    """The kernel on int8 frames + scales equals the torch fold and the float64 model form on the float32
    frames those stand for (the scale is applied to the dots: exact up to float32 rounding)."""
    psi = random_psi(16, 5)
    g = torch.Generator().manual_seed(5)
    q8, sc, deq = _int8(torch.randn(30, 4, 16, generator=g))
    mask = torch.rand(30, 4, generator=g) > 0.2
    mask[:, 0] = True
    vbar = (deq * mask[..., None]).sum(1) / mask.sum(1, keepdim=True) if with_vbar else None
    v = pfv.fold_videos(deq, mask, psi, vbar=vbar)
    t = torch.randn(3, 16, generator=g)
    q = pfq.fold_queries(t, psi, 0.3)
    idx = torch.randint(0, 30, (3, 7), generator=g)
    kw = {}
    if with_vbar:
        n = vbar.norm(dim=-1)
        kw = {"vrows": (vbar / n[:, None]).contiguous().numpy(), "vscale": n.numpy()}
    got = pc.pair_scores(q, q8, v.packed, idx.numpy(), fscale=sc, **kw)
    want = pf.pair_scores(q, v, idx, kernel=False)
    torch.testing.assert_close(torch.from_numpy(got), want, atol=TOL, rtol=0)
    ref = reference(psi, t, deq, mask, 0.3)  # (3, 30) float64 model form (v̄ = the masked mean, as vbar here)
    torch.testing.assert_close(torch.from_numpy(got).double(), torch.gather(ref, 1, idx), atol=TOL, rtol=0)


def test_int8_frames_need_their_scales():
    psi = random_psi(8, 1)
    q8, sc, deq = _int8(torch.randn(3, 2, 8))
    v = pfv.fold_videos(deq, None, psi)
    q = pfq.fold_queries(torch.randn(1, 8), psi, 1.0)
    with pytest.raises(ValueError, match="int8 frames need fscale"):
        pc.pair_scores(q, q8, v.packed, np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match=r"int8 frames need fscale.*\(3, 1\)"):
        pc.pair_scores(q, q8, v.packed, np.zeros((1, 1), np.int64), fscale=sc[:, :1].copy())
    with pytest.raises(ValueError, match="fscale goes with int8 frames only"):
        pc.pair_scores(q, deq.numpy(), v.packed, np.zeros((1, 1), np.int64), fscale=sc)
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        pc.pair_scores(q, deq.numpy(), v.packed, np.zeros((1, 1), np.int64), threads=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_split_the_candidates_and_change_nothing(threads):
    """Split over threads, every query's candidates get exactly the scores of one thread (same arithmetic per
    pair), including a K that does not divide evenly."""
    psi = random_psi(16, 2)
    g = torch.Generator().manual_seed(2)
    v = pfv.fold_videos(torch.randn(50, 4, 16, generator=g).half(), None, psi)
    q = pfq.fold_queries(torch.randn(2, 16, generator=g), psi, 0.5)
    idx = torch.randint(0, 50, (2, pc.MIN_PAIRS_PER_THREAD * threads + 5), generator=g).numpy()
    one = pc.pair_scores(q, v.frames, v.packed, idx)
    many = pc.pair_scores(q, v.frames, v.packed, idx, threads=threads)
    assert np.array_equal(one, many)
    torch.testing.assert_close(torch.from_numpy(many), pf.pair_scores(q, v, torch.from_numpy(idx), kernel=False),
                               atol=TOL, rtol=0)


def test_sharp_pooling_with_underflowing_weights_matches_the_reference():
    """A low pooling temperature drives most softmax weights below float32's normal range; the kernel flushes
    those to 0 (to stay fast) and still equals the float64 model form."""
    psi = random_psi(16, 4)
    g = torch.Generator().manual_seed(4)
    frames = 6.0 * torch.randn(20, 6, 16, generator=g)
    v = pfv.fold_videos(frames, None, psi)
    t = 3.0 * torch.randn(2, 16, generator=g)
    q = pfq.fold_queries(t, psi, 0.01)
    idx = torch.randint(0, 20, (2, 9), generator=g)
    got = torch.from_numpy(pc.pair_scores(q, v.frames, v.packed, idx.numpy()))
    ref = torch.gather(reference(psi, t, frames, None, 0.01), 1, idx)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=TOL, rtol=0)


def test_query_fold_cache_hits_equal_fold_queries_and_stay_bounded():
    psi = random_psi(16, 3)
    fold = pfq.as_fold(psi)
    cache = pfq.QueryFoldCache(3)
    t = torch.randn(4, 16)
    want = pfq.fold_queries(t, fold, 0.5)
    first = cache.fold(t[:2], fold, 0.5)
    assert (cache.misses, cache.hits, len(cache)) == (2, 0, 2)
    mixed = cache.fold(t[[1, 2, 0]], fold, 0.5)  # two hits, one miss, in the caller's order
    assert (cache.misses, cache.hits, len(cache)) == (3, 2, 3)
    for got, rows in ((first, [0, 1]), (mixed, [1, 2, 0])):
        # rtol: rows folded in batches of other sizes round differently in float32 (1 ulp at |u| ~ 8 is 9.5e-7)
        torch.testing.assert_close(got.u, want.u[rows], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got.sc, want.sc[rows], atol=1e-5, rtol=1e-6)
        assert got.fingerprint == want.fingerprint and got.inv_temp == want.inv_temp
    cache.fold(t[3:], fold, 0.5)
    assert len(cache) == 3  # the least recently used row (t[1]) went
    other = cache.fold(t[:1], fold, 0.25)  # another temperature is another key
    assert other.inv_temp == 4.0 and cache.misses == 5
    with pytest.raises(ValueError, match="max_entries must be >= 0, got -1"):
        pfq.QueryFoldCache(-1)
