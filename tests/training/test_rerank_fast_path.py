"""The served rerank's fast path: the compiled query fold against the torch product in float64, the
kernel on arrays checked once per version against `pair_scores` and the psi reference, and the per-version
cache of those arrays (kept while the version and its arrays live, rebuilt when an array is replaced)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from gare import psi_fold_cpu as pc
from gare import psi_fold_cpu_queries as pfcq
from gare import psi_fold_queries as pfq
from gare import psi_fold_videos as pfv
from gare_index import psi_candidates
from tests.training.test_psi_fold import TOL, random_psi, reference


def _fold64(t: torch.Tensor, fold: pfq.PsiFold) -> tuple[torch.Tensor, torch.Tensor]:
    """The query side of the fold in float64 with plain torch ops (what fold_queries computes in float32)."""
    t = t.double()
    d = fold.dim
    y = t @ fold.query_map.double()
    u = torch.cat([t, y[:, : 2 * d]], dim=1).view(-1, 3, d)
    ct = t - t.mean(-1, keepdim=True)
    sc = torch.cat([t.pow(2).sum(-1, keepdim=True), ct.pow(2).sum(-1, keepdim=True), t.sum(-1, keepdim=True),
                    y[:, 2 * d :], torch.zeros_like(t[:, :1])], dim=1)
    return u, sc


@pytest.mark.parametrize("d", [16, 18])  # 18: a width the 4-row unrolled product does not divide
def test_compiled_query_fold_equals_the_float64_fold(d):
    psi = random_psi(d, 3)
    fold = pfq.as_fold(psi)
    t = torch.randn(5, d, generator=torch.Generator().manual_seed(d))
    q = pfq.fold_queries(t, fold, 0.5)  # 5 <= KERNEL_ROWS: the compiled fold
    u64, sc64 = _fold64(t, fold)
    torch.testing.assert_close(q.u.double(), u64, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(q.sc.double(), sc64, atol=2e-5, rtol=2e-6)
    assert q.inv_temp == 2.0 and q.fingerprint == fold.fingerprint and q.u.dtype == torch.float32
    # every row folded on its own (a batch changes at most the rounding of its sums: row alignment)
    for i in range(5):
        one = pfq.fold_queries(t[i : i + 1], fold, 0.5)
        torch.testing.assert_close(one.u[0], q.u[i], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(one.sc[0], q.sc[i], atol=1e-5, rtol=1e-6)
    # a batch over KERNEL_ROWS takes the torch product: the same vectors to float32 rounding
    big = pfq.fold_queries(t.repeat(pfq.KERNEL_ROWS // 5 + 1, 1), fold, 0.5)
    torch.testing.assert_close(big.u[:5], q.u, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(big.sc[:5], q.sc, atol=1e-5, rtol=1e-6)


def test_compiled_query_fold_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"do not match: \(1, 8\), \(8, 16\)"):
        pfcq.fold_query_rows(np.zeros((1, 8), np.float32), np.zeros((8, 16), np.float32))


@pytest.mark.parametrize("d", [16, 33, 512])
def test_compiled_query_fold_gives_a_row_the_same_bits_alone_or_beside_others(d):
    # a query's fold must not depend on its batch: the served rerank folds a query alone or in a micro-batch,
    # and a fresh process may meet it either way (the sums |t|² and Σt once took a vector or a scalar path by
    # where the arrays lay, which failed CI's engine-versus-in-process comparison in its last bit)
    rng = np.random.default_rng(d)
    qmap = rng.standard_normal((d, 2 * d + 3)).astype(np.float32)
    t = rng.standard_normal((70, d)).astype(np.float32)
    alone = [pfcq.fold_query_rows(t[i : i + 1].copy(), qmap) for i in range(70)]
    for a, off in ((2, 0), (3, 1), (17, 5), (64, 0), (70, 0)):
        u, sc = pfcq.fold_query_rows(t[off : off + a], qmap)
        for i in range(a):
            assert np.array_equal(u[i], alone[off + i][0][0]) and np.array_equal(sc[i], alone[off + i][1][0]), (a, off, i)


@pytest.mark.parametrize("with_vbar", [False, True])
def test_scores_on_checked_arrays_equal_pair_scores_and_the_reference(with_vbar):
    psi = random_psi(16, 2)
    g = torch.Generator().manual_seed(5)
    frames = torch.randn(40, 4, 16, generator=g).half()
    mask = torch.ones(40, 4, dtype=torch.bool)
    mask[::3, 3:] = False
    v = pfv.fold_videos(frames, mask, psi)
    t = torch.randn(2, 16, generator=g)
    q = pfq.fold_queries(t, psi, 0.5)
    idx = torch.randint(0, 40, (2, 37), generator=g).numpy()  # repeats, any order: the prefetch follows idx
    kw = {}
    if with_vbar:
        vbar = (frames.float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        kw = {"vrows": (vbar / vbar.norm(dim=1, keepdim=True)).numpy(), "vscale": vbar.norm(dim=1).numpy()}
    ka = pc.kernel_arrays(v.frames.numpy(), v.packed.numpy(), **kw)
    got = pc.scores(q, ka, idx)
    assert np.array_equal(got, pc.pair_scores(q, v.frames, v.packed, idx, **kw))
    for i in range(2):
        want = reference(psi, t[i : i + 1], frames[idx[i]].float(), mask[idx[i]], 0.5)[0]
        np.testing.assert_allclose(got[i], want.numpy(), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match=r"candidate rows must lie in \[0, 40\), got \[0, 40\]"):
        pc.scores(q, ka, np.array([[0, 40], [1, 2]]))


class _Version:
    """The fields of an index version the rerank's array cache reads."""

    def __init__(self, n: int, f: int, d: int) -> None:
        self.frames = np.zeros((n, f, d), np.float16)
        self.units = np.zeros((n, d), np.float32)
        self.norms = np.ones(n, np.float32)


