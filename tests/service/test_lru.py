"""gare_serve.lru.ByteLRU (the one bounded LRU of the query, result and thumbnail caches) and the search's
text-tower choice (gare_search.text_encoder)."""

import pytest

from gare.text_quant import DEFAULT_CPU_TEXT_ENCODER, DEFAULT_CUDA_TEXT_ENCODER
from gare_search.text_encoder import TextEncoderError, choose_text_encoder
from gare_serve.lru import ByteLRU
from gare_serve.media.thumbnails import ThumbnailCache


def test_entry_bound_evicts_least_recently_used():
    lru: ByteLRU[str, int] = ByteLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a becomes the most recent: b goes next
    ev = lru.put("c", 3)
    assert ev is not None and (ev.entries, ev.bytes) == (1, 0)
    assert lru.keys() == ["a", "c"] and lru.get("b") is None
    st = lru.stats()
    assert (st.hits, st.misses, st.evictions, st.entries) == (1, 1, 1, 2)


def test_byte_bound_evicts_and_refuses_an_entry_larger_than_the_cache():
    lru: ByteLRU[str, str] = ByteLRU(100, 10)
    lru.put("a", "x", 4)
    lru.put("b", "y", 4)
    ev = lru.put("c", "z", 4)
    assert ev is not None and ev.bytes == 1 and lru.nbytes == 8 and lru.keys() == ["b", "c"]
    lru.put("b", "y2", 6)  # replacing an entry re-counts its bytes
    assert lru.nbytes <= 10 and lru.get("b") == "y2"
    assert lru.put("big", "w", 11) is None and lru.get("big") is None


@pytest.mark.parametrize("entries,nbytes", [(0, 10), (5, 0)])
def test_a_zero_bound_turns_it_off(entries, nbytes):
    lru: ByteLRU[str, int] = ByteLRU(entries, nbytes)
    assert not lru.enabled and lru.put("a", 1) is None and lru.get("a") is None
    assert lru.stats().misses == 0  # lookups of a cache that is off are not counted


def test_negative_bounds_are_refused_with_their_value():
    with pytest.raises(ValueError, match="max_entries.*-1"):
        ByteLRU(-1)
    with pytest.raises(ValueError, match="max_bytes.*-2"):
        ByteLRU(1, -2)


def test_thumbnail_cache_is_bounded_by_entries():
    c = ThumbnailCache(1)
    c.put("a", b"jpeg-a")
    c.put("b", b"jpeg-b")
    assert c.get("a") is None and c.get("b") == b"jpeg-b"
    off = ThumbnailCache(0)
    off.put("a", b"x")
    assert off.get("a") is None


def test_text_tower_choice():
    assert choose_text_encoder("auto", "cpu", "fp32") == DEFAULT_CPU_TEXT_ENCODER
    assert choose_text_encoder("auto", "cuda", "fp32") == DEFAULT_CUDA_TEXT_ENCODER
    assert choose_text_encoder("auto", "cuda", "bf16") == "fp32"  # the model's own tower at that precision
    assert choose_text_encoder("fp32", "cpu", "fp32") == "fp32"
    with pytest.raises(TextEncoderError, match="'fp16' is a CUDA option"):
        choose_text_encoder("fp16", "cpu", "fp32")
    with pytest.raises(TextEncoderError, match="'int8' is a CPU option"):
        choose_text_encoder("int8", "cuda", "fp32")
    with pytest.raises(TextEncoderError, match="not bf16"):
        choose_text_encoder("int8", "cpu", "bf16")


def test_auto_tower_and_precision_resolve_together():
    """Both "auto": the device's measured default tower at its own arithmetic, whatever AUTO_PRECISION says of the
    model's own tower; an explicit precision keeps its meaning (fp32: the default tower; a half precision: the
    model's own tower); a tower of its own arithmetic with precision auto runs at fp32 around it."""
    from gare_search.query import AUTO_PRECISION
    from gare_search.text_encoder import resolve_encoder

    assert resolve_encoder("auto", "cpu", "auto") == (DEFAULT_CPU_TEXT_ENCODER, "fp32")
    assert resolve_encoder("auto", "cuda", "auto") == (DEFAULT_CUDA_TEXT_ENCODER, "fp32")
    assert resolve_encoder("fp32", "cuda", "auto") == ("fp32", AUTO_PRECISION["cuda"])
    assert resolve_encoder("auto", "cuda", "fp32") == (DEFAULT_CUDA_TEXT_ENCODER, "fp32")
    assert resolve_encoder("auto", "cuda", "bf16") == ("fp32", "bf16")
    assert resolve_encoder("fp16", "cuda", "auto") == ("fp16", "fp32")
    assert resolve_encoder("int8", "cpu", "auto") == ("int8", "fp32")
    with pytest.raises(TextEncoderError, match="runs its own arithmetic"):
        resolve_encoder("fp16", "cuda", "bf16")
    with pytest.raises(ValueError, match="fp16 is only supported on CUDA"):
        resolve_encoder("fp32", "cpu", "fp16")
