"""`gare-serve --workers 2` spreads connections over its workers whatever the clients do (issue 29, must-have 4).

With one listening socket shared by the workers, the worker that wakes first accepts every queued connection:
a burst of keep-alive clients could land whole on one worker and stay there. With a socket per worker
(SO_REUSEPORT, ``gare_serve.processes.port_group.PortGroup``) the kernel hashes connections over the workers' sockets: the
chance that all 32 connections of a burst land on one of two sockets is 2 * 2^-32 per burst, and the splits
of several bursts stay within what fair coins give (``IMBALANCE_LIMIT``).

One real server (``--port 0``) serves every test of the module that needs one: start-up takes minutes on a
loaded machine. The last test kills a worker.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.service.support import REPO, copy_index

BURST_CLIENTS = 32
REQUESTS_PER_CONNECTION = 4  # each connection sends exactly this many: connections = requests // this
BURSTS = 5

RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


# ------------------------------------------------------------------------------------------ helpers
def _listening_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port` (any address), from /proc/net/tcp{,6}."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(name) as fh:
            next(fh)
            for line in fh:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                    out.add(int(f[9]))
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    d = f"/proc/{pid}/fd"
    for fd in os.listdir(d):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{d}/{fd}")
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return out


def _worker_requests(base_url: str) -> dict[int, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r'gare_worker_requests\{pid="(\d+)"\} ([0-9.e+]+)', text)}


def burst(port: int, texts: list[str], clients: int = BURST_CLIENTS, per_connection: int = REQUESTS_PER_CONNECTION) -> None:
    """`clients` keep-alive connections opened at once (a barrier), each sending `per_connection` searches."""
    gate = threading.Barrier(clients)
    failures: list[str] = []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            gate.wait()
            conn.connect()
            for j in range(per_connection):
                body = json.dumps({"query": texts[(i + j) % len(texts)], "k": 3})
                conn.request("POST", "/v1/search", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status != 200 or r.will_close:  # a reopened connection could go to another worker
                    failures.append(f"client {i} request {j}: {r.status}, will_close={r.will_close}")
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"client {i}: {e!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]


def connections_per_worker(base_url: str, port: int, texts: list[str]) -> dict[int, int]:
    """Run one burst; {worker pid: connections it served} from the workers' own request counters (the
    scrape before the burst adds at most one request to one worker: floor division drops it)."""
    before = _worker_requests(base_url)
    burst(port, texts)
    after = _worker_requests(base_url)
    per = {pid: int(after[pid] - before.get(pid, 0.0)) // REQUESTS_PER_CONNECTION for pid in after}
    per = {pid: n for pid, n in per.items() if n}
    assert sum(per.values()) == BURST_CLIENTS, (before, after)
    return per


def _bind_as_another_user(port: int, uid: int = 65534) -> int:
    """errno of binding 127.0.0.1:`port` with SO_REUSEPORT and SO_REUSEADDR as user `uid` (0: it bound and
    listened). Needs root: a forked child drops to `uid` (an exec'd interpreter might not be readable by it)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 255
        try:
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(8)
            code = 0
        except OSError as e:
            code = e.errno or 254
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _ready(base_url: str) -> dict | None:
    try:
        r = httpx.get(base_url + "/readyz", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


# ------------------------------------------------------------------------------------------ the server
class _Server:
    def __init__(self, proc: subprocess.Popen, log: Path, port: int) -> None:
        self.proc, self.log, self.port = proc, log, port
        self.base_url = f"http://127.0.0.1:{port}"

    def workers(self) -> list[int]:
        ready = _ready(self.base_url)
        assert ready is not None
        return sorted(int(w["pid"]) for w in ready["workers"])


@pytest.fixture(scope="module")
def server(service_env, tmp_path_factory):
    idx = copy_index(service_env["index"], tmp_path_factory.mktemp("spread") / "index")
    # port 0: the service picks a free port, and every worker must listen on that one
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1",
           # a worker importing torch on a loaded machine can miss uvicorn's ping for minutes: do not kill it
           "GARE_WORKER_HEALTHCHECK_S": "900"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = Path(tempfile.mkstemp(prefix="gare-serve-spread-", suffix=".log")[1])
    args = [sys.executable, "-m", "gare_serve.cli", "--index", str(idx), "--workers", "2", "--host", "127.0.0.1",
            "--port", "0", "--batch-max-wait-ms", "2", "--log-level", "info"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    srv = None
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gare-serve exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
            if srv is None and (m := RUNNING.search(log.read_text(errors="replace"))):
                srv = _Server(proc, log, int(m.group(1)))
            if srv is not None and _ready(srv.base_url) is not None:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"gare-serve did not become ready:\n{log.read_text(errors='replace')}")
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ served
def test_port_zero_gives_each_worker_its_own_listening_socket_on_one_port(server):
    assert server.port > 0
    pids = server.workers()
    assert len(pids) == 2 and server.proc.pid not in pids
    listening = _listening_inodes(server.port)
    own = {pid: _socket_inodes(pid) & listening for pid in pids}
    # one listening socket per worker, none shared, none in the parent (it holds the port bound, not listening)
    assert all(len(s) == 1 for s in own.values()), own
    assert own[pids[0]] != own[pids[1]] and len(listening) == 2, (own, listening)
    assert not _socket_inodes(server.proc.pid) & listening


# The bursts' imbalance, sum over bursts of (one worker's connections - 16)^2: with every connection hashed to
# one of two sockets at random (a fair coin each), the exact tail P(sum >= 280) over 5 bursts of 32 is 4.9e-7
# (the mean is 40). Skewed accepts go far beyond: 25 / 7, 6 / 26, ... sum to 312 on the shared socket here.
IMBALANCE_LIMIT = 280


def test_every_burst_of_keepalive_connections_reaches_both_workers(server, service_env):
    texts = service_env["captions"]
    pids = set(server.workers())
    seen = []
    for _ in range(BURSTS):
        per = connections_per_worker(server.base_url, server.port, texts)
        seen.append(per)
        assert set(per) == pids, f"a burst left a worker without connections: {seen}"
    imbalance = sum((per[min(pids)] - BURST_CLIENTS // 2) ** 2 for per in seen)
    print(f"connections per worker in {BURSTS} bursts of {BURST_CLIENTS}: {seen}; imbalance {imbalance}")
    assert imbalance < IMBALANCE_LIMIT, seen


def test_nothing_else_can_take_or_join_the_port(server, service_env, tmp_path):
    for opts in ((), (socket.SO_REUSEADDR,)):  # what servers and clients do: refused while the group lives
        s = socket.socket()
        for o in opts:
            s.setsockopt(socket.SOL_SOCKET, o, 1)
        with s, pytest.raises(OSError) as e:
            s.bind(("127.0.0.1", server.port))
        assert e.value.errno == errno.EADDRINUSE
    if os.geteuid() == 0:  # another user, even with SO_REUSEPORT set, cannot join the group
        assert _bind_as_another_user(server.port) == errno.EADDRINUSE
    # a second gare-serve on the port stops at once, before any worker starts loading a model
    idx = copy_index(service_env["index"], tmp_path / "index")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gare_serve.cli", "--index", str(idx), "--workers", "2", "--host", "127.0.0.1",
                        "--port", str(server.port)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1"})
    print(f"second gare-serve on the port: exit {r.returncode} after {time.monotonic() - t0:.1f} s")
    assert r.returncode == 1 and "Address already in use" in r.stderr, r.stderr[-2000:]
    assert "Started server process" not in r.stderr + r.stdout
    assert len(server.workers()) == 2  # still serving


def test_a_killed_worker_is_restarted_with_its_own_socket_and_gets_connections(server, service_env):
    old = server.workers()
    os.kill(old[0], signal.SIGKILL)
    deadline = time.time() + 900
    new: list[int] = []
    while time.time() < deadline:
        ready = _ready(server.base_url)
        if ready is not None:
            new = sorted(int(w["pid"]) for w in ready["workers"])
            if len(new) == 2 and old[0] not in new:
                break
        time.sleep(0.5)
    assert len(new) == 2 and old[0] not in new and old[1] in new, (old, new)
    (fresh,) = set(new) - set(old)
    listening = _listening_inodes(server.port)
    assert len(_socket_inodes(fresh) & listening) == 1 and len(listening) == 2
    texts = service_env["captions"]
    for _ in range(2):
        per = connections_per_worker(server.base_url, server.port, texts)
        assert set(per) == set(new), per


# ------------------------------------------------------------------------------------------ no server
def _worker_socket(group) -> socket.socket:
    """What a spawned worker gets for the group's anchor: multiprocessing's pickler, as uvicorn's spawn uses."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    return pickle.loads(ForkingPickler.dumps(group.socket))


def test_port_group_keeps_the_port_from_anything_but_its_workers():
    from gare_serve.processes.port_group import PortGroup

    group = PortGroup("127.0.0.1", 0)
    workers: list[socket.socket] = []
    try:
        port = group.port
        assert port > 0 and group.socket.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
        for phase in ("anchor only (workers loading or restarting)", "two workers listening"):
            for opts in ((), (socket.SO_REUSEADDR,)):
                with socket.socket() as s, pytest.raises(OSError) as e:
                    for o in opts:
                        s.setsockopt(socket.SOL_SOCKET, o, 1)
                    s.bind(("127.0.0.1", port))
                assert e.value.errno == errno.EADDRINUSE, phase
            with pytest.raises(OSError) as e:  # a second gare-serve's group
                PortGroup("127.0.0.1", port)
            assert e.value.errno == errno.EADDRINUSE, phase
            if os.geteuid() == 0:  # another user, even with SO_REUSEPORT set
                assert _bind_as_another_user(port) == errno.EADDRINUSE, phase
            if not workers:
                workers = [_worker_socket(group) for _ in range(2)]
                for w in workers:
                    assert type(w) is socket.socket and w.getsockname() == ("127.0.0.1", port)
                    assert w.proto == socket.IPPROTO_TCP and w.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
                    w.listen(64)
        # the kernel spreads connections over the workers' sockets
        for _ in range(3):
            conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(BURST_CLIENTS)]
            got = []
            for w in workers:
                w.setblocking(False)
                n = 0
                with contextlib.suppress(BlockingIOError):
                    while True:
                        w.accept()[0].close()
                        n += 1
                got.append(n)
            for c in conns:
                c.close()
            assert sum(got) == BURST_CLIENTS and min(got) > 0, got
    finally:
        for w in workers:
            w.close()
        group.close()
    # closed: the port is free again, for the next start too (the workers' connections left in TIME_WAIT
    # do not block it)
    PortGroup("127.0.0.1", port).close()


def test_worker_sockets_keep_tcp_nodelay():
    from gare_serve.processes.port_group import PortGroup
    from tests.service.test_nodelay import _accepted_nodelay

    group = PortGroup("127.0.0.1", 0)
    try:
        w = _worker_socket(group)
        w.listen(8)
        proto, nodelay = _accepted_nodelay(w)
        assert proto == socket.IPPROTO_TCP and nodelay != 0
        w.close()
    finally:
        group.close()


class _FakeMultiprocess:
    got: dict = {}

    def __init__(self, config, sockets):
        _FakeMultiprocess.got = {"config": config, "sockets": list(sockets), "env_port": os.environ.get("GARE_PORT")}

    def run(self):
        pass


@pytest.fixture()
def fake_supervisor(monkeypatch, tmp_path):
    import uvicorn.supervisors

    monkeypatch.setattr(uvicorn.supervisors, "Multiprocess", _FakeMultiprocess)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    _FakeMultiprocess.got = {}
    saved = dict(os.environ)  # serve_workers exports GARE_* for its workers: keep them out of later tests
    yield _FakeMultiprocess
    os.environ.clear()
    os.environ.update(saved)


def test_serve_workers_gives_the_supervisor_the_group_or_the_shared_socket(fake_supervisor, tmp_path):
    from gare_serve import cli
    from gare_serve.processes.port_group import PortGroupSocket, resolve_worker_sockets
    from gare_serve.settings import Settings

    assert resolve_worker_sockets("auto") == ("reuseport" if sys.platform.startswith("linux") else "shared")
    assert resolve_worker_sockets("shared") == "shared"
    base = dict(index=tmp_path, host="127.0.0.1", port=0, torch_threads=1)
    assert cli.serve_workers(Settings(**base), 2) == 0  # default: reuseport (Linux)
    got = fake_supervisor.got
    (anchor,) = got["sockets"]
    assert isinstance(anchor, PortGroupSocket) and anchor.fileno() == -1  # closed when the supervisor returned
    assert anchor.group_port > 0 and got["config"].port == anchor.group_port
    assert got["env_port"] == str(anchor.group_port)  # the workers' settings carry the chosen port, not 0
    assert cli.serve_workers(Settings(**base, worker_sockets="shared"), 2) == 0
    (shared,) = fake_supervisor.got["sockets"]
    try:
        assert type(shared) is socket.socket and shared.proto == socket.IPPROTO_TCP
        assert not shared.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
    finally:
        shared.close()


def test_a_port_in_use_fails_the_start_before_any_worker(fake_supervisor, tmp_path, capsys):
    from gare_serve import cli
    from gare_serve.settings import Settings

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli.serve_workers(Settings(index=tmp_path, host="127.0.0.1", port=port, torch_threads=1), 2) == 1
    assert fake_supervisor.got == {}  # no supervisor, no worker
    assert "Address already in use" in capsys.readouterr().err


async def tiny_app(scope, receive, send):
    """An ASGI app for uvicorn workers started by the supervisor test below (imported by name in the worker)."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            states.append(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(st == "T" for st in states)


def _health_check_of_a_worker_killed_while_pinged(supervisor_class, timeout_s: float) -> tuple[bool, float]:
    """(what the supervisor's liveness check says, its seconds) for a worker killed while that check's ping is
    outstanding (the worker is stopped first so that it cannot answer)."""
    import uvicorn
    from uvicorn.supervisors import multiprocess

    saved = {sig: signal.getsignal(sig) for sig in multiprocess.SIGNALS}  # the supervisor installs its handlers
    config = uvicorn.Config("tests.service.test_serve_spread:tiny_app", workers=1, host="127.0.0.1", port=0,
                            log_level="warning", timeout_worker_healthcheck=timeout_s)
    sock = config.bind_socket()
    sup = supervisor_class(config, sockets=[sock])
    try:
        sup.init_processes()
        worker = sup.processes[0]
        assert worker.wait_until_ready(300)
        sup.keep_subprocess_alive()  # one round of the supervisor's loop (it runs every 0.5 s)
        time.sleep(0.5)
        while worker.parent_conn.poll(0):  # answers to pings that timed out while the worker started
            worker.parent_conn.recv()
        os.kill(worker.pid, signal.SIGSTOP)
        while not _all_threads_stopped(worker.pid):
            time.sleep(0.01)
        got: dict = {}

        def check() -> None:
            t0 = time.monotonic()
            got["alive"] = worker.is_alive(timeout_s)
            got["s"] = time.monotonic() - t0

        th = threading.Thread(target=check)
        th.start()
        time.sleep(0.5)  # the ping is out
        os.kill(worker.pid, signal.SIGKILL)
        th.join()
        return got["alive"], got["s"]
    finally:
        for proc in sup.processes:
            if proc.process.is_alive():
                proc.kill()
            proc.process.join()
        sock.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_supervisor_notices_a_worker_killed_while_pinged_at_once():
    from uvicorn.supervisors import Multiprocess

    from gare_serve.processes.worker_lifetime import prompt_supervisor

    alive, s = _health_check_of_a_worker_killed_while_pinged(prompt_supervisor(Multiprocess), 30)
    assert alive is False and s < 5, s
    # uvicorn's own supervisor waits for the whole health-check timeout, then restarts the worker
    alive, s = _health_check_of_a_worker_killed_while_pinged(Multiprocess, 6)
    assert alive is False and s >= 5.5, s
