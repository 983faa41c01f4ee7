"""Stopping `gare-serve --workers 2`: SIGTERM drains the request in flight, then the workers and only then
their parent exit; a parent killed outright (SIGKILL) takes its workers with it (PR_SET_PDEATHSIG,
gare_serve/processes/worker_lifetime.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time

import httpx
import pytest

from tests.service.support import UvicornProcess, copy_index

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], limit_s: float) -> dict[int, float]:
    """{pid: seconds until it was gone} for those gone within `limit_s` (polled every 20 ms)."""
    t0 = time.monotonic()
    gone: dict[int, float] = {}
    while time.monotonic() - t0 < limit_s and len(gone) < len(pids):
        for pid in pids:
            if pid not in gone and not _alive(pid):
                gone[pid] = time.monotonic() - t0
        time.sleep(0.02)
    return gone


@contextlib.contextmanager
def _two_workers(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")
    env = {"GARE_WORKER_HEALTHCHECK_S": "900"}
    srv = UvicornProcess(["--index", str(idx), "--workers", "2"], env=env, ready_timeout_s=600)
    workers: list[int] = []
    run_dir = None
    try:
        with srv:
            ready = httpx.get(srv.base_url + "/readyz", timeout=10).json()
            workers = [int(w["pid"]) for w in ready["workers"]]
            assert len(workers) == 2 and srv.proc.pid not in workers
            m = re.search(r"\(run dir (\S+/gare-serve-\w+)\)", srv.output())
            run_dir = m.group(1) if m else None
            try:
                yield srv, workers
            except BaseException:
                print(srv.output()[-4000:])
                raise
    finally:
        for pid in workers:  # whatever the test did, no worker survives it
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if run_dir:  # left behind by a killed parent
            shutil.rmtree(run_dir, ignore_errors=True)


def test_sigterm_drains_the_request_in_flight_then_stops_workers_before_the_parent(service_env, tmp_path):
    with _two_workers(service_env, tmp_path) as (srv, workers):
        parent = srv.proc
        body = json.dumps({"queries": service_env["captions"][:16], "k": 5}).encode()
        head = (f"POST /v1/search/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            # in flight: a worker has the headers and is reading the body when the parent gets SIGTERM
            s.sendall(head + body[:20])
            time.sleep(0.5)
            parent.send_signal(signal.SIGTERM)
            time.sleep(1.5)
            assert parent.poll() is None, "the parent exited while a request was still in flight"
            s.sendall(body[20:])
            s.settimeout(30)
            got = b""
            while chunk := s.recv(65536):  # the worker closes the connection once it has answered
                got += chunk
        head_out, _, payload = got.partition(b"\r\n\r\n")
        assert head_out.startswith(b"HTTP/1.1 200 "), got[:300]
        assert len(json.loads(payload)["results"]) == 16
        parent.wait(timeout=60)
        assert parent.returncode == 0, srv.output()[-2000:]
        # the parent waited for its workers (it joined them, so they are reaped): none runs once it is gone,
        # looked at once, with no time allowed for them to finish afterwards
        alive = [pid for pid in workers if _alive(pid)]
        print(f"SIGTERM: answered after the drain, parent exited; workers still running then: {alive}")
        assert alive == [], f"workers {alive} outlived their parent"


def test_workers_exit_when_their_parent_is_killed(service_env, tmp_path):
    with _two_workers(service_env, tmp_path) as (srv, workers):
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        # SIGTERM from the kernel (PR_SET_PDEATHSIG), an idle worker's graceful exit; nothing else would stop
        # them (the health check is off: 900 s), so a 30-s hang guard tells the two apart
        gone = _wait_gone(workers, 30)
        print(f"SIGKILL of the parent: workers gone after {gone} s")
        assert set(gone) == set(workers), f"workers {set(workers) - set(gone)} outlived their killed parent"


# ------------------------------------------------------------------------------------ unit level, fast
def test_die_with_parent_signals_the_orphan_and_refuses_a_parent_already_gone():
    import subprocess
    import sys

    from tests.service.support import REPO

    # parent -> child: the child asks for SIGTERM on its parent's death, then sleeps; the parent is killed
    child_code = ("import os, sys, time; from gare_serve.processes.worker_lifetime import die_with_parent; "
                  "assert die_with_parent(os.getppid()); print(os.getpid(), flush=True); time.sleep(60)")
    parent_code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child_code!r}]); "
                   "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        gone = _wait_gone([child], 5)
        assert child in gone, "the orphan did not get its SIGTERM"
    finally:
        parent.kill()
        parent.wait(10)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    # a worker whose supervisor died before it could ask: it stops at once
    r = subprocess.run([sys.executable, "-c", "import os; from gare_serve.processes.worker_lifetime import die_with_parent; "
                        "die_with_parent(os.getppid() + 1000000)"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "exited before this worker started" in r.stderr


def test_the_parent_stops_its_workers_even_when_the_supervisor_fails(monkeypatch, tmp_path):
    import multiprocessing

    import uvicorn.supervisors

    from gare_serve import cli
    from gare_serve.settings import Settings

    procs, opened = [], []

    class Worker:
        def __init__(self):
            self.process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
            self.process.start()

    class FailingMultiprocess:
        def __init__(self, config, sockets):
            opened.extend(sockets)
            self.processes = []

        def run(self):
            self.processes = [Worker(), Worker()]
            procs.extend(w.process for w in self.processes)
            raise OSError("cannot restart a worker")

    monkeypatch.setattr(uvicorn.supervisors, "Multiprocess", FailingMultiprocess)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    saved = dict(os.environ)  # serve_workers exports GARE_* for its workers: keep them out of later tests
    try:
        with pytest.raises(OSError, match="cannot restart"):
            cli.serve_workers(Settings(index=tmp_path, host="127.0.0.1", port=0, torch_threads=1), 2)
        assert len(procs) == 2 and not any(p.is_alive() for p in procs)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for p in procs:
            if p.is_alive():
                p.kill()
        for sock in opened:
            sock.close()
