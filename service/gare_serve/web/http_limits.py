"""Slow-client bounds of the HTTP server: the time to a request's headers and the time to its body.

uvicorn's h11 protocol closes an idle keep-alive connection (``timeout_keep_alive``) but any byte resets
that timer, and nothing bounds reading the request line and headers or a request body: a client that sends
one byte every few seconds holds a connection (and, for a body, a running request) for as long as it likes.

* :class:`HeaderTimeoutH11Protocol` (the ``http=`` protocol of ``gare-serve``, both the one-process and the
  ``--workers N`` path): a request's complete headers must arrive within ``header_timeout_s`` of the
  connection opening or of the previous response finishing. The clock does not restart with each byte.
  Past it the connection is closed, after a 408 when the client had begun a request and no response bytes
  had been sent for it; an idle connection that never started one, or one whose previous request is still
  being drained after its response, is simply closed (as uvicorn's keep-alive timeout does).
* :class:`BodyTimeoutMiddleware` (pure ASGI, installed by ``gare_serve.app.create_app``): once the headers are
  in, the whole body must arrive within ``body_timeout_s``; past it a 408 with a JSON ``{"detail": ...}``
  body and ``Connection: close``, like the other errors of ``gare_serve.web.middleware``.

The timeouts are the settings ``header_timeout_s`` and ``body_timeout_s`` (``gare_serve.settings``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gare_serve.settings import Settings
from gare_serve.web.middleware import EarlyAnswer

__all__ = ["BodyTimeout", "BodyTimeoutMiddleware", "HeaderTimeoutH11Protocol", "LimitsConfig", "header_timeout_of"]

DEFAULT_HEADER_TIMEOUT_S: float = Settings.model_fields["header_timeout_s"].default


def header_timeout_of(config: Any) -> float:
    """The header timeout a uvicorn ``Config`` carries (``header_timeout_s``: :class:`LimitsConfig`), else the
    default (a plain ``uvicorn.Config(http=HeaderTimeoutH11Protocol)``)."""
    value = getattr(config, "header_timeout_s", None)
    return DEFAULT_HEADER_TIMEOUT_S if value is None else float(value)


def _json_408(detail: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return headers, body


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_of(self.config)
        self._header_timer: asyncio.TimerHandle | None = None
        self._bytes_since_armed = 0
        self._upgraded = False

    # The timer runs while no request is in progress: from the connection opening or a response finishing
    # until the next request's headers are parsed (uvicorn then starts a cycle, whose body is bounded by
    # BodyTimeoutMiddleware and whose response by the app).
    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _update_header_timer(self) -> None:
        if self._upgraded or self.transport is None or self.transport.is_closing() or not self._awaiting_headers():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._bytes_since_armed = 0
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout_handler)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_handler(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        # A 408 only where it answers something: the client began a request and we have sent nothing for it
        # (h11's server side is IDLE until it has a request). Otherwise close, as the keep-alive timeout does.
        if self._bytes_since_armed and self.conn.our_state is h11.IDLE:
            headers, body = _json_408(
                f"request headers not received within {self.header_timeout_s:g} s"
            )
            head = b"HTTP/1.1 408 Request Timeout\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            self.transport.write(head + b"\r\n" + body)
        self.transport.close()

    # -------------------------------------------------------------------------- protocol hooks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._bytes_since_armed += len(data)
        super().data_received(data)
        self._update_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request
        self._update_header_timer()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the transport now belongs to the websocket protocol
        self._cancel_header_timer()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


class BodyTimeout(Exception):
    """Raised to the app by the wrapped ``receive`` once the body deadline has passed (the 408 is sent)."""


class BodyTimeoutMiddleware:
    """408 when a request's body has not fully arrived within ``timeout_s`` of the app being called (that is,
    of uvicorn having parsed the headers). The deadline covers only the body: once the last body chunk is in,
    ``receive`` (which then waits for a disconnect) is passed through unbounded."""

    def __init__(self, app: Any, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.app = app
        self.timeout_s = float(timeout_s)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False
        early = EarlyAnswer(send)

        async def timed_receive() -> dict[str, Any]:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError
                msg = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                headers, body = _json_408(f"request body not received within {self.timeout_s:g} s")
                await early.answer(408, headers, body)
                raise BodyTimeout from None
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                body_done = True
            return msg

        try:
            await self.app(scope, timed_receive, early.send)
        except BodyTimeout:
            pass
        except Exception:
            if not early.answered:
                raise
            # the 408 is out: whatever the app made of the missing body is not a second response


class LimitsConfig(uvicorn.Config):
    """A uvicorn ``Config`` that serves with :class:`HeaderTimeoutH11Protocol` and carries its timeout (an
    attribute of the config, so it reaches ``gare-serve --workers N``'s spawned workers with the pickled config;
    the protocol class travels there by reference)."""

    def __init__(self, app: Any, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, **kwargs: Any) -> None:
        kwargs.setdefault("http", HeaderTimeoutH11Protocol)
        super().__init__(app, **kwargs)
        if header_timeout_s <= 0:
            raise ValueError("header_timeout_s must be > 0")
        self.header_timeout_s = float(header_timeout_s)
