"""The psi rerank's device and threads travel with each search (gare_search.rerank.RerankSettings): no module
global is consulted, so two searches in one process with different choices each get their own."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gare import psi_fold_cpu
from gare_search import query as Q
from gare_search import rerank as R
from gare_search import search as S
from gare_search import shard_search as SH


def test_no_process_wide_switch_is_left():
    for name in ("RERANK_DEVICE", "RERANK_THREADS"):
        assert not hasattr(R, name), f"gare_search.rerank.{name} is a module global again"


def test_settings_are_checked():
    assert R.RerankSettings() == R.DEFAULT_RERANK == R.RerankSettings(device="model", threads=None)
    with pytest.raises(ValueError, match="rerank device must be one of"):
        R.RerankSettings(device="gpu")
    with pytest.raises(ValueError, match="rerank threads must be >= 1"):
        R.RerankSettings(threads=0)
    assert R.RerankSettings(threads=3).thread_count() == 3
    assert R.RerankSettings().thread_count() == max(1, torch.get_num_threads())


def _record_threads(monkeypatch):
    """psi_fold_cpu.scores wrapped to record the `threads` each rerank asked for."""
    seen: list[int] = []
    real = psi_fold_cpu.scores

    def scores(q, arrays, idx, *, threads=1):
        seen.append(threads)
        return real(q, arrays, idx, threads=threads)

    monkeypatch.setattr(psi_fold_cpu, "scores", scores)
    return seen


def test_two_searches_with_different_threads_each_get_their_own(model_and_index, monkeypatch):
    """Interleaved searches (one query, a batch, a shard's candidates) with threads 1, 3 and the default: each
    rerank runs with its own search's choice, and the scores do not depend on it."""
    model, version, sh = model_and_index
    seen = _record_threads(monkeypatch)
    texts = sh["captions"][:3]
    t = Q.encode_queries(model, texts)
    one, three = R.RerankSettings(threads=1), R.RerankSettings(threads=3)
    runs = [(three, 3), (one, 1), (R.DEFAULT_RERANK, max(1, torch.get_num_threads())), (three, 3), (one, 1)]
    answers = []
    for settings, want in runs:
        seen.clear()
        res = S.search_batch(model, version, texts[:1], encoder=lambda _texts: t[:1], rerank_settings=settings)
        batch = S.search_batch(model, version, texts, encoder=lambda _texts: t, rerank_settings=settings)
        parts = SH.shard_candidates(model, version, t, S.SearchOptions(), rerank_settings=settings)
        assert seen == [want, want, want]
        answers.append(([h.psi_score for h in res[0].hits], [[h.psi_score for h in r.hits] for r in batch],
                        [p.psi for p in parts]))
    for got in answers[1:]:
        assert got[0] == answers[0][0] and got[1] == answers[0][1]
        assert all(np.array_equal(a, b) for a, b in zip(got[2], answers[0][2], strict=True))


def test_warm_up_follows_the_settings_it_is_given(monkeypatch):
    """A model on a GPU compiles the CPU kernel only for a rerank placed on the CPU, call by call."""
    calls: list[str] = []
    monkeypatch.setattr(R, "psi_fold_cpu", SimpleNamespace(available=lambda: True,
                                                           warm_up=lambda: calls.append("kernel")))
    monkeypatch.setattr(R, "psi_fold_cpu_queries", SimpleNamespace(warm_up=lambda: calls.append("queries")))
    gpu = torch.device("cuda")  # a device object only: nothing runs there
    R.warm_up(gpu, R.RerankSettings(device="model"))
    assert calls == []
    R.warm_up(gpu, R.RerankSettings(device="cpu"))
    assert calls == ["kernel", "queries"]
    R.warm_up(gpu)  # the default: where the model is
    assert calls == ["kernel", "queries"]
    R.warm_up("cpu", R.RerankSettings(device="model"))  # a CPU model: the kernel either way
    assert calls == ["kernel", "queries"] * 2
