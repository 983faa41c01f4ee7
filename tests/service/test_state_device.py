"""The service places the served index version where its settings say (gare_serve.engine.state.ServiceState.on_device):
a resident copy (gare_index.resident_version) when ``gpu_index_devices`` names devices or the model is on CUDA, the
memory-mapped version otherwise; answers are the plain version's, /readyz shows the stage-1 choice, a reload places
the new version too, and the text tower gets the service's fixed-shape row count."""

from __future__ import annotations

import asyncio

import numpy as np

from gare_build.build import remove
from gare_index.resident_version import ResidentVersion
from gare_index.store import IndexVersion
from gare_serve.app import create_app
from gare_serve.engine.reload import reload
from tests.service.support import copy_index, running_app, settings

HANG_S = 300
QUIET = dict(index_poll_s=0, recall_sample_rate=0, result_cache_entries=0, query_cache_entries=0)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


async def _answers(app, texts):
    async with running_app(app) as c:
        state = c._transport.app.state.gare
        out = [(await c.post("/v1/search", json={"query": q, "k": 8})).json() for q in texts]
        ready = (await c.get("/readyz")).json()
        return state, out, ready


def test_cpu_model_serves_the_mapped_version_and_passes_its_text_batching(service_env):
    texts = service_env["captions"][:3]
    state, fixed, ready = _run(_answers(create_app(settings(
        service_env["index"], device="cpu", text_encoder="fp32", text_batching="fixed", text_batch_rows=8, **QUIET)),
        texts))
    assert isinstance(state.handle.version, IndexVersion) and state.stage1 is None and "stage1" not in ready
    assert state.encoder.rows == 8 and state.encoder.variant.startswith("model-fp32@8x")
    per_text, plain, _ = _run(_answers(create_app(settings(service_env["index"], device="cpu", text_encoder="fp32",
                                                           **QUIET)), texts))
    assert per_text.encoder.rows is None and per_text.encoder.variant == "fp32"  # the CPU default: each text alone
    for a, b in zip(fixed, plain, strict=True):  # other shapes, other rounding: the same hits within float error
        np.testing.assert_allclose([h["score"] for h in a["results"]], [h["score"] for h in b["results"]],
                                   atol=1e-4, rtol=0)


def test_named_devices_serve_a_resident_copy_with_the_same_answers(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")
    texts = service_env["captions"][:6]
    _, plain, _ = _run(_answers(create_app(settings(idx, device="cpu", **QUIET)), texts))
    for method in ("exact", "auto"):
        state, got, ready = _run(_answers(create_app(settings(
            idx, device="cpu", gpu_index_devices="cpu,cpu", stage1_method=method, **QUIET)), texts))
        assert isinstance(state.handle.version, ResidentVersion)
        st = ready["stage1"]
        assert st["resident"] is True and st["devices"] == ["cpu", "cpu"] and st["method"] in ("exact", "ann")
        if method == "exact":
            assert st["method"] == "exact" and "forced" in st["reason"]
        else:  # measured: both p50s recorded
            assert st["exact_p50_ms"] > 0 and st["ann_p50_ms"] > 0
        for a, b in zip(got, plain, strict=True):  # the test index is flat: exact stage 1 finds the same shortlist
            assert [h["id"] for h in a["results"]] == [h["id"] for h in b["results"]]
            np.testing.assert_allclose([h["score"] for h in a["results"]], [h["score"] for h in b["results"]],
                                       atol=1e-5, rtol=0)


def test_a_reload_places_the_new_version_too(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")

    async def go():
        async with running_app(create_app(settings(idx, device="cpu", gpu_index_devices="cpu", stage1_method="exact",
                                                   **QUIET))) as c:
            state = c._transport.app.state.gare
            first = state.handle.version
            remove(str(idx), ["4"])  # writes v000002
            r = await reload(state, broadcast=False)  # what POST /v1/admin/reload runs (keys: tests/service/test_service.py)
            hits = (await c.post("/v1/search", json={"query": service_env["captions"][4], "k": 16})).json()
            return first, state.handle.version, r, hits

    first, now, r, hits = _run(go())
    assert r["reloaded"] and r["version"] == "v000002", r
    assert isinstance(first, ResidentVersion) and isinstance(now, ResidentVersion) and now.name == "v000002"
    assert hits["index_version"] == "v000002" and 4 not in [h["id"] for h in hits["results"]]
