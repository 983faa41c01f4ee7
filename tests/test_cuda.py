"""The CUDA paths against their CPU references.

CI has no GPU, so every test here is skipped there ("needs CUDA"); they run on a lent GPU through
`bash bench/gpu_check.sh` (which also runs bench/gpu_bench.py) and fail there if a CUDA path drifts from
the CPU one: the folded psi, the build-time psi constants, the served-score pair scorer, the text encoder
under fp16/bf16 autocast, a training step (losses and gradients) and the Sinkhorn biases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.psi_weights import randomize_psi

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")


def _tiny_model(seed: int = 0):
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(seed)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    randomize_psi(model.psi)
    return model


def _gallery(n: int, f: int, d: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """frames (n, f, d) float16 with ~1 in 3 videos padded (rows zeroed), mask (n, f) bool."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randn(n, f, d, generator=g) * 2.0
    n_real = torch.where(torch.rand(n, generator=g) < 0.33, torch.randint(1, f, (n,), generator=g), f)
    mask = torch.arange(f)[None] < n_real[:, None]
    return (frames * mask[..., None]).half(), mask


def test_psi_fold_on_cuda_equals_cpu_and_the_model():
    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare.psi import pair_scores

    model = _tiny_model()
    d, f = int(model.psi.dim), 12
    frames, mask = _gallery(300, f, d)
    t = torch.randn(5, d, generator=torch.Generator().manual_seed(3)) * 3.0
    temp = model.cfg.temp
    fw = pfw.fold_weights(model.psi)
    cpu = pf.pair_scores(pfq.fold_queries(t, fw, temp), pfv.fold_videos(frames, mask, fw))
    fwc = fw.to(CUDA)
    vc = pfv.fold_videos(frames.to(CUDA), mask.to(CUDA), fwc)
    gpu = pf.pair_scores(pfq.fold_queries(t.to(CUDA), fwc, temp), vc)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-5, rtol=0)
    # and the training definition, on the GPU (TF32 off: the reference must be fp32 exact)
    torch.backends.cuda.matmul.allow_tf32 = False
    psi = model.psi.to(CUDA)
    with torch.no_grad():
        ref, _ = pair_scores(psi, t.to(CUDA), frames.float().to(CUDA), mask.to(CUDA), temp)
    torch.testing.assert_close(gpu, ref, atol=2e-5, rtol=0)
    # candidates (rerank) and exhaustive (chunked, constants on the CPU moved chunk by chunk)
    idx = torch.randint(0, 300, (5, 17), generator=torch.Generator().manual_seed(4)).to(CUDA)
    torch.testing.assert_close(pf.pair_scores(pfq.fold_queries(t.to(CUDA), fwc, temp), vc, idx),
                               gpu.gather(1, idx), atol=1e-6, rtol=0)
    ex = pf.exhaustive(pfq.fold_queries(t.to(CUDA), fwc, temp), vc.to("cpu"), chunk=64, device=CUDA)
    torch.testing.assert_close(ex, cpu, atol=2e-5, rtol=0)


