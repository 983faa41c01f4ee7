"""Clients that never read their answer: what a `gare-serve` worker holds for them, and whether it gives it back.

N clients (default 60) each open a connection with a small receive buffer (a slow or hostile client far away),
send one large ``POST /v1/search/batch`` (64 queries, k = 1000 on the 1-s segment index of the service tests:
about 1 MB of JSON each) and never read a byte of the answer. The worker (``gare-serve --workers 1``: one
process, the worker itself) is sampled for its RSS (``/proc/<pid>/status`` VmRSS) before the clients come,
while they hold their connections, and after they have gone. Reported: the RSS at each step, how many
connections the server dropped by itself (its send timeout: the client sees EOF or a reset), and the RSS
after minus the RSS before (the target: within 20 MiB).

The same burst runs against one fresh server per configuration, side by side in one run: the served defaults,
and the same server with the hit budget (GARE_INFLIGHT_HITS) and the heap trim (GARE_HEAP_TRIM_S) each turned
off, and both off (what the worker kept before either existed).

    python -m bench.http_unread                      # 60 clients, every configuration
    python -m bench.http_unread --configs served --clients 20 --send-timeout-s 2 --hold-s 8

Writes bench/results/http_unread.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import REPO, RESULTS, start, with_provenance, write_report

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/web/http_limits.py",
    "service/gare_serve/web/hit_budget.py",
    "service/gare_serve/heap_trim.py",
    "service/gare_serve/processes",
    "service/gare_serve/web/search_routes.py",
    "service/gare_serve/cli.py",
)

MiB = 1024 * 1024
OFF = {"GARE_INFLIGHT_HITS": str(100_000_000), "GARE_HEAP_TRIM_S": "0"}
# each configuration's settings on top of the server's defaults
CONFIGS: dict[str, dict[str, str]] = {
    "served": {},
    "no hit budget": {"GARE_INFLIGHT_HITS": OFF["GARE_INFLIGHT_HITS"]},
    "no heap trim": {"GARE_HEAP_TRIM_S": OFF["GARE_HEAP_TRIM_S"]},
    "neither": dict(OFF),
}


def make_env(root: Path) -> tuple[Path, list[str]]:
    """(a 1-s segment index, its captions) of the service tests' kind: 16 synthetic captioned mp4 files, a tiny
    GARE checkpoint, `gare-index build --segment 1` (what tests/service/support.py builds; bench may not import
    tests)."""
    import torch

    from gare.checkpoint import save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE
    from gare_build.build import BuildOptions, build
    from gare_train.synth import SynthConfig, generate_corpus

    info = generate_corpus(root / "corpus", SynthConfig(n_videos=16, seed=0, duration=2.0, captions_per_video=2),
                           progress=False)
    torch.manual_seed(0)
    ckpt = root / "tiny.safetensors"
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    save_checkpoint(ckpt, model, queues={"text": torch.nn.functional.normalize(torch.randn(64, model.cfg.embed_dim), dim=-1)})
    build(str(ckpt), str(info["videos_dir"]), str(root / "seg_index"), BuildOptions(workers=0, progress=False, segment=1.0))
    return root / "seg_index", read_captions(root)


def read_captions(root: Path) -> list[str]:
    with open(root / "corpus" / "captions.jsonl", encoding="utf-8") as fh:
        return [json.loads(line)["captions"][0] for line in fh]


class Server:
    """`gare-serve --workers 1` (one process: the worker itself) on 127.0.0.1:<free port>."""

    def __init__(self, index: Path, env: dict[str, str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        pythonpath = os.pathsep.join(str(REPO / d) for d in ("training", "indexer", "service", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gare_serve.cli", "--host", "127.0.0.1", "--port", str(self.port), "--index",
             str(index), "--workers", "1", "--log-level", "warning"],
            env={**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1", **env})

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gare-serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.base_url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("gare-serve did not become ready")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def batch_request(port: int, captions: list[str], n_queries: int, k: int) -> bytes:
    queries = [f"{captions[i % len(captions)]} {i}" for i in range(n_queries)]
    body = json.dumps({"queries": queries, "k": k}).encode()
    head = (f"POST /v1/search/batch HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def open_unread(port: int, request: bytes, rcvbuf: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window it advertises
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def status_of(s: socket.socket, wait_s: float) -> int | None:
    """The status code of the answer's first line, peeked (nothing is read off the socket); None if none came."""
    s.settimeout(wait_s)
    try:
        head = s.recv(64, socket.MSG_PEEK)
    except (TimeoutError, OSError):
        return None
    finally:
        s.settimeout(None)
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def read_answer(s: socket.socket, body_bytes: int) -> None:
    s.settimeout(120)
    got = b""
    while len(got.partition(b"\r\n\r\n")[2]) < body_bytes:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        got += chunk


def dropped_by_server(s: socket.socket) -> bool:
    """True when the server has closed (FIN: CLOSE_WAIT here) or reset (CLOSE) the connection: the first byte of
    Linux's TCP_INFO is the socket's TCP state; nothing is read, so the server is not let to send more."""
    state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    return state in (7, 8)  # TCP_CLOSE, TCP_CLOSE_WAIT


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    if args.env is not None and (args.env / "seg_index").is_dir():  # a service-test corpus built before
        index, captions = args.env / "seg_index", read_captions(args.env)
    else:
        index, captions = make_env(args.env or Path(tempfile.mkdtemp(prefix="gare-unread-")))
    # every client's 64 queries queued at once: a queue that holds them all, so that each gets its answer (not a 503)
    env = {"GARE_WORKER_HEALTHCHECK_S": "900", "GARE_BATCH_QUEUE_SIZE": str(max(1024, 2 * args.clients * args.queries))}
    if args.result_cache_entries is not None:
        env["GARE_RESULT_CACHE_ENTRIES"] = str(args.result_cache_entries)
    if args.send_timeout_s is not None:
        env["GARE_SEND_TIMEOUT_S"] = str(args.send_timeout_s)
    out: dict = {"clients": args.clients, "queries": args.queries, "k": args.k, "rcvbuf": args.rcvbuf,
                 "hold_s": args.hold_s, "read": args.read, "result_cache_entries": args.result_cache_entries, "settle_s": args.settle_s, "send_timeout_s": args.send_timeout_s,
                 "setup_s": round(time.perf_counter() - t0, 1), "runs": []}
    for name in args.configs:
        print(f"{name}: {CONFIGS[name] or 'the defaults'}", file=sys.stderr, flush=True)
        row = burst(index, captions, {**env, **CONFIGS[name]}, args)
        out["answer_bytes"] = row.pop("answer_bytes")
        out["runs"].append({"config": name, "settings": CONFIGS[name], **row})
    return out


