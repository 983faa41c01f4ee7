"""How the service shows an index entry to clients: the API's path prefix, media URLs, paths and rendered hits.

Paths in responses are relative to ``library_root`` when the file is under it, else the file name only (the
server's directory layout is not the client's business); thumbnail and file URLs carry a signed token when
search needs an API key (``gare_serve.media.signing``), because ``<img>`` and ``<video>`` elements cannot send one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gare_index.store import IndexVersion
from gare_search.search import QueryResult
from gare_serve.engine.state import ServiceState
from gare_serve.web.schemas import Hit

log = logging.getLogger(__name__)

API_VERSION = "v1"

__all__ = ["API_VERSION", "media_urls", "display_path", "public_metadata", "hit_models", "fresh_urls"]


def media_urls(state: ServiceState, video_id: int) -> tuple[str, str]:
    """(thumbnail_url, video_url); signed when search needs a key."""
    base = f"/{API_VERSION}/videos/{video_id}"
    q = f"?token={state.media.token(video_id)}" if state.settings.require_key_for_search else ""
    return f"{base}/thumbnail{q}", f"{base}/file{q}"


def display_path(library_root: str | Path | None, path: str | None) -> str | None:
    """A path for clients: relative to the library root when known, else the file name only."""
    if not path:
        return None
    p = Path(path)
    if library_root is not None:  # the manifest records no library root (docs/index-format.md)
        try:
            return p.resolve().relative_to(Path(library_root).resolve()).as_posix()
        except (ValueError, OSError):
            pass
    return p.name


def public_metadata(state: ServiceState, row: dict[str, Any]) -> dict[str, Any]:
    """An entry's metadata row as clients see it: ``path`` as :func:`display_path` shows it, plus ``name``."""
    out = {k: v for k, v in row.items() if k != "path"}
    out["path"] = display_path(state.settings.library_root, row.get("path"))
    out["name"] = Path(row["path"]).name if row.get("path") else None
    return out


def hit_models(state: ServiceState, version: IndexVersion, res: QueryResult) -> list[Hit]:
    """The hits of ``res`` as the API renders them, with their metadata (one read) and media URLs."""
    if not res.hits:
        return []
    rows = version.metadata([h.id for h in res.hits])
    out = []
    for r, (h, m) in enumerate(zip(res.hits, rows, strict=True), start=1):
        thumb, video = media_urls(state, h.id)
        out.append(Hit(
            rank=r, id=h.id, score=h.score, ann_score=h.ann_score, psi_score=h.psi_score, bias=h.bias,
            start=m.get("start"), end=m.get("end"), metadata=public_metadata(state, m),
            thumbnail_url=thumb, video_url=video,
        ))
    return out


def fresh_urls(state: ServiceState, rendered: tuple[Hit, ...]) -> list[Hit]:
    """Cached rendered hits with media URLs signed now: a signed URL expires (``media_token_ttl_s``), so a
    cached answer must not hand out the token it was first rendered with. Unsigned URLs never change."""
    if not state.settings.require_key_for_search:
        return list(rendered)
    out = []
    for h in rendered:
        thumb, video = media_urls(state, h.id)
        out.append(h.model_copy(update={"thumbnail_url": thumb, "video_url": video}))
    return out
