"""Issue 14 in process: the query-embedding cache on the request path and the text-encoder option."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from gare.checkpoint import load_model
from gare_search import search as S
from gare_search.text_encoder import load_query_encoder
from gare_serve.app import create_app
from gare_serve.engine.batch_worker import Job
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.startup import StartupError
from gare_serve.engine.state import ServiceState
from tests.service.support import make_checkpoint, settings


class CountingEncoder:
    """Counts calls of the real model's encode_text (and the rows each call encoded); changes nothing."""

    def __init__(self, model):
        self.model, self.inner, self.rows = model, model.encode_text, []

    def __enter__(self):
        def counted(tokens, *a, **kw):
            self.rows.append(int(tokens.shape[0]))
            return self.inner(tokens, *a, **kw)

        self.model.encode_text = counted
        return self

    def __exit__(self, *exc):
        del self.model.encode_text  # back to the class method


def _ids_scores(body):
    return [(h["id"], h["score"]) for h in body["results"]]


def test_repeated_query_does_not_run_the_encoder(service_env):
    sh = service_env
    app = create_app(settings(sh["index"]))
    q, q2 = sh["captions"][0], sh["captions"][1]
    with TestClient(app) as c, CountingEncoder(app.state.gare.model) as enc:
        first = c.post("/v1/search", json={"query": q, "k": 5}).json()
        assert enc.rows == [1] and first["timings_ms"]["cache"] == "miss" and first["timings_ms"]["encode"] > 0
        # the same text, as the tokenizer sees it (case, spacing): no encoder call, identical results
        again = c.post("/v1/search", json={"query": "  " + q.upper().replace(" ", "   ") + " ", "k": 5}).json()
        assert enc.rows == [1]
        assert again["timings_ms"]["cache"] == "hit" and again["timings_ms"]["encode"] == 0
        assert _ids_scores(again) == _ids_scores(first)
        # batch route: the hit is skipped, the miss is encoded alone (one row), both equal the offline search
        batch = c.post("/v1/search/batch", json={"queries": [q, q2], "k": 5}).json()
        assert enc.rows == [1, 1]
        assert [r["timings_ms"]["cache"] for r in batch["results"]] == ["hit", "miss"]
        # a batch of two queries shares the folded constants in one matmul: same ranking, scores equal to
        # float32 rounding (not bit for bit)
        got, want = _ids_scores(batch["results"][0]), _ids_scores(first)
        assert [i for i, _ in got] == [i for i, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) < 1e-6
        state = app.state.gare
        with state.use_version() as v:
            off = S.search(state.model, v, q2, S.SearchOptions(k=5))
        assert [h["id"] for h in batch["results"][1]["results"]] == [h.id for h in off.hits]
        assert [h["score"] for h in batch["results"][1]["results"]] == pytest.approx([h.score for h in off.hits], abs=1e-5)
        text = c.get("/metrics").text
        assert 'gare_query_cache_lookups_total{result="hit"} 2.0' in text
        assert 'gare_query_cache_lookups_total{result="miss"} 2.0' in text


def test_cache_off_runs_the_encoder_every_time(service_env):
    sh = service_env
    app = create_app(settings(sh["index"], query_cache_entries=0))
    with TestClient(app) as c, CountingEncoder(app.state.gare.model) as enc:
        for _ in range(3):
            r = c.post("/v1/search", json={"query": sh["captions"][2], "k": 3}).json()
            assert r["timings_ms"]["cache"] == "miss"
        assert enc.rows == [1, 1, 1]


def test_another_checkpoint_never_gets_old_embeddings(service_env, tmp_path):
    """The key holds the checkpoint sha256: after a model swap the same text is encoded by the new model."""
    sh = service_env
    st = ServiceState(settings(sh["index"]), Metrics())
    st.load()
    try:
        q = sh["captions"][3]
        opts = S.SearchOptions(k=5)
        with st.use_version() as v:
            r1 = st.run_jobs([Job(v, q, opts)])[0]
            assert not r1.cached and st.run_jobs([Job(v, q, opts)])[0].cached
            other = make_checkpoint(tmp_path / "other.safetensors", seed=7)
            st.model, _ = load_model(other, st.device)
            # the query encoder belongs to the model: a model swap builds the same kind of tower on the new one
            st.encoder = load_query_encoder(st.model, st.encoder.kind, st.device, st.precision)
            st.checkpoint_sha = "other-" + st.checkpoint_sha
            with CountingEncoder(st.model) as enc:
                r2 = st.run_jobs([Job(v, q, opts)])[0]
            assert enc.rows == [1] and not r2.cached
            want = S.search(st.model, v, q, opts)
            assert [h.id for h in r2.hits] == [h.id for h in want.hits]
            assert [h.score for h in r2.hits] == pytest.approx([h.score for h in want.hits], abs=1e-5)
            assert [h.score for h in r2.hits] != pytest.approx([h.score for h in r1.hits], abs=1e-4)
    finally:
        st.close()


