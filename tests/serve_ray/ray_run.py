"""The Ray part of the tests in tests/serve_ray/test_ray_serve.py, run as a child process (inside a private network
namespace with only loopback when the test runs as root): ``python -m tests.serve_ray.ray_run CONFIG.json OUT.json``.

Starts a local Ray cluster of ``nodes`` nodes bound to 127.0.0.1 (no dashboard), Serve's HTTP proxy on 127.0.0.1,
deploys ``gare_serve.ray_serve.deployment:build_app`` over a sharded index, then runs the config's ``steps`` in order and writes
what each saw to OUT.json (``out["steps"][name]``). With ``apps`` ([{name, app, steps}]) the apps are deployed one
after the other on the same cluster (each deleted before the next is deployed): ``out["apps"][name]["steps"]``. Every answer is recorded as {status, partial, missing_shards,
index_version, hits: [[file name, id, score, ann, psi, bias], ...], detail, qi (the request's index)}. Steps:

- ``ask``: each request of ``requests`` once, in order.
- ``kill``: kill ``count`` (default all) live replicas of shard ``shard``'s deployment, no restart by hand
  (``hide``: that shard's folder, renamed first, so that no replacement can start).
- ``until_restarted``: query (round-robin over ``requests``) until Ray has a replica of ``shard`` that was not
  killed and 3 complete answers in a row came back (at most ``timeout_s``).
- ``load_while``: ``clients`` threads query in closed loop while ``command`` runs (``gare-index add`` switching the
  generation), and on until ``after`` answers of index_version ``until_version`` came back (at most ``timeout_s``).
- ``raw``: each of ``requests`` (raw HTTP/1.1 bytes, latin-1 text) on its own connection: the status, headers and
  body of the answer (tests/serve_ray/test_ray_limits.py).
- ``slow``: one connection sends ``head`` at once, then ``trickle`` one byte every ``every_s`` seconds, stopping
  when the server answers or closes (at most ``guard_s``): what came back and when, from the connection's opening.
- ``metrics``: GET /metrics until every line of ``until`` is in it (at most ``timeout_s``; the recall watch evaluates
  its samples in the background): the ``prefix`` lines of the last answer.
- ``listeners``: every listening TCP socket of this process and its descendants (every Ray process of the run),
  with its address and the process's name, and (``netns``: in a private network namespace) every listening socket
  of the namespace from /proc/net/tcp and tcp6.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import ray
from ray import serve
from ray.cluster_utils import Cluster

from gare_serve.ray_serve.deployment import build_app, shard_deployment_name

LOOPBACK = "127.0.0.1"


def replica_names(deployment: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"])


def wait_ready(base: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(base + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the Ray Serve app did not become ready in {timeout_s} s")


def ask(client: httpx.Client, body: dict[str, Any], qi: int) -> dict[str, Any]:
    try:
        r = client.post("/v1/search", json=body)
    except httpx.HTTPError as e:  # a transport error is an answer too (counted, never dropped)
        return {"status": 0, "detail": f"{type(e).__name__}: {e}", "qi": qi, "t": time.time()}
    b = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"detail": r.text}
    hits = [[h["metadata"]["name"], h["id"], h["score"], h["ann_score"], h["psi_score"], h["bias"]]
            for h in b.get("results", [])]
    return {"status": r.status_code, "partial": b.get("partial"), "missing_shards": b.get("missing_shards"),
            "index_version": b.get("index_version"), "hits": hits, "detail": b.get("detail"), "qi": qi,
            "t": time.time()}


def step_ask(client: httpx.Client, st: dict[str, Any]) -> dict[str, Any]:
    return {"answers": [ask(client, body, i) for i, body in enumerate(st["requests"])]}


def step_kill(client: httpx.Client, st: dict[str, Any]) -> dict[str, Any]:
    dep = shard_deployment_name(st["shard"])
    before = replica_names(dep)
    killed = before[: st.get("count", len(before))]
    if st.get("hide"):  # the shard's folder away: Serve's replacement replicas cannot open it, the shard stays down
        os.rename(st["hide"], st["hide"] + ".hidden")
    actors = [ray.get_actor(name, namespace="serve") for name in killed]
    for actor in actors:
        ray.kill(actor, no_restart=True)
    # ray.kill only asks: until an actor is gone it may still answer a request (the next step's would then see the
    # shard alive). Each is gone when a call on it raises (at most 60 s: a hang guard).
    deadline = time.time() + 60
    for actor in actors:
        while time.time() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=1)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.05)
    return {"before": before, "killed": killed, "t": time.time()}


def step_until_restarted(client: httpx.Client, st: dict[str, Any], killed: list[str]) -> dict[str, Any]:
    dep, reqs = shard_deployment_name(st["shard"]), st["requests"]
    seen: list[dict[str, Any]] = []
    t0, restarted_at = time.time(), None
    while time.time() - t0 < st.get("timeout_s", 90):
        seen.append(ask(client, reqs[len(seen) % len(reqs)], len(seen) % len(reqs)))
        now = replica_names(dep)
        if restarted_at is None and set(now) - set(killed):
            restarted_at = time.time() - t0
        tail = seen[-3:]
        if restarted_at is not None and len(tail) == 3 and all(a["status"] == 200 and not a["partial"] for a in tail):
            break
        time.sleep(0.05)
    return {"restarted_at_s": restarted_at, "replicas_after": replica_names(dep), "answers": seen}


def step_load_while(base: str, st: dict[str, Any]) -> dict[str, Any]:
    reqs, answers, stop = st["requests"], [], threading.Event()
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as cl:
            i = c
            while not stop.is_set():
                a = ask(cl, reqs[i % len(reqs)], i % len(reqs))
                with lock:
                    answers.append(a)
                i += 1

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(st.get("clients", 4))]
    for th in threads:
        th.start()
    t0 = time.time()
    time.sleep(st.get("before_s", 2.0))  # answers from the old generation first
    cmd = subprocess.run(st["command"], capture_output=True, text=True, env={**os.environ, **st.get("env", {})})
    t_cmd = time.time() - t0
    while time.time() - t0 < st.get("timeout_s", 120):
        with lock:
            if sum(a.get("index_version") == st["until_version"] for a in answers) >= st.get("after", 8):
                break
        time.sleep(0.2)
    stop.set()
    for th in threads:
        th.join(timeout=90)
    return {"command_rc": cmd.returncode, "command_output": (cmd.stdout + cmd.stderr)[-4000:], "command_done_s": t_cmd,
            "answers": answers}


def step_metrics(client: httpx.Client, st: dict[str, Any]) -> dict[str, Any]:
    t0, text = time.time(), ""
    while time.time() - t0 < st.get("timeout_s", 60):
        text = client.get("/metrics").text
        if all(line in text.splitlines() for line in st["until"]):
            break
        time.sleep(0.1)
    return {"lines": [ln for ln in text.splitlines() if ln.startswith(st["prefix"])], "waited_s": time.time() - t0}


def read_answer(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection, or a whole answer with a Content-Length came,
    or ``deadline`` (time.monotonic()) passed."""
    got = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except OSError:  # reset by the server: what came before it is the answer
            break
        if not chunk:
            break
        got += chunk
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            lengths = [int(v) for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
                       if k.strip().lower() == b"content-length"]
            if lengths and len(body) >= lengths[0]:
                break
    return got


