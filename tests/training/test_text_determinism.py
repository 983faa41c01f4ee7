"""Issue 24: a query's embedding is the same bits alone and inside any batch, on every text tower, and the
service's encoder gives the offline path's bits (gare.text_quant's docstring has the scheme).

Before the fix the int8 tower quantised activations with one scale per batch, and every tower saw the batch's
padding and row count: run on that code, the model's own encoder and the int8 tower gave other bits for a caption
alone than in the batch (int8 up to 0.13 in a coordinate, fp32 ~1e-6).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gare.model import GARE
from gare.text_quant import CUDA_TEXT_ENCODERS, QMAX, TEXT_ENCODERS, build_text_encoder, encode_each
from gare_search import query as Q
from gare_search import search as S
from gare_serve.engine.batch_worker import Job
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.state import ServiceState
from tests.conftest import require
from tests.service.support import settings
from tests.training.test_text_quant import trained_tiny

# the 1k-A test captions of MSR-VTT, next to the repository (../shared/data/msrvtt), or in GARE_MSRVTT_ANNO (where
# bench/gpu_check.sh points it on a lent GPU machine, to the copy bench/gpu_carry.sh put in .gpuassets)
CAPTIONS_CSV = Path(os.environ.get("GARE_MSRVTT_ANNO", Path(__file__).resolve().parents[3] / "shared" / "data" / "msrvtt")
                    ) / "MSRVTT_JSFUSION_test.csv"
CPU_TOWERS = [k for k in TEXT_ENCODERS if k not in CUDA_TEXT_ENCODERS]  # int8, fp32-packed
SERVICE_CPU_TOWERS = ["fp32", "int8", "fp32-packed"]  # the service's fp32 is the model's own encoder


@pytest.fixture(scope="module")
def captions() -> list[str]:
    return load_captions()


def load_captions() -> list[str]:
    """32 real captions of mixed lengths, shuffled: every 31st of the test split sorted by length (3 to 19
    words: the longest fill the tiny model's 16-token context, the shortest leave most of it padding)."""
    require(CAPTIONS_CSV.exists(), f"the MSR-VTT test captions at {CAPTIONS_CSV}")
    with open(CAPTIONS_CSV, encoding="utf-8", newline="") as fh:
        rows = [r["sentence"] for r in csv.DictReader(fh)]
    ranked = sorted(rows, key=lambda s: (len(s.split()), s))
    picked = ranked[:: max(1, len(ranked) // 32)][:32]
    assert len(picked) == 32 and len({len(s.split()) for s in picked}) >= 10
    return [picked[i] for i in torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()]


@pytest.fixture(scope="module")
def model() -> GARE:
    return trained_tiny()


def model_own(model: GARE) -> Callable[[list[str]], torch.Tensor]:
    return lambda texts: S.encode_queries(model, texts)


def with_tower(model: GARE, kind: str) -> Callable[[list[str]], torch.Tensor]:
    tower = build_text_encoder(model, kind)
    return lambda texts: S.encode_queries(model, texts, tower=tower)


def assert_batch_invariant(encode: Callable[[list[str]], torch.Tensor], texts: list[str]) -> None:
    """Every text alone == its row in the batch of all of them == its row in the reversed batch (torch.equal)."""
    batch = encode(texts)
    rev = encode(texts[::-1]).flip(0)
    assert batch.shape == (len(texts), batch.shape[1]) and batch.dtype == torch.float32
    differ = [i for i, t in enumerate(texts) if not torch.equal(encode([t])[0], batch[i])]
    assert not differ, f"{len(differ)} of {len(texts)} texts encode differently alone, e.g. {texts[differ[0]]!r}"
    assert torch.equal(rev, batch)


def test_model_encoder_is_batch_invariant(model, captions):
    """The model's own encoder (the service's `text_encoder: fp32`, the offline default)."""
    assert_batch_invariant(model_own(model), captions)


@pytest.mark.parametrize("kind", CPU_TOWERS)
def test_cpu_tower_is_batch_invariant(model, captions, kind):
    assert_batch_invariant(with_tower(model, kind), captions)


@pytest.mark.parametrize("kind", CPU_TOWERS)
def test_tower_ignores_padding_and_trimming(model, captions, kind):
    """The tower called on tokens padded to the context, trimmed to the batch's longest text, or one text alone
    at its own length: the same bits (the service once trimmed, the offline path did not)."""
    enc = build_text_encoder(model, kind)
    tokens = model.tokenize(captions)
    full = enc(tokens)
    assert torch.equal(enc(Q.trim_tokens(tokens)), full)
    alone = torch.cat([enc(tokens[i : i + 1, : int(tokens[i].argmax()) + 1]) for i in range(len(captions))])
    assert torch.equal(alone, full)


def test_model_encoder_matches_plain_batched_encoder(model, captions):
    """Each text alone is the same function as the batched encoder, only without the batch's rounding."""
    tokens = model.tokenize(captions)
    with torch.inference_mode():
        ref = model.encode_text(tokens)
        got = encode_each(model.encode_text, tokens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(S.encode_queries(model, captions), got)


def test_int8_products_are_summed_exactly():
    """The int8 tower's products at the extremes (+-QMAX, all one sign, K = 2048 like a ViT-B c_proj) give the
    exact integer sums whatever the row count: the GEMM's blocking cannot change them."""
    g = torch.Generator().manual_seed(0)
    K, N = 2048, 96
    w = torch.randint(-QMAX, QMAX + 1, (N, K), generator=g, dtype=torch.int8)
    w[:8] = QMAX
    w[8:16] = -QMAX
    for m in (1, 7, 33):
        q = torch.randint(-QMAX, QMAX + 1, (m, K), generator=g, dtype=torch.int8)
        q[0] = QMAX
        got = torch._int_mm(q, w.t())
        assert torch.equal(got.long(), q.long() @ w.t().long())


@pytest.fixture(scope="module")
def service_states(service_env):
    """kind -> a loaded ServiceState serving the test index with that text encoder (built once per kind)."""
    states: dict[str, ServiceState] = {}

    def get(kind: str) -> ServiceState:
        if kind not in states:
            st = ServiceState(settings(service_env["index"], text_encoder=kind), Metrics())
            st.load()
            states[kind] = st
        return states[kind]

    yield get
    for st in states.values():
        st.close()


@pytest.mark.parametrize("kind", SERVICE_CPU_TOWERS)
def test_service_encoder_equals_offline(service_states, captions, kind):
    """The service's encoder (any micro-batch) == the offline encode_queries with a tower built anew from the
    same model, bit for bit; and a served search == the offline search() with that tower."""
    st = service_states(kind)
    assert st.encoder.kind == kind
    tower = None if kind == "fp32" else build_text_encoder(st.model, kind)
    offline = S.encode_queries(st.model, captions, tower=tower)
    assert torch.equal(st.encoder.encode(captions), offline)
    assert torch.equal(st.encoder.encode(captions[5:6]), offline[5:6])
    opts = S.SearchOptions(k=5)
    with st.use_version() as v:
        for q in captions[:3]:  # one request alone: the served hits are the offline ones, every float equal
            assert st.run_jobs([Job(v, q, opts)])[0].hits == S.search(st.model, v, q, opts, tower=tower).hits
        # a micro-batch of 8 (embeddings from the cache now): same ranking; the batched rerank may round the
        # scores differently in the last bits (tests/service/test_serve_scale.py), the embeddings do not
        served = st.run_jobs([Job(v, q, opts) for q in captions[:8]])
        for q, r in zip(captions[:8], served, strict=True):
            want = S.search(st.model, v, q, opts, tower=tower)
            assert [h.id for h in r.hits] == [h.id for h in want.hits]
            assert [h.score for h in r.hits] == pytest.approx([h.score for h in want.hits], abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", [*CUDA_TEXT_ENCODERS, "model-fp32", "model-fp16", "model-bf16"])
def test_cuda_encoders_are_batch_invariant(model, captions, kind):
    """The same scheme on CUDA: the half-precision towers and the model's own encoder under autocast."""
    m = model.to("cuda")
    try:
        if kind.startswith("model-"):
            precision = kind.removeprefix("model-")
            assert_batch_invariant(lambda texts: S.encode_queries(m, texts, precision), captions)
        else:
            assert_batch_invariant(with_tower(m, kind), captions)
    finally:
        model.to("cpu")
