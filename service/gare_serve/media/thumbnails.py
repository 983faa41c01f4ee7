"""Thumbnails of index entries: the JPEG of an entry's middle frame, and the cache of those JPEGs.

The cache is a :class:`gare_serve.lru.ByteLRU` bounded by entries (``thumbnail_cache_size``; 0 caches nothing);
the route counts its hits and misses (``gare_thumbnail_cache_total``).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import decord
from PIL import Image

from gare_serve.lru import ByteLRU

log = logging.getLogger(__name__)

__all__ = ["ThumbnailCache", "make_thumbnail"]


class ThumbnailCache:
    """A small thread-safe LRU of JPEG bytes, bounded by entries; size 0 caches nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lru: ByteLRU[Hashable, bytes] = ByteLRU(size)

    def get(self, key: Hashable) -> bytes | None:
        return self._lru.get(key)

    def put(self, key: Hashable, value: bytes) -> None:
        self._lru.put(key, value, len(value))


def make_thumbnail(path: Path, meta: dict[str, Any], width: int) -> bytes:
    """A JPEG of the middle frame of the entry's window, at most `width` pixels wide."""
    vr = decord.VideoReader(str(path), num_threads=1)
    n = len(vr)
    if n == 0:
        raise ValueError(f"{path} has no frames")
    fps = float(vr.get_avg_fps()) or 1.0
    start = meta.get("start") or 0.0
    end = meta.get("end") if meta.get("end") is not None else n / fps
    t = start + max(0.0, (end - start)) / 2.0  # the middle of the entry's window
    idx = int(min(n - 1, max(0, round(t * fps))))
    img = Image.fromarray(vr[idx].asnumpy()).convert("RGB")
    if img.width > width:
        img = img.resize((width, max(1, round(img.height * width / img.width))), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=82)
    return buf.getvalue()