def parse_answer(raw: bytes) -> dict[str, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ":" in ln)}
    return {"status": status, "headers": headers, "body": body.decode("utf-8", "replace")[:2000]}


def step_raw(base_port: int, st: dict[str, Any]) -> dict[str, Any]:
    answers = []
    for req in st["requests"]:
        with socket.create_connection((LOOPBACK, base_port), timeout=30) as sock:
            sock.sendall(req.encode("latin-1"))
            answers.append(parse_answer(read_answer(sock, time.monotonic() + st.get("timeout_s", 60))))
    return {"answers": answers}


def step_slow(base_port: int, st: dict[str, Any]) -> dict[str, Any]:
    """A slow client: ``head`` at once, then ``trickle`` one byte every ``every_s``; stops when the server speaks
    or closes. ``closed_at_s`` (from the connection's opening): None when the server did neither within
    ``guard_s``."""
    data = st["trickle"].encode("latin-1")
    t0 = time.monotonic()
    sent, closed_at, raw, why = 0, None, b"", "guard"
    with socket.create_connection((LOOPBACK, base_port), timeout=30) as sock:
        sock.sendall(st.get("head", "").encode("latin-1"))
        while time.monotonic() - t0 < st["guard_s"]:
            if sent < len(data):
                try:
                    sock.sendall(data[sent:sent + 1])
                    sent += 1
                except OSError as e:
                    closed_at, why = time.monotonic() - t0, f"send failed: {e}"
                    break
            sock.settimeout(st["every_s"])
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as e:
                closed_at, why = time.monotonic() - t0, f"recv failed: {e}"
                break
            closed_at, why = time.monotonic() - t0, "answered" if chunk else "closed"
            raw = chunk + (read_answer(sock, time.monotonic() + 10) if chunk else b"")
            break
    return {"closed_at_s": closed_at, "why": why, "bytes_sent": sent, "bytes_total": len(data),
            "answer": parse_answer(raw) if raw else None}


def _proc_net_listeners() -> list[dict[str, Any]]:
    """LISTEN sockets of this network namespace (/proc/net/tcp, tcp6): address and port, as the kernel has them."""
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw)
            out.append({"family": name, "ip": addr, "port": int(hexport, 16)})
    return out


