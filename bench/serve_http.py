"""Serving benchmark over real HTTP: `gare-serve --workers N` processes on 127.0.0.1, closed-loop clients.

    python -m bench.serve_http                                   # 10k entries, ViT-B/32 text tower (random weights)
    python -m bench.serve_http --n 10000 --duration 8 --workers 1,2

One index (``serve_bench.write_gallery``: the real index format, ViT-B/32 sizes d=512, f=12) and one ViT-B/32
GARE checkpoint with random weights. For every server configuration a real ``gare-serve`` is started
(``python -m gare_serve.cli``; uvicorn, ``--workers N``), and closed-loop clients (threads, one keep-alive
HTTP/1.1 connection each, ``POST /v1/search`` back to back, two-stage, k=10) run for ``--duration`` s with
1 and then 32 clients. Reported per run: q/s, p50/p95/p99 latency (client side), CPU seconds per second
used by each worker process (/proc/PID/stat utime+stime) and each worker's RSS at the end (VmRSS).

Configurations: workers x {cache off with distinct queries (every request runs the encoder), cache on with
a Zipf(1.0) stream over 2,000 distinct queries (``bench/zipf_queries.py``)}. Plus an in-process component
table (one query): fp32 / int8 text tower, a cache hit, ANN top-256, psi rerank of 256 (the fold, as served).
The gallery carries psi's folded constants (as `gare-index build` writes them), so the servers rerank with the
fold; ``--index DIR`` serves an existing index instead (e.g. one kept by ``bench/serve_bench.py --keep``).

The client threads run on the same cores as the server: on a 2-core machine they take a share of the CPU
(reported as ``client_cpu``). Results: bench/results/serve_http.{json,md} with commit, command, date, CPU
and the load average before and after (the machine may be shared: compare ratios within one run only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.harness import (  # noqa: E402
    add_render_arg,
    git_commit,
    loadavg,
    machine,
    render_saved,
    start,
    with_provenance,
    write_report,
)
from bench.serve_bench import make_queries, resident_fraction, summary_ms, timed, write_gallery  # noqa: E402
from bench.support import CHECKOUT_PATH, free_port, stop_process  # noqa: E402
from bench.zipf_queries import zipf_stream  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/",
    "indexer/gare_search/",
    "indexer/gare_index/",
    "training/gare/text_quant.py",
    "training/gare/text_*.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
)


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def worker_pids(parent: int) -> list[int]:
    """The serving processes: the children of uvicorn's supervisor (or the process itself with 1 worker)."""
    import psutil

    p = psutil.Process(parent)
    kids = [c.pid for c in p.children(recursive=False) if "multiprocessing.resource_tracker" not in " ".join(c.cmdline())]
    return kids or [parent]


def closed_loop(url: str, stream: list[str], clients: int, duration: float) -> dict[str, Any]:
    lat: list[list[float]] = [[] for _ in range(clients)]
    kinds: list[list[str]] = [[] for _ in range(clients)]  # each answer's timings_ms.cache: miss, hit or result
    errors = [0] * clients
    probe: list[list[float]] = [[] for _ in range(clients)]  # GET /healthz every 10th request
    stop = time.perf_counter() + duration
    start_gate = threading.Barrier(clients)

    def client(i: int) -> None:
        j = i * 7919
        with httpx.Client(base_url=url, timeout=60) as c:
            start_gate.wait()
            while time.perf_counter() < stop:
                q = stream[j % len(stream)]
                j += 1
                t0 = time.perf_counter()
                r = c.post("/v1/search", json={"query": q, "k": 10})
                if r.status_code == 200:
                    lat[i].append(time.perf_counter() - t0)
                    kinds[i].append(r.json()["timings_ms"]["cache"])
                else:
                    errors[i] += 1
                if j % 10 == 0:  # the floor of this machine's HTTP round trip under the same traffic: GET /healthz
                    t0 = time.perf_counter()
                    if c.get("/healthz").status_code == 200:
                        probe[i].append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    c0 = time.process_time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    all_lat = [x for xs in lat for x in xs]
    all_kind = [k for ks in kinds for k in ks]
    by_kind = {k: summary_ms([x for x, kk in zip(all_lat, all_kind, strict=True) if kk == k])
               for k in ("miss", "hit", "result") if k in all_kind}
    return {"clients": clients, "qps": round(len(all_lat) / wall, 2), **{f"latency_{k}": v for k, v in summary_ms(all_lat).items()},
            "errors": sum(errors), "wall_s": round(wall, 2), "client_cpu": round((time.process_time() - c0) / wall, 2),
            "answers": {k: all_kind.count(k) for k in ("miss", "hit", "result")}, "latency_by_cache": by_kind,
            "healthz": summary_ms([x for xs in probe for x in xs])}


