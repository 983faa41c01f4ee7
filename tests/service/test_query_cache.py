"""gare_serve.engine.query_cache: LRU order, both bounds, key normalisation, checkpoint separation, threads, metrics."""

from __future__ import annotations

import threading

import open_clip
import pytest
import torch
from prometheus_client import CollectorRegistry

from gare_serve.engine.query_cache import ENTRY_OVERHEAD_BYTES, QueryCache, default_normalize, make_normalizer
from gare_serve.settings import Settings

D = 8


def vec(i: float, d: int = D) -> torch.Tensor:
    return torch.full((d,), float(i))


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def entry_bytes(text: str, ckpt: str = "c", variant: str = "", d: int = D) -> int:
    return 4 * d + len(ckpt) + len(variant) + len(text.encode()) + ENTRY_OVERHEAD_BYTES


def test_get_put_roundtrip_returns_a_copy():
    c = QueryCache(10, 1 << 20)
    assert c.get("dog", "c") is None
    c.put("dog", "c", vec(3).to(torch.float64))
    got = c.get("dog", "c")
    assert got is not None and got.dtype == torch.float32 and torch.equal(got, vec(3))
    got.add_(1)  # the caller's copy, not the cached tensor
    assert torch.equal(c.get("dog", "c"), vec(3))


def test_lru_order_and_entry_bound():
    reg = CollectorRegistry()
    c = QueryCache(3, 1 << 20, registry=reg)
    for i, t in enumerate(["a", "b", "c"]):
        c.put(t, "k", vec(i))
    assert c.get("a", "k") is not None  # a is now the most recent: order b, c, a
    c.put("d", "k", vec(9))  # evicts b (least recent), not a
    assert [k[2] for k in c.keys()] == ["c", "a", "d"]
    assert c.get("b", "k") is None
    assert len(c) == 3
    assert sample(reg, "gare_query_cache_evictions_total", reason="entries") == 1
    # re-putting an existing key refreshes it without growing
    c.put("c", "k", vec(7))
    assert [k[2] for k in c.keys()] == ["a", "d", "c"] and torch.equal(c.get("c", "k"), vec(7))


def test_byte_bound_evicts_lru_and_accounts_exactly():
    reg = CollectorRegistry()
    one = entry_bytes("q0")
    c = QueryCache(1000, 3 * one, registry=reg)
    for i in range(5):
        c.put(f"q{i}", "c", vec(i))
    assert c.nbytes == 3 * one and len(c) == 3
    assert [k[2] for k in c.keys()] == ["q2", "q3", "q4"]
    assert sample(reg, "gare_query_cache_evictions_total", reason="bytes") == 2
    assert sample(reg, "gare_query_cache_bytes") == 3 * one
    # a longer text costs more bytes: it pushes out two short entries
    long_text = "x" * (one + 10)
    c.put(long_text, "c", vec(1))
    assert c.nbytes <= 3 * one and c.get(long_text, "c") is not None and len(c) == 1
    # an entry larger than the whole budget is not stored (and evicts nothing)
    c.put("y" * (4 * one), "c", vec(2))
    assert len(c) == 1


def test_zero_turns_the_cache_off():
    for entries, nbytes in [(0, 1 << 20), (100, 0)]:
        reg = CollectorRegistry()
        c = QueryCache(entries, nbytes, registry=reg)
        assert not c.enabled
        c.put("dog", "c", vec(1))
        assert c.get("dog", "c") is None and len(c) == 0
        assert sample(reg, "gare_query_cache_lookups_total", result="miss") == 0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_entries"):
        QueryCache(-1, 10)
    with pytest.raises(ValueError, match="max_bytes"):
        QueryCache(1, -5)
    with pytest.raises(ValueError, match="shape"):
        QueryCache(1, 1 << 20).put("a", "c", torch.zeros(2, D))


def test_checkpoint_and_variant_are_part_of_the_key():
    c = QueryCache(10, 1 << 20)
    c.put("a dog", "sha-1", vec(1))
    c.put("a dog", "sha-2", vec(2))
    c.put("a dog", "sha-1", vec(3), variant="int8")
    assert torch.equal(c.get("a dog", "sha-1"), vec(1))
    assert torch.equal(c.get("a dog", "sha-2"), vec(2))
    assert torch.equal(c.get("a dog", "sha-1", "int8"), vec(3))
    assert c.get("a dog", "sha-3") is None


def test_clip_normalisation_merges_what_the_tokenizer_merges():
    tok = open_clip.get_tokenizer("ViT-B-32")
    c = QueryCache(10, 1 << 20, normalize=make_normalizer(tok))
    c.put("A  Dog\t runs\n", "c", vec(1))
    for same in ["a dog runs", "A DOG RUNS", "  a dog   runs ", "Ａ dog runs", "a dog runs"]:
        assert torch.equal(c.get(same, "c"), vec(1)), same
    assert c.get("a dog ran", "c") is None