def test_build_time_psi_constants_on_cuda_equal_cpu():
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw
    from gare_index.psi_consts import compute_rows

    model = _tiny_model(1)
    d, f, n = int(model.psi.dim), 12, 700
    frames, mask = _gallery(n, f, d, seed=5)
    vbar = (frames.float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    norms = vbar.norm(dim=-1)
    units = vbar / norms[:, None]
    fw = pfw.fold_weights(model.psi)
    w = pfv.packed_width(f)
    out_cpu, out_gpu = np.zeros((n, w), np.float32), np.zeros((n, w), np.float32)
    args = (frames.numpy(), mask.numpy().astype(np.uint8), units.numpy(), norms.numpy())
    compute_rows(fw, *args, out_cpu, device="cpu")
    compute_rows(fw, *args, out_gpu, device="cuda")
    pad = np.isinf(out_cpu)  # padded frames carry -inf attention offsets
    assert pad.any() and np.array_equal(np.isinf(out_gpu), pad) and np.array_equal(out_gpu[pad], out_cpu[pad])
    fin = np.where(pad, 0.0, out_cpu)
    scale = np.abs(fin).max(axis=0, keepdims=True) + 1.0  # per field: the packed fields differ in size
    np.testing.assert_allclose(np.where(pad, 0.0, out_gpu) / scale, fin / scale, atol=2e-5, rtol=0)
    rows = np.array([5, 99, 640], dtype=np.int64)  # a scattered subset (add/remove recompute rows)
    part = np.zeros((n, w), np.float32)
    compute_rows(fw, *args, part, rows, device="cuda")
    np.testing.assert_allclose(np.where(pad[rows], 0.0, part[rows]) / scale, fin[rows] / scale, atol=2e-5, rtol=0)
    assert not part[np.setdiff1d(np.arange(n), rows)].any()


def test_served_pair_scorer_on_cuda_equals_cpu():
    from gare_build.served_biases import fold_pair_scorer

    model = _tiny_model(2)
    d, f, n = int(model.psi.dim), 12, 200
    frames, mask = _gallery(n, f, d, seed=6)
    vbar = (frames.float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    norms = vbar.norm(dim=-1).numpy()
    units = (vbar / vbar.norm(dim=-1, keepdim=True)).numpy()
    queue = np.random.default_rng(0).standard_normal((9, d)).astype(np.float32)
    qi = np.repeat(np.arange(9), 20)  # queue order: each query's candidates together
    rows = np.random.default_rng(1).integers(0, n, qi.size)
    args = (queue, frames.numpy(), mask.numpy().astype(np.uint8), units, norms)
    cpu = fold_pair_scorer(model, *args)(qi, rows)
    gpu = fold_pair_scorer(model.to(CUDA), *args)(qi, rows)
    torch.testing.assert_close(gpu, cpu, atol=2e-5, rtol=0)
    scattered = np.random.default_rng(2).permutation(qi.size)  # one (query, video) at a time
    torch.testing.assert_close(fold_pair_scorer(model, *args)(qi[scattered], rows[scattered]), cpu[scattered], atol=2e-5, rtol=0)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_text_encoder_under_autocast_on_cuda_stays_close_to_fp32(precision):
    from gare_search.query import encode_queries

    model = _tiny_model(3)
    texts = ["a dog runs across a field", "a red car drives through a city at night", "someone is cooking"]
    ref = encode_queries(model, texts, "fp32")
    model = model.to(CUDA)
    got = encode_queries(model, texts, precision)
    assert got.device.type == "cuda" and got.dtype == torch.float32
    cos = F.cosine_similarity(got.cpu(), ref)
    assert cos.min() > (0.999 if precision == "fp16" else 0.99), cos


def _train_step(model, dev, precision, frames, mask, texts):
    """One forward (text, video, psi), the four losses and backward; (terms, grads) on the CPU in float64."""
    from gare.config import LossConfig
    from gare.model import autocast
    from gare_train.loss import gare_loss

    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    with autocast(dev, precision):
        t = model.encode_text(model.tokenize(texts)).to(dtype)
        Fv, vbar = model.encode_video(frames.to(dev, dtype), mask.to(dev))
    s, delta = model.pair_logits(t, Fv.to(dtype), mask.to(dev), vbar.to(dtype))
    terms = gare_loss(s, delta, model.clip.logit_scale, LossConfig())
    terms["total"].backward()
    grads = {k: p.grad.detach().double().cpu() for k, p in model.named_parameters() if p.grad is not None}
    return {k: float(v.detach()) for k, v in terms.items()}, grads


def _step_inputs(model):
    g = torch.Generator().manual_seed(7)
    frames = torch.randn(4, 3, 3, model.cfg.image_size, model.cfg.image_size, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return frames, mask, ["a man sings", "a cat jumps", "cars race on a track", "a woman cooks pasta"]


def test_training_step_on_cuda_equals_cpu_in_float64():
    """The same function on both devices: in float64 the losses and every gradient agree to ~1e-9.
    (In float32 the two devices round differently and this tiny model's logit scale of 100 amplifies that to
    ~1% in some gradient entries, which says nothing about the code; float64 does.)"""
    model = _tiny_model(4).double().eval()  # eval: dropout off (the two devices' generators differ)
    frames, mask, texts = _step_inputs(model)
    ref_terms, ref_grads = _train_step(model, torch.device("cpu"), "fp32", frames, mask, texts)
    got_terms, got_grads = _train_step(model.to(CUDA), CUDA, "fp32", frames, mask, texts)
    assert got_grads.keys() == ref_grads.keys() and len(ref_grads) > 10
    for k, v in ref_terms.items():
        assert abs(got_terms[k] - v) <= 1e-9 * max(1.0, abs(v)), (k, got_terms[k], v)
    for k, gref in ref_grads.items():
        torch.testing.assert_close(got_grads[k], gref, atol=1e-9 * (gref.abs().max().item() + 1e-6), rtol=1e-7, msg=k)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_step_on_cuda_in_each_precision_follows_float64(precision):
    """fp32 and autocast (bf16, fp16) steps on the GPU: finite, losses close to the float64 step, and the whole
    gradient pointing the same way (cosine), no further from float64 than the CPU's own fp32 step allows."""
    model = _tiny_model(4).eval()
    frames, mask, texts = _step_inputs(model)
    ref_terms, ref_grads = _train_step(model.double(), torch.device("cpu"), "fp32", frames, mask, texts)
    cpu_terms, cpu_grads = _train_step(model.float(), torch.device("cpu"), "fp32", frames, mask, texts)
    got_terms, got_grads = _train_step(model.to(CUDA), CUDA, precision, frames, mask, texts)
    flat = {name: torch.cat([gr[k].flatten() for k in ref_grads]) for name, gr in
            (("ref", ref_grads), ("cpu", cpu_grads), ("got", got_grads))}
    assert torch.isfinite(flat["got"]).all()
    cos_cpu = float(F.cosine_similarity(flat["cpu"], flat["ref"], dim=0))
    cos_got = float(F.cosine_similarity(flat["got"], flat["ref"], dim=0))
    tol = 1e-4 if precision == "fp32" else 5e-2
    for k, v in ref_terms.items():
        assert abs(got_terms[k] - v) <= tol * max(1.0, abs(v)), (k, got_terms[k], v)
    assert cos_got > (min(0.9999, cos_cpu - 1e-4) if precision == "fp32" else 0.98), (cos_got, cos_cpu)


def test_sinkhorn_biases_on_cuda_equal_cpu_at_scale():
    from gare.sinkhorn import normalization_error, sinkhorn_biases

    g = torch.Generator().manual_seed(8)
    q = F.normalize(torch.randn(2048, 64, generator=g), dim=-1)
    gal = F.normalize(torch.randn(50_000, 64, generator=g), dim=-1)
    a, b = sinkhorn_biases(q, gal, 0.02, chunk=8192)
    a2, b2 = sinkhorn_biases(q.to(CUDA), gal.to(CUDA), 0.02, chunk=8192)
    torch.testing.assert_close(b2, b, atol=2e-4, rtol=0)  # both returned on the CPU
    e_cpu = normalization_error(q, gal, 0.02, b)
    e_gpu = normalization_error(q.to(CUDA), gal.to(CUDA), 0.02, b2.to(CUDA))
    assert abs(float(e_cpu) - float(e_gpu)) < 1e-3


@pytest.mark.parametrize("kind", ["fp16"])
def test_half_precision_text_tower_on_cuda_stays_close_to_fp32(kind):
    """gare.text_quant's CUDA towers (half-precision weights, fp32 projection) against the CPU fp32 encoder."""
    from gare.text_quant import build_text_encoder
    from gare_search.query import encode_queries, trim_tokens

    model = _tiny_model(5)
    texts = ["a dog runs across a field", "a red car drives through a city at night", "someone is cooking"]
    ref = encode_queries(model, texts, "fp32")
    enc = build_text_encoder(model.to(CUDA), kind)
    got = enc(trim_tokens(model.tokenize(texts)))
    assert got.device.type == "cuda" and got.dtype == torch.float32
    cos = F.cosine_similarity(got.cpu(), ref)
    assert cos.min() > 0.999, cos


def test_uint8_frames_normalised_on_cuda_equal_the_cpu_float_frames():
    """The build sends uint8 frames from its decode workers and normalises them on the encoder's device: on the
    GPU the float32 frames are bit for bit load_frames' CPU ones (IEEE division and subtraction, same order)."""
    from gare.video import normalize_frames

    g = torch.Generator().manual_seed(0)
    u8 = torch.randint(0, 256, (3, 5, 3, 32, 32), generator=g, dtype=torch.uint8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    cpu = normalize_frames(u8, mask)
    gpu = normalize_frames(u8.to(CUDA), mask)
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    assert torch.equal(cpu[1, 2:], torch.zeros_like(cpu[1, 2:]))


def test_rerank_on_the_cpu_kernel_for_a_cuda_model_equals_the_cuda_rerank(model_and_index):
    """RerankSettings(device="cpu") with the model on CUDA: t comes back to the CPU and the compiled kernel scores the rows
    in the memory-mapped index; equal to the CUDA rerank (and to the CPU model's) within 2e-5, one query and a
    ragged batch."""
    from gare_search import query as Q
    from gare_search import rerank as R

    model, version, sh = model_and_index
    ids = np.asarray(version.ids)
    cands = [ids[::-1], ids[2:5], ids[:4]]
    ref = R.psi_scores(model, version, Q.encode_queries(model, sh["captions"][:3]), cands)
    m = model.to(CUDA)
    try:
        t = Q.encode_queries(m, sh["captions"][:3])
        assert t.device.type == "cuda"
        on_gpu = R.psi_scores(m, version, t, cands), R.psi_scores(m, version, t[:1], cands[:1])
        kw = {"settings": R.RerankSettings(device="cpu")}
        on_cpu = R.psi_scores(m, version, t, cands, **kw), R.psi_scores(m, version, t[:1], cands[:1], **kw)
    finally:
        model.to("cpu")
    for many, one in (on_gpu, on_cpu):
        for i in range(3):
            np.testing.assert_allclose(many[i], ref[i], atol=2e-5, rtol=0)
        np.testing.assert_allclose(one[0], ref[0], atol=2e-5, rtol=0)