def test_kernel_arrays_are_kept_per_version_and_follow_its_arrays():
    v = _Version(6, 2, 4)
    consts = np.zeros((6, pfv.packed_width(2)), np.float32)
    first = psi_candidates._kernel_arrays(v, consts)
    assert first is not None and first.fr.dtype == np.uint16 and first.vr.shape == (6, 4)
    assert psi_candidates._kernel_arrays(v, consts) is first  # checked once, not per request
    v.frames = np.ones((6, 2, 4), np.float16)  # an array replaced: new views
    second = psi_candidates._kernel_arrays(v, consts)
    assert second is not first and second.fr[0, 0, 0] == np.float16(1).view(np.uint16)
    assert psi_candidates._kernel_arrays(v, consts.astype(np.float64)) is None  # constants the kernel cannot read
    key = id(v)
    assert key in psi_candidates._ARRAYS
    del v
    gc.collect()
    assert key not in psi_candidates._ARRAYS  # the views (and the memmaps behind them) go with the version


def test_fold_one_shares_the_cache_with_fold_and_equals_it():
    psi = random_psi(16, 3)
    fold = pfq.as_fold(psi)
    cache = pfq.QueryFoldCache(4)
    t = torch.randn(3, 16, generator=torch.Generator().manual_seed(9))
    u, sc = cache.fold_one(t[0].numpy(), fold, 0.5)  # a miss: folded and kept
    assert u.shape == (1, 3, 16) and sc.shape == (1, 7) and (cache.misses, cache.hits) == (1, 0)
    want = pfq.fold_queries(t[:1], fold, 0.5)
    assert np.array_equal(u, want.u.numpy()) and np.array_equal(sc, want.sc.numpy())
    got = cache.fold(t[:2], fold, 0.5)  # row 0 hits the row fold_one kept
    assert (cache.misses, cache.hits) == (2, 1)
    assert np.array_equal(got.u[0].numpy(), u[0]) and np.array_equal(got.sc[0].numpy(), sc[0])
    u1, _ = cache.fold_one(t[1].numpy(), fold, 0.5)  # kept by fold: a hit
    assert cache.hits == 2 and np.array_equal(u1[0], got.u[1].numpy())
    with pytest.raises(ValueError, match=r"t must be float32 \(16,\), got float64 \(16,\)"):
        cache.fold_one(t[0].double().numpy(), fold, 0.5)


def test_a_row_kept_from_a_large_batch_has_the_bits_of_the_row_alone():
    # a batch past KERNEL_ROWS is folded by a torch product elsewhere (fold_queries); the cache keeps the rows
    # the one-query fold would compute, so a query's psi scores do not depend on the batch that first met it
    psi = random_psi(16, 3)
    fold = pfq.as_fold(psi)
    t = torch.randn(pfq.KERNEL_ROWS + 6, 16, generator=torch.Generator().manual_seed(4))
    big = pfq.QueryFoldCache(256)
    got = big.fold(t, fold, 0.5)
    for i in (0, pfq.KERNEL_ROWS - 1, pfq.KERNEL_ROWS, pfq.KERNEL_ROWS + 5):
        alone_u, alone_sc = pfq.QueryFoldCache(4).fold_one(t[i].numpy(), fold, 0.5)
        kept_u, kept_sc = big.fold_one(t[i].numpy(), fold, 0.5)
        assert np.array_equal(kept_u, alone_u) and np.array_equal(kept_sc, alone_sc), i
        assert np.array_equal(got.u[i].numpy(), alone_u[0]) and np.array_equal(got.sc[i].numpy(), alone_sc[0]), i
    assert big.hits == 4 and big.misses == t.shape[0]
