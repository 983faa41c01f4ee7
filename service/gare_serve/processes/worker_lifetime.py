"""How long the processes of ``gare-serve --workers N`` live: workers that die with their supervisor
(:func:`die_with_parent`) and a supervisor that notices at once a worker that died (:func:`prompt_supervisor`).

Parent death. uvicorn's supervisor (``uvicorn.supervisors.Multiprocess``) stops its workers on SIGTERM/SIGINT
(SIGTERM to each, then it joins them all: they drain their requests, ``timeout_graceful_shutdown``), but a
supervisor that is killed (SIGKILL, the OOM killer) leaves them running, still accepting on the port. Each
worker therefore asks Linux for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``; the worker's config,
``gare_serve.processes.uvicorn_config.NodelayConfig.load``, calls :func:`die_with_parent`): the orphan drains and
exits like a worker told to stop. (The signal follows the parent *thread* that started the worker; uvicorn starts
and restarts workers from the supervisor's main thread.)

Worker death. A worker that dies is restarted by the supervisor at its next liveness check, also when it died
while being pinged (:func:`prompt_supervisor`); a restarted worker binds a new socket in the port group
(``gare_serve.processes.port_group``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

__all__ = ["die_with_parent", "prompt_supervisor"]

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def prompt_supervisor(base: type) -> type:
    """``base`` (uvicorn's ``Multiprocess``) noticing at once a worker that died while it was being pinged.

    uvicorn's ``Process`` keeps the worker's end of its health-check pipe open in the supervisor too. A worker
    killed between the supervisor's liveness check and its answer to the ping therefore never closes the pipe,
    and the supervisor waits ``timeout_worker_healthcheck`` (``worker_healthcheck_s``: 120 s by default) before it
    restarts the worker, handling no signal meanwhile (SIGTERM included). The subclass closes the supervisor's
    copy once the worker runs (the worker has its own): that ping then ends at once with EOF."""

    class PromptSupervisor(base):  # type: ignore[misc, valid-type]
        def keep_subprocess_alive(self) -> None:
            for proc in getattr(self, "processes", ()):
                conn = getattr(proc, "child_conn", None)
                if conn is not None and proc.process.pid is not None:  # started: the worker holds its own end
                    conn.close()  # idempotent
            super().keep_subprocess_alive()

    PromptSupervisor.__qualname__ = PromptSupervisor.__name__ = f"Prompt{base.__name__}"
    return PromptSupervisor


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
