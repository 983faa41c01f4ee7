"""Issue 24: a query's embedding is the same bits alone and inside any batch, on every text tower, and the
service's encoder gives the offline path's bits (gare.text_quant's docstring has the scheme). Every tower and
scheme the CPU has (the model's own tower per text and at fixed shapes, int8, fp32-packed) is checked here with
real captions at several places in a batch and across fixed-shape chunks; the CUDA towers by the `gpu` tests.

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
from gare.text_fixed import DEFAULT_ROWS, FixedShapeEncoder
from gare.text_quant import CUDA_TEXT_ENCODERS, QMAX, TEXT_ENCODERS, build_text_encoder, encode_each
from gare_search import query as Q
from gare_search import search as S
from gare_search.text_encoder import load_query_encoder
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


def assert_invariant_at_places(encode: Callable[[list[str]], torch.Tensor], texts: list[str]) -> torch.Tensor:
    """Each text alone == its row in the batch of all texts rotated by 0, 5 and 19 (every text at three places)
    == its rows in a batch of len(texts) + 9 (> 32: a fixed-shape encoder's chunks crossed, the first 9 texts
    again in the last chunk); torch.equal. Returns the texts alone (a, d)."""
    alone = torch.cat([encode([t]) for t in texts])
    for k in (0, 5, 19):
        got = encode(texts[k:] + texts[:k])
        differ = [(i + k) % len(texts) for i in range(len(texts)) if not torch.equal(got[i], alone[(i + k) % len(texts)])]
        assert not differ, f"rotated by {k}: {len(differ)} texts differ from alone, e.g. {texts[differ[0]]!r}"
    assert torch.equal(encode(texts + texts[:9]), torch.cat([alone, alone[:9]]))
    return alone


def test_model_encoder_is_batch_invariant(model, captions):
    """The model's own encoder (the service's `text_encoder: fp32`, the offline default)."""
    assert_batch_invariant(model_own(model), captions)


# every scheme the model's own tower has on the CPU: name -> (precision, scheme, rows); per text is the CPU
# default, "fixed" the code CUDA runs by default (rows 32: one chunk per 32 texts; rows 8: four chunks). bf16's
# fixed shape passes the same build-time check (tests/training/test_text_fixed.py)
OWN_CPU_SCHEMES = {
    "fp32-per-text": ("fp32", "per-text", DEFAULT_ROWS),
    "fp32-fixed": ("fp32", "fixed", DEFAULT_ROWS),
    "fp32-fixed-8rows": ("fp32", "fixed", 8),
}


@pytest.mark.parametrize("name", list(OWN_CPU_SCHEMES))
def test_model_encoder_schemes_are_invariant_at_every_place(model, captions, name):
    """The model's own tower as the service builds it (load_query_encoder) and as encode_queries runs it with the
    same scheme: a text alone == inside 32 mixed-length texts at three places and across chunks, bit for bit."""
    precision, scheme, rows = OWN_CPU_SCHEMES[name]
    enc = load_query_encoder(model, "fp32", "cpu", precision, scheme=scheme, rows=rows)
    assert isinstance(enc.tower, FixedShapeEncoder) == (scheme == "fixed")
    if scheme == "fixed":  # this CPU keeps a row's bits at the fixed shape: if it did not, the tower says so here
        assert enc.tower.fixed, enc.tower.failures
        assert enc.variant == f"model-{precision}@{rows}x{model.cfg.max_words}"
    else:
        assert enc.variant == precision
    alone = assert_invariant_at_places(enc.encode, captions)
    offline = S.encode_queries(model, captions, precision, scheme=scheme, rows=rows)
    assert torch.equal(offline, alone)


@pytest.mark.parametrize("kind", CPU_TOWERS)
def test_cpu_tower_is_invariant_at_every_place(model, captions, kind):
    assert_invariant_at_places(with_tower(model, kind), captions)


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


CUDA_KINDS = [*CUDA_TEXT_ENCODERS, "model-fp32", "model-fp16", "model-bf16"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture()
def cuda_model(model):
    """The module's model on the GPU for one test, back on the CPU after it."""
    yield model.to("cuda")
    model.to("cpu")


def cuda_encoder(model: GARE, kind: str, cuda_graph: bool, rows: int = DEFAULT_ROWS):
    """The service's encoder for a CUDA kind: the fp16 tower, or "model-<precision>" the model's own tower."""
    if kind.startswith("model-"):
        return load_query_encoder(model, "fp32", "cuda", kind.removeprefix("model-"), rows=rows, cuda_graph=cuda_graph)
    return load_query_encoder(model, kind, "cuda", "fp32", rows=rows, cuda_graph=cuda_graph)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", CUDA_KINDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_cuda_encoders_are_batch_invariant(cuda_model, captions, kind, graph):
    """The CUDA schemes (fixed shapes, eager and replayed from a CUDA graph): a text alone == inside 32
    mixed-length texts at three places and across chunks, bit for bit. The encoder must run the fixed shape
    (a device whose kernels round a row by its place fails here, naming what its build-time check found) and,
    with `graph`, the captured graph (a failed capture fails here)."""
    enc = cuda_encoder(cuda_model, kind, graph)
    assert isinstance(enc.tower, FixedShapeEncoder)
    assert enc.tower.fixed, f"{kind}: the fixed shape breaks invariance on this GPU: {enc.tower.failures}"
    assert enc.tower.graph == graph, f"{kind}: CUDA graph capture failed (see the warning)"
    assert_invariant_at_places(enc.encode, captions)
    assert_batch_invariant(enc.encode, captions)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", CUDA_KINDS)
def test_cuda_graph_equals_eager_and_offline(cuda_model, captions, kind):
    """The graph replays the eager forward's kernels: the same bits; and the offline path (encode_queries, eager
    at the default rows) gives the service's bits."""
    eager, graph = cuda_encoder(cuda_model, kind, False), cuda_encoder(cuda_model, kind, True)
    assert graph.tower.graph and eager.variant == graph.variant
    want = eager.encode(captions)
    assert torch.equal(graph.encode(captions), want)
    if kind.startswith("model-"):
        assert torch.equal(S.encode_queries(cuda_model, captions, kind.removeprefix("model-")), want)
    else:
        assert torch.equal(S.encode_queries(cuda_model, captions, tower=build_text_encoder(cuda_model, kind)), want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", CUDA_KINDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_cuda_batch_of_32_is_one_forward(cuda_model, captions, kind, graph):
    """The cost claim in calls, not time: 32 texts are one fixed-shape forward (or graph replay), 41 texts two,
    one text one."""
    enc = cuda_encoder(cuda_model, kind, graph).tower
    for texts, passes in ((captions, 1), (captions + captions[:9], 2), (captions[:1], 1)):
        before = enc.forward_passes
        enc(cuda_model.tokenize(texts))
        assert enc.forward_passes - before == passes, (len(texts), enc.forward_passes - before)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_refuses_moved_weights(cuda_model, captions):
    """A captured graph reads the weights where they were at capture: after the model moved it raises instead of
    reading freed memory."""
    enc = cuda_encoder(cuda_model, "model-fp32", True)
    assert enc.tower.graph
    enc.encode(captions[:2])
    cuda_model.to("cpu")
    cuda_model.to("cuda")
    with pytest.raises(RuntimeError, match="weights moved since its CUDA graph was captured"):
        enc.encode(captions[:2])
