"""gare.text_quant: the stand-alone tower equals the model's encoder; the int8 tower agrees with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gare.config import get_model_config
from gare.model import GARE
from gare.text_quant import (
    CUDA_TEXT_ENCODERS,
    QMAX,
    TEXT_ENCODERS,
    Int8Linear,
    TextTower,
    build_text_encoder,
    quantize_int8,
)

TEXTS = ["a red dog runs across a field", "a man plays the guitar at night", "two purple crosses move down",
         "a", "a yellow square sits still, then a violet plus sign bounces quickly on a black screen"]


def trained_tiny(steps: int = 15) -> GARE:
    """gare-test-tiny with its text tower trained briefly (contrastive, text vs fixed targets), so that
    weights and activations have the structure training gives them rather than the init's."""
    torch.manual_seed(0)
    m = GARE.build(get_model_config("gare-test-tiny"))
    texts = [f"a {c} {s} moves {d}" for c in ("red", "blue", "green", "pink") for s in ("dog", "box", "star") for d in ("up", "left")]
    tokens = m.tokenize(texts)
    targets = F.normalize(torch.randn(len(texts), m.cfg.embed_dim), dim=-1)
    opt = torch.optim.AdamW([p for n, p in m.clip.named_parameters() if not n.startswith("visual")], lr=5e-3)
    losses = []
    for _ in range(steps):
        t = F.normalize(m.encode_text(tokens), dim=-1)
        loss = F.cross_entropy(t @ targets.T / 0.05, torch.arange(len(texts)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"the tiny text tower did not train (losses {losses[0]:.3f} -> {losses[-1]:.3f})"
    return m.eval()


@pytest.fixture(scope="module")
def model() -> GARE:
    return trained_tiny()


def test_tower_equals_model_encoder(model):
    tokens = model.tokenize(TEXTS)
    with torch.inference_mode():
        ref = model.encode_text(tokens)
        got = TextTower.from_model(model)(tokens)
        got_short = TextTower.from_model(model)(tokens[:, :10])  # L < context: same modules, sliced
        ref_short = model.encode_text(tokens[:, :10])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_short, ref_short, rtol=1e-5, atol=1e-5)


def test_int8_quantises_every_block_linear(model):
    q = quantize_int8(TextTower.from_model(model))
    assert not any(isinstance(m, torch.nn.Linear) for m in q.blocks.modules())  # no fp32 Linear left
    lins = [m for m in q.blocks.modules() if isinstance(m, Int8Linear)]  # q/k/v, out, c_fc, c_proj per block
    assert len(lins) == 4 * len(q.blocks)
    for m in lins:  # 7-bit codes (QMAX: exact sums on every x86 int8 kernel), one scale per output channel
        assert m.weight.dtype == torch.int8 and int(m.weight.abs().max()) == QMAX
        assert m.weight_scale.shape == (m.weight.shape[0],)


@pytest.mark.parametrize("kind", [k for k in TEXT_ENCODERS if k not in CUDA_TEXT_ENCODERS])
def test_encoders_agree_with_fp32_on_a_trained_model(model, kind):
    tokens = model.tokenize(TEXTS)
    with torch.inference_mode():
        ref = model.encode_text(tokens)
    out = build_text_encoder(model, kind)(tokens)
    assert out.shape == ref.shape and out.dtype == torch.float32
    cos = F.cosine_similarity(out, ref)
    assert float(cos.min()) > 0.99, (kind, cos)
    # norms too (psi uses |t|)
    torch.testing.assert_close(out.norm(dim=1), ref.norm(dim=1), rtol=0.05, atol=0.0)


def test_int8_is_not_the_identity(model):
    """Guards the comparison above: int8 must differ from fp32 (else the test would not test anything)."""
    tokens = model.tokenize(TEXTS)
    with torch.inference_mode():
        ref = model.encode_text(tokens)
    assert not torch.allclose(build_text_encoder(model, "int8")(tokens), ref, atol=1e-6)


def test_bad_kind_and_cuda_are_refused(model):
    with pytest.raises(ValueError, match="unknown text encoder 'int4'"):
        build_text_encoder(model, "int4")

    class OnCuda:  # a model reporting a CUDA device (no GPU needed to check the refusal)
        device = torch.device("cuda:0")
        clip = model.clip

    for kind in TEXT_ENCODERS:
        if kind in CUDA_TEXT_ENCODERS:
            continue
        with pytest.raises(ValueError, match="CPU option.*use fp16"):
            build_text_encoder(OnCuda(), kind)
    for kind in CUDA_TEXT_ENCODERS:  # and the half-precision towers are refused on the CPU
        with pytest.raises(ValueError, match=f"'{kind}'.*CUDA option"):
            build_text_encoder(model, kind)
