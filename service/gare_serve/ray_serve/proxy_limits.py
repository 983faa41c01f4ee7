"""gare-serve's HTTP limits in Ray Serve's own HTTP proxy: the header timeout, the body timeout, the body size
limits and the Host check, enforced before a request reaches the ingress replica.

Ray's proxy (``ray.serve._private.proxy.ProxyActor``) serves with its own ``uvicorn.Server``, built from Serve's
``HTTPOptions``, which carry no header or body timeout, no body limit and no Host check (and no longer accept
middlewares). Two things reach it:

* Serve's supported hook ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (an environment variable of the Ray
  nodes): the proxy calls the function it names once, in the proxy's process, before it starts its HTTP server,
  and wraps its ASGI app in the middlewares the function returns. :func:`proxy_middlewares` is that function. Its
  middleware, :class:`ProxyLimits`, runs gare-serve's ``TrustedHostMiddleware``, ``BodySizeLimitMiddleware`` (the
  image route's larger limit included) and ``BodyTimeoutMiddleware``, in gare-serve's order, with the values of
  the ``GARE_*`` settings the ingress reads (``gare_serve.settings``). So ``/-/healthz`` and ``/-/routes``, which
  the proxy answers itself, get the Host check too, and a body too large or too slow is refused before it
  travels to a replica.
* The header timeout lives below ASGI, in uvicorn's protocol. Ray builds ``uvicorn.Config`` with ``http`` left
  at ``"auto"``, which uvicorn resolves through ``uvicorn.config.HTTP_PROTOCOLS`` when the server starts.
  :func:`proxy_middlewares` points that entry of the proxy's process at :func:`header_timeout_protocol`, which
  builds gare-serve's ``HeaderTimeoutH11Protocol`` with the configured ``header_timeout_s``: a connection that has
  not sent a request's complete headers within it is closed (a 408 if it had begun one), as gare-serve does.
  Nothing else runs a uvicorn server in that process.

The settings module imports the model code (torch), which takes longer than Ray waits for a proxy to become
ready on a loaded machine, so this module imports only uvicorn and Starlette and the callback loads the settings
and gare-serve's middleware in a thread. Until they are loaded (seconds, once per proxy) a connection is
answered 503 with ``Retry-After`` and a request waits for them: nothing passes unchecked. Settings that do not
load (a bad ``GARE_*`` value) fail every request with a 503 and are logged, naming the value.

Serve's direct-ingress replicas (``RAY_SERVE_ENABLE_DIRECT_INGRESS``) call the same hook for their own HTTP
servers, so they get the same limits. ``tests/serve_ray/test_ray_limits.py`` checks all of it on a real cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

import uvicorn.config
from starlette.middleware import Middleware

log = logging.getLogger(__name__)

__all__ = ["CALLBACK_ENV", "CALLBACK_PATH", "ProxyLimits", "header_timeout_protocol", "proxy_middlewares"]

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "gare_serve.ray_serve.proxy_limits.proxy_middlewares"
PROTOCOL_PATH = "gare_serve.ray_serve.proxy_limits:header_timeout_protocol"
NOT_READY_BODY = b'{"detail": "the proxy is loading its request limits"}'
NOT_READY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
             b"content-length: %d\r\nconnection: close\r\n\r\n" % len(NOT_READY_BODY)) + NOT_READY_BODY

# this process's gare_serve.ray_serve.proxy_chain.LoadedLimits, once loaded (one proxy per process)
_loading: concurrent.futures.Future[Any] = concurrent.futures.Future()


def _load_in_background(done: concurrent.futures.Future[Any]) -> None:
    try:
        from gare_serve.ray_serve.proxy_chain import load_limits  # heavy: imports torch (the settings)

        done.set_result(load_limits())
    except BaseException as e:  # noqa: BLE001 - every request then fails closed with this error logged
        log.error("Serve proxy limits did not load; every request is refused: %s", e)
        done.set_exception(e)


class _NotReadyProtocol(asyncio.Protocol):
    """A connection accepted before the limits are loaded: a 503 with Retry-After, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(NOT_READY)
        transport.close()


def header_timeout_protocol(*args: Any, **kwargs: Any) -> asyncio.Protocol:
    """uvicorn's protocol factory for Ray's proxy (``HTTP_PROTOCOLS["auto"]``): gare-serve's header-timeout
    protocol once the limits are loaded, a 503 before (and when they failed to load)."""
    if _loading.done() and _loading.exception() is None:
        return _loading.result().protocol(*args, **kwargs)
    return _NotReadyProtocol()


class ProxyLimits:
    """ASGI middleware around Ray's proxy app: gare-serve's Host check and body limits (:func:`load_limits`), once
    they are loaded; a request that comes earlier waits for them."""

    def __init__(self, app: Any, loading: concurrent.futures.Future[Any] | None = None) -> None:
        self.app = app
        self.loading = loading if loading is not None else _loading
        self.chain: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.chain is None:
            if scope["type"] not in ("http", "websocket"):
                await self.app(scope, receive, send)
                return
            limits = await asyncio.wrap_future(self.loading)  # fails closed (a 500) if they did not load
            self.chain = limits.wrap(self.app)
        await self.chain(scope, receive, send)


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=`` :data:`CALLBACK_PATH`), run once in
    the proxy's process before its HTTP server starts: installs the header-timeout protocol for that server,
    starts loading the limits in a thread and returns the middleware that applies them."""
    uvicorn.config.HTTP_PROTOCOLS["auto"] = PROTOCOL_PATH
    if not _loading.running() and not _loading.done():
        _loading.set_running_or_notify_cancel()
        threading.Thread(target=_load_in_background, args=(_loading,), name="gare-proxy-limits", daemon=True).start()
    return [Middleware(ProxyLimits)]