def step_listeners(st: dict[str, Any]) -> dict[str, Any]:
    me = psutil.Process()
    found = []
    for p in [me, *me.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline())[:120] or p.name()
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found.append({"pid": p.pid, "name": name, "ip": c.laddr.ip, "port": c.laddr.port})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {"processes": found, "netns": _proc_net_listeners() if st.get("netns") else None,
            "n_processes": len(me.children(recursive=True)) + 1}


def start_head(node: dict[str, Any], tries: int) -> Cluster:
    """The head node; up to ``tries`` starts (Ray gives a raylet a fixed 30 s to register, which a host loaded by
    other jobs can miss: the failed node's processes are stopped before the next try)."""
    for attempt in range(1, tries + 1):
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(**node)
            return cluster
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a node that did not start
            cluster.shutdown()
            for child in psutil.Process().children(recursive=True):  # what the failed node had started, by pid
                child.kill()
            psutil.wait_procs(psutil.Process().children(recursive=True), timeout=10)
            if attempt == tries:
                raise
            print(f"the head node did not start (try {attempt} of {tries}): {e}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def run_steps(base: str, port: int, steps: list[dict[str, Any]], into: dict[str, Any]) -> None:
    """Each step of one app in order; what it saw goes to ``into[step name]``."""
    killed: dict[int, list[str]] = {}
    with httpx.Client(base_url=base, timeout=60) as client:  # a client per app: no connection of the one before
        for st in steps:
            t1 = time.time()
            if st["do"] == "ask":
                r = step_ask(client, st)
            elif st["do"] == "kill":
                r = step_kill(client, st)
                killed[st["shard"]] = r["killed"]
            elif st["do"] == "until_restarted":
                r = step_until_restarted(client, st, killed.get(st["shard"], []))
            elif st["do"] == "load_while":
                r = step_load_while(base, st)
            elif st["do"] == "raw":
                r = step_raw(port, st)
            elif st["do"] == "slow":
                r = step_slow(port, st)
            elif st["do"] == "listeners":
                r = step_listeners(st)
            elif st["do"] == "metrics":
                r = step_metrics(client, st)
            else:
                raise ValueError(f"unknown step {st['do']!r}")
            into[st["name"]] = {**r, "step_s": time.time() - t1}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    t_start = time.time()
    node = {"node_ip_address": LOOPBACK, "include_dashboard": False, "num_cpus": cfg.get("num_cpus", 2),
            "object_store_memory": 80 * 1024 * 1024}
    cluster = start_head(node, cfg.get("start_tries", 1))
    for _ in range(cfg.get("nodes", 2) - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict[str, Any] = {"nodes": len([n for n in ray.nodes() if n["Alive"]]),
                           "node_ips": sorted({n["NodeManagerAddress"] for n in ray.nodes()}),
                           "cluster_s": time.time() - t_start, "steps": {}}
    # one or several apps, one after the other on the same cluster and proxy (``apps``: [{name, app, steps}]); a
    # config with ``app`` and ``steps`` is one app whose steps are also ``out["steps"]``
    apps = cfg.get("apps") or [{"name": "main", "app": cfg["app"], "steps": cfg["steps"]}]
    out["apps"] = {}
    try:
        # proxy_location "HeadOnly": the nodes of a local cluster share 127.0.0.1, so a proxy on every node (Ray's
        # default) puts two proxies on one port, and the kernel splits the connections between them
        serve.start(http_options={"host": LOOPBACK, "port": cfg["port"]},
                    proxy_location=cfg.get("proxy_location", "EveryNode"))
        base = f"http://{LOOPBACK}:{cfg['port']}"
        for i, spec in enumerate(apps):
            if i:  # the previous app gone before the next one answers /readyz (never a stale answer)
                t0 = time.time()
                serve.delete("gare")
                out["apps"][apps[i - 1]["name"]]["delete_s"] = time.time() - t0
            t0 = time.time()
            serve.run(build_app(spec["app"]), name="gare", route_prefix="/", blocking=False)
            wait_ready(base, cfg.get("ready_timeout_s", 240))
            rec: dict[str, Any] = {"ready_s": time.time() - t0, "steps": {}}
            out["apps"][spec["name"]] = rec
            run_steps(base, cfg["port"], spec["steps"], rec["steps"])
        if "apps" not in cfg:
            out["ready_s"], out["steps"] = out["apps"]["main"]["ready_s"], out["apps"]["main"]["steps"]
    finally:
        t_down = time.time()
        # no serve.shutdown(): its graceful drain of every replica takes seconds each, and the cluster (every Ray
        # process of this run) goes with cluster.shutdown() anyway
        ray.shutdown()
        cluster.shutdown()
        out["shutdown_s"] = time.time() - t_down
        out["total_s"] = time.time() - t_start
        out["started_at"], out["ended_at"] = t_start, time.time()
    return out


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(main(config), default=str))
