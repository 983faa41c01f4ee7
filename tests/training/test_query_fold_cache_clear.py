"""QueryFoldCache.clear: a benchmark that times a query met for the first time empties the rerank's cache in place
(the rerank keeps its one cache object; nothing outside rerank.py assigns it)."""

from __future__ import annotations

import torch

from gare import psi_fold_queries as pfq
from gare_search import rerank as R
from tests.training.test_psi_fold import random_psi


def test_clear_forgets_every_query_and_restarts_the_counters():
    fold = pfq.as_fold(random_psi(16, 3))
    cache = pfq.QueryFoldCache(8)
    t = torch.randn(3, 16)
    first = cache.fold(t, fold, 0.5)
    cache.fold(t[:1], fold, 0.5)
    assert (len(cache), cache.misses, cache.hits) == (3, 3, 1)
    cache.clear()
    assert (len(cache), cache.misses, cache.hits) == (0, 0, 0)
    again = cache.fold(t, fold, 0.5)  # every row is a miss again, and the same vectors
    assert (len(cache), cache.misses, cache.hits) == (3, 3, 0)
    assert torch.equal(again.u, first.u) and torch.equal(again.sc, first.sc)


def test_the_rerank_cache_is_cleared_in_place():
    cache = R.QUERY_FOLDS
    cache.fold(torch.randn(1, 16), pfq.as_fold(random_psi(16, 1)), 0.5)
    assert len(cache) >= 1
    cache.clear()
    assert R.QUERY_FOLDS is cache and len(cache) == 0
