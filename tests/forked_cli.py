"""`gare-index` processes forked from one that has already imported the CLI (a fork server, like multiprocessing's
"forkserver"), for tests that start and SIGKILL many of them (tests/robustness/test_robust_faults.py).

Each command is a real process of its own: its own pid and process group (set before its pid is known here, so
``os.killpg`` at once takes it and its decode workers), its own stdout and stderr pipes, the environment and working directory it is given, and
``gare_build.cli.main`` run from the start with its arguments; it exits through the interpreter's normal exit
(atexit handlers run). What it skips is the interpreter start and the imports of torch, open_clip and faiss, about
5 s of CPU per process on 2 cores. The server is started with the environment its commands share (what modules
read once at import, such as ``HF_HUB_OFFLINE``); a command's own environment is applied before ``main`` runs.

The server reaps its children and reports each exit status; :class:`ForkedProcess` gives ``poll``, ``wait``,
``communicate`` and ``returncode`` with :class:`subprocess.Popen`'s meaning (``-N``: killed by signal N).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

_SERVER_SRC = r"""
import json, os, select, signal, socket, sys, traceback
sock = socket.socket(fileno=int(sys.argv[1]))
from gare_build.cli import main  # the imports every forked command shares

def run(req, fds):
    os.setpgid(0, 0)  # its own process group (also set by the server: either may run first): killpg(pid)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    sock.close()
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["gare-index", *req["args"]]
    try:
        return main(req["args"])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1

sock.send(b'{"ready": true}')
while True:
    ready, _, _ = select.select([sock], [], [], 0.05)
    while True:  # reap the commands that ended; their statuses go back to the test
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sock.send(json.dumps({"exit": pid, "code": code}).encode())
    if not ready:
        continue
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    if not msg:  # the test process closed its end
        break
    req = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        sys.exit(run(req, fds))  # the interpreter's normal exit, as a process started from scratch
    try:
        os.setpgid(pid, pid)  # before the pid is sent: the test may killpg at once
    except OSError:  # the child ran first and set it, or has already ended
        pass
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps({"pid": pid}).encode())
"""


class ForkServer:
    """One fork server (a child process of this one); :meth:`popen` starts a command, :meth:`close` ends it."""

    def __init__(self, env: dict[str, str], *, cwd: str | os.PathLike | None = None, ready_timeout_s: float = 600) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER_SRC, str(theirs.fileno())], env=env,
                                      pass_fds=(theirs.fileno(),), cwd=cwd)
        theirs.close()
        self._cwd = str(cwd or os.getcwd())
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        self._sock.settimeout(ready_timeout_s)
        first = self._sock.recv(4096)  # the server's imports (the cost every forked command then skips)
        if json.loads(first or b"{}").get("ready") is not True:
            raise RuntimeError(f"the fork server did not start (exit code {self._proc.poll()})")
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(4096)
            except OSError:
                msg = b""
            with self._cond:
                if not msg:
                    self._closed = True
                    self._cond.notify_all()
                    return
                m = json.loads(msg)
                if "pid" in m:
                    self._pids.append(int(m["pid"]))
                else:
                    self._exits[int(m["exit"])] = int(m["code"])
                self._cond.notify_all()

    def popen(self, args: list[str], env: dict[str, str], *, cwd: str | os.PathLike | None = None,
              timeout_s: float = 60) -> ForkedProcess:
        """Start `gare-index ARGS` (text pipes for stdout and stderr, as Popen(..., text=True))."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        req = {"args": list(args), "env": dict(env), "cwd": str(cwd or self._cwd)}
        try:
            with self._cond:
                socket.send_fds(self._sock, [json.dumps(req).encode()], [out_w, err_w])
                deadline = time.monotonic() + timeout_s
                while not self._pids:
                    if self._closed or not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                        raise RuntimeError("the fork server did not start the command")
                pid = self._pids.pop(0)
        finally:
            os.close(out_w)
            os.close(err_w)
        return ForkedProcess(self, pid, os.fdopen(out_r, "r"), os.fdopen(err_r, "r"))

    def status(self, pid: int, timeout_s: float | None) -> int | None:
        """The command's exit code once it ended (waiting up to `timeout_s`; 0: do not wait)."""
        with self._cond:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while pid not in self._exits:
                if self._closed:
                    raise RuntimeError(f"the fork server went away before command {pid} ended")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(timeout=left)
            return self._exits[pid]

    def close(self) -> None:
        try:  # shutdown, not only close: the reader thread is blocked in recv on this socket (close alone would
            self._sock.shutdown(socket.SHUT_RDWR)  # leave the connection open); the server's loop ends on EOF
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=10)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ForkedProcess:
    """A command started by a :class:`ForkServer` (the part of :class:`subprocess.Popen` the tests use)."""

    def __init__(self, server: ForkServer, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self._server = server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"gare-index (pid {self.pid})", timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the command wrote to stdout and stderr once it ended (read in threads: neither pipe fills)."""
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=n, f=f: got.__setitem__(n, f.read()), daemon=True)
                   for n, f in (("out", self.stdout), ("err", self.stderr))]
        for t in readers:
            t.start()
        self.wait(timeout)
        for t in readers:
            t.join(timeout=60)
        return got.get("out", ""), got.get("err", "")