def serve(index: Path, workers: int, cache: bool, threads: int | None,
          text_encoder: str = "auto") -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(f"/tmp/gare-serve-http-{port}.log")
    args = [sys.executable, "-m", "gare_serve.cli", "--index", str(index), "--port", str(port), "--workers", str(workers),
            "--log-level", "warning", "--query-cache-entries", "10000" if cache else "0",
            "--result-cache-entries", "10000" if cache else "0", "--text-encoder", text_encoder]
    if threads:
        args += ["--torch-threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (CHECKOUT_PATH, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gare-serve exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"gare-serve not ready: {log.read_text()[-3000:]}")


def components(index: Path, reps: int) -> dict[str, Any]:
    import faiss
    import torch

    from gare.checkpoint import load_model
    from gare.text_quant import build_text_encoder
    from gare_index.store import open_index
    from gare_search import query as Q
    from gare_search import rerank as R
    from gare_search import search as S
    from gare_search import stage1
    from gare_serve.engine.query_cache import QueryCache

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)  # one thread for every stage, as a worker with --torch-threads 1 runs them
    R.warm_up("cpu")  # compile the CPU kernel first, as the service's lifespan does
    v = open_index(index)
    model, _ = load_model(Path(v.manifest["checkpoint"]["path"]), "cpu")
    qs = make_queries(reps, seed=5)
    tok = [Q.trim_tokens(model.tokenize([q])) for q in qs]
    int8 = build_text_encoder(model, "int8")
    it = iter(range(10**9))
    int8(tok[0])
    Q.encode_queries(model, [qs[0]])
    out = {
        "text encoder fp32 (model)": summary_ms(timed(lambda: Q.encode_queries(model, [qs[next(it) % reps]]), reps)),
        "text encoder int8 (packed int8 tower, the CPU default)": summary_ms(timed(lambda: int8(tok[next(it) % reps]), reps)),
    }
    cache = QueryCache(1000, 1 << 26)
    cache.encode([qs[0]], "sha", lambda m: Q.encode_queries(model, m))
    out["cache hit (lookup, no encoder)"] = summary_ms(timed(lambda: cache.encode([qs[0]], "sha", lambda m: Q.encode_queries(model, m)), reps))
    t = Q.encode_queries(model, [qs[0]])
    units = Q.unit_rows(t)
    _, ids = stage1.ann_stage(v, units, 256)
    out["ANN top-256"] = summary_ms(timed(lambda: stage1.ann_stage(v, units, 256), reps))
    assert R.fold_usable(model, v), "the index has no valid psi constants: the service would not rerank with the fold"
    R.psi_scores(model, v, t, [ids[0][ids[0] >= 0]])  # the candidates' rows into RAM first, as for every repeat below
    out["psi rerank 256 (fold, as served)"] = summary_ms(timed(lambda: R.psi_scores(model, v, t, [ids[0][ids[0] >= 0]]), reps))
    out["two-stage search, cache hit (encoder skipped)"] = summary_ms(timed(
        lambda: S.search_batch(model, v, [qs[0]], S.SearchOptions(k=10), encoder=lambda m: t), reps))
    # The whole search with each text tower on queries of its own: first each query's first search (its candidates'
    # rows may still be on disk: at 1M the arrays are ~19 GB next to the page cache's share); then, interleaved
    # query by query, the encoder alone and the search again (rows in RAM), so the ratio the targets use compares
    # the two under the same machine state (this VM's speed drifts by tens of percent within minutes).
    def int8_enc(m: list[str]) -> torch.Tensor:
        return int8(Q.trim_tokens(model.tokenize(list(m))))

    def fp32_enc(m: list[str]) -> torch.Tensor:
        return Q.encode_queries(model, list(m))

    ratios: dict[str, Any] = {}
    for name, enc, seed in (("fp32", fp32_enc, 6), ("int8", int8_enc, 7)):
        fresh = make_queries(reps, seed=seed)  # none searched before
        first, alone, two = [], [], []
        for q in fresh:
            t0 = time.perf_counter()
            S.search_batch(model, v, [q], S.SearchOptions(k=10), encoder=enc)
            first.append(time.perf_counter() - t0)
        for q in fresh:
            t0 = time.perf_counter()
            enc([q])
            t1 = time.perf_counter()
            S.search_batch(model, v, [q], S.SearchOptions(k=10), encoder=enc)
            alone.append(t1 - t0)
            two.append(time.perf_counter() - t1)
        out[f"two-stage search, encoder {name}, first time each query (rows may be on disk)"] = summary_ms(first)
        out[f"text encoder {name} alone, interleaved with the row below"] = summary_ms(alone)
        out[f"two-stage search, encoder {name} (rows in RAM)"] = summary_ms(two)
        ratios[name] = round(statistics.median(b / a for a, b in zip(alone, two, strict=True)), 3)
    out["two-stage / encoder alone, median of the per-query ratios"] = ratios
    v.close()
    return out


