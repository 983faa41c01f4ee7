"""ASGI middleware (body-size limit, trusted hosts, security headers) and the JSON error handlers of the service.

Every error body goes through :func:`public_detail`: a client never sees a memory address, a server path or
a traceback, whatever a library put in an exception's text.
"""

import logging
import re
import sqlite3
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gare_serve.engine.batcher import BatcherClosed, BatcherOverloaded
from gare_serve.engine.engine_wire import EngineUnavailable

log = logging.getLogger(__name__)

class EarlyAnswer:
    """One request's send, for a middleware that may answer before the app has (a body too large, too slow):
    the framework turns any exception raised while it reads the body into its own 400, so the middleware sends
    its answer itself, then raises to stop the app, and whatever the app sends after that is dropped."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self.started = False  # the app has begun its own response: too late to answer instead
        self.answered = False

    async def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if not self.started and not self.answered:
            self.answered = True
            await self._send({"type": "http.response.start", "status": status, "headers": headers})
            await self._send({"type": "http.response.body", "body": body})

    async def send(self, msg: dict[str, Any]) -> None:
        if self.answered:
            return
        if msg["type"] == "http.response.start":
            self.started = True
        await self._send(msg)


class BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for request bodies over `max_bytes` (declared Content-Length or counted while streaming)."""

    def __init__(self, app: Any, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_max = max_bytes
        self.path_limits = dict(path_limits or {})  # e.g. the image upload route: a larger limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope.get("path", ""), self.default_max)
        early = EarlyAnswer(send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > max_bytes or declared < 0:
                    await self._reject(early, declared, max_bytes)
                    return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > max_bytes:
                    await self._reject(early, seen, max_bytes)
                    raise BodyTooLarge
            return msg

        try:
            await self.app(scope, limited_receive, early.send)
        except BodyTooLarge:
            pass

    async def _reject(self, early: EarlyAnswer, size: int, max_bytes: int) -> None:
        detail = (
            f"request body too large (limit {max_bytes} bytes)" if size >= 0 else "invalid Content-Length header"
        )
        code = 413 if size >= 0 else 400
        resp = JSONResponse({"detail": detail}, status_code=code)
        await early.answer(code, resp.raw_headers, resp.body)


class HeadMiddleware:
    """HEAD wherever GET is served (RFC 9110 §9.3.2): the request is routed as GET and only the response's
    status and headers go out (Content-Length included). FastAPI routes answer only their declared methods,
    and declaring HEAD on each would double the OpenAPI operations.

    A file response is not read for a HEAD: the scope offers the ASGI ``http.response.pathsend`` extension,
    so Starlette's FileResponse hands over the path instead of streaming the file, and the path is dropped.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        extensions = {**scope.get("extensions", {}), "http.response.pathsend": {}}
        scope = {**scope, "method": "GET", "extensions": extensions}
        ended = False

        async def head_send(msg: dict[str, Any]) -> None:
            nonlocal ended
            kind = msg["type"]
            if kind in ("http.response.body", "http.response.pathsend"):
                if not ended:  # one empty, final body; later chunks of a streamed body are dropped
                    ended = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send(msg)

        await self.app(scope, receive, head_send)


class TrustedHostMiddleware:
    """400 for a request whose Host header is not an accepted name (DNS rebinding: a web page on another site
    resolving its own name to 127.0.0.1 reaches a keyless local server only with its own name as the Host).

    ``allowed``: exact names (any case, port ignored, IPv6 with or without brackets), ``*.domain`` for its
    subdomains, or ``*`` for any. Starlette's own middleware splits ``[::1]:8000`` on the first colon.
    """

    def __init__(self, app: Any, allowed: Sequence[str]) -> None:
        self.app = app
        names = [h.strip().lower() for h in allowed if h.strip()]
        self.any = "*" in names
        self.exact = {h.strip("[]") for h in names if not h.startswith("*.")}
        self.suffixes = tuple(h[1:] for h in names if h.startswith("*."))

    @staticmethod
    def host_name(value: str) -> str:
        v = value.strip().lower()
        if v.startswith("["):  # [v6]:port
            return v[1:v.find("]")] if "]" in v else ""
        if v.count(":") == 1:
            v = v.split(":", 1)[0]
        return v.rstrip(".")

    def accepts(self, value: str) -> bool:
        if self.any:
            return True
        name = self.host_name(value)
        return bool(name) and (name in self.exact or name.endswith(self.suffixes))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.any:
            await self.app(scope, receive, send)
            return
        hosts = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"]
        if len(hosts) == 1 and self.accepts(hosts[0]):
            await self.app(scope, receive, send)
            return
        resp = JSONResponse({"detail": "invalid Host header: this server answers only for its configured names "
                                       "(GARE_TRUSTED_HOSTS)"}, status_code=400)
        await resp(scope, receive, send)


class SecurityHeadersMiddleware:
    CSP = (
        "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; style-src 'self'; script-src 'self'; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    )

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                headers = list(msg.get("headers", []))
                names = {k.lower() for k, _ in headers}
                extra = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                         (b"content-security-policy", self.CSP.encode())]
                headers += [(k, v) for k, v in extra if k not in names]
                msg = {**msg, "headers": headers}
            await send(msg)

        await self.app(scope, receive, send_wrapper)


# a memory address as Python prints it (``at 0x7f3a2b1c4d50``): a "0x" that starts a token, so that the numbers of
# an error's text stay (``image is 10000x10000``: its "0x1000" is part of a number, not an address)
_ADDRESS = re.compile(r"(?<![0-9A-Za-z_.])0x[0-9a-fA-F]{4,}")
# an absolute file system path of two or more components; the API's own routes (/v1/..., /static/...) are kept
_FS_PATH = re.compile(r"(?<![\w/.])/(?!v\d+/|static/|docs/)[^\s'\"(),;:<>]+/[^\s'\"(),;:<>]*")


def public_detail(text: str) -> str:
    """An error message safe to show a client: no memory addresses, file system paths or tracebacks."""
    if "Traceback (most recent call last)" in text or 'File "' in text:
        return "internal server error"
    return _FS_PATH.sub("<path>", _ADDRESS.sub("0x…", text))


def _readable(errors: Sequence[dict[str, Any]]) -> str:
    parts = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        etype = e.get("type", "")
        if etype == "json_invalid":
            err = (e.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"malformed JSON body ({err})")
            continue
        if etype == "missing" and not loc:
            parts.append("a JSON request body is required")
            continue
        msg = str(e.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if etype == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = [
            {"loc": [str(x) for x in e.get("loc", ())], "msg": public_detail(str(e.get("msg", ""))), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": public_detail(_readable(exc.errors())), "errors": errs}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404 and detail == "Not Found":
            detail = "not found"
        if exc.status_code == 405:
            detail = "method not allowed"
        return JSONResponse({"detail": public_detail(detail)}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(BatcherOverloaded)
    async def _busy(request: Request, exc: BatcherOverloaded) -> JSONResponse:
        return JSONResponse({"detail": "the server is busy; retry shortly"}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(BatcherClosed)
    async def _closed(request: Request, exc: BatcherClosed) -> JSONResponse:
        return JSONResponse({"detail": "the server is shutting down"}, status_code=503)

    @app.exception_handler(EngineUnavailable)
    async def _engine(request: Request, exc: EngineUnavailable) -> JSONResponse:
        # engine=shared: the engine process is down, restarting or late (its message says which)
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(sqlite3.Error)
    async def _metadata(request: Request, exc: sqlite3.Error) -> JSONResponse:
        # open/reload refuse a damaged meta.sqlite (gare_index.metadb); this is for one damaged after that
        log.error("index metadata unreadable on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"detail": public_detail(f"the index metadata cannot be read ({exc}); run gare-index verify")},
                            status_code=503)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"detail": "internal server error"}, status_code=500)
