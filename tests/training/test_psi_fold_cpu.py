"""The compiled CPU kernel of the folded psi (gare/psi_fold_cpu.py) against the torch fold and the float64
reference (gare.psi.pair_scores), on the layouts the index stores: float16/float32 frames and constants,
memory-mapped arrays, v̄ given as unit rows times norms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gare import psi_fold as pf
from gare import psi_fold_cpu as pc
from gare import psi_fold_queries as pfq
from gare import psi_fold_videos as pfv
from tests.training.test_psi_fold import FAST, TOL, problems, random_psi, reference


def test_numba_is_available():
    """The package depends on numba; without it the rerank silently falls back to the 3x slower torch path."""
    assert pc.available()


def test_kernel_layout_constants_are_the_folds():
    """The kernel hard-codes the packed row's layout (it imports nothing of the project): the counts and the cosine
    eps must be psi_fold's (the field order itself is held by the equality tests below)."""
    assert (pc._N_VEC, pc._N_MAT, pc._COS_EPS) == (len(pfv.VEC_FIELDS), len(pfv.MAT_FIELDS), pf._COS_EPS)
    assert pfv.SCALAR_FIELDS == ("cvv", "vsum") and pfv.VEC_FIELDS[:5] == ("rs", "bias", "le", "lg", "omega")


def test_half_widening_is_exact_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    half = bits.view(np.float16).reshape(256, 256)
    got, want = pc.widen_half(half), half.astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    assert np.array_equal(got[fin], want[fin])  # zeros (both signs), subnormals, normals, ±inf
    assert np.array_equal(np.signbit(got[fin]), np.signbit(want[fin]))


