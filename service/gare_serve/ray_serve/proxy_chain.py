"""gare-serve's request limits as Ray Serve's proxy applies them (``gare_serve.ray_serve.proxy_limits`` loads this
module in a thread of the proxy's process: the settings import the model code): the Host check, the body size
limits and the body timeout around the proxy's ASGI app, in gare-serve's order (``gare_serve.app``), and the
header-timeout protocol with the configured timeout."""

from __future__ import annotations

import logging
from typing import Any

from gare_serve.settings import Settings, load_settings
from gare_serve.web.http_limits import BodyTimeoutMiddleware, HeaderTimeoutH11Protocol
from gare_serve.web.middleware import BodySizeLimitMiddleware, TrustedHostMiddleware
from gare_serve.web.presentation import API_VERSION

log = logging.getLogger(__name__)

__all__ = ["IMAGE_ROUTE", "LoadedLimits", "limit_chain", "load_limits", "timeout_protocol"]

IMAGE_ROUTE = f"/{API_VERSION}/search/image"
MULTIPART_ENVELOPE_BYTES = 64 * 1024  # as gare_serve.app: the image upload's limit plus its multipart envelope


def timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """gare-serve's header-timeout h11 protocol with ``header_timeout_s`` fixed (Ray's uvicorn ``Config`` does not
    carry the timeout, which ``HeaderTimeoutH11Protocol`` otherwise reads from it)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s!r}")

    class ProxyHeaderTimeoutProtocol(HeaderTimeoutH11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_timeout_s = float(header_timeout_s)  # read when the connection is made, after this

    return ProxyHeaderTimeoutProtocol


def limit_chain(app: Any, settings: Settings) -> Any:
    """``app`` inside gare-serve's Host check, body size limits and body timeout (outermost last, as
    ``add_middleware`` stacks them in ``gare_serve.app.create_app``)."""
    app = TrustedHostMiddleware(app, allowed=settings.trusted_host_list())
    app = BodySizeLimitMiddleware(app, max_bytes=settings.max_body_bytes,
                                  path_limits={IMAGE_ROUTE: settings.max_image_bytes + MULTIPART_ENVELOPE_BYTES})
    return BodyTimeoutMiddleware(app, timeout_s=settings.body_timeout_s)


class LoadedLimits:
    """What the proxy enforces, from one ``Settings``: the middleware chain and the header-timeout protocol."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.protocol = timeout_protocol(settings.header_timeout_s)

    def wrap(self, app: Any) -> Any:
        return limit_chain(app, self.settings)


def load_limits(settings: Settings | None = None) -> LoadedLimits:
    """The limits of ``settings`` (default: the ``GARE_*`` environment and config file, as the ingress reads)."""
    limits = LoadedLimits(settings if settings is not None else load_settings())
    s = limits.settings
    log.info("Serve proxy limits: headers within %g s, bodies within %g s, bodies up to %d bytes (%s: %d), Host %s",
             s.header_timeout_s, s.body_timeout_s, s.max_body_bytes, IMAGE_ROUTE,
             s.max_image_bytes + MULTIPART_ENVELOPE_BYTES, s.trusted_host_list())
    return limits
