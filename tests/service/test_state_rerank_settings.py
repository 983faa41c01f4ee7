"""The service hands its rerank settings to every search it runs (gare_serve.engine.state.ServiceState), built from
its own settings: no library global is set, so two states in one process keep their own."""

from __future__ import annotations

from gare_search import rerank
from gare_search import search as S
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.state import ServiceState
from tests.service.support import settings


def test_each_state_passes_its_own_rerank_settings(monkeypatch):
    got: list[rerank.RerankSettings] = []
    monkeypatch.setattr(S, "search_batch", lambda *a, rerank_settings, **kw: got.append(rerank_settings) or [])
    on_cpu = ServiceState(settings("unused-index", rerank_device="cpu"), Metrics())
    on_model = ServiceState(settings("unused-index", rerank_device="model"), Metrics())
    for state in (on_cpu, on_model, on_cpu):
        state.search_batch("model", "version", ["a text"])
    assert got == [rerank.RerankSettings(device="cpu"), rerank.RerankSettings(device="model"),
                   rerank.RerankSettings(device="cpu")]
