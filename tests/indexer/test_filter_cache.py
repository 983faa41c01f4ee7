"""What a filter passes, kept per version (gare_index.filter_cache): the id bitmap of both paths against a
naive one, the LRU's byte bound, and on a real version: a repeated filter is not evaluated again, its cached rows
equal a fresh evaluation, callers cannot edit them, and a search by example's exclusions never reach the cache."""

from __future__ import annotations

import numpy as np
import pytest

from gare_index.filter_cache import FilterCache, FilterRows, id_bitmap
from gare_index.filters import FieldTable, evaluate
from gare_search import search as S
from gare_search.filtered import filtered_stage1
from tests.indexer.test_filtered_search import TEXTS, _gallery


def naive_bitmap(mask: np.ndarray, ids: np.ndarray) -> set[int]:
    return {int(i) for i, ok in zip(ids, mask, strict=True) if ok}


def bits_to_ids(bits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist())


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
def test_id_bitmap_equals_the_naive_set_on_both_paths(n):
    rng = np.random.default_rng(n)
    mask = rng.random(n) < 0.3
    dense = np.arange(n, dtype=np.int64)
    assert bits_to_ids(id_bitmap(mask, dense, ids_are_rows=True)) == naive_bitmap(mask, dense)
    assert bits_to_ids(id_bitmap(mask, dense, ids_are_rows=False)) == naive_bitmap(mask, dense)
    gappy = np.sort(rng.choice(5 * n + 3, n, replace=False)).astype(np.int64)[rng.permutation(n)]  # any row order
    assert bits_to_ids(id_bitmap(mask, gappy, ids_are_rows=False)) == naive_bitmap(mask, gappy)


def entry(n: int, seed: int) -> FilterRows:
    """A distinct entry per seed, every one of the same size (n // 2 rows pass)."""
    mask = np.random.default_rng(seed).permutation(n) < n // 2
    return FilterRows(mask, np.packbits(mask, bitorder="little"), int(mask.sum()))


def test_the_cache_keeps_entries_within_its_bytes_least_recently_used_first():
    one = entry(1000, 0).nbytes
    cache = FilterCache(max_bytes=3 * one + 10)  # room for three entries
    built: list[str] = []

    def get(key: str, seed: int) -> bool:
        def build() -> FilterRows:
            built.append(key)
            return entry(1000, seed)
        return cache.get(key, build)[1]

    assert [get(k, i) for i, k in enumerate("abc")] == [False, False, False]
    assert get("a", 0) is True  # a is now the most recent
    assert cache.nbytes <= cache.max_bytes
    get("d", 3)  # evicts b, the least recently used
    assert get("a", 0) and get("c", 2) and get("d", 3)
    assert get("b", 1) is False and built == ["a", "b", "c", "d", "b"]
    assert cache.hits == 4 and cache.misses == 5 and len(cache) == 3 and cache.nbytes <= cache.max_bytes
    small = FilterCache(max_bytes=one // 2)  # an entry larger than the whole cache is answered, not kept
    got, hit = small.get("x", lambda: entry(1000, 9))
    assert not hit and got.passing == entry(1000, 9).passing and len(small) == 0 and small.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        FilterCache(-1)


@pytest.fixture(scope="module")
def version_env(tmp_path_factory, ckpt):
    model, v = _gallery(tmp_path_factory.mktemp("fcache") / "INDEX", ckpt, "ivf")
    yield model, v
    v.close()


def test_a_repeated_filter_is_taken_from_the_cache_and_equals_a_fresh_evaluation(version_env):
    model, v = version_env
    schema = v.field_schema
    fresh = FieldTable(v.n, schema, lambda name: v._field_column(name, schema[name]))  # a table of its own
    for spec in ({"channel": "news"}, {"$or": [{"channel": "film"}, {"tags": "a"}]}, {"year": {"$gte": 2010}}):
        f = v.compile_filter(spec)
        first, hit1 = v.filter_rows(f)
        again, hit2 = v.filter_rows(v.compile_filter(dict(reversed(list(spec.items())))))  # same canonical text
        assert (hit1, hit2) == (False, True) and again is first
        want = evaluate(f, fresh)
        np.testing.assert_array_equal(first.mask, want)
        assert first.passing == int(want.sum())
        np.testing.assert_array_equal(first.rows, np.flatnonzero(want))
        assert bits_to_ids(first.bits) == naive_bitmap(want, v.ids)
        with pytest.raises(ValueError, match="read-only"):
            first.mask[0] = not first.mask[0]
        with pytest.raises(ValueError, match="read-only"):
            first.rows[0] = 0


def test_the_plan_says_cached_and_an_exclusion_never_reaches_the_cache(version_env):
    model, v = version_env
    f = v.compile_filter({"channel": {"$in": ["music", "film"]}})
    units = np.asarray(v.stage1_units[:2], dtype=np.float32)
    fr, _ = v.filter_rows(f)
    before = fr.mask.copy()
    excluded = v.ids[fr.rows[:5]]
    for below in (0.0, 1.0):  # the ANN plan and the exact plan
        _, ids, plan = filtered_stage1(v, units, 30, f, ncl_stage1=False, exact_below=below, exclude=excluded)
        assert plan.cached is True and plan.as_dict()["filter_cached"] is True
        assert plan.passing == int(before.sum()) - 5
        for row in ids:
            assert not set(row.tolist()) & set(excluded.tolist())
    np.testing.assert_array_equal(v.filter_rows(f)[0].mask, before)  # the cached entry is untouched
    # a new filter: evaluated once (not cached), then cached, and over the service's path the answer is the same
    g = v.compile_filter({"year": {"$lt": 2003}})
    o = S.SearchOptions(k=5, candidates=20, filter=g)
    a, b = S.search_batch(model, v, TEXTS[:1], o)[0], S.search_batch(model, v, TEXTS[:1], o)[0]
    assert (a.plan.cached, b.plan.cached) == (False, True)
    assert [(h.id, h.score) for h in a.hits] == [(h.id, h.score) for h in b.hits]
