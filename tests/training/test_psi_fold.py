"""gare.psi_fold: the folded psi equals gare.psi.pair_scores / model.score (issue 12).

No __init__.py here on purpose: a package named `training` under tests/ would shadow the real one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gare import psi_fold as pf
from gare import psi_fold_queries as pfq
from gare import psi_fold_videos as pfv
from gare import psi_fold_weights as pfw
from gare.psi import Psi, pair_scores
from tests.psi_weights import randomize_psi

TOL = 1e-5


def random_psi(d: int, seed: int, wstd: float = 0.3) -> Psi:
    """A psi with non-trivial weights and LayerNorm gamma/beta (the N(0, 0.02) init makes Δ ~ 0)."""
    return randomize_psi(Psi(d).eval(), wstd=wstd, ln_std=0.4, other_std=0.2,
                         generator=torch.Generator().manual_seed(seed))


def reference(psi: Psi, t, frames, mask, temp, dtype=torch.float64) -> torch.Tensor:
    ref = Psi(psi.dim).eval().to(dtype)
    ref.load_state_dict(psi.state_dict())
    with torch.no_grad():
        s, _ = pair_scores(ref, t.to(dtype), frames.to(dtype), mask, temp)
    return s


@st.composite
def problems(draw):
    d = draw(st.sampled_from([8, 16, 32, 48]))
    f = draw(st.integers(1, 16))
    a = draw(st.integers(1, 4))
    b = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    t_scale = 10 ** draw(st.floats(-4, 1.5))  # tiny to large norms, independently for texts and frames
    f_scale = 10 ** draw(st.floats(-4, 1.5))
    wstd = draw(st.sampled_from([0.02, 0.3, 0.6]))
    padded = draw(st.booleans())
    temp = draw(st.sampled_from([3.0, 0.5, 10.0]))
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(a, d, generator=g) * t_scale
    frames = torch.randn(b, f, d, generator=g) * f_scale
    if padded:
        n_real = torch.randint(1, f + 1, (b,), generator=g)
        mask = torch.arange(f)[None, :] < n_real[:, None]
        frames = frames * mask[..., None]  # the encoder zeroes padded rows
    else:
        mask = torch.ones(b, f, dtype=torch.bool)
    return random_psi(d, seed, wstd), t, frames, mask, temp


FAST = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(problems())
def test_fold_equals_pair_scores(problem):
    psi, t, frames, mask, temp = problem
    s = pf.pair_scores(pfq.fold_queries(t, psi, temp), pfv.fold_videos(frames, mask, psi))
    assert s.dtype == torch.float32 and s.shape == (t.shape[0], frames.shape[0])
    torch.testing.assert_close(s.double(), reference(psi, t, frames, mask, temp), atol=TOL, rtol=0)
    torch.testing.assert_close(s, reference(psi, t, frames, mask, temp, torch.float32), atol=TOL, rtol=0)


@FAST
@given(problems(), st.sampled_from([torch.float16, torch.bfloat16]))
def test_low_precision_stored_frames(problem, dtype):
    """fp16/bf16-stored frames: the fold accumulates in fp32 and matches psi on the upcast frames."""
    psi, t, frames, mask, temp = problem
    stored = frames.to(dtype)
    v = pfv.fold_videos(stored, mask, psi)
    assert v.frames.dtype == dtype and v.rs.dtype == torch.float32
    s = pf.pair_scores(pfq.fold_queries(t.to(dtype), psi, temp), v)
    torch.testing.assert_close(s.double(), reference(psi, t.to(dtype).float(), stored.float(), mask, temp), atol=TOL, rtol=0)


@FAST
@given(problems(), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_subset_equals_full_gathered(problem, k, seed):
    psi, t, frames, mask, temp = problem
    q, v = pfq.fold_queries(t, psi, temp), pfv.fold_videos(frames, mask, psi)
    idx = torch.randint(0, frames.shape[0], (t.shape[0], k), generator=torch.Generator().manual_seed(seed))
    full = pf.pair_scores(q, v)
    torch.testing.assert_close(pf.pair_scores(q, v, idx), full.gather(1, idx), atol=1e-6, rtol=0)


@FAST
@given(problems())
def test_all_rows_mode(problem):
    """mask=None / all-ones mask: psi attends over every row (padded ones too) and v̄ is the plain mean."""
    psi, t, frames, mask, temp = problem
    q = pfq.fold_queries(t, psi, temp)
    ref = reference(psi, t, frames, None, temp)
    s_none = pf.pair_scores(q, pfv.fold_videos(frames, None, psi))
    s_ones = pf.pair_scores(q, pfv.fold_videos(frames, torch.ones_like(mask), psi))
    torch.testing.assert_close(s_none.double(), ref, atol=TOL, rtol=0)
    torch.testing.assert_close(s_ones, s_none, atol=0, rtol=0)


def test_all_rows_mode_differs_from_masked():
    """The two padding modes really give different scores (so the tests above can tell them apart)."""
    psi = random_psi(16, 4)
    t, frames = torch.randn(3, 16), torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[:, 3:] = False
    frames = frames * mask[..., None]
    q = pfq.fold_queries(t, psi, 3.0)
    masked = pf.pair_scores(q, pfv.fold_videos(frames, mask, psi))
    rows = pf.pair_scores(q, pfv.fold_videos(frames, None, psi))
    torch.testing.assert_close(masked.double(), reference(psi, t, frames, mask, 3.0), atol=TOL, rtol=0)
    assert (masked - rows).abs().max() > 1e-3


def test_fully_padded_video_scores_nan_like_pair_scores():
    psi = random_psi(16, 1)
    t, frames = torch.randn(2, 16), torch.randn(3, 5, 16)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    frames[1] = 0
    ref = reference(psi, t, frames, mask, 3.0)
    q, v = pfq.fold_queries(t, psi, 3.0), pfv.fold_videos(frames, mask, psi)
    # all pairs (torch ops) and the candidates path (the CPU kernel): the same NaN, the other videos untouched
    for s in (pf.pair_scores(q, v), pf.pair_scores(q, v, torch.arange(3).repeat(2, 1))):
        assert torch.isnan(ref[:, 1]).all() and torch.isnan(s[:, 1]).all()
        torch.testing.assert_close(s[:, [0, 2]].double(), ref[:, [0, 2]], atol=TOL, rtol=0)


def test_equals_model_score_and_fused(tiny_model):
    """Against model.score (block-wise, the training definition) and the fused reference (tests/psi_reference.py)."""
    from tests.psi_reference import fused_pair_scores, model_pair_scores  # references only this test uses

    torch.manual_seed(3)
    d, f = tiny_model.cfg.embed_dim, tiny_model.cfg.max_frames
    t, frames = torch.randn(5, d), torch.randn(7, f, d)
    mask = torch.ones(7, f, dtype=torch.bool)
    mask[2, f // 2 :] = False
    mask[5, 1:] = False
    frames = frames * mask[..., None]
    with torch.no_grad():
        ref = tiny_model.score(t, frames.half(), mask, block_videos=3, block_texts=2)
    fw = pfw.fold_weights(tiny_model.psi)
    v = pfv.fold_videos(frames.half(), mask, fw)
    s = pf.pair_scores(pfq.fold_queries(t, fw, tiny_model.cfg.temp), v)
    torch.testing.assert_close(s, ref, atol=TOL, rtol=0)
    # pair by pair: the fold against the model's own score and the fused form (tests/psi_reference.py)
    P = torch.arange(7)
    tp, fp, mp = t[P % 5], frames.half()[P], mask[P]
    diag = ref[P % 5, P]
    torch.testing.assert_close(pf.fold_pair_scores(tiny_model, tp, fp, mp, fold=fw), diag, atol=TOL, rtol=0)
    torch.testing.assert_close(model_pair_scores(tiny_model, tp, fp, mp), diag, atol=TOL, rtol=0)
    with torch.no_grad():
        vbar = (frames.half().float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        torch.testing.assert_close(fused_pair_scores(tiny_model, tp, fp.float(), mp, vbar[P]), diag, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="has 5 rows but frames has 7"):
        pf.fold_pair_scores(tiny_model, tp[:5], fp, mp)


def test_explicit_vbar_equals_model_score(tiny_model):
    """An index's v̄ (norm * unit of float32 features) is not the mean of its float16 frames: constants folded
    with that v̄ (one extra dot per pair) equal model.score(..., vbar=) for all pairs, candidates and chunks."""
    torch.manual_seed(4)
    d, f = tiny_model.cfg.embed_dim, tiny_model.cfg.max_frames
    t, frames = torch.randn(4, d), torch.randn(9, f, d)
    mask = torch.ones(9, f, dtype=torch.bool)
    mask[1, 2:] = False
    frames = frames * mask[..., None]
    vbar = (frames * mask[..., None]).sum(1) / mask.sum(1, keepdim=True) + 0.05 * torch.randn(9, d)
    with torch.no_grad():
        ref = tiny_model.score(t, frames.half(), mask, vbar=vbar)
    fw = pfw.fold_weights(tiny_model.psi)
    v = pfv.fold_videos(frames.half(), mask, fw, vbar=vbar)
    q = pfq.fold_queries(t, fw, tiny_model.cfg.temp)
    torch.testing.assert_close(pf.pair_scores(q, v), ref, atol=TOL, rtol=0)
    idx = torch.randint(0, 9, (4, 5))
    torch.testing.assert_close(pf.pair_scores(q, v, idx), ref.gather(1, idx), atol=TOL, rtol=0)
    torch.testing.assert_close(pf.exhaustive(q, v, chunk=4, query_chunk=3), ref, atol=TOL, rtol=0)
    assert (pf.pair_scores(q, pfv.fold_videos(frames.half(), mask, fw)) - ref).abs().max() > 1e-3  # v̄ matters


def test_exhaustive_chunks_equal_pair_scores():
    psi = random_psi(24, 5)
    g = torch.Generator().manual_seed(0)
    t, frames = torch.randn(5, 24, generator=g), torch.randn(23, 4, 24, generator=g).half()
    mask = torch.rand(23, 4, generator=g) > 0.3
    mask[:, 0] = True
    fw = pfw.fold_weights(psi)
    v, q = pfv.fold_videos(frames, mask, fw, chunk=4), pfq.fold_queries(t, fw, 3.0)
    full = pf.pair_scores(q, pfv.fold_videos(frames, mask, fw))
    torch.testing.assert_close(pf.pair_scores(q, v), full, atol=1e-6, rtol=0)  # fold chunking changes nothing
    ex = pf.exhaustive(q, v, chunk=5, query_chunk=2)
    assert ex.shape == (5, 23) and ex.device.type == "cpu"
    torch.testing.assert_close(ex, full, atol=1e-6, rtol=0)


def test_packed_round_trip_select_cat_and_fp16_constants():
    psi = random_psi(16, 2)
    frames, mask = torch.randn(6, 3, 16), torch.ones(6, 3, dtype=torch.bool)
    fw = pfw.fold_weights(psi)
    v, q = pfv.fold_videos(frames, mask, fw), pfq.fold_queries(torch.randn(2, 16), fw, 3.0)
    full = pf.pair_scores(q, v)
    assert v.packed.shape == (6, pfv.packed_width(3)) and v.packed.dtype == torch.float32
    back = pfv.VideoConstants(frames=frames, packed=v.packed.clone(), fingerprint=fw.fingerprint)  # as stored
    torch.testing.assert_close(pf.pair_scores(q, back), full, atol=0, rtol=0)
    # the named views are the documented quantities
    torch.testing.assert_close(v.h, frames @ frames.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v.omega, torch.full((6, 3), 1 / 3))
    assert v.g1.shape == (6, 3, 3) and v.cvv.shape == (6,)
    both = pfv.VideoConstants.cat([v.slice(0, 2), v.slice(2, 6)])
    torch.testing.assert_close(pf.pair_scores(q, both), full, atol=0, rtol=0)
    sel = v.select(torch.tensor([4, 1]))
    torch.testing.assert_close(pf.pair_scores(q, sel), full[:, [4, 1]], atol=1e-6, rtol=0)
    half = v.to(dtype=torch.float16)
    assert half.frames.dtype == torch.float32 and half.g1.dtype == torch.float16
    assert half.bytes_per_video() * 2 == v.bytes_per_video()
    assert (pf.pair_scores(q, half) - full).abs().max() < 5e-2  # lossy but still computed in fp32
    with pytest.raises(ValueError, match="do not match frames"):
        pfv.VideoConstants(frames=frames, packed=v.packed[:, :-1], fingerprint=fw.fingerprint)


def test_bytes_per_video_at_f12_d512():
    v = pfv.fold_videos(torch.randn(2, 12, 512).half(), None, Psi(512).eval())
    assert v.bytes_per_video() == pfv.packed_width(12) * 4 == (5 * 12 * 12 + 10 * 12 + 2) * 4 == 3368 <= 4096


def test_refuses_other_head_counts_and_mismatches():
    with pytest.raises(ValueError, match="heads=2"):
        pfw.fold_weights(Psi(16, heads=2))
    with pytest.raises(ValueError, match="heads=4"):
        pfv.fold_videos(torch.randn(1, 2, 16), None, Psi(16, heads=4))
    a, b = random_psi(16, 1), random_psi(16, 2)
    v, q = pfv.fold_videos(torch.randn(2, 3, 16), None, a), pfq.fold_queries(torch.randn(1, 16), b, 3.0)
    assert pfw.fold_weights(a).fingerprint == v.fingerprint != q.fingerprint
    with pytest.raises(ValueError, match="different psi weights"):
        pf.pair_scores(q, v)
    qa = pfq.fold_queries(torch.randn(1, 16), a, 3.0)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        pf.pair_scores(qa, v, torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"\(b, f, 16\)"):
        pfv.fold_videos(torch.randn(2, 16), None, a)
    with pytest.raises(ValueError, match="temp must be > 0, got 0"):
        pfq.fold_queries(torch.randn(1, 16), a, 0.0)


def test_docstring_byte_figure_is_the_packed_width():
    """The figure the module docstring quotes for f = 12 is what the code stores."""
    assert f"{pfv.packed_width(12)} floats, {pfv.packed_width(12) * 4:,} bytes" in " ".join(pf.__doc__.split())


def test_candidate_paths_agree():
    """pair_scores(idx) dots the frames of a small v once (v.n <= a·K) or gathers them (v.n > a·K): same scores,
    with and without an explicit vbar, repeats allowed."""
    psi = random_psi(16, seed=5)
    fw = pfw.fold_weights(psi)
    g = torch.Generator().manual_seed(5)
    frames = torch.randn(6, 4, 16, generator=g)
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[2, 1:] = False
    frames = frames * mask[..., None]
    q = pfq.fold_queries(torch.randn(3, 16, generator=g), fw, 0.05)
    for vbar in (None, torch.randn(6, 16, generator=g)):
        v = pfv.fold_videos(frames, mask, fw, vbar=vbar)
        full = pf.pair_scores(q, v)
        small = torch.tensor([[0, 1, 2, 2], [5, 4, 3, 0], [1, 1, 1, 1]])  # 12 >= 6 rows: one matmul over v
        big = torch.tensor([[0], [5], [2]])  # 3 < 6 rows: gathered frames
        torch.testing.assert_close(pf.pair_scores(q, v, small), full.gather(1, small), atol=TOL, rtol=0)
        torch.testing.assert_close(pf.pair_scores(q, v, big), full.gather(1, big), atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_chunked_upcast_and_in_order_candidates(dtype):
    """More videos than one upcast chunk (pf._CHUNK_VIDEOS), stored low-precision: the chunked frame dots, the
    in-order single-query path (candidates = v's rows, the common rerank) and the gathered multi-query path
    equal the float64 reference on the same (rounded) frames, with an explicit vbar too."""
    n, f, d = 2 * pf._CHUNK_VIDEOS + 9, 5, 16
    psi = random_psi(d, seed=11)
    fw = pfw.fold_weights(psi)
    g = torch.Generator().manual_seed(11)
    mask = torch.arange(f)[None, :] < torch.randint(1, f + 1, (n,), generator=g)[:, None]
    frames = (torch.randn(n, f, d, generator=g) * mask[..., None]).to(dtype)
    t = torch.randn(3, d, generator=g)
    ref = reference(psi, t, frames.float(), mask, 0.5).float()  # (3, n)
    v = pfv.fold_videos(frames, mask, fw)
    q = pfq.fold_queries(t, fw, 0.5)
    torch.testing.assert_close(pf.pair_scores(q, v), ref, atol=TOL, rtol=0)
    in_order = torch.arange(n)[None]
    q1 = pfq.fold_queries(t[:1], fw, 0.5)
    torch.testing.assert_close(pf.pair_scores(q1, v, in_order), ref[:1], atol=TOL, rtol=0)
    shuffled = torch.stack([torch.randperm(n, generator=g) for _ in range(3)])
    torch.testing.assert_close(pf.pair_scores(q, v, shuffled), ref.gather(1, shuffled), atol=TOL, rtol=0)
    vb = torch.randn(n, d, generator=g)
    vv = pfv.fold_videos(frames, mask, fw, vbar=vb)
    full = pf.pair_scores(q1, vv)
    torch.testing.assert_close(pf.pair_scores(q1, vv, in_order), full, atol=TOL, rtol=0)
    torch.testing.assert_close(pf.pair_scores(q1, vv, shuffled[:1]), full.gather(1, shuffled[:1]), atol=TOL, rtol=0)


def test_upcast_buffer_works_inside_and_outside_inference_mode():
    """The per-thread upcast buffer is first made under inference_mode (the service), then used outside it
    (training-side callers): both calls give the same dots, in a fresh thread so the buffer is new."""
    import threading

    frames, u = torch.randn(3, 4, 8).half(), torch.randn(2, 8)
    ref = u @ frames.float().reshape(-1, 8).t()
    out, errors = [], []

    def run():
        try:
            with torch.inference_mode():
                out.append(pf._frame_dots(frames, u).clone())
            out.append(pf._frame_dots(frames, u))
        except Exception as e:  # reported below
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert not errors, errors
    for o in out:
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)
