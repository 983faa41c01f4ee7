"""The options of a search request against the served index, decided from its manifest (pure functions).

:func:`served_defaults` reads what the index decided at build time (its chosen K, ``stage1.default_candidates``;
its NCL default and why, ``biases.default``, decided on validation captions), else the search's own NCL
default; :func:`resolve_options` fills what a request left out (:class:`AskedOptions`, ``None`` = the index
decides) within the service's bounds. ``GET /v1/index`` shows the same defaults
(``gare_serve.web.admin_routes``), the searches use them (``gare_serve.engine.search_requests``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gare_index.describe import index_default_candidates, index_ncl_default
from gare_search import search as S

__all__ = ["AskedOptions", "ServedDefaults", "resolve_options", "served_defaults"]


@dataclass(frozen=True)
class AskedOptions:
    """A request's search options as sent: ``candidates`` and ``ncl`` None where the served index decides."""

    k: int = 10
    candidates: int | None = None
    rerank: bool = True
    ncl: bool | None = None
    ncl_stage1: bool = False
    filter: Any = None  # the request's filter object as sent (compiled against the served version's fields)


@dataclass(frozen=True)
class ServedDefaults:
    """What the served index decided for requests that leave a choice open."""

    candidates: int | None  # its chosen K (manifest stage1.default_candidates); None: the service's setting
    ncl: bool  # its NCL default (manifest biases.default), else the search's NCL_DEFAULT
    ncl_reason: str


def served_defaults(manifest: Any) -> ServedDefaults:
    """The defaults of the index whose manifest this is: the K and the NCL default decided at build time (the NCL
    one on validation captions), else the search's NCL default with its reason."""
    own = index_ncl_default(manifest)
    ncl, reason = own if own is not None else (S.NCL_DEFAULT, S.NCL_DEFAULT_REASON)
    return ServedDefaults(index_default_candidates(manifest), ncl, reason)


def resolve_options(asked: AskedOptions, defaults: ServedDefaults, *, max_candidates: int,
                    default_candidates: int) -> S.SearchOptions:
    """The search options of a text request: K the index's chosen one (else ``default_candidates``), at least k and
    at most ``max_candidates``, when the request gives none; ncl the index's default when the request gives none;
    ``ncl_stage1`` implies ncl."""
    K = asked.candidates
    if K is None:
        K = min(max_candidates, max(defaults.candidates or default_candidates, asked.k))
    ncl = defaults.ncl if asked.ncl is None else asked.ncl
    return S.SearchOptions(k=asked.k, candidates=int(K), rerank=asked.rerank, ncl=ncl or asked.ncl_stage1,
                           ncl_stage1=asked.ncl_stage1)
