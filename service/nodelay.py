"""The uvicorn ``Config`` of ``gare-serve --workers N``: a listening socket that keeps TCP_NODELAY, the HTTP
limits of ``service.http_limits``, and workers that do not outlive their supervisor.

TCP_NODELAY. uvicorn binds the socket that its worker processes share itself and leaves the socket's
``proto`` at 0. Accepted sockets inherit that, and asyncio sets TCP_NODELAY only when ``proto ==
IPPROTO_TCP``. Nagle's algorithm then holds each keep-alive response until the client's delayed ACK: about
40 ms on every request after a connection's first. Measured here with a trivial app, 44 ms against 1.3 ms per
request; upstream this is Kludex/uvicorn#3149. The single-process path lets asyncio build the socket from
getaddrinfo (proto 6) and is unaffected.

HTTP limits. :class:`NodelayConfig` is a :class:`service.http_limits.LimitsConfig`: the header-timeout
protocol and its timeout are pickled with the config into every spawned worker.

Parent death. uvicorn's supervisor (``uvicorn.supervisors.Multiprocess``) stops its workers on SIGTERM/SIGINT
(SIGTERM to each, then it joins them all: they drain their requests, ``timeout_graceful_shutdown``), but a
supervisor that is killed (SIGKILL, the OOM killer) leaves them running, still accepting on the port. Each
worker therefore asks Linux for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, in
:meth:`NodelayConfig.load`, which only the workers run): the orphan drains and exits like a worker told to
stop. (The signal follows the parent *thread* that started the worker; uvicorn starts and restarts workers
from the supervisor's main thread.)

A module of its own, at import level: the worker processes are spawned, so the config class must be
importable by name.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

from .http_limits import LimitsConfig

__all__ = ["NodelayConfig", "die_with_parent"]

log = logging.getLogger("gare.service")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have Linux send ``sig`` to this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``). A parent
    already gone before the call (``getppid() != parent_pid``) would never send it: SystemExit then. False
    where unsupported (not Linux, or prctl failed): the process then only stops when told to."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # prctl is variadic and the kernel reads unsigned longs: pass every argument at that width
        rc = libc.prctl(*(ctypes.c_ulong(v) for v in (PR_SET_PDEATHSIG, int(sig), 0, 0, 0)))
    except (OSError, AttributeError) as e:  # pragma: no cover - a libc without prctl
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable (%s): this worker may outlive its supervisor", e)
        return False
    if rc != 0:  # pragma: no cover
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker may outlive its supervisor",
                    ctypes.get_errno())
        return False
    if os.getppid() != parent_pid:
        raise SystemExit(f"worker {os.getpid()}: the supervisor {parent_pid} exited before this worker started")
    return True


class NodelayConfig(LimitsConfig):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.supervisor_pid = os.getpid()  # built in the supervisor, pickled into each worker

    def bind_socket(self) -> socket.socket:
        sock = super().bind_socket()
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.proto != socket.IPPROTO_TCP:
            # the same descriptor, re-wrapped with the protocol it has (nothing is re-bound)
            fixed = socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())
            fixed.set_inheritable(True)
            return fixed
        return sock

    def load(self) -> None:
        # Each worker's uvicorn Server loads its config first thing, with its signal handlers already
        # installed (the SIGTERM from PR_SET_PDEATHSIG is a graceful shutdown); the supervisor never loads it.
        if os.getpid() != self.supervisor_pid:
            die_with_parent(self.supervisor_pid)
        super().load()
