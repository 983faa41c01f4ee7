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

* The same protocol bounds the other direction, a client that does not read its answer: every accepted socket
  gets a bounded kernel send buffer (``send_buffer_bytes``: SO_SNDBUF, instead of Linux's autotuning up to
  ``net.ipv4.tcp_wmem``'s 4 MiB), and a connection whose unsent output (asyncio's write buffer plus the kernel's
  unacknowledged bytes, SIOCOUTQ) has not shrunk for ``send_timeout_s`` is reset (SO_LINGER 0, then abort: the
  kernel frees its buffer at once instead of probing a closed window for minutes). A slow reader that keeps
  taking bytes is never dropped: the clock restarts with any progress. While output is unsent, uvicorn's
  keep-alive timeout does not close the connection (a close would leave the socket to the kernel, its buffer
  held until the kernel gives up); the send timeout decides.

The timeouts are the settings ``header_timeout_s``, ``body_timeout_s`` and ``send_timeout_s``, the buffer
``send_buffer_bytes`` (``gare_serve.settings``).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import json
import logging
import socket
import struct
import termios
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gare_serve.settings import Settings
from gare_serve.web.middleware import EarlyAnswer

__all__ = ["BodyTimeout", "BodyTimeoutMiddleware", "HeaderTimeoutH11Protocol", "LimitsConfig", "bytes_acked",
           "header_timeout_of", "kernel_unsent", "send_limits_of"]

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S: float = Settings.model_fields["header_timeout_s"].default
DEFAULT_SEND_TIMEOUT_S: float = Settings.model_fields["send_timeout_s"].default
DEFAULT_SEND_BUFFER_BYTES: int = Settings.model_fields["send_buffer_bytes"].default


def header_timeout_of(config: Any) -> float:
    """The header timeout a uvicorn ``Config`` carries (``header_timeout_s``: :class:`LimitsConfig`), else the
    default (a plain ``uvicorn.Config(http=HeaderTimeoutH11Protocol)``)."""
    value = getattr(config, "header_timeout_s", None)
    return DEFAULT_HEADER_TIMEOUT_S if value is None else float(value)


def send_limits_of(config: Any) -> tuple[float, int]:
    """(send timeout in s, SO_SNDBUF in bytes or 0 for the kernel's default) a uvicorn ``Config`` carries, else the
    defaults."""
    timeout = getattr(config, "send_timeout_s", None)
    buffer = getattr(config, "send_buffer_bytes", None)
    return (DEFAULT_SEND_TIMEOUT_S if timeout is None else float(timeout),
            DEFAULT_SEND_BUFFER_BYTES if buffer is None else int(buffer))


def kernel_unsent(sock: Any) -> int:
    """Bytes the kernel holds for a TCP socket that the peer has not acknowledged (Linux SIOCOUTQ); 0 where it
    cannot be read (another system, a closed socket)."""
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf, True)
        return int(buf[0])
    except (OSError, ValueError, AttributeError):
        return 0


_TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info (since Linux 4.1)