@pytest.mark.parametrize(
    "a,b",
    [("x²", "x2"), ("Ⅳ", "iv"), ("a dog", "a dog."), ("ﬁsh", "fish"), ("ＡＢＣ dog", "abc dog"), ("&amp; dog", "& dog"),
     ("A  Dog\t runs", "a dog runs"), ("café", "cafe\u0301")],
)
def test_key_never_merges_texts_with_different_tokens(a, b):
    """Equal keys <=> equal tokens for the CLIP tokenizer. NFKC would merge "x²"/"x2" and "Ⅳ"/"iv", which
    the tokenizer keeps apart, so the key is the tokenizer's own cleaned text instead."""
    tok = open_clip.get_tokenizer("ViT-B-32")
    norm = make_normalizer(tok)
    same_tokens = bool(torch.equal(tok([a]), tok([b])))
    assert (norm(a) == norm(b)) == same_tokens


def test_default_normalize_keeps_case_and_collapses_space():
    assert default_normalize("  A\u00a0 dog\n") == "A dog"
    assert default_normalize("cafe\u0301") == "café"
    assert make_normalizer(object()) is default_normalize


def test_encode_runs_the_encoder_on_distinct_misses_only():
    reg = CollectorRegistry()
    tok = open_clip.get_tokenizer("ViT-B-32")
    c = QueryCache(100, 1 << 20, normalize=make_normalizer(tok), registry=reg)
    calls: list[list[str]] = []

    def enc(texts: list[str]) -> torch.Tensor:
        calls.append(list(texts))
        return torch.stack([vec(len(t)) for t in texts])

    out, hits = c.encode(["a cat", "A Cat", "a dog"], "ck", enc)
    assert calls == [["a cat", "a dog"]] and hits == [False, False, False]
    assert torch.equal(out, torch.stack([vec(5), vec(5), vec(5)]))
    out, hits = c.encode(["a dog", "a bird"], "ck", enc)
    assert calls[-1] == ["a bird"] and hits == [True, False]
    assert torch.equal(out, torch.stack([vec(5), vec(6)]))
    out, hits = c.encode(["a dog"], "ck", enc)
    assert len(calls) == 2 and hits == [True]
    assert sample(reg, "gare_query_cache_lookups_total", result="hit") == 2
    assert sample(reg, "gare_query_cache_lookups_total", result="miss") == 4
    assert sample(reg, "gare_query_cache_entries") == 3
    st = c.stats()
    assert (st.hits, st.misses, st.entries) == (2, 4, 3) and st.hit_rate == pytest.approx(2 / 6)


def test_concurrent_access_keeps_bounds_and_values():
    """8 threads hammer a small cache: every value read matches its key, bounds and counters hold."""
    reg = CollectorRegistry()
    c = QueryCache(50, 40 * entry_bytes("q000"), registry=reg)
    errors: list[str] = []
    n_threads, n_ops = 8, 2000
    barrier = threading.Barrier(n_threads)

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        barrier.wait()
        for _ in range(n_ops):
            i = int(torch.randint(0, 120, (1,), generator=g))
            got = c.get(f"q{i:03d}", "c")
            if got is None:
                c.put(f"q{i:03d}", "c", vec(i))
            elif not torch.equal(got, vec(i)):
                errors.append(f"q{i:03d} -> {got[0].item()}")
            if len(c) > 50 or c.nbytes > 40 * entry_bytes("q000"):
                errors.append("bound exceeded")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    st = c.stats()
    assert st.hits + st.misses == n_threads * n_ops
    assert st.hits > 0 and st.evictions > 0
    assert len(c) <= 40 and c.nbytes == sum(entry_bytes(k[2]) for k in c.keys())
    assert sample(reg, "gare_query_cache_lookups_total", result="hit") == st.hits
    assert sample(reg, "gare_query_cache_lookups_total", result="miss") == st.misses
    assert (sample(reg, "gare_query_cache_evictions_total", reason="entries")
            + sample(reg, "gare_query_cache_evictions_total", reason="bytes")) == st.evictions


def test_settings_fields_and_off_switch(monkeypatch):
    from gare_serve.engine.query_cache import from_settings

    s = Settings()
    assert s.query_cache_entries > 0 and s.query_cache_bytes > 0
    assert from_settings(s).enabled
    monkeypatch.setenv("GARE_QUERY_CACHE_ENTRIES", "0")
    assert not from_settings(Settings()).enabled
    monkeypatch.delenv("GARE_QUERY_CACHE_ENTRIES")
    monkeypatch.setenv("GARE_QUERY_CACHE_BYTES", "0")
    assert not from_settings(Settings()).enabled
    monkeypatch.setenv("GARE_QUERY_CACHE_BYTES", "-1")
    with pytest.raises(ValueError):
        Settings()
