"""gare.text_clean: open_clip's three text cleanings, by name, without open_clip; how the engine names its
tokenizer's; a process that builds no model never imports open_clip."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gare.backbone import get_tokenizer, open_clip_module
from gare.config import get_model_config
from gare.text_clean import CLEANERS, clean_name, cleaner, identity, nfc_whitespace

# Texts that exercise each step: HTML entities (single and double escaped), mojibake ftfy repairs, combining
# marks, every kind of whitespace, punctuation and underscores, case.
PIECES = ["&amp;", "&amp;amp;", "&lt;b&gt;", "&#39;", "&quot;", "Ã©", "â€™", "cafe\u0301", "\u00a0", "\u2003", "\t",
          "\n", "  ", "_", "-", "'", ".", ",", "!", "A", "dog", "CAT", "Über", "ß", "İ", "ﬁ", "😀", "{}", "\\"]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=12).map("".join)


@pytest.mark.parametrize("name", ["lower", "whitespace", "canonicalize"])
@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_each_cleaning_equals_open_clip_s(name, text):
    assert CLEANERS[name](text) == open_clip_module().tokenizer.get_clean_fn(name)(text)


def test_the_names_come_from_the_tokenizer_s_own_function():
    tok = get_tokenizer(get_model_config("gare-test-tiny"))
    assert clean_name(tok) == "lower"  # CLIP's tokenizer
    get = open_clip_module().tokenizer.get_clean_fn

    class Tok:
        def __init__(self, fn):
            self.clean_fn = fn

    assert [clean_name(Tok(get(n))) for n in ("lower", "whitespace", "canonicalize")] == \
        ["lower", "whitespace", "canonicalize"]
    assert clean_name(object()) == "nfc-whitespace"  # no clean_fn: the caches' own cleaning
    assert clean_name(Tok(lambda t: t.upper())) == "identity"  # a cleaning not known here: merge nothing
    assert cleaner("nfc-whitespace") is nfc_whitespace
    assert cleaner("from-a-newer-engine") is identity and cleaner(None) is identity
    assert nfc_whitespace(" Cafe\u0301\u00a0 X ") == "Café X"


def test_processes_that_build_no_model_never_import_open_clip():
    code = ("import sys; import gare_serve.app, gare_serve.cli, gare_build.cli, gare_serve.ray_serve.shard_replica, "
            "gare.text_clean, gare.checkpoint; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('open_clip', 'torchvision', 'timm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
