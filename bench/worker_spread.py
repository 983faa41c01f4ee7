"""Do connections reach every worker? `gare-serve --workers 2`, shared listening socket vs a socket per worker.

    python -m bench.worker_spread                       # 5 runs, 32 keep-alive clients, 40 requests each
    python -m bench.worker_spread --runs 5 --clients 32 --requests 40 --n 2000

Two real servers (``python -m gare_serve.cli --workers 2``) on one index: ``--worker-sockets shared`` (one listening
socket inherited by both workers, the design before issue 29) and ``--worker-sockets reuseport`` (a socket per
worker, SO_REUSEPORT: the kernel hashes connections over them; ``gare_serve/processes/port_group.py``). Both run for the whole
benchmark; each run sends one burst to each, in alternating order (shared first in even runs): ``--clients``
threads open one keep-alive HTTP/1.1 connection each at the same instant (a barrier) and send ``--requests``
``POST /v1/search`` (distinct queries, two-stage, k=10, query and result caches off so that every request runs
the text encoder) back to back on it. Per burst: the connections each worker served (its
``gare_worker_requests`` counter in /metrics before and after, divided by ``--requests``: every connection
sends exactly that many), q/s (requests / the burst's wall time), client-side p50/p99 latency and the CPU
seconds per second each worker used (/proc/PID/stat). The index and checkpoint are those of
``bench/serve_http.py`` (``serve_bench.write_gallery``: ViT-B/32 sizes, random weights, psi fold constants).

Results: bench/results/worker_spread.{json,md} with the commit, command, CPU model (lscpu), kernel and the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.harness import (  # noqa: E402
    add_render_arg,
    cpu_name,
    git_commit,
    loadavg,
    render_saved,
    start,
    with_provenance,
    write_report,
)
from bench.support import CHECKOUT_PATH, burst, stop_process, worker_requests  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/",
)


MODES = ("shared", "reuseport")
TICK = os.sysconf("SC_CLK_TCK")
RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


class Server:
    """`gare-serve --workers 2 --worker-sockets MODE --port 0` in a child process."""

    def __init__(self, index: Path, mode: str, log: Path) -> None:
        self.mode, self.log = mode, log
        args = [sys.executable, "-m", "gare_serve.cli", "--index", str(index), "--workers", "2", "--worker-sockets", mode,
                "--host", "127.0.0.1", "--port", "0", "--log-level", "info", "--query-cache-entries", "0",
                "--result-cache-entries", "0"]
        env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, "GARE_TORCH_THREADS": "1", "GARE_WORKER_HEALTHCHECK_S": "900"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.port = 0
        self.url = ""
        self.pids: list[int] = []

    def wait_ready(self, limit_s: float = 900) -> None:
        deadline = time.time() + limit_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gare-serve ({self.mode}) exited: {self.log.read_text()[-3000:]}")
            if not self.port and (m := RUNNING.search(self.log.read_text(errors="replace"))):
                self.port = int(m.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
            if self.port:
                try:
                    r = httpx.get(self.url + "/readyz", timeout=5)
                    if r.status_code == 200:
                        self.pids = sorted(int(w["pid"]) for w in r.json()["workers"])
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"gare-serve ({self.mode}) not ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        stop_process(self.proc)


def measure(srv: Server, queries: list[str], clients: int, requests: int) -> dict[str, Any]:
    before = worker_requests(srv.url)
    c0 = {p: cpu_seconds(p) for p in srv.pids}
    t0 = time.perf_counter()
    r = burst(srv.port, queries, clients, requests)
    dt = time.perf_counter() - t0
    after = worker_requests(srv.url)
    # the /metrics scrape before the burst counts one request on one worker: floor division drops it
    conns = [int(after.get(p, 0) - before.get(p, 0)) // requests for p in srv.pids]
    r.update(mode=srv.mode, connections_per_worker=conns,
             worker_cpu=[round((cpu_seconds(p) - c0[p]) / dt, 2) for p in srv.pids])
    if sum(conns) != clients:
        r["note"] = f"connections counted {sum(conns)} != {clients} clients"
    return r


def make_index(work: Path, n: int) -> Path:
    import torch

    from bench.serve_bench import write_gallery
    from gare.checkpoint import file_sha256, save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE
    from gare.psi_fold_weights import fold_weights

    torch.manual_seed(0)
    cfg = get_model_config("gare-vit-b-32", pretrained="none")
    m = GARE.build(cfg).eval()
    ck = work / "gare-vit-b-32-random.safetensors"
    save_checkpoint(ck, m, queues={})
    fold = fold_weights(m.psi)
    del m
    write_gallery(work / "g", n, {"path": str(ck), "sha256": file_sha256(ck), "model_config": cfg.to_dict()}, fold)
    return work / "g" / "index"


def summary(runs: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    out = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        qps = [r["qps"] for r in rs]
        out[mode] = {
            "runs": len(rs),
            "runs_with_an_idle_worker": sum(1 for r in rs if min(r["connections_per_worker"]) == 0),
            "largest_share_per_run": [round(max(r["connections_per_worker"]) / clients, 2) for r in rs],
            "qps_min": min(qps), "qps_median": statistics.median(qps), "qps_max": max(qps),
        }
    s, p = out["shared"], out["reuseport"]
    out["reuseport_over_shared_median_qps"] = round(p["qps_median"] / s["qps_median"], 2)
    return out


@with_provenance
def markdown(d: dict[str, Any]) -> str:
    L = ["# Worker spread: `gare-serve --workers 2`, one shared listening socket vs a socket per worker (SO_REUSEPORT)", "",
         f"Generated by `{d['command']}` at commit `{d['commit']}` on {d['date']}"
         + (f" (files differing from that commit in the working tree: {', '.join(d['modified'])})." if d.get("modified") else "."), "",
         f"CPU: {d['cpu']} ({d['cores']} cores); Linux {d['kernel']}; Python {d['python']}, uvicorn {d['uvicorn']}. "
         f"Load average (1/5/15 min) before: {d['load_start']}, after: {d['load_end']}.", "",
         f"Each run: one burst per server (order alternating), {d['clients']} keep-alive connections opened at once, "
         f"{d['requests']} `POST /v1/search` each (distinct queries, caches off, two-stage, k=10); index of "
         f"{d['n']:,} entries, ViT-B/32 text tower with random weights (`--text-encoder auto`), 1 torch thread per "
         "worker. Connections per worker: each worker's `gare_worker_requests` delta / requests per connection. "
         "Worker CPU: CPU seconds per second of the burst, per worker.", "",
         "| run | worker sockets | connections per worker | q/s | p50 ms | p99 ms | wall s | worker CPU/s | errors |",
         "|---:|---|---|---:|---:|---:|---:|---|---:|"]
    for r in d["runs"]:
        L.append(f"| {r['run']} | {r['mode']} | {' / '.join(map(str, r['connections_per_worker']))} | {r['qps']} | "
                 f"{r['p50_ms']} | {r['p99_ms']} | {r['wall_s']} | {', '.join(map(str, r['worker_cpu']))} | {r['errors']} |")
    s = d["summary"]
    L += ["", "| worker sockets | runs | runs where a worker got no connection | largest share per run | q/s min / median / max |",
          "|---|---:|---:|---|---|"]
    for mode in MODES:
        m = s[mode]
        L.append(f"| {mode} | {m['runs']} | {m['runs_with_an_idle_worker']} | {', '.join(map(str, m['largest_share_per_run']))} | "
                 f"{m['qps_min']} / {m['qps_median']} / {m['qps_max']} |")
    L += ["", f"Median q/s, reuseport / shared: **{s['reuseport_over_shared_median_qps']}x**.", "", d["notes"].strip(), ""]
    return "\n".join(L)


NOTES = """
## Notes