def burst(index: Path, captions: list[str], env: dict[str, str], args: argparse.Namespace) -> dict:
    """One fresh server, warmed, then the burst of clients; its RSS before, during and after."""
    with Server(index, env) as srv:
        pid = srv.proc.pid
        request = batch_request(srv.port, captions, args.queries, args.k)
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:  # warm: every path the clients take, read
            for _ in range(3):
                r = c.post("/v1/search/batch", content=request.partition(b"\r\n\r\n")[2],
                           headers={"content-type": "application/json"})
                r.raise_for_status()
        time.sleep(1.0)
        before = rss_bytes(pid)
        socks = [open_unread(srv.port, request, args.rcvbuf) for _ in range(args.clients)]
        statuses = [status_of(s, 120.0) for s in socks]
        if args.read:  # the control: the same burst, every answer read (what the server keeps without unread clients)
            for s in socks:
                read_answer(s, len(r.content))
        peak = before
        deadline = time.monotonic() + args.hold_s
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.25)
        during = rss_bytes(pid)
        dropped = sum(dropped_by_server(s) for s in socks)
        for s in socks:
            s.close()
        time.sleep(args.settle_s)
        after = rss_bytes(pid)
        alive = httpx.get(srv.base_url + "/healthz", timeout=10).status_code
    return {"answer_bytes": len(r.content), "rss_before_mib": round(before / MiB, 1), "rss_peak_mib": round(peak / MiB, 1),
            "rss_end_of_hold_mib": round(during / MiB, 1), "rss_after_mib": round(after / MiB, 1),
            "rss_after_minus_before_mib": round((after - before) / MiB, 1),
            "statuses": {str(c): statuses.count(c) for c in sorted(set(statuses), key=str)},
            "dropped_by_server": dropped, "healthz_after": alive, "target_met": (after - before) <= 20 * MiB}


@with_provenance
def markdown(out: dict) -> str:
    lines = [
        "# Clients that never read a large batch answer (bench/http_unread.py)", "",
        f"{out['clients']} clients, each `POST /v1/search/batch` ({out['queries']} queries, k={out['k']}, "
        f"{out['answer_bytes']} bytes of answer), receive buffer {out['rcvbuf']} bytes, "
        f"{'reading their answers (control)' if out['read'] else 'never reading'}; held "
        f"{out['hold_s']} s, then closed; RSS sampled {out['settle_s']} s after. `gare-serve --workers 1` (one fresh "
        f"server per row, side by side in this run), send timeout "
        f"{out['send_timeout_s'] if out['send_timeout_s'] is not None else 'default'}.", "",
        "| configuration | settings | RSS before | peak | end of hold | after | after - before | answered 200 | "
        "dropped by the server | target (<= 20 MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:
        settings = ", ".join(f"`{k}={v}`" for k, v in r["settings"].items()) or "defaults"
        lines.append(
            f"| {r['config']} | {settings} | {r['rss_before_mib']} MiB | {r['rss_peak_mib']} MiB | "
            f"{r['rss_end_of_hold_mib']} MiB | {r['rss_after_mib']} MiB | {r['rss_after_minus_before_mib']} MiB | "
            f"{r['statuses'].get('200', 0)} of {out['clients']} | {r['dropped_by_server']} of {out['clients']} | "
            f"{'met' if r['target_met'] else 'missed'} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=60)
    p.add_argument("--queries", type=int, default=64, help="queries in each batch (the server's default limit: 64)")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--rcvbuf", type=int, default=4096, help="each client's SO_RCVBUF")
    p.add_argument("--hold-s", type=float, default=45.0, help="how long the clients hold their connections")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after they close before the last RSS sample")
    p.add_argument("--send-timeout-s", type=float, default=None, help="GARE_SEND_TIMEOUT_S (default: the server's)")
    p.add_argument("--result-cache-entries", type=int, default=0, help="GARE_RESULT_CACHE_ENTRIES (default 0: each "
                   "client's answer is computed and rendered, not one cached answer re-sent)")
    p.add_argument("--configs", type=lambda v: [c.strip() for c in v.split(",")], default=list(CONFIGS),
                   help=f"comma-separated, of: {', '.join(CONFIGS)} (default: all, in that order)")
    p.add_argument("--read", action="store_true", help="control run: the clients read their answers")
    p.add_argument("--env", type=Path, default=None, help="the service-test corpus and indexes to use (built there "
                   "when missing; default: a new temporary directory)")
    p.add_argument("--out", type=Path, default=RESULTS / "http_unread")
    args = p.parse_args(argv)
    if unknown := [c for c in args.configs if c not in CONFIGS]:
        p.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    run_rec = start(__name__, MEASURES, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = run(args)
    out["run"] = run_rec.record()
    print(json.dumps(out, indent=1))
    write_report(args.out.with_suffix(".json"), out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
