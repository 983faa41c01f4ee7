"""A small typed Python client over gare-serve's REST API, for scripts: text, batch, by example and by image
searches, the video and index routes, the admin reload; every non-2xx answer raises a typed exception that carries
the server's message.

    from gare_serve.client import GareClient

    with GareClient("http://127.0.0.1:8000", api_key=os.environ.get("GARE_SEARCH_KEY")) as client:
        for hit in client.search("a dog catches a frisbee", k=5).results:
            print(hit.rank, hit.id, round(hit.score, 3), hit.metadata.get("path"))

Only httpx and the standard library: importing it loads neither torch nor the service. Options left as None are not
sent, so the server's own defaults (the index's K, its NCL default) apply; a ``filter`` is passed through as given.
"""

from __future__ import annotations

import dataclasses
import logging
import mimetypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

log = logging.getLogger(__name__)

__all__ = ["BadRequest", "BatchResult", "Forbidden", "GareClient", "GareError", "Hit", "NotFound", "SearchResult",
           "Timings", "Unauthorized", "Unavailable"]

API = "/v1"


# ---------------------------------------------------------------------------------------------------------- errors
class GareError(Exception):
    """A non-2xx answer: ``status`` and the server's ``detail`` (its message, or the validation errors of a 422)."""

    def __init__(self, status: int, detail: Any, *, method: str = "", url: str = "") -> None:
        self.status, self.detail, self.method, self.url = status, detail, method, url
        super().__init__(f"{method} {url}: {status} {_detail_text(detail)}".strip())


class BadRequest(GareError):
    """4xx other than 401/403/404: the request is wrong (422 names the field), too large (413), of a refused type (415)."""


class Unauthorized(GareError):
    """401: no key or an unknown key."""


class Forbidden(GareError):
    """403: the key is known but its role may not call this route (a search key on an admin route)."""


class NotFound(GareError):
    """404: an unknown video id (or route)."""


class Unavailable(GareError):
    """503 (or another 5xx): busy, loading or an engine restarting; ``retry_after`` is the server's hint in seconds."""

    def __init__(self, status: int, detail: Any, *, retry_after: float | None = None, method: str = "",
                 url: str = "") -> None:
        super().__init__(status, detail, method=method, url=url)
        self.retry_after = retry_after


def _detail_text(detail: Any) -> str:
    if isinstance(detail, list):  # FastAPI's validation errors: [{loc, msg, type}, ...]
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', e)}" if isinstance(e, dict)
                         else str(e) for e in detail)
    return str(detail)


def _error(r: httpx.Response) -> GareError:
    try:
        body = r.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
    except ValueError:
        detail = r.text
    where = {"method": r.request.method, "url": str(r.request.url)}
    s = r.status_code
    if s >= 500:
        ra = r.headers.get("retry-after")
        try:
            retry = float(ra) if ra is not None else None
        except ValueError:  # an HTTP date: not parsed, the caller waits its own way
            retry = None
        return Unavailable(s, detail, retry_after=retry, **where)
    cls = {401: Unauthorized, 403: Forbidden, 404: NotFound}.get(s, BadRequest)
    return cls(s, detail, **where)


# ---------------------------------------------------------------------------------------------------------- results
T = TypeVar("T")


