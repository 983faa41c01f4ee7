"""The GARE model against naive references: per-pair psi loop, block-wise scoring, text encoder, masking."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gare.backbone import open_clip_module
from gare.model import GARE, autocast
from gare.psi import masked_mean


@torch.no_grad()
def naive_pair_score(model: GARE, t: torch.Tensor, frames: torch.Tensor, n_real: int) -> tuple[float, torch.Tensor]:
    """SPEC §2 for one pair, written out with explicit weights and Python-level loops over frames."""
    psi, d = model.psi, t.shape[0]
    Fj = frames[:n_real]  # only real frames
    vbar = Fj.mean(0)
    ln1 = lambda x: F.layer_norm(x, (d,), psi.ln1.weight, psi.ln1.bias)  # noqa: E731
    h, C = ln1(vbar - t), ln1(Fj)
    Q = psi.q.weight @ h + psi.q.bias
    K = C @ psi.k.weight.T + psi.k.bias
    V = C @ psi.v.weight.T + psi.v.bias
    logits = torch.stack([K[f] @ Q / math.sqrt(d) for f in range(n_real)])
    w = torch.exp(logits - logits.max())
    w = w / w.sum()
    attn = sum(w[f] * V[f] for f in range(n_real))
    A = F.layer_norm(psi.o.weight @ attn + psi.o.bias, (d,), psi.ln2.weight, psi.ln2.bias)
    Out = F.layer_norm(A + psi.ffn.weight @ A + psi.ffn.bias, (d,), psi.ln3.weight, psi.ln3.bias)
    delta = psi.mu.weight @ Out + psi.mu.bias
    pw = torch.stack([torch.exp(t @ Fj[f] / model.cfg.temp) for f in range(n_real)])
    p = sum((pw[f] / pw.sum()) * Fj[f] for f in range(n_real))
    x = t + delta
    return float(x @ p / (x.norm() * p.norm())), delta


def _features(model: GARE, b: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    f, s = model.cfg.max_frames, model.cfg.image_size
    frames = torch.randn(b, f, 3, s, s, generator=g)
    mask = torch.ones(b, f, dtype=torch.long)
    for j in range(b):  # some videos shorter than max_frames
        mask[j, f - (j % 3):] = 0
    with torch.no_grad():
        Fe, vbar = model.encode_video(frames, mask)
    return Fe, vbar, mask


def test_psi_score_matches_naive_loop(tiny_model):
    model = tiny_model
    texts = ["a red circle moves left", "two blue squares", "a green triangle then a circle"]
    with torch.no_grad():
        t = model.encode_text(model.tokenize(texts))
        Fe, vbar, mask = _features(model, 5)
        s, delta = model.score(t, Fe, mask, return_delta=True)
    assert s.shape == (3, 5) and delta.shape == (3, 5, model.cfg.embed_dim)
    assert delta.abs().mean() > 0.05  # psi really contributes
    for i in range(3):
        for j in range(5):
            ref, ref_delta = naive_pair_score(model, t[i], Fe[j], int(mask[j].sum()))
            assert abs(float(s[i, j]) - ref) < 1e-5, (i, j)
            torch.testing.assert_close(delta[i, j], ref_delta, atol=1e-5, rtol=1e-5)
    # and psi matters: the score differs from the plain pooled cosine
    assert (s - F.cosine_similarity(t[:, None], Fe.sum(1)[None], dim=-1)).abs().max() > 1e-3


def test_blockwise_equals_one_block(tiny_model):
    with torch.no_grad():
        t = tiny_model.encode_text(tiny_model.tokenize([f"caption number {i}" for i in range(7)]))
        Fe, vbar, mask = _features(tiny_model, 11)
        full = tiny_model.score(t, Fe, mask, block_texts=1000, block_videos=1000)
        for bt, bv in [(1, 1), (2, 3), (4, 5), (7, 11)]:
            torch.testing.assert_close(tiny_model.score(t, Fe, mask, block_texts=bt, block_videos=bv), full, atol=1e-6, rtol=0)
        # precomputed K/V and v̄ (the index-time cache) give the same scores
        kv = tiny_model.video_kv(Fe)
        torch.testing.assert_close(tiny_model.score(t, Fe, mask, vbar=vbar, kv=kv, block_videos=4), full, atol=1e-6, rtol=0)


def test_padded_frames_do_not_matter(tiny_model):
    with torch.no_grad():
        t = tiny_model.encode_text(tiny_model.tokenize(["a cat"]))
        Fe, vbar, mask = _features(tiny_model, 3)
        assert (Fe[mask == 0] == 0).all()  # padded rows are zeroed by the encoder
        torch.testing.assert_close(vbar, masked_mean(Fe, mask))
        garbage = Fe.clone()
        garbage[mask == 0] = torch.randn_like(garbage[mask == 0]) * 10
        torch.testing.assert_close(tiny_model.score(t, garbage, mask), tiny_model.score(t, Fe, mask), atol=1e-6, rtol=0)


def test_video_encoder_ignores_padded_frame_content(tiny_model):
    cfg = tiny_model.cfg
    frames = torch.randn(1, cfg.max_frames, 3, cfg.image_size, cfg.image_size)
    mask = torch.ones(1, cfg.max_frames, dtype=torch.long)
    mask[0, 3:] = 0
    other = frames.clone()
    other[0, 3:] = torch.randn_like(other[0, 3:])
    with torch.no_grad():
        a, va = tiny_model.encode_video(frames, mask)
        b, vb = tiny_model.encode_video(other, mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(va, vb, atol=1e-5, rtol=0)


def test_text_encoder_equals_open_clip(tiny_model):
    texts = ["a person is connecting something to system", "a little girl does gymnastics"]
    tok = open_clip_module().get_tokenizer(tiny_model.cfg.backbone)(texts)  # full context
    with torch.no_grad():
        ref = tiny_model.clip.encode_text(tok)
        ours = tiny_model.encode_text(tok[:, : tiny_model.cfg.max_words])
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        # shorter token windows give the same EOT feature for short captions (causal mask)
        torch.testing.assert_close(tiny_model.encode_text(tok[:, :10]), ref, atol=1e-5, rtol=1e-5)


def test_temporal_initialised_from_text_tower(tiny_cfg):
    model = GARE.build(tiny_cfg)
    torch.testing.assert_close(model.temporal.frame_position_embeddings.weight, model.clip.positional_embedding)
    for i, blk in enumerate(model.temporal.transformer.resblocks):
        src = model.clip.transformer.resblocks[i].state_dict()
        for k, v in blk.state_dict().items():
            assert torch.equal(v, src[k]), (i, k)
    assert len(model.temporal.transformer.resblocks) == tiny_cfg.temporal_layers
    # new Linear layers: N(0, 0.02), zero bias
    assert torch.equal(model.psi.q.bias, torch.zeros_like(model.psi.q.bias))
    assert 0.01 < float(model.psi.q.weight.std()) < 0.03


def test_16bit_frame_storage_deviation(tiny_model):
    """Frame features stored as fp16 / bf16 (the index format) against fp32: the score deviation."""
    with torch.no_grad():
        t = tiny_model.encode_text(tiny_model.tokenize([f"query {i}" for i in range(8)]))
        Fe, vbar, mask = _features(tiny_model, 32)
        ref = tiny_model.score(t, Fe, mask)
        dev16 = (tiny_model.score(t, Fe.half(), mask) - ref).abs().max().item()
        devbf = (tiny_model.score(t, Fe.bfloat16(), mask) - ref).abs().max().item()
    # measured here: fp16 ~1e-4, bf16 ~1e-3 (8 mantissa bits); scores are cosines in [-1, 1]
    assert dev16 < 2e-3, dev16
    assert devbf < 2e-2, devbf
    assert dev16 < devbf


def test_bf16_autocast_on_cpu(tiny_model):
    with torch.no_grad(), autocast("cpu", "bf16"):
        t = tiny_model.encode_text(tiny_model.tokenize(["a dog runs"]))
        Fe, _, mask = _features(tiny_model, 2)
    with torch.no_grad():
        t32 = tiny_model.encode_text(tiny_model.tokenize(["a dog runs"]))
    assert t.dtype == torch.float32
    assert F.cosine_similarity(t, t32).item() > 0.98
