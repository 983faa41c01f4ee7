"""gare.text_packed: the fp32 packed tower equals the model's tower up to float rounding, its GEMMs keep to the row
counts the build-time check covers, the check catches a GEMM that rounds by the batch, and such a machine gets
one text at a time (still batch-invariant)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gare.model import GARE
from gare.text_packed import (
    MAX_ROWS,
    ROW_BLOCK,
    Fp32RowLinear,
    PackedTextTower,
    rows_independent,
)
from gare.text_quant import TextTower, encode_each, fp32_packed_encoder
from tests.training.test_text_determinism import assert_batch_invariant, load_captions
from tests.training.test_text_quant import TEXTS, trained_tiny


@pytest.fixture(scope="module")
def model() -> GARE:
    return trained_tiny()


@pytest.fixture(scope="module")
def captions() -> list[str]:
    return load_captions()


def rounds_by_batch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A GEMM like some machine's might be: the same product, rounded differently once a call has > 16 rows
    (the relative change, 2^-20, is a few float32 ulps)."""
    y = F.linear(x, w, b)
    return y + y * 2.0**-20 if x.shape[0] > ROW_BLOCK else y


def with_gemm(tower: PackedTextTower, gemm) -> PackedTextTower:
    for m in tower.modules():
        if isinstance(m, Fp32RowLinear):
            m.gemm = gemm
    return tower


def test_packed_tower_equals_the_model_tower(model):
    """The same function as the model's own tower (each text alone), apart from a GEMM's rounding."""
    tokens = model.tokenize(TEXTS)
    packed = PackedTextTower(TextTower.from_model(model), Fp32RowLinear)
    with torch.inference_mode():
        ref = encode_each(model.encode_text, tokens)
        got = packed(tokens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32 and all(p.dtype == torch.float32 for p in packed.buffers() if p.is_floating_point())


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 255, 256, 257, 600])
def test_row_linear_calls_only_checked_row_counts(rows):
    """Any number of rows: the output of nn.Linear, from GEMMs of 16, 32, ..., MAX_ROWS rows only."""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(48, 80)
    row = Fp32RowLinear(lin)
    calls: list[int] = []

    def counting(x, w, b):  # the real product, its row counts recorded
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    row.gemm = counting
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        got = row(x)
        want = lin(x)
    assert got.shape == (rows, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls and all(c % ROW_BLOCK == 0 and ROW_BLOCK <= c <= MAX_ROWS for c in calls), calls
    assert sum(calls) == -(-rows // ROW_BLOCK) * ROW_BLOCK


@pytest.fixture(scope="module")
def vit_b32_tower() -> tuple[TextTower, object]:
    """ViT-B/32's text tower (random weights, open_clip's own config) and its tokenizer: the shapes served."""
    import open_clip

    clip = open_clip.create_model("ViT-B-32-quickgelu", pretrained=None)
    return TextTower.from_model(clip), open_clip.get_tokenizer("ViT-B-32-quickgelu")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size", ["tiny", "vit-b-32"])
def test_the_checks_verdict_holds(model, captions, vit_b32_tower, threads, size):
    """Where this machine's GEMM passes the check at a thread count, the packed tower run batched gives every text
    the bits it gets alone; where it fails (here: 2 threads split ViT-B/32's K = 2048 product between them),
    the encoder falls back to one text at a time, which is invariant. Both branches run on this machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tower, tokenize = (TextTower.from_model(model), model.tokenize) if size == "tiny" else vit_b32_tower
        packed = PackedTextTower(tower, Fp32RowLinear)
        failures = rows_independent(packed)
        tokens = tokenize(captions)
        if not failures:
            with torch.inference_mode():
                batch = packed(tokens)
                rev = packed(tokens.flip(0)).flip(0)
                alone = torch.cat([packed(tokens[i : i + 1]) for i in range(len(captions))])
            assert torch.equal(batch, alone) and torch.equal(rev, batch)
        else:
            enc = fp32_packed_encoder(packed)
            assert enc.per_text
            assert_batch_invariant(lambda texts: enc(tokenize(texts)), captions)
    finally:
        torch.set_num_threads(before)


def test_check_catches_a_gemm_that_rounds_by_the_batch(model, captions):
    tower = with_gemm(PackedTextTower(TextTower.from_model(model), Fp32RowLinear), rounds_by_batch)
    failures = rows_independent(tower)
    assert failures and "32-row GEMM" in failures[0], failures
    # what the check protects: packed on that GEMM, a text's bits depend on its batch
    tokens = model.tokenize(captions)
    with torch.inference_mode():
        batch = tower(tokens)
        alone = torch.cat([tower(tokens[i : i + 1]) for i in range(len(captions))])
    assert not torch.equal(batch, alone)


def test_failed_check_falls_back_to_one_text_at_a_time(model, captions, caplog):
    tower = with_gemm(PackedTextTower(TextTower.from_model(model), Fp32RowLinear), rounds_by_batch)
    with caplog.at_level("WARNING", logger="gare.text_quant"):
        enc = fp32_packed_encoder(tower)
    assert enc.per_text and "not row-independent" in caplog.text
    assert_batch_invariant(lambda texts: enc(model.tokenize(texts)), captions)

