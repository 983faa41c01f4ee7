"""How a tokenizer cleans a text before tokenizing it, by name, without building the tokenizer.

The caches key a query by its text as the tokenizer sees it, so two texts share an entry only when they become
the same tokens. open_clip's tokenizers clean a text with one of three functions (``clean_fn``, chosen by name):
``"lower"`` (CLIP's), ``"whitespace"`` and ``"canonicalize"``; a tokenizer without one (Hugging Face's) gets the
caches' own ``"nfc-whitespace"``. gare-serve's HTTP workers key their result caches that way but never build a
tokenizer: importing open_clip costs seconds of CPU in every process. The engine names its tokenizer's cleaning
(:func:`clean_name`, sent to the workers) and a worker takes the same function from here (:func:`cleaner`).
The open_clip three are written from what they do (ftfy, HTML entities unescaped twice, whitespace collapsed;
then lower case, or punctuation and underscores removed and lower case) and tested equal to open_clip's own
on generated texts (tests/training/test_text_clean.py). A cleaning this module does not know: ``"identity"``,
which never merges two different texts (fewer cache hits, never a wrong one).
"""

from __future__ import annotations

import html
import string
import unicodedata
from collections.abc import Callable
from typing import Any

import ftfy

from gare.backbone import open_clip_module

__all__ = ["CLEANERS", "clean_name", "cleaner", "nfc_whitespace"]


def _basic(text: str) -> str:
    """Mojibake and other broken Unicode repaired (ftfy), HTML entities unescaped twice, ends stripped."""
    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


def _collapse(text: str) -> str:
    return " ".join(text.split())


def clean_lower(text: str) -> str:
    return _collapse(_basic(text)).lower()


def clean_whitespace(text: str) -> str:
    return _collapse(_basic(text))


_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def clean_canonicalize(text: str) -> str:
    return _collapse(_basic(text).replace("_", " ").translate(_NO_PUNCTUATION).lower())


def nfc_whitespace(text: str) -> str:
    """The caches' cleaning for a tokenizer without its own: Unicode NFC, whitespace collapsed, case kept."""
    return _collapse(unicodedata.normalize("NFC", text))


def identity(text: str) -> str:
    return text


CLEANERS: dict[str, Callable[[str], str]] = {
    "lower": clean_lower, "whitespace": clean_whitespace, "canonicalize": clean_canonicalize,
    "nfc-whitespace": nfc_whitespace, "identity": identity,
}
_OPEN_CLIP_NAMES = ("lower", "whitespace", "canonicalize")


def clean_name(tokenizer: Any | None) -> str:
    """The name in :data:`CLEANERS` of how ``tokenizer`` cleans a text: its ``clean_fn`` when that is one of
    open_clip's (compared by identity with open_clip's own), ``"nfc-whitespace"`` when it has none, else
    ``"identity"``."""
    fn = getattr(tokenizer, "clean_fn", None)
    if not callable(fn):
        return "nfc-whitespace"
    get = open_clip_module().tokenizer.get_clean_fn  # imported already: the tokenizer is open_clip's
    for name in _OPEN_CLIP_NAMES:
        if fn is get(name):
            return name
    return "identity"


def cleaner(name: str | None) -> Callable[[str], str]:
    """The function :func:`clean_name` named; ``"identity"`` for a name this module does not know (an engine
    of another release, or none named)."""
    return CLEANERS.get(name or "", identity)
