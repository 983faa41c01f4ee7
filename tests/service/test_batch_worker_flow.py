"""The micro-batch worker's plain interface (gare_serve.engine.batch_worker): it embeds the texts itself (query
cache in front of the encoder), hands those embeddings to one search call per index version, feeds the query bank
with their unit rows and returns the results in the jobs' order, with the cache hits marked. No model: a fake
encoder and a fake search record what they are given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare_search import search as S
from gare_serve.engine.batch_worker import BatchSearch, Job, run_batch
from gare_serve.engine.query_cache import QueryCache
from gare_serve.engine.traffic_bank import QueryBank

DIM = 4


class FakeEncoder:
    """Texts -> rows that depend on the text only; counts the texts it encodes."""

    variant = "fp32"
    precision = "fp32"

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode(self, texts: list[str]) -> torch.Tensor:
        self.encoded.extend(texts)
        return torch.stack([torch.arange(1, DIM + 1, dtype=torch.float32) * (len(t) + 1) + sum(map(ord, t)) % 7
                            for t in texts])


class FakeSearch:
    """gare_search.search.search_batch's signature: records each call, answers one hit per text (its row in the
    call) with fixed stage timings."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, model, version, texts, options, *, encoder=None, **kw):
        t = encoder(list(texts))
        self.calls.append({"model": model, "version": version, "texts": list(texts), "options": list(options),
                           "t": t, "kw": kw})
        return [S.QueryResult([S.Hit(id=i, score=float(t[i].sum()), ann_score=0.0, psi_score=None, bias=0.0)],
                              {"encode": 0.25, "ann": 0.5, "total": 1.0}) for i in range(len(texts))]


def _search(tmp_path, cache_entries: int = 0, bank: bool = False):
    enc, search = FakeEncoder(), FakeSearch()
    bs = BatchSearch(
        model="the model", encoder=enc, search_batch=search, checkpoint_sha="sha",
        query_cache=QueryCache(cache_entries, 1 << 20) if cache_entries else None,
        query_bank=QueryBank(16, DIM, tmp_path / "bank.npy") if bank else None,
    )
    return bs, enc, search


def test_one_search_per_version_results_in_job_order(tmp_path):
    bs, enc, search = _search(tmp_path)
    v1, v2 = object(), object()
    o = S.SearchOptions(k=1, candidates=1)
    jobs = [Job(v1, "a dog", o), Job(v2, "a cat runs", o), Job(v1, "rain", o), Job(v2, "x", o)]
    out = run_batch(bs, jobs)
    assert [c["version"] for c in search.calls] == [v1, v2]
    assert [c["texts"] for c in search.calls] == [["a dog", "rain"], ["a cat runs", "x"]]
    assert all(c["model"] == "the model" and c["options"] == [o, o] for c in search.calls)
    # each result is the one its text got in its version's call
    want = {q: float(enc.encode([q])[0].sum()) for q in ("a dog", "a cat runs", "rain", "x")}
    assert [r.hits[0].score for r in out] == [want[j.query] for j in jobs]
    assert not any(r.cached for r in out)


def test_the_search_gets_the_embeddings_the_worker_made_and_the_bank_them_too(tmp_path):
    bs, enc, search = _search(tmp_path, bank=True)
    texts = ["a dog", "a red circle", "a dog"]
    run_batch(bs, [Job("v", q, S.SearchOptions()) for q in texts])
    (call,) = search.calls
    assert torch.equal(call["t"], FakeEncoder().encode(texts))
    assert enc.encoded == texts  # no query cache: every text through the encoder, once
    # the bank keeps t as served, |t| included (psi is not scale-invariant; the tuner and the biases score these rows)
    np.testing.assert_array_equal(bs.query_bank.snapshot(), call["t"].numpy())
    assert not np.allclose(np.linalg.norm(call["t"].numpy(), axis=1), 1.0)  # unit rows would fail the line above


def test_query_cache_hits_skip_the_encoder_and_report_no_encode_time(tmp_path):
    bs, enc, search = _search(tmp_path, cache_entries=8)
    o = S.SearchOptions()
    first = run_batch(bs, [Job("v", "a dog", o), Job("v", "a cat", o)])
    assert enc.encoded == ["a dog", "a cat"]
    assert not any(r.cached for r in first)
    assert all(r.timings["encode"] >= 0.25 and r.timings["total"] >= 1.0 for r in first)
    again = run_batch(bs, [Job("v", "a cat", o), Job("v", "a fox", o)])
    assert enc.encoded == ["a dog", "a cat", "a fox"]  # the hit did not reach the encoder
    assert [r.cached for r in again] == [True, False]
    assert again[0].timings["encode"] == 0.0 and again[1].timings["encode"] >= 0.25
    assert all(r.timings["total"] >= 1.0 for r in again)
    # the cached embedding is the one the encoder made: the same hit score as the first time
    assert again[0].hits[0].score == pytest.approx(first[1].hits[0].score)


def test_the_recall_watch_sees_the_version_through_its_wrapper(tmp_path):
    class Watch:
        def wrap(self, version):
            return ("wrapped", version)

    enc, search = FakeEncoder(), FakeSearch()
    bs = BatchSearch(model=None, encoder=enc, search_batch=search, recall_watch=Watch())
    run_batch(bs, [Job("v", "a dog", S.SearchOptions())])
    assert search.calls[0]["version"] == ("wrapped", "v")