@with_provenance
def markdown(d: dict[str, Any]) -> str:
    m = d["machine"]
    L = ["# Serving over HTTP: gare-serve --workers N, closed-loop clients on loopback", "",
         f"Generated by `{d['command']}` at commit `{d['commit']}` on {d['date']}.", "",
         f"CPU: {m['cpu']} ({m['cores']} cores, usable {d['usable_cores']}); torch {m['torch']}, faiss {m['faiss']}. "
         f"Load average (1/5/15 min) before: {d['load_start']}, after: {d['load_end']}. Index: {d['n']:,} entries, "
         f"ViT-B/32 text tower (random weights; servers: --text-encoder {d.get('text_encoder', 'auto')}), two-stage "
         "(ANN top-256 + psi rerank with the fold), k=10.", "",
         "| workers | stream | clients | q/s | p50 ms | p95 ms | p99 ms | errors | CPU/s per worker | RSS MiB per worker | client CPU/s |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in d["runs"]:
        L.append(f"| {r['workers']} | {r['stream']} | {r['clients']} | {r['qps']} | {r['latency_p50']} | {r['latency_p95']} | "
                 f"{r['latency_p99']} | {r['errors']} | {', '.join(str(x) for x in r['worker_cpu'])} | "
                 f"{', '.join(str(x) for x in r['worker_rss_mib'])} | {r['client_cpu']} |")
    L += ["", "Answers by cache (`timings_ms.cache`: result = the whole result from the result cache, hit = the "
          "query embedding from the embedding cache, miss = every stage ran) and their client-side latency:", "",
          "| workers | stream | clients | answers miss / hit / result | result p50 ms | result p99 ms | miss p50 ms | GET /healthz p50 ms (every 10th request) |",
          "|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in d["runs"]:
        a, lk = r.get("answers"), r.get("latency_by_cache", {})
        if a is None:
            continue
        L.append(f"| {r['workers']} | {r['stream']} | {r['clients']} | {a['miss']} / {a['hit']} / {a['result']} | "
                 f"{lk.get('result', {}).get('p50', '-')} | {lk.get('result', {}).get('p99', '-')} | {lk.get('miss', {}).get('p50', '-')} | "
                 f"{r.get('healthz', {}).get('p50', '-')} |")
    L += ["", "Ratios (same run): 32 clients vs 1 client, q/s and p99:", ""]
    for key, rs in d["ratios"].items():
        L.append(f"- {key}: q/s x{rs['qps']}, p99 x{rs['p99']}")
    L += ["", "## Components (in process, one query, 1 thread)", "",
          f"Share of frames.npy in the page cache before these (util-linux fincore): {d.get('frames_resident_before_components')}. "
          "Each row runs once untimed first; the two-stage rows use fresh queries, searched twice: the first time "
          "(their candidates' rows may be read from disk) and again (rows in RAM).", "",
          "| component | p50 ms | p95 ms | mean ms | n |", "|---|---:|---:|---:|---:|"]
    for k, s in d["components"].items():
        if "p50" in s:
            L.append(f"| {k} | {s['p50']} | {s['p95']} | {s['mean']} | {s['n']} |")
    L += ["", "## Targets (issues 12 and 14), from this run", "", "| target | measured | met |", "|---|---|---|"]
    for t in targets(d):
        L.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO' if t['met'] is not None else 'not measured'} |")
    L += ["", d["notes"], ""]
    return "\n".join(L)


def targets(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets, each computed from this run's observations (None = the run lacks the figure)."""
    out: list[dict[str, Any]] = []
    by = {(r["workers"], r["stream"], r["clients"]): r for r in d["runs"]}
    wmax = max((r["workers"] for r in d["runs"]), default=0)
    lo, hi = by.get((wmax, "distinct", 1)), by.get((wmax, "distinct", 32))
    q = round(hi["qps"] / lo["qps"], 2) if lo and hi and lo["qps"] else None
    p = round(hi["latency_p99"] / lo["latency_p99"], 2) if lo and hi and lo["latency_p99"] else None
    out.append({"target": f"32 vs 1 clients, {wmax} workers, every request searched: q/s >= 2.5x", "measured": f"x{q}", "met": None if q is None else q >= 2.5})
    # Little's law for the closed loop: with c CPU seconds per query (the workers' CPU over the answers of the
    # 32-client run itself, micro-batching included), C cores answer at most C/c queries a second, so 32 clients
    # wait at least 32·c/C on average; the target needs p99 <= 4x the 1-client p99.
    why = ""
    if lo and hi and hi["qps"]:
        c_q = sum(hi["worker_cpu"]) / hi["qps"]
        cores = d["usable_cores"]
        why = (f"; the 32-client run spent {c_q * 1000:.1f} ms of worker CPU per query, so {cores} cores answer at most "
               f"{cores / c_q:.0f} q/s and 32 clients wait >= {32 * c_q / cores * 1000:.0f} ms on average, against "
               f"4 x {lo['latency_p99']} = {4 * lo['latency_p99']:.0f} ms")
    out.append({"target": f"32 vs 1 clients, {wmax} workers: p99 <= 4x", "met": None if p is None else p <= 4,
                "measured": f"x{p}{why}"})
    z = by.get((wmax, "zipf", 1))
    hit = (z or {}).get("latency_by_cache", {}).get("result", {}).get("p50")
    floor = (z or {}).get("healthz", {}).get("p50")
    out.append({"target": f"result-cache answer, 1 client, {wmax} workers: p50 <= 3 ms over HTTP",
                "measured": f"{hit} ms (GET /healthz in the same stream: {floor} ms)", "met": None if hit is None else hit <= 3.0})
    c = d.get("components", {})
    for enc in ("fp32", "int8"):
        two = c.get(f"two-stage search, encoder {enc} (rows in RAM)", {}).get("p50")
        alone = c.get(f"text encoder {enc} alone, interleaved with the row below", {}).get("p50")
        r = c.get("two-stage / encoder alone, median of the per-query ratios", {}).get(enc)
        out.append({"target": f"two-stage <= 1.15x the {enc} text encoder alone (in process, 1 thread, rows in RAM; "
                              "median of per-query ratios, interleaved)",
                    "measured": f"x{r} (p50 {two} / {alone} ms)", "met": None if r is None else r <= 1.15})
    return out


NOTES = (
    "Notes: the clients (Python threads) share the machine's cores with the workers, and other jobs may run at "
    "the same time (load averages above); numbers are comparable only within this run. `CPU/s per worker` is "
    "CPU seconds each worker process used per second of the run (1.0 = one core busy). `zipf` = a "
    "Zipf(1.0) stream over 2,000 distinct queries with both caches on (a repeat is answered from the result "
    "cache; the embedding cache serves a text seen with other options); `distinct` = both caches off, every "
    "request runs every stage."
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10000, help="index entries")
    ap.add_argument("--workers", default="1,2", help="worker counts to compare")
    ap.add_argument("--clients", default="1,32")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    ap.add_argument("--component-reps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/gare-serve-http")
    ap.add_argument("--index", default=None, help="serve this existing index (its manifest names the checkpoint)")
    ap.add_argument("--text-encoder", default="auto", help="gare-serve --text-encoder (default auto: the CPU default)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_http"))
    ap.add_argument("--keep", action="store_true", help="keep the generated gallery in --work (serve it again with --index)")
    add_render_arg(ap, REPO / "bench" / "results" / "serve_http.json")
    args = ap.parse_args(argv)
    if args.render:
        print(f"wrote {render_saved(args.render, markdown)}")
        return 0
    run = start(__name__, MEASURES, argv)
    import torch

    from gare.checkpoint import file_sha256, save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE
    from gare_serve.engine.worker_board import usable_cores

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data: dict[str, Any] = {
        "command": run.command,
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "usable_cores": usable_cores(), "load_start": loadavg(), "n": args.n, "text_encoder": args.text_encoder, "runs": [], "ratios": {}, "notes": NOTES,
    }
    try:
        if args.index:
            from gare_index.store import open_index

            index = Path(args.index)
            with open_index(index) as v:
                data["n"] = v.n
        else:
            from gare.psi_fold_weights import fold_weights

            torch.manual_seed(0)
            cfg = get_model_config("gare-vit-b-32", pretrained="none")
            m = GARE.build(cfg).eval()
            ck = work / "gare-vit-b-32-random.safetensors"
            save_checkpoint(ck, m, queues={})
            fold = fold_weights(m.psi)
            del m
            print("writing the gallery", flush=True)
            write_gallery(work / "g", args.n, {"path": str(ck), "sha256": file_sha256(ck), "model_config": cfg.to_dict()}, fold)
            index = work / "g" / "index"
        from gare_index.store import open_index as _open

        with _open(index) as v:
            data["frames_resident_before_components"] = resident_fraction(v.path / "frames.npy")
        data["components"] = components(index, args.component_reps)
        print(json.dumps(data["components"]), flush=True)
        distinct = make_queries(20000, seed=1)
        zipf = zipf_stream(20000, n_distinct=2000, s=1.0, seed=3)
        for w in [int(x) for x in args.workers.split(",")]:
            for stream_name, stream, cache in (("distinct", distinct, False), ("zipf", zipf, True)):
                proc, url, log = serve(index, w, cache, None, args.text_encoder)
                try:
                    pids = worker_pids(proc.pid)
                    closed_loop(url, stream[:50], 2, 2.0)  # warm up
                    by_c = {}
                    for c in [int(x) for x in args.clients.split(",")]:
                        c0 = [cpu_seconds(p) or 0.0 for p in pids]
                        t0 = time.perf_counter()
                        r = closed_loop(url, stream, c, args.duration)
                        dt = time.perf_counter() - t0
                        r["worker_cpu"] = [round(((cpu_seconds(p) or 0.0) - a) / dt, 2) for p, a in zip(pids, c0, strict=True)]
                        r["worker_rss_mib"] = [rss_mib(p) for p in pids]
                        r.update(workers=w, stream=stream_name)
                        print(json.dumps(r), flush=True)
                        data["runs"].append(r)
                        by_c[c] = r
                    if len(by_c) >= 2:
                        lo, hi = by_c[min(by_c)], by_c[max(by_c)]
                        data["ratios"][f"{w} worker(s), {stream_name}"] = {
                            "qps": round(hi["qps"] / lo["qps"], 2) if lo["qps"] else None,
                            "p99": round(hi["latency_p99"] / lo["latency_p99"], 2) if lo["latency_p99"] else None}
                finally:
                    stop_process(proc, 30)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    data["load_end"] = loadavg()
    data["targets"] = targets(data)
    data["run"] = run.record()
    print(write_report(Path(args.out).with_suffix(".json"), data, markdown).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
