"""gare.text_fixed: every tower call has the one shape (rows, context), the fixed-shape result is the per-text
function up to float rounding, the build-time check catches a tower that rounds a row by its neighbours (that
device then gets each text alone, still invariant), and the search's encoder names the scheme in its variant."""

from __future__ import annotations

import logging

import pytest
import torch

from gare.model import GARE
from gare.text_fixed import DEFAULT_ROWS, FixedShapeEncoder, autocast_tower, fit_context, resolve_scheme
from gare.text_quant import PROBE_TEXTS, describe, encode_each, model_encoder
from gare_search import query as Q
from gare_search.text_encoder import TextEncoderError, load_query_encoder
from tests.training.test_text_determinism import assert_invariant_at_places, load_captions
from tests.training.test_text_quant import trained_tiny


@pytest.fixture(scope="module")
def model() -> GARE:
    return trained_tiny()


@pytest.fixture(scope="module")
def captions() -> list[str]:
    return load_captions()


class Recording:
    """A tower (the model's own encode_text), recording the shape of every call it gets."""

    def __init__(self, encode) -> None:
        self.encode = encode
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(tokens.shape))
        return self.encode(tokens)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 32, 41])
def test_every_tower_call_has_the_fixed_shape(model, captions, n):
    """n texts (tokens as the tokenizer pads them, or trimmed to the longest) -> ceil(n / rows) calls, each of
    exactly (rows, context); the rows kept are the real texts', in order."""
    rec = Recording(model.encode_text)
    enc = FixedShapeEncoder(rec, 8, model.cfg.max_words, "cpu")
    texts = (captions * 2)[:n]
    tokens = model.tokenize(texts)
    full = enc(tokens)
    assert rec.shapes == [(8, model.cfg.max_words)] * -(-n // 8)
    assert full.shape == (n, model.cfg.embed_dim) and full.dtype == torch.float32
    assert enc.forward_passes == len(rec.shapes)
    rec.shapes.clear()
    assert torch.equal(enc(Q.trim_tokens(tokens)), full)  # fewer columns: padded back to the context
    assert rec.shapes == [(8, model.cfg.max_words)] * -(-n // 8)


def test_the_search_encoder_calls_the_model_at_the_fixed_shape_only(model, captions, monkeypatch):
    """The service's encoder with the fixed scheme (built, its device check run, before recording): every call
    of the model's encode_text is (rows, context), 35 texts in 5 calls of 8 rows."""
    enc = load_query_encoder(model, "fp32", "cpu", "fp32", scheme="fixed", rows=8)
    rec = Recording(model.encode_text)
    monkeypatch.setattr(model, "encode_text", rec)
    t = enc.encode(captions + captions[:3])
    assert rec.shapes == [(8, model.cfg.max_words)] * 5 and t.shape == (35, model.cfg.embed_dim)


def test_fixed_shape_equals_per_text_up_to_rounding(model, captions):
    """The same function as each text alone at its own length. Not bitwise: the fixed shape runs the text's
    tokens in other shapes ((rows, context) instead of (1, its length)), whose GEMM blocking and attention
    kernels may sum in another order; the difference is float32 rounding (~1e-6 here), not a different
    computation."""
    tokens = model.tokenize(captions)
    fixed = model_encoder(model, rows=8)(tokens)
    with torch.inference_mode():
        each = encode_each(model.encode_text, tokens)
        batched = model.encode_text(tokens)
    torch.testing.assert_close(fixed, each, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fixed, batched, rtol=1e-5, atol=1e-5)


def test_the_cpu_passes_the_fixed_shape_check(model):
    """This CPU keeps a row's bits at the fixed shape for the model's tower at fp32 and bf16 (if it did not, the
    fixed-shape scheme would run each text alone, and this test shows it)."""
    for precision in ("fp32", "bf16"):
        enc = model_encoder(model, precision, rows=8)
        assert enc.fixed and enc.failures == [], enc.failures
        assert enc.scheme == f"fixed 8x{model.cfg.max_words}" and enc.shape_key == f"8x{model.cfg.max_words}"
        assert describe(enc) == f"model-{precision} (fixed 8x{model.cfg.max_words})"


def test_check_catches_a_tower_that_rounds_by_its_neighbours(model, captions, caplog):
    """A tower whose rows see the rest of the batch (here: a shift by the batch's token count, 1e-6 relative,
    like a kernel whose reduction depends on the other rows) fails the build-time check; the encoder says so and
    runs each text alone, which is invariant again."""

    def by_batch(tokens: torch.Tensor) -> torch.Tensor:
        t = model.encode_text(tokens)
        return t * (1 + 1e-6 * float((tokens != 0).sum()) / tokens.numel())

    with caplog.at_level(logging.WARNING, logger="gare.text_fixed"):
        enc = FixedShapeEncoder(by_batch, 8, model.cfg.max_words, "cpu", probe=model.tokenize(list(PROBE_TEXTS)),
                                kind="test")
    assert not enc.fixed and enc.shape_key is None and "rounds differently" in enc.failures[0]
    assert "do not keep a row's bits" in caplog.text and enc.scheme.startswith("per text")
    tokens = model.tokenize(captions[:9])
    with torch.inference_mode():
        assert torch.equal(enc(tokens), encode_each(by_batch, tokens))
    assert_invariant_at_places(lambda texts: enc(model.tokenize(texts)), captions)
    plain = FixedShapeEncoder(by_batch, 8, model.cfg.max_words, "cpu")  # no probe: no check, fixed shapes
    a, b = plain(tokens[:1]), plain(tokens)[:1]
    assert plain.fixed and not torch.equal(a, b)  # what the check protects against


def test_fit_context():
    tok = torch.tensor([[49406, 320, 49407, 0, 0]])
    assert torch.equal(fit_context(tok, 8), torch.tensor([[49406, 320, 49407, 0, 0, 0, 0, 0]]))
    assert torch.equal(fit_context(tok, 3), tok[:, :3])
    with pytest.raises(ValueError, match="4 tokens does not fit the encoder's context of 3"):
        fit_context(torch.tensor([[49406, 320, 321, 49407]]), 3)


def test_bad_arguments_name_the_value(model):
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        FixedShapeEncoder(model.encode_text, 0, 16, "cpu")
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device, not cpu"):
        FixedShapeEncoder(model.encode_text, 8, 16, "cpu", cuda_graph=True)
    with pytest.raises(ValueError, match="unknown text encoding scheme 'batched'"):
        resolve_scheme("batched", "cpu")
    with pytest.raises(ValueError, match="fp16 autocast is only supported on CUDA"):
        autocast_tower(model.encode_text, "cpu", "fp16")
    with pytest.raises(TextEncoderError, match="rows must be >= 1, got -1"):
        load_query_encoder(model, "fp32", "cpu", "fp32", scheme="fixed", rows=-1)
    with pytest.raises(TextEncoderError, match="unknown text encoding scheme 'fast'"):
        load_query_encoder(model, "fp32", "cpu", "fp32", scheme="fast")


def test_schemes_by_device_and_their_variants(model):
    """auto: fixed shapes on CUDA, per text on the CPU; the CPU towers pack rows whatever the rows. The variant
    (the query cache's key part) changes with the fixed shape, since the shape changes the bits."""
    assert resolve_scheme("auto", "cuda") == "fixed" and resolve_scheme("auto", "cpu") == "per-text"
    own = load_query_encoder(model, "fp32", "cpu", "fp32")
    assert own.tower is None and own.variant == "fp32" and own.rows is None
    assert own.describe() == "fp32 (the model's own tower at fp32; per text)"
    fixed = load_query_encoder(model, "fp32", "cpu", "fp32", scheme="fixed")
    L = model.cfg.max_words
    assert fixed.rows == DEFAULT_ROWS and fixed.variant == f"model-fp32@{DEFAULT_ROWS}x{L}"
    assert fixed.describe() == f"fp32 (the model's own tower at fp32; fixed {DEFAULT_ROWS}x{L})"
    assert load_query_encoder(model, "fp32", "cpu", "fp32", scheme="fixed", rows=8).variant == f"model-fp32@8x{L}"
    int8 = load_query_encoder(model, "int8", "cpu", "fp32", rows=8)
    assert int8.variant == "int8" and int8.rows is None and int8.describe() == "int8 (packed rows)"


def test_encode_queries_runs_one_forward_for_32_texts(model, captions):
    """encode_queries with the fixed scheme: 32 texts cost one forward of the cached encoder, one text one."""
    enc = Q.own_encoder(model, "fp32", scheme="fixed")
    assert enc is Q.own_encoder(model, "fp32", scheme="fixed")  # built (and checked) once per model
    before = enc.forward_passes
    Q.encode_queries(model, captions, scheme="fixed")
    Q.encode_queries(model, captions[:1], scheme="fixed")
    assert enc.forward_passes - before == 2