def _build(cls: type[T], data: Mapping[str, Any]) -> T:
    """``cls`` from a JSON object: its own fields, the rest kept in ``extra`` (a newer server's fields survive)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    known = {k: v for k, v in data.items() if k in names and k != "extra"}
    return cls(**known, extra={k: v for k, v in data.items() if k not in names})  # type: ignore[call-arg]


@dataclasses.dataclass(frozen=True)
class Hit:
    rank: int
    id: int
    score: float
    ann_score: float
    psi_score: float | None
    bias: float
    start: float | None
    end: float | None
    metadata: dict[str, Any]
    thumbnail_url: str
    video_url: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Timings:
    """Milliseconds per stage, as the server measured them (``cache`` says whether the result cache answered)."""

    queue: float
    encode: float
    ann: float
    rerank: float
    total: float
    rank: float = 0.0
    cache: str = "miss"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    query: str | None
    index_version: str
    k: int
    candidates: int
    rerank: bool
    ncl: bool
    results: list[Hit]
    timings_ms: Timings
    batch_size: int
    partial: bool = False
    missing_shards: list[int] = dataclasses.field(default_factory=list)
    example: dict[str, Any] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return [h.id for h in self.results]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SearchResult:
        d = dict(data)
        d["results"] = [_build(Hit, h) for h in d.get("results", [])]
        d["timings_ms"] = _build(Timings, d.get("timings_ms", {}))
        return _build(cls, d)


@dataclasses.dataclass(frozen=True)
class BatchResult:
    index_version: str
    results: list[SearchResult]
    timings_ms: dict[str, float]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchResult:
        d = dict(data)
        d["results"] = [SearchResult.from_json(r) for r in d.get("results", [])]
        return _build(cls, d)


# ---------------------------------------------------------------------------------------------------------- client
class GareClient:
    """One gare-serve (or the Ray Serve ingress, which answers the same API) at ``base_url``.

    ``api_key`` goes as ``Authorization: Bearer``; a search key serves every method but :meth:`reload`, which
    needs an admin key. ``http`` is an ``httpx.Client`` of your own (proxies, TLS, or FastAPI's TestClient for an
    in-process app); ``base_url`` is then taken from it unless given."""

    def __init__(self, base_url: str = "", *, api_key: str | None = None, timeout: float = 60.0,
                 http: httpx.Client | None = None) -> None:
        # sent with each request: a client passed in is shared with its owner and keeps its own headers
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if http is None:
            if not base_url:
                raise ValueError("GareClient needs base_url (e.g. http://127.0.0.1:8000) or an httpx.Client")
            http = httpx.Client(base_url=base_url, timeout=timeout)
            base_url, self._owned = "", True
        else:
            self._owned = False
        self._prefix = base_url.rstrip("/")  # with a client passed in: its base_url unless one is given here
        self.http = http

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def __enter__(self) -> GareClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, self._prefix + path, headers=self._auth, **kw)
        if r.status_code >= 400:
            raise _error(r)
        return r.json()

    @staticmethod
    def _options(k: int | None, candidates: int | None, rerank: bool | None, ncl: bool | None,
                 filter: Mapping[str, Any] | None) -> dict[str, Any]:  # noqa: A002 - the API's name
        given = {"k": k, "candidates": candidates, "rerank": rerank, "ncl": ncl, "filter": filter}
        return {name: v for name, v in given.items() if v is not None}

    # ------------------------------------------------------------------ searches
    def search(self, query: str, k: int | None = None, *, candidates: int | None = None, rerank: bool | None = None,
               ncl: bool | None = None, filter: Mapping[str, Any] | None = None) -> SearchResult:  # noqa: A002
        """One text query (``POST /v1/search``)."""
        body = {"query": query, **self._options(k, candidates, rerank, ncl, filter)}
        return SearchResult.from_json(self._call("POST", f"{API}/search", json=body))

    def search_batch(self, queries: Sequence[str], k: int | None = None, *, candidates: int | None = None,
                     rerank: bool | None = None, ncl: bool | None = None,
                     filter: Mapping[str, Any] | None = None) -> BatchResult:  # noqa: A002
        """Many text queries with shared options (``POST /v1/search/batch``); results in the queries' order."""
        if isinstance(queries, str):
            raise TypeError("search_batch takes a sequence of queries, got one string; use search() for one")
        body = {"queries": list(queries), **self._options(k, candidates, rerank, ncl, filter)}
        return BatchResult.from_json(self._call("POST", f"{API}/search/batch", json=body))

    def search_like(self, video_ids: int | Sequence[int], k: int | None = None, *, candidates: int | None = None,
                    rerank: bool | None = None, filter: Mapping[str, Any] | None = None) -> SearchResult:  # noqa: A002
        """More like these indexed videos (their mean unit vector; ``POST /v1/search`` with ``video_ids``)."""
        ids = [int(video_ids)] if isinstance(video_ids, int) else [int(i) for i in video_ids]
        body = {"video_ids": ids, **self._options(k, candidates, rerank, None, filter)}
        return SearchResult.from_json(self._call("POST", f"{API}/search", json=body))

    def search_image(self, image: bytes | str | Path, k: int | None = None, *, candidates: int | None = None,
                     content_type: str | None = None) -> SearchResult:
        """Search by an image (``POST /v1/search/image``, multipart): a file path, or its bytes with
        ``content_type`` (image/jpeg, image/png, image/webp, image/gif)."""
        if isinstance(image, (str, Path)):
            path = Path(image)
            data, name = path.read_bytes(), path.name
            content_type = content_type or mimetypes.guess_type(path.name)[0]
        else:
            data, name = bytes(image), "image"
        if not content_type:
            raise ValueError(f"give content_type for the image {name!r} (its type cannot be told from its name)")
        form = {n: str(v) for n, v in (("k", k), ("candidates", candidates)) if v is not None}
        return SearchResult.from_json(self._call("POST", f"{API}/search/image", data=form,
                                                 files={"image": (name, data, content_type)}))

    # ------------------------------------------------------------------ the rest of the API
    def video(self, video_id: int) -> dict[str, Any]:
        """One indexed entry: its metadata and media URLs (``GET /v1/videos/{id}``)."""
        return self._call("GET", f"{API}/videos/{int(video_id)}")

    def index(self) -> dict[str, Any]:
        """The served index version (``GET /v1/index``)."""
        return self._call("GET", f"{API}/index")

    def reload(self) -> dict[str, Any]:
        """Serve the index's current version now (``POST /v1/admin/reload``; an admin key)."""
        return self._call("POST", f"{API}/admin/reload")

    def ready(self) -> bool:
        """Whether the service is ready (``GET /readyz`` answers 200); a network error is not ready."""
        try:
            return self.http.get(self._prefix + "/readyz", headers=self._auth).status_code == 200
        except httpx.TransportError as e:
            log.debug("readyz: %s", e)
            return False