def bytes_acked(sock: Any) -> int | None:
    """Bytes of output the peer's kernel has acknowledged on a TCP socket so far (Linux TCP_INFO), None where it
    cannot be read. It grows while the client takes the answer, however much more the server writes meanwhile."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, ValueError, AttributeError):
        return None
    return struct.unpack_from("Q", info, _TCPI_BYTES_ACKED)[0] if len(info) >= _TCPI_BYTES_ACKED + 8 else None


def _json_408(detail: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return headers, body


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and a send timeout on its answers, over
    a bounded kernel send buffer (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_of(self.config)
        self.send_timeout_s, self.send_buffer_bytes = send_limits_of(self.config)
        self._header_timer: asyncio.TimerHandle | None = None
        self._bytes_since_armed = 0
        self._upgraded = False
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_mark: tuple[int | None, int] = (None, 0)  # (bytes acknowledged, unsent bytes) at the last check
        self._send_progress_at = 0.0  # loop time the client last took bytes (or the watch began)

    # ------------------------------------------------------------------------------------- send timeout
    def _sock(self) -> Any:
        return None if self.transport is None else self.transport.get_extra_info("socket")

    def unsent_bytes(self) -> int:
        """Output not yet taken by the client: asyncio's write buffer plus the kernel's unacknowledged bytes."""
        if self.transport is None:
            return 0
        return self.transport.get_write_buffer_size() + kernel_unsent(self._sock())

    def _watch_send(self) -> None:
        """Start watching the unsent output (no-op when already watching or nothing is unsent)."""
        if self._send_timer is not None or self._upgraded or self.transport is None:
            return
        pending = self.unsent_bytes()
        if pending:
            self._send_mark, self._send_progress_at = (bytes_acked(self._sock()), pending), self.loop.time()
            self._send_timer = self.loop.call_later(self._send_check_s(), self._send_check)

    def _send_check_s(self) -> float:
        return min(1.0, self.send_timeout_s / 4)

    def _send_check(self) -> None:
        self._send_timer = None
        if self.transport is None or self._upgraded:
            return
        pending = self.unsent_bytes()
        if not pending:
            return  # all taken; the next write that stays unsent starts a new watch
        now = self.loop.time()
        acked = bytes_acked(self._sock())
        last_acked, last_pending = self._send_mark
        # progress: the client's kernel acknowledged more (a streamed answer keeps the unsent amount level while
        # the client reads); where that counter is not available, less is left unsent
        if (acked > last_acked) if (acked is not None and last_acked is not None) else (pending < last_pending):
            self._send_progress_at = now
        self._send_mark = (acked, pending)
        if now - self._send_progress_at >= self.send_timeout_s:
            self._drop_unread(pending)
            return
        self._send_timer = self.loop.call_later(self._send_check_s(), self._send_check)

    def _drop_unread(self, pending: int) -> None:
        """Reset a connection whose client has taken none of its `pending` unsent bytes for the send timeout."""
        log.info("dropped a connection from %s: %d bytes of its answer not taken by the client within %g s",
                 self.client, pending, self.send_timeout_s)
        sock = self._sock()
        if sock is not None:
            try:  # RST on close: the kernel frees the send buffer now instead of probing a zero window
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()  # the app's next send waits for the client to read
        self._watch_send()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing() and self.unsent_bytes():
            # the answer is still on its way: closing now would hand the socket and its unsent bytes to the
            # kernel; the send timeout resets it if the client stays silent, else keep-alive is counted again
            self._watch_send()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

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
        sock = transport.get_extra_info("socket")
        if self.send_buffer_bytes > 0 and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            except OSError as e:  # the answers still go out, with the kernel's own buffer
                log.warning("could not set SO_SNDBUF=%d on an accepted socket: %s", self.send_buffer_bytes, e)
        self._update_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._bytes_since_armed += len(data)
        super().data_received(data)
        self._update_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request
        self._update_header_timer()
        self._watch_send()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the transport now belongs to the websocket protocol
        self._cancel_header_timer()
        self._cancel_send_timer()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_send_timer()
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
    """A uvicorn ``Config`` that serves with :class:`HeaderTimeoutH11Protocol` and carries its limits (attributes
    of the config, so they reach ``gare-serve --workers N``'s spawned workers with the pickled config; the protocol
    class travels there by reference)."""

    def __init__(self, app: Any, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S, send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES,
                 **kwargs: Any) -> None:
        kwargs.setdefault("http", HeaderTimeoutH11Protocol)
        super().__init__(app, **kwargs)
        if header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be > 0, got {send_timeout_s}")
        if send_buffer_bytes < 0:
            raise ValueError(f"send_buffer_bytes must be >= 0 (0: the kernel's default), got {send_buffer_bytes}")
        self.header_timeout_s = float(header_timeout_s)
        self.send_timeout_s = float(send_timeout_s)
        self.send_buffer_bytes = int(send_buffer_bytes)