@FAST
@given(problems(), st.sampled_from(["float32", "float16"]), st.sampled_from(["float32", "float16"]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_kernel_equals_torch_fold_and_reference(problem, frame_dtype, const_dtype, with_vbar, seed):
    psi, t, frames, mask, temp = problem
    g = torch.Generator().manual_seed(seed)
    fr = frames.to(getattr(torch, frame_dtype))
    vbar = torch.randn(frames.shape[0], frames.shape[-1], generator=g) * frames.abs().mean() if with_vbar else None
    v = pfv.fold_videos(fr, mask, psi, vbar=vbar)
    v = v.to(dtype=getattr(torch, const_dtype))
    q = pfq.fold_queries(t, psi, temp)
    k = int(torch.randint(1, 9, (1,), generator=g))
    idx = torch.randint(0, frames.shape[0], (t.shape[0], k), generator=g)  # repeats allowed
    got = pf.pair_scores(q, v, idx)  # the kernel (auto on the CPU)
    ref_torch = pf.pair_scores(q, v, idx, kernel=False)
    assert got.dtype == torch.float32 and got.shape == idx.shape
    torch.testing.assert_close(got, ref_torch, atol=TOL, rtol=0, equal_nan=True)
    if not with_vbar and const_dtype == "float32":  # the float64 definition on the stored (rounded) frames
        ref = reference(psi, t, fr.float(), mask, temp).gather(1, idx)
        torch.testing.assert_close(got.double(), ref, atol=TOL, rtol=0, equal_nan=True)
    if with_vbar:  # v̄ as the index stores it: unit rows times norms
        n = vbar.norm(dim=1).clamp_min(1e-30)
        s = pc.pair_scores(q, v.frames, v.packed, idx.numpy(), vrows=(vbar / n[:, None]).contiguous(), vscale=n)
        torch.testing.assert_close(torch.from_numpy(s), ref_torch, atol=TOL, rtol=0, equal_nan=True)


@FAST
@given(problems())
def test_kernel_all_rows_mode(problem):
    """Constants folded with reference_padding (psi attends to padded rows): the kernel follows the constants."""
    psi, t, frames, _, temp = problem
    v = pfv.fold_videos(frames, torch.ones(frames.shape[:2], dtype=torch.bool), psi, reference_padding=True)
    q = pfq.fold_queries(t, psi, temp)
    idx = torch.arange(frames.shape[0]).repeat(t.shape[0], 1)
    torch.testing.assert_close(pf.pair_scores(q, v, idx), pf.pair_scores(q, v, idx, kernel=False), atol=TOL, rtol=0)


def test_real_sizes_from_memory_mapped_arrays(tmp_path):
    """d = 512, f = 12, float16 frames and float32 constants memory-mapped as the index stores them, K = 256:
    equal to the torch fold on the gathered rows."""
    n, f, d = 600, 12, 512
    psi = random_psi(d, 7, wstd=0.05)
    g = torch.Generator().manual_seed(7)
    mask = torch.arange(f)[None, :] < torch.randint(1, f + 1, (n,), generator=g)[:, None]
    frames = (torch.randn(n, f, d, generator=g) * 0.05 * mask[..., None]).half()
    vbar = torch.randn(n, d, generator=g) * 0.05
    v = pfv.fold_videos(frames, mask, psi, vbar=vbar)
    norms = vbar.norm(dim=1)
    np.save(tmp_path / "frames.npy", frames.numpy())
    np.save(tmp_path / "consts.npy", v.packed.numpy())
    np.save(tmp_path / "units.npy", (vbar / norms[:, None]).numpy())
    mm = {k: np.load(tmp_path / f"{k}.npy", mmap_mode="r") for k in ("frames", "consts", "units")}
    assert isinstance(mm["frames"], np.memmap)
    q = pfq.fold_queries(torch.randn(2, d, generator=g), psi, 0.05)
    idx = torch.stack([torch.randperm(n, generator=g)[:256] for _ in range(2)])
    got = pc.pair_scores(q, mm["frames"], mm["consts"], idx.numpy(), vrows=mm["units"], vscale=norms.numpy())
    want = pf.pair_scores(q, v, idx, kernel=False)
    np.testing.assert_allclose(got, want.numpy(), atol=TOL, rtol=0)


def test_bad_inputs_are_refused_with_the_value():
    psi = random_psi(8, 2)
    frames = torch.randn(3, 2, 8)
    v = pfv.fold_videos(frames, None, psi)
    q = pfq.fold_queries(torch.randn(1, 8), psi, 1.0)
    with pytest.raises(ValueError, match="float16 or float32.*float64"):
        pc.pair_scores(q, frames.double().numpy(), v.packed, np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match=r"candidate rows must lie in \[0, 3\), got \[0, 3\]"):
        pc.pair_scores(q, frames, v.packed, np.array([[0, 3]]))
    with pytest.raises(ValueError, match=r"idx must be \(1, K\)"):
        pc.pair_scores(q, frames, v.packed, np.zeros((2, 1), np.int64))
    with pytest.raises(ValueError, match="does not match frames"):
        pc.pair_scores(q, frames, v.packed[:, :-1], np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match="vscale must be float32"):
        pc.pair_scores(q, frames, v.packed, np.zeros((1, 1), np.int64), vscale=np.ones(3, np.float32))
    bf = pfv.VideoConstants(frames=frames.bfloat16(), packed=v.packed, fingerprint=v.fingerprint)
    assert not pf.cpu_kernel_usable(bf)  # bfloat16 frames: the torch path, same answer
    idx = torch.tensor([[2, 0]])
    torch.testing.assert_close(pf.pair_scores(q, bf, idx), pf.pair_scores(q, bf, idx, kernel=False))
    with pytest.raises(ValueError, match="CPU kernel cannot score.*bfloat16"):
        pf.pair_scores(q, bf, idx, kernel=True)


def test_warm_up_compiles_every_layout_a_search_meets(tmp_path):
    """After warm_up, read-only memmaps and writeable arrays of either dtype compile nothing new (a request
    never waits for numba)."""
    assert pc.warm_up() >= 0.0
    kernel = pc._kernel()[0]
    n_sigs = len(kernel.signatures)
    assert n_sigs == 6  # float16/float32/int8 frames x float16/float32 constants
    psi = random_psi(8, 3)
    v = pfv.fold_videos(torch.randn(4, 3, 8), None, psi)
    q = pfq.fold_queries(torch.randn(2, 8), psi, 1.0)
    for fr_dt in (torch.float16, torch.float32):
        for pk_dt in (torch.float16, torch.float32):
            np.save(tmp_path / "f.npy", v.frames.to(fr_dt).numpy())
            np.save(tmp_path / "p.npy", v.packed.to(pk_dt).numpy())
            fr, pk = np.load(tmp_path / "f.npy", mmap_mode="r"), np.load(tmp_path / "p.npy", mmap_mode="r")
            idx = np.zeros((2, 3), np.int64)
            pc.pair_scores(q, fr, pk, idx, vrows=np.ones((4, 8), np.float32), vscale=np.ones(4, np.float32))
            pc.pair_scores(q, np.array(fr), np.array(pk), idx)
    assert len(kernel.signatures) == n_sigs


@pytest.mark.parametrize("a", [1, 3, 9])  # 1, 3: below pf._KERNEL_MAX_QUERIES (8); 9: above
def test_exhaustive_agrees_on_both_sides_of_the_kernel_threshold(a):
    """exhaustive() takes the kernel below pf._KERNEL_MAX_QUERIES queries and the batched torch ops above:
    both equal the torch pair scores."""
    psi = random_psi(16, 9)
    g = torch.Generator().manual_seed(9)
    v = pfv.fold_videos((torch.randn(40, 5, 16, generator=g)).half(), None, psi)
    q = pfq.fold_queries(torch.randn(a, 16, generator=g), psi, 0.5)
    want = pf.pair_scores(q, v)
    torch.testing.assert_close(pf.exhaustive(q, v, chunk=16), want, atol=TOL, rtol=0)
    for forced in (True, False):
        torch.testing.assert_close(pf.exhaustive(q, v, chunk=16, kernel=forced), want, atol=TOL, rtol=0)