def test_reload_keeps_results_and_cache_is_keyed_by_checkpoint(service_env, tmp_path):
    """A reload to a version of the same checkpoint keeps serving cached embeddings correctly."""
    from gare_build.build import remove
    from tests.service.support import copy_index

    sh = service_env
    idx = copy_index(sh["index"], tmp_path / "index")
    app = create_app(settings(idx, api_keys="k"))
    q = sh["captions"][4]
    with TestClient(app) as c:
        c.post("/v1/search", json={"query": q, "k": 16})
        remove(str(idx), ["4"])
        assert c.post("/v1/admin/reload", headers={"X-API-Key": "k"}).json()["version"] == "v000002"
        r = c.post("/v1/search", json={"query": q, "k": 16}).json()
        assert r["timings_ms"]["cache"] == "hit" and r["index_version"] == "v000002"
        state = app.state.gare
        with state.use_version() as v:
            off = S.search(state.model, v, q, S.SearchOptions(k=16))
        assert [h["id"] for h in r["results"]] == [h.id for h in off.hits]


def test_int8_text_encoder_option(service_env):
    sh = service_env
    st = ServiceState(settings(sh["index"], text_encoder="int8"), Metrics())
    st.load()
    try:
        assert st.encoder.kind == "int8" and st.encoder.variant == "int8" and st.encoder.tower is not None
        texts = sh["captions"][:6]
        t8 = st.encoder.encode(texts)
        t32 = S.encode_queries(st.model, texts, "fp32")
        cos = torch.nn.functional.cosine_similarity(t8, t32, dim=-1)
        assert t8.shape == t32.shape and bool((cos > 0.98).all()), cos
        assert not torch.equal(t8, t32)  # really the quantised tower
    finally:
        st.close()


def test_auto_text_encoder_is_the_measured_cpu_default(service_env):
    """`text_encoder` defaults to auto: DEFAULT_CPU_TEXT_ENCODER on the CPU at fp32 (tests/test_evidence.py checks
    it is the measured winner), the model's own tower at another precision (no startup error)."""
    from gare.text_quant import DEFAULT_CPU_TEXT_ENCODER
    from gare_serve.settings import Settings

    assert Settings.model_fields["text_encoder"].default == "auto"
    sh = service_env
    st = ServiceState(settings(sh["index"], text_encoder="auto"), Metrics())
    st.load()
    try:
        assert st.encoder.kind == DEFAULT_CPU_TEXT_ENCODER and st.encoder.variant == DEFAULT_CPU_TEXT_ENCODER
        assert (st.encoder.tower is not None) == (DEFAULT_CPU_TEXT_ENCODER != "fp32")
    finally:
        st.close()
    st = ServiceState(settings(sh["index"], text_encoder="auto", precision="bf16"), Metrics())
    st.load()
    try:
        assert st.encoder.kind == "fp32" and st.encoder.variant == "bf16"
    finally:
        st.close()


def test_text_encoder_needs_fp32_precision(service_env):
    sh = service_env
    with pytest.raises(StartupError, match="int8"):
        ServiceState(settings(sh["index"], text_encoder="int8", precision="bf16"), Metrics()).load()


def test_cli_text_encoder_and_workers_options():
    from gare_serve.cli import build_parser, settings_from_args

    s = settings_from_args(build_parser().parse_args(["--index", "x", "--text-encoder", "int8", "--workers", "3"]))
    assert s.text_encoder == "int8" and s.workers == 3


def test_rerank_device_setting(service_env, monkeypatch):
    """--rerank-device / GARE_RERANK_DEVICE reach the rerank settings the service passes to its searches; other
    values are refused by name."""
    import typing

    from gare_search import rerank
    from gare_serve.cli import build_parser, settings_from_args
    from gare_serve.settings import Settings

    assert settings_from_args(build_parser().parse_args(["--index", "x", "--rerank-device", "cpu"])).rerank_device == "cpu"
    # the setting, the CLI and the rerank module name the same choices
    (action,) = [a for a in build_parser()._actions if a.dest == "rerank_device"]
    assert tuple(action.choices) == typing.get_args(Settings.model_fields["rerank_device"].annotation) == rerank.RERANK_DEVICES
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--index", "x", "--rerank-device", "gpu"])
    monkeypatch.setenv("GARE_RERANK_DEVICE", "gpu")
    with pytest.raises(ValueError, match="rerank_device"):
        Settings(index=service_env["index"])
    monkeypatch.delenv("GARE_RERANK_DEVICE")
    state = ServiceState(settings(service_env["index"], rerank_device="cpu"), Metrics())
    state.load()
    assert state.rerank_settings == rerank.RerankSettings(device="cpu")