- **Why the shared socket skews.** Both workers' event loops wait on the one listening socket; a new connection
  wakes them, and the first to run accepts every connection queued at that moment (asyncio accepts up to the
  backlog per wake-up). A burst therefore tends to land on whichever worker is awake first, and keep-alive
  connections stay where they landed for their whole life. With a socket per worker the kernel picks the socket
  by a hash of each connection's addresses and ports: with 2 workers every connection is a fair coin, so a
  burst of 32 splits around 16 / 16 (a binomial: 95% of bursts between 11 / 21 and 21 / 11; all 32 on one
  worker once in 2^31 bursts), never by the workers' timing.
- **Same machine, one run.** Client threads run on the same 2 cores as the servers (they take a share of the
  CPU), and the machine may be shared with other jobs (load averages above): compare the two modes within
  this run only, and across runs by the count of runs where a worker idled rather than by the q/s alone.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=40, help="requests per connection")
    ap.add_argument("--n", type=int, default=2000, help="index entries")
    ap.add_argument("--work", default="/tmp/gare-worker-spread")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "worker_spread"))
    add_render_arg(ap, REPO / "bench" / "results" / "worker_spread.json")
    args = ap.parse_args(argv)
    if args.render:
        print(f"wrote {render_saved(args.render, markdown)}")
        return 0
    run = start(__name__, MEASURES, argv)
    import uvicorn

    from bench.serve_bench import make_queries

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data: dict[str, Any] = {
        "command": run.command,
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
        "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
        "uvicorn": uvicorn.__version__, "load_start": loadavg(), "runs_requested": args.runs, "clients": args.clients,
        "requests": args.requests, "n": args.n, "runs": [], "notes": NOTES,
    }
    t_start = time.perf_counter()
    print("writing the index", flush=True)
    index = make_index(work, args.n)
    queries = make_queries(args.runs * 2 * args.clients * args.requests + 1000, seed=5)
    servers = {mode: Server(index, mode, work / f"serve-{mode}.log") for mode in MODES}
    try:
        for srv in servers.values():
            srv.wait_ready()
            print(f"{srv.mode}: port {srv.port}, workers {srv.pids}", flush=True)
            burst(srv.port, queries[-1000:], 2, 5)  # warm-up (first requests of each worker), not counted
        data["startup_s"] = round(time.perf_counter() - t_start, 1)
        q = 0
        for i in range(args.runs):  # alternating the order (not `run`: that is this run's record)
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                chunk = queries[q:q + args.clients * args.requests]
                q += len(chunk)
                r = measure(servers[mode], chunk, args.clients, args.requests)
                r["run"] = i + 1
                print(json.dumps(r), flush=True)
                data["runs"].append(r)
    finally:
        for srv in servers.values():
            srv.stop()
    data["load_end"] = loadavg()
    data["total_s"] = round(time.perf_counter() - t_start, 1)
    data["summary"] = summary(data["runs"], args.clients)
    data["run"] = run.record()
    print(write_report(Path(args.out).with_suffix(".json"), data, markdown).read_text())
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
