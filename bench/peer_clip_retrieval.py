"""A peer side by side: clip-retrieval's back end (`clip-retrieval back`) against `gare-serve` two-stage over HTTP.

    python -m bench.peer_clip_retrieval                          # 1M entries, 20 s per run, 5 runs of 32 clients
    python -m bench.peer_clip_retrieval --n 20000 --duration 5 --runs 2 --keep      # a quick look
    python -m bench.peer_clip_retrieval --render                 # the report again from the committed JSON

What both serve (built by ``--prepare``, once, in ``--work``):

- one open_clip ViT-B-32 (QuickGELU, as OpenAI's and GARE's ViT-B/32) weights file with random weights
  (``vit-b-32-quickgelu-random.safetensors``, open_clip layout; no weights can be downloaded here). The GARE
  checkpoint is built from that file (``gare-vit-b-32`` with ``pretrained=<file>``: the CLIP tower loaded from it,
  temporal transformer and psi random), so both text towers hold the same weights (checked in the report: the two
  embeddings of the same texts);
- one gallery of ``--n`` entries in gare's index format (``bench/serve_bench.write_gallery``: ViT-B/32 sizes,
  d = 512, 12 frames, psi's fold constants) whose unit vectors (``units.npy``) are also clip-retrieval's image
  embeddings: ``emb/img_emb/img_emb_0.npy`` is a link to them and ``emb/metadata/metadata_0.parquet`` holds a
  path per entry; ``clip-retrieval index`` (its own code: autofaiss with its defaults) builds the FAISS index
  clip-retrieval would build, ``peer_index/image.index`` (+ ``metadata/``).

clip-retrieval runs in its own virtual environment (``--peer-venv``, default ``~/.cache/gare/peer-venv``:
``pip install clip-retrieval==2.45.0 torch==2.14.1 torchvision==0.29.1`` then ``pip install "setuptools<81"``: its
clip-anytorch imports ``pkg_resources``), so the project's stays untouched. What
had to be adapted for it to run offline, all through its own options (nothing patched):
``--clip_model open_clip:ViT-B-32-quickgelu/<the local weights file>`` (all_clip passes what follows the first
``/`` to open_clip as ``pretrained``, and open_clip loads a local file), ``--enable_mclip_option False`` (else it
downloads M-CLIP from the Hugging Face hub) and ``--provide_aesthetic_embeddings False`` (else it downloads
embeddings from GitHub). Its Flask server binds 0.0.0.0 (no option changes that), so the whole measurement runs in
a private network namespace with only loopback (``unshare -n``; the script re-executes itself there when root).

Measured, one server at a time, in one run (``--measure``): clip-retrieval's back end, gare-serve two-stage with the
fp32 text towers (``--text-encoder fp32``: the model's own, one text at a time; ``fp32-packed``: the same weights,
a micro-batch's texts in shared GEMMs) and gare-serve with its defaults (int8 tower), each with ``--workers 2
--worker-sockets reuseport``, caches off (distinct queries: every request runs the encoder). Closed-loop clients
(threads, one keep-alive HTTP/1.1 connection each, requests back to back, k = 10) run ``--duration`` s with 1
client, then ``--runs`` times with 32; each run records q/s, client-side p50/p99, the load average before it, each
worker's CPU seconds per second and (gare) how many requests each worker answered. Results:
bench/results/peer_clip_retrieval.{json,md} (+ .png when matplotlib is there).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from bench.support import CHECKOUT_PATH, free_port, stop_process  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/",
    "indexer/gare_search/",
    "indexer/gare_index/",
    "training/gare/text_quant.py",
    "training/gare/text_*.py",
    "training/gare/psi.py",
    "training/gare/psi_fold*.py",
    "indexer/gare_build/",
)


OUT = BENCH / "results" / "peer_clip_retrieval"
PEER_VERSION = "2.45.0"
WEIGHTS = "vit-b-32-quickgelu-random.safetensors"
OPEN_CLIP_ARCH = "ViT-B-32-quickgelu"  # GARE's ViT-B/32 config uses QuickGELU (quick_gelu=True), as OpenAI's weights
INDICE = "gallery"
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ preparation
def write_weights(path: Path, seed: int = 0) -> None:
    """An open_clip ViT-B-32 (QuickGELU) state dict with random weights, as safetensors (no pickle)."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))


def prepare(work: Path, n: int, peer_venv: Path, tune_queries: int = 0) -> dict[str, Any]:
    """Weights file, GARE checkpoint, gallery and clip-retrieval's index in `work` (each step skipped when done);
    with `tune_queries`, gare's stage 1 re-tuned by `gare-index tune --from-bank` on that many served-like queries."""
    import numpy as np
    import torch

    from bench.serve_bench import write_gallery
    from gare.checkpoint import file_sha256, save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE
    from gare.psi_fold_weights import fold_weights

    work.mkdir(parents=True, exist_ok=True)
    record_path = work / "prepare.json"
    record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.exists() else {}
    if record.get("n") not in (None, n):
        raise SystemExit(f"{work} holds a gallery of {record['n']} entries, not {n}: remove it or pick another --work")
    record["n"] = n
    weights = work / WEIGHTS
    if not weights.exists():
        write_weights(weights)
    ck = work / "gare-vit-b-32-from-weights.safetensors"
    if not ck.exists():
        torch.manual_seed(0)
        cfg = get_model_config("gare-vit-b-32", pretrained=str(weights))  # the CLIP tower from the weights file
        m = GARE.build(cfg).eval()
        cfg = get_model_config("gare-vit-b-32", pretrained="none")
        m.cfg = cfg  # the checkpoint holds every weight: it must not name a file to load again
        save_checkpoint(ck, m, queues={})
        record["fold"] = True
        del m
    index = work / "g" / "index"
    if "gallery" not in record:
        from gare.checkpoint import load_model

        model, ckpt = load_model(ck, "cpu")
        fold = fold_weights(model.psi)
        shutil.rmtree(work / "g", ignore_errors=True)
        print(f"writing the gallery ({n:,} entries)", flush=True)
        t0 = time.perf_counter()
        g = write_gallery(work / "g", n, {"path": str(ck), "sha256": file_sha256(ck), "model_config": ckpt.config.to_dict()}, fold)
        g["total_s"] = round(time.perf_counter() - t0, 1)
        record["gallery"] = g
        record_path.write_text(json.dumps(record, indent=1))
    if tune_queries and record.get("gare_tune", {}).get("queries") != tune_queries:
        record["gare_tune"] = tune_stage1(work, index, ck, tune_queries)
        record_path.write_text(json.dumps(record, indent=1))
    from gare_index.store import open_index

    with open_index(index) as v:
        units = v.path / "units.npy"
        ann = dict(v.manifest.get("ann_params", {}))
    record["gare_ann_params"] = ann
    emb = work / "emb"
    if not (emb / "metadata" / "metadata_0.parquet").exists():
        (emb / "img_emb").mkdir(parents=True, exist_ok=True)
        (emb / "metadata").mkdir(parents=True, exist_ok=True)
        link = emb / "img_emb" / "img_emb_0.npy"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(units)  # the same unit vectors, not a copy: (n, 512) float32
        assert np.load(link, mmap_mode="r").shape == (n, 512)
        # a path per entry (the paths write_gallery gives its rows), written by the peer's venv (pyarrow is there)
        code = ("import sys, pyarrow as pa, pyarrow.parquet as pq; n = int(sys.argv[1]); "
                "p = [f'/library/clip{i:07d}.mp4' for i in range(n)]; "
                "pq.write_table(pa.table({'image_path': p, 'url': p, 'caption': [''] * n}), sys.argv[2])")
        subprocess.run([str(peer_venv / "bin" / "python"), "-c", code, str(n), str(emb / "metadata" / "metadata_0.parquet")],
                       check=True, env=peer_env())
    peer_index = work / "peer_index"
    if "peer_index" not in record:
        shutil.rmtree(peer_index, ignore_errors=True)
        cmd = [str(peer_venv / "bin" / "clip-retrieval"), "index", "--embeddings_folder", str(emb), "--index_folder", str(peer_index)]
        print("building clip-retrieval's index:", shlex.join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=peer_env())
        infos = json.loads((peer_index / "image.json").read_text()) if (peer_index / "image.json").exists() else {}
        record["peer_index"] = {"command": "clip-retrieval index --embeddings_folder EMB --index_folder PEER_INDEX",
                                "build_s": round(time.perf_counter() - t0, 1), "autofaiss_infos": infos}
        record_path.write_text(json.dumps(record, indent=1))
    (work / "indices_paths.json").write_text(json.dumps({INDICE: str(peer_index)}))
    record_path.write_text(json.dumps(record, indent=1))
    return record


def tune_stage1(work: Path, index: Path, ck: Path, n_queries: int) -> dict[str, Any]:
    """`gare-index tune --from-bank` on the gallery: the bank is the fp32 tower's embeddings of `n_queries` texts of
    the benchmark's template that the measured stream does not reach (the texts just before the warm-up set), as a
    server's query bank would hold them; the tuner keeps the index or writes a tuned version (atomic switch)."""
    import numpy as np
    import torch

    from gare.checkpoint import load_model
    from gare.text_quant import build_text_encoder
    from gare_search.query import encode_queries, unit_rows

    texts = distinct_queries(seed=1)[-(500 + n_queries):-500]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the packed tower batches at one thread (gare.text_packed's check)
    try:
        model, _ = load_model(ck, "cpu")
        bank = unit_rows(encode_queries(model, texts, tower=build_text_encoder(model, "fp32-packed")))
    finally:
        torch.set_num_threads(threads)
    np.save(work / "tune_bank.npy", bank.astype(np.float32))
    cmd = [sys.executable, "-m", "gare_build.cli", "tune", "--index", str(index), "--from-bank", str(work / "tune_bank.npy"),
           "--tune-queries", str(n_queries), "--no-progress"]
    print("tuning gare's stage 1:", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": CHECKOUT_PATH})
    from gare_index.store import open_index

    with open_index(index) as v:
        st = dict(v.manifest.get("stage1", {}) or {})
    return {"command": f"gare-index tune --index INDEX --from-bank BANK --tune-queries {n_queries}", "queries": n_queries,
            "s": round(time.perf_counter() - t0, 1),
            **{k: st.get(k) for k in ("setting", "recall", "recall_target", "p50_ms", "latency_budget_ms", "met",
                                      "default_candidates", "tuning_s", "coverage_s")}}


def peer_env() -> dict[str, str]:
    """clip-retrieval's process environment: offline hubs, nothing of the project's venv or path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


# ------------------------------------------------------------------------------------------ queries and clients
_COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan", "black", "white"]
_THINGS = ["dog", "cat", "man", "woman", "car", "ball", "circle", "square", "bird", "child", "horse", "train"]
_ACTS = ["runs across a field", "jumps over a fence", "rises slowly", "slides to the left", "is cooking pasta",
         "plays the guitar", "rolls down a hill", "dances on a stage", "swims in a pool", "drives through a city"]
_TAILS = ["", " at night", " in slow motion", " while people watch", ", then it stops", " on a sunny beach"]
_ADJS = ["", "small ", "big ", "old ", "young ", "bright "]


def distinct_queries(seed: int = 0) -> list[str]:
    """Every caption of the template (6 x 10 x 12 x 10 x 6 = 43,200), each once, in a seeded random order."""
    import random

    out = [f"a {a}{c} {t} {x}{tail}" for a in _ADJS for c in _COLORS for t in _THINGS for x in _ACTS for tail in _TAILS]
    random.Random(seed).shuffle(out)
    return out


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


Request = Callable[[http.client.HTTPConnection, str], bool]


def gare_request(conn: http.client.HTTPConnection, q: str) -> bool:
    """gare-serve: two-stage text search (its defaults: ANN top-K, psi rerank), k = 10."""
    conn.request("POST", "/v1/search", json.dumps({"query": q, "k": 10}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    return r.status == 200 and len(json.loads(body)["results"]) == 10


def peer_request(conn: http.client.HTTPConnection, q: str) -> bool:
    """clip-retrieval: POST /knn-service as its front end sends a text query (image index, 10 results)."""
    conn.request("POST", "/knn-service", json.dumps({"text": q, "modality": "image", "num_images": 10,
                                                      "indice_name": INDICE}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    return r.status == 200 and len(json.loads(body)) == 10


def closed_loop(port: int, request: Request, queries: list[str], clients: int, duration: float) -> dict[str, Any]:
    """`clients` threads, one keep-alive connection each, requests back to back for `duration` s; every request
    takes the next query of `queries` (each text asked once); q/s = answers / wall time."""
    lock = threading.Lock()
    nxt = [0]
    lat: list[float] = []
    errors: list[str] = []
    gate = threading.Barrier(clients + 1)
    stop = [0.0]

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        mine: list[float] = []
        try:
            gate.wait()
            while time.perf_counter() < stop[0]:
                with lock:
                    j = nxt[0]
                    nxt[0] += 1
                if j >= len(queries):
                    errors.append("ran out of distinct queries")
                    return
                t0 = time.perf_counter()
                ok = request(conn, queries[j])
                if ok:
                    mine.append(time.perf_counter() - t0)
                else:
                    errors.append(f"client {i}: bad answer to {queries[j]!r}")
        except Exception as e:  # noqa: BLE001 - counted and shown in the report
            errors.append(f"client {i}: {e!r}")
        finally:
            conn.close()
            with lock:
                lat.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    stop[0] = time.perf_counter() + duration
    t0 = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ms = [x * 1000 for x in lat]
    return {"clients": clients, "answers": len(lat), "queries_used": nxt[0], "wall_s": round(wall, 2),
            "qps": round(len(lat) / wall, 2), "p50_ms": round(pct(ms, 50), 1), "p99_ms": round(pct(ms, 99), 1),
            "errors": len(errors), "first_errors": errors[:3]}


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


# ------------------------------------------------------------------------------------------ servers
class Server:
    """A server in a child process on 127.0.0.1:<port>, ready when `ready_path` answers 200."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], port: int, ready_path: str, log: Path) -> None:
        self.name, self.args, self.port, self.ready_path, self.log = name, args, port, ready_path, log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.pids: list[int] = []

    def wait_ready(self, limit_s: float = 1800) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log.read_text(errors='replace')[-4000:]}")
            try:
                r = httpx.get(self.url + self.ready_path, timeout=10)
                if r.status_code == 200:
                    body = r.json()
                    if isinstance(body, dict) and "workers" in body:
                        self.pids = sorted(int(w["pid"]) for w in body["workers"])
                    else:
                        self.pids = [self.proc.pid]
                    return time.perf_counter() - t0
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {limit_s} s: {self.log.read_text(errors='replace')[-4000:]}")

    def stop(self) -> None:
        stop_process(self.proc)


def peer_args(peer_venv: Path, work: Path, port: int) -> list[str]:
    """`clip-retrieval back` with its defaults except the three offline options (see the module docstring)."""
    return [str(peer_venv / "bin" / "clip-retrieval"), "back", "--port", str(port),
            "--indices_paths", str(work / "indices_paths.json"),
            "--clip_model", f"open_clip:{OPEN_CLIP_ARCH}/{work / WEIGHTS}",
            "--enable_mclip_option", "False", "--provide_aesthetic_embeddings", "False"]


def gare_args(index: Path, port: int, text_encoder: str) -> list[str]:
    return [sys.executable, "-m", "gare_serve.cli", "--index", str(index), "--host", "127.0.0.1", "--port", str(port),
            "--workers", "2", "--worker-sockets", "reuseport", "--query-cache-entries", "0", "--result-cache-entries", "0",
            "--text-encoder", text_encoder, "--log-level", "warning"]


def worker_requests(url: str) -> dict[int, float]:
    from bench.support import worker_requests as wr

    return wr(url)


def measure_server(srv: Server, request: Request, queries: list[str], warm: list[str], duration: float, runs: int,
                   gare: bool) -> list[dict[str, Any]]:
    """1 client once, then `runs` times 32 clients; the same query stream (from its start) for every server."""
    closed_loop(srv.port, request, warm, 2, min(5.0, duration))  # warm-up (first requests of each worker), not counted
    out: list[dict[str, Any]] = []
    pos = 0
    for run, clients in enumerate([1] + [32] * runs):
        load = loadavg()
        before = worker_requests(srv.url) if gare else {}
        c0 = {p: cpu_seconds(p) for p in srv.pids}
        t0 = time.perf_counter()
        r = closed_loop(srv.port, request, queries[pos:], clients, duration)
        dt = time.perf_counter() - t0
        pos += r["queries_used"]
        r.update(server=srv.name, run=run if clients > 1 else 0, load_before=load,
                 worker_cpu=[round((cpu_seconds(p) - c0[p]) / dt, 2) for p in srv.pids])
        if gare:
            after = worker_requests(srv.url)
            # the /metrics scrape before the run counts one request on one worker
            r["requests_per_worker"] = [int(after.get(p, 0) - before.get(p, 0)) for p in srv.pids]
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def gare_stage_times(url: str, queries: list[str]) -> dict[str, float]:
    """Median of the server's own stage timings (timings_ms) over one client's requests (after the runs)."""
    import httpx

    rows = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for q in queries:
            r = c.post("/v1/search", json={"query": q, "k": 10})
            if r.status_code == 200:
                rows.append(r.json()["timings_ms"])
    keys = [k for k in ("queue", "encode", "ann", "rerank", "rank", "total") if rows and k in rows[0]]
    return {k: round(statistics.median(float(t[k]) for t in rows), 2) for k in keys} | {"n": len(rows)}


def same_tower_check(work: Path, texts: list[str]) -> dict[str, Any]:
    """Both towers hold the weights file's weights: open_clip's encode_text (what clip-retrieval calls, 77
    tokens) vs gare's encode_queries (the GARE checkpoint, tokens trimmed), unit vectors compared."""
    import open_clip
    import torch

    from gare.backbone import load_clip_weights
    from gare.checkpoint import load_model
    from gare.text_quant import build_text_encoder
    from gare_search.query import encode_queries

    ref = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None).eval()
    load_clip_weights(ref, str(work / WEIGHTS))
    tok = open_clip.get_tokenizer(OPEN_CLIP_ARCH)
    with torch.no_grad():
        a = ref.encode_text(tok(texts)).float()
        a = a / a.norm(dim=-1, keepdim=True)
    model, _ = load_model(work / "gare-vit-b-32-from-weights.safetensors", "cpu")
    b = encode_queries(model, texts)
    b = b / b.norm(dim=-1, keepdim=True)
    c = encode_queries(model, texts, tower=build_text_encoder(model, "fp32-packed"))
    c = c / c.norm(dim=-1, keepdim=True)
    lengths = [int((t != 0).sum()) for t in tok(texts)]
    return {"texts": len(texts), "max_abs_diff": float((a - b).abs().max()), "min_cosine": float((a * b).sum(-1).min()),
            "packed_max_abs_diff": float((a - c).abs().max()), "packed_min_cosine": float((a * c).sum(-1).min()),
            "tokens_per_text_min": min(lengths), "tokens_per_text_max": max(lengths)}


# ------------------------------------------------------------------------------------------ summary and report
SERVERS = ("clip-retrieval", "gare-serve fp32", "gare-serve fp32-packed", "gare-serve int8 (default)")
TEXT_ENCODER = {"gare-serve fp32": "fp32", "gare-serve fp32-packed": "fp32-packed", "gare-serve int8 (default)": "auto"}
FP32_SERVERS = ("gare-serve fp32", "gare-serve fp32-packed")  # the fp32 towers: the model's own, and packed


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server: the 1-client run and the 32-client runs' q/s, p50 and p99 (min / median / max)."""
    out: dict[str, Any] = {}
    for name in SERVERS:
        one = [r for r in runs if r["server"] == name and r["clients"] == 1]
        many = [r for r in runs if r["server"] == name and r["clients"] > 1]
        if not one and not many:
            continue
        s: dict[str, Any] = {}
        if one:
            s["one"] = {k: one[0][k] for k in ("qps", "p50_ms", "p99_ms", "errors")}
        if many:
            q = [r["qps"] for r in many]
            s["many"] = {"runs": len(many), "qps": q, "qps_min": min(q), "qps_median": statistics.median(q), "qps_max": max(q),
                         "p50_ms_median": statistics.median(r["p50_ms"] for r in many),
                         "p99_ms_median": statistics.median(r["p99_ms"] for r in many),
                         "errors": sum(r["errors"] for r in many)}
            shares = [min(r["requests_per_worker"]) / max(1, sum(r["requests_per_worker"])) for r in many if r.get("requests_per_worker")]
            if shares:
                s["many"]["smallest_worker_share"] = [round(x, 3) for x in shares]
        out[name] = s
    return out


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 29's targets from this run's numbers, for each fp32 tower (met None = the run lacks the figure)."""
    peer = summary.get("clip-retrieval", {})
    out: list[dict[str, Any]] = []
    for name in FP32_SERVERS:
        fp32 = summary.get(name, {})
        if not fp32:
            continue
        pm, gm = peer.get("many"), fp32.get("many")
        if pm and gm:
            per_run = [round(g / p, 2) for g, p in zip(gm["qps"], pm["qps"], strict=False)]
            worst = round(gm["qps_min"] / pm["qps_max"], 2)
            out.append({"target": f"{name} (two-stage, fp32 tower), 32 clients: q/s >= 5x clip-retrieval's in every run",
                        "measured": f"run by run x{', x'.join(map(str, per_run))}; slowest gare-serve run / fastest "
                                    f"clip-retrieval run x{worst}",
                        "met": bool(len(per_run) == len(pm["qps"]) and worst >= 5)})
        else:
            out.append({"target": f"{name} >= 5x clip-retrieval at 32 clients", "measured": "-", "met": None})
        po, go = peer.get("one"), fp32.get("one")
        r1 = round(go["qps"] / po["qps"], 2) if po and go and po["qps"] else None
        out.append({"target": f"{name} (two-stage, fp32 tower), 1 client: q/s >= 1.5x clip-retrieval's",
                    "measured": f"x{r1}" if r1 is not None else "-", "met": None if r1 is None else r1 >= 1.5})
    for name in SERVERS[1:]:
        sh = summary.get(name, {}).get("many", {}).get("smallest_worker_share")
        if sh is None and name not in summary:
            continue
        out.append({"target": f"{name}, 32 clients: no run where a worker idles (each of the 2 answers >= 25%)",
                    "measured": "smallest worker share per run: " + (", ".join(map(str, sh)) if sh else "-"),
                    "met": None if not sh else min(sh) >= 0.25})
    return out


def ratio_lines(summary: dict[str, Any]) -> list[str]:
    peer = summary.get("clip-retrieval", {})
    L = []
    for name in SERVERS[1:]:
        s = summary.get(name, {})
        if peer.get("one") and s.get("one"):
            L.append(f"- {name} / clip-retrieval, 1 client: q/s x{s['one']['qps'] / peer['one']['qps']:.2f}, "
                     f"p50 x{s['one']['p50_ms'] / peer['one']['p50_ms']:.2f}")
        if peer.get("many") and s.get("many"):
            L.append(f"- {name} / clip-retrieval, 32 clients: median q/s x{s['many']['qps_median'] / peer['many']['qps_median']:.2f} "
                     f"(per run {', '.join(f'x{g / p:.2f}' for g, p in zip(s['many']['qps'], peer['many']['qps'], strict=False))}), "
                     f"median p99 x{s['many']['p99_ms_median'] / peer['many']['p99_ms_median']:.2f}")
    return L


@with_provenance
def markdown(d: dict[str, Any]) -> str:
    prep, pv = d["prepare"], d["peer_versions"]
    g = prep.get("gallery", {})
    ai = prep.get("peer_index", {}).get("autofaiss_infos", {})
    L = ["# A peer side by side: clip-retrieval's back end vs gare-serve two-stage over HTTP", "",
         f"Generated by `{d['command']}` at commit `{d['commit']}` on {d['date']}.", "",
         f"CPU: {d['cpu']} ({d['cores']} cores, shared with other jobs); Linux {d['kernel']}. Load average (1/5/15 min) "
         f"at the start: {d['load_start']}, at the end: {d['load_end']}; before each run: in the table. Run inside a private "
         f"network namespace with only loopback: {d['netns']}.", "",
         f"Index: {d['n']:,} entries, the same unit vectors (d = 512) in both. gare-serve: its index format "
         f"(`bench/serve_bench.write_gallery`: 12 fp16 frames per entry, psi fold constants), stage 1 "
         f"`{json.dumps(prep.get('gare_ann_params', {}))}`; built in {g.get('total_s', '-')} s"
         + (f", then tuned by `{prep['gare_tune']['command']}` in {prep['gare_tune']['s']} s ({prep['gare_tune']['setting']}: "
            f"held-out recall {prep['gare_tune']['recall']} of the exact top-10 at p50 {prep['gare_tune']['p50_ms']} ms, "
            f"met {prep['gare_tune']['met']}; ANN tuning {prep['gare_tune']['tuning_s']} s, psi coverage "
            f"{prep['gare_tune']['coverage_s']} s; default candidates {prep['gare_tune']['default_candidates']})"
            if prep.get("gare_tune") else "") + ". clip-retrieval: "
         f"`{prep.get('peer_index', {}).get('command', '-')}` (autofaiss with its defaults), index "
         f"`{ai.get('index_key', '-')}`, search parameters `{ai.get('index_param', '-')}`; built in "
         f"{prep.get('peer_index', {}).get('build_s', '-')} s.", "",
         f"Text tower: one open_clip {OPEN_CLIP_ARCH} weights file with random weights (`{WEIGHTS}`); the GARE checkpoint "
         f"was built from it. Same embedding from both towers on {d['tower_check']['texts']} query texts: max |diff| "
         f"{d['tower_check']['max_abs_diff']:.2e}, min cosine {d['tower_check']['min_cosine']:.6f} (texts of "
         f"{d['tower_check']['tokens_per_text_min']}-{d['tower_check']['tokens_per_text_max']} tokens with SOT/EOT)"
         + (f"; gare's fp32-packed tower vs the peer's: max |diff| {d['tower_check']['packed_max_abs_diff']:.2e}, min cosine "
            f"{d['tower_check']['packed_min_cosine']:.6f}." if "packed_max_abs_diff" in d["tower_check"] else "."), "",
         f"Peer: clip-retrieval {pv.get('clip-retrieval')} (open_clip_torch {pv.get('open_clip_torch')}, torch {pv.get('torch')}, "
         f"faiss-cpu {pv.get('faiss-cpu')}, flask {pv.get('flask')}, numpy {pv.get('numpy')}) in its own venv; project: torch "
         f"{d['torch']}, faiss {d['faiss']}, uvicorn {d['uvicorn']}.", "",
         "Commands (one server at a time; caches off on gare-serve so that every request runs every stage):", ""]
    for name, cmd in d["server_commands"].items():
        L.append(f"- {name}: `{cmd}`")
    L += ["", f"Closed loop: each client one keep-alive HTTP/1.1 connection, requests back to back for {d['duration_s']} s, "
          "k = 10, every request a distinct text (the same stream, from its start, for every server); 1 client once, "
          f"then 32 clients {d['runs_requested']} times. q/s = answers / wall time; latency client side.", "",
          "| server | clients | run | load before | q/s | p50 ms | p99 ms | errors | CPU/s per process | requests per worker |",
          "|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in d["runs"]:
        L.append(f"| {r['server']} | {r['clients']} | {r['run']} | {', '.join(map(str, r['load_before']))} | {r['qps']} | "
                 f"{r['p50_ms']} | {r['p99_ms']} | {r['errors']} | {', '.join(map(str, r['worker_cpu']))} | "
                 f"{' / '.join(map(str, r.get('requests_per_worker', []))) or '-'} |")
    L += ["", "| server | 1 client q/s | p50 ms | p99 ms | 32 clients q/s min / median / max | median p50 ms | median p99 ms |",
          "|---|---:|---:|---:|---|---:|---:|"]
    for name, s in d["summary"].items():
        o, m = s.get("one", {}), s.get("many", {})
        L.append(f"| {name} | {o.get('qps', '-')} | {o.get('p50_ms', '-')} | {o.get('p99_ms', '-')} | "
                 f"{m.get('qps_min', '-')} / {m.get('qps_median', '-')} / {m.get('qps_max', '-')} | "
                 f"{m.get('p50_ms_median', '-')} | {m.get('p99_ms_median', '-')} |")
    L += ["", "Ratios (this run):", "", *ratio_lines(d["summary"]), ""]
    loads = {}
    for r in d["runs"]:
        loads.setdefault(r["server"], []).append(r["load_before"][0])
    L += ["1-minute load average before the runs of each server (other jobs share the machine; the servers ran one "
          "after another): " + "; ".join(f"{k} {min(v)}-{max(v)}" for k, v in loads.items()) + ".", ""]
    if d.get("gare_stage_ms"):
        L += ["gare-serve's own stage timings (`timings_ms`, median over one client's requests after the runs, ms):", "",
              "| server | " + " | ".join(k for k in next(iter(d["gare_stage_ms"].values())) if k != "n") + " | n |",
              "|---|" + "---:|" * len(next(iter(d["gare_stage_ms"].values())))]
        for name, st in d["gare_stage_ms"].items():
            L.append(f"| {name} | " + " | ".join(str(v) for k, v in st.items() if k != "n") + f" | {st['n']} |")
        L.append("")
    L += ["## Targets (issue 29), from this run", "", "| target | measured | met |", "|---|---|---|"]
    for t in d["targets"]:
        L.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO' if t['met'] is not None else 'not measured'} |")
    if d["n"] < 1_000_000:
        L += ["", f"Size: {d['n']:,} entries, not the 1M issue 29 asks for: writing a 1M gallery in gare's format (psi's fold "
              "constants for every entry) takes 30-60 min on these 2 shared cores, more than this run had; disk and RAM "
              "would have allowed 1M (12 GB of frames). Stage 1 of both grows with n (gare's IVF scans nprobe/nlist of "
              "the entries; the HNSW's cost grows slowly), the encoder's cost does not."]
    if d.get("plot"):
        L += ["", f"![q/s per server]({d['plot']})"]
    L += ["", NOTES.strip(), ""]  # the renderer's prose (a JSON written before a change of it may hold older words)
    return "\n".join(L)


NOTES = """
## What was adapted for clip-retrieval to run offline

Nothing of its code was patched; three of its own options, and a local weights file:

- `--clip_model open_clip:ViT-B-32-quickgelu/<path of the weights file>`: all_clip (its model loader) passes what
  follows the model name's first `/` to open_clip as `pretrained`, and open_clip loads a local file (by default it
  would download ViT-B/32's OpenAI weights). QuickGELU because GARE's ViT-B/32 uses it (as OpenAI's weights do).
- `--enable_mclip_option False`: by default it loads M-CLIP (multilingual) from the Hugging Face hub at start.
- `--provide_aesthetic_embeddings False`: by default it downloads aesthetic embeddings from GitHub at start.
- Its Flask server listens on 0.0.0.0 (`app.run(host="0.0.0.0")`, no option), so the script runs every server and
  client in a private network namespace with only loopback (`unshare -n`), which also shows that nothing was
  downloaded during the run. Its index is built by its own `clip-retrieval index` from the gallery's unit vectors
  (`img_emb/img_emb_0.npy`, a link to gare's `units.npy`) and a parquet file of paths (`metadata/`).
- Installed in its own venv: `pip install clip-retrieval==2.45.0 torch==2.14.1 torchvision==0.29.1` (pip chose
  the rest within clip-retrieval's pins: numpy < 2, open-clip-torch < 3, ...), then `pip install "setuptools<81"`:
  its dependency clip-anytorch imports `pkg_resources`, which the newest setuptools no longer ships (without the pin
  `clip-retrieval index` and `back` fail at import).

## What differs in the work each does

- **Rerank.** clip-retrieval answers from the ANN alone (its `/knn-service`: encode, FAISS `search_and_reconstruct`
  of the 10 nearest, metadata of each hit from a pandas frame); gare-serve runs stage 1 for K candidates and psi's
  rerank of them (reading their 12 fp16 frames each) before ranking the top 10: more work per query.
- **Stage 1.** Each with its own default index over the same vectors: autofaiss's choice for clip-retrieval
  (above), gare's IVF for gare-serve (above). Their recalls differ and are not measured here.
- **Token length.** clip-retrieval's open_clip tokenizer pads every text to 77 tokens and the tower runs all 77
  positions; gare-serve trims the padding after the longest text of a micro-batch (the range above), which is
  exact for CLIP's causal text tower (the tower check above) and costs ~5x fewer positions here.
- **Precision.** Both fp32 in the fp32 rows; gare-serve's default is its int8 (dynamic quantization) tower.
- **Batching.** gare-serve gathers concurrent requests into micro-batches, but what a batch saves depends on the
  tower. `fp32` runs the model's own tower on each text alone at its own length (`gare.text_quant.encode_each`, so
  that a text's embedding is the same bits alone or in any batch, issue 24): at 32 clients it costs per query what
  it costs at one client. `fp32-packed` (the same fp32 weights and arithmetic, `gare.text_packed`) and the int8
  tower pack the batch's texts into shared GEMMs, each text's rows computed on their own (fp32-packed: checked on
  the machine when the tower is built; see the module). clip-retrieval encodes each request alone (both cores
  inside one process).
- **Web server and processes.** clip-retrieval runs Flask's development server (werkzeug, one process, a thread per
  request, torch using every core inside one process); gare-serve runs uvicorn with 2 worker processes (a
  SO_REUSEPORT socket each, 1 torch thread each). Neither is tuned beyond its defaults here.
- **Same machine.** The clients (Python threads) share the 2 cores with the servers, and other jobs ran on the
  machine (load averages above): compare the servers within this run only.
"""


def plot(d: dict[str, Any], path: Path) -> bool:
    """q/s per server at 1 and 32 clients (32: each run a dot, the median a bar); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(d["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "one", "1 client"), (axes[1], "many", "32 clients")):
        vals = [d["summary"][n].get(key, {}).get("qps" if key == "one" else "qps_median", 0) for n in names]
        ax.bar(range(len(names)), vals, color=["#999999", "#1f77b4", "#ff7f0e", "#2ca02c"][: len(names)])
        if key == "many":
            for i, n in enumerate(names):
                qs = d["summary"][n].get("many", {}).get("qps", [])
                ax.plot([i] * len(qs), qs, "k.", ms=5)
        ax.set_xticks(range(len(names)), [n.replace(" (default)", "\n(default)") for n in names], fontsize=8)
        ax.set_ylabel("q/s")
        ax.set_title(title)
    fig.suptitle(f"{d['n']:,} entries, ViT-B/32 text tower, HTTP on loopback ({d['cpu']}, {d['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def peer_versions(peer_venv: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in ['clip-retrieval', "
            "'open_clip_torch', 'torch', 'faiss-cpu', 'flask', 'numpy', 'autofaiss', 'all_clip', 'werkzeug']}))")
    out = subprocess.run([str(peer_venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True, env=peer_env())
    return json.loads(out.stdout)


def in_private_netns() -> bool:
    return os.environ.get("GARE_PEER_NETNS") == "1"


def reexec_in_netns(argv: list[str]) -> int:
    """Run this script again inside `unshare -n` with loopback up (clip-retrieval binds 0.0.0.0)."""
    script = 'ip link set lo up && exec "$@"'
    cmd = ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, "-m", "bench.peer_clip_retrieval", *argv]
    # as the package's module, from the repository root (a script path would not find the bench package)
    return subprocess.run(cmd, env={**os.environ, "GARE_PEER_NETNS": "1"},
                          cwd=Path(__file__).resolve().parents[1]).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="index entries")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    ap.add_argument("--runs", type=int, default=5, help="runs of 32 clients per server")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--work", default="/tmp/gare-peer", help="weights, checkpoint, gallery and peer index (reused when there)")
    ap.add_argument("--peer-venv", default=str(Path.home() / ".cache" / "gare" / "peer-venv"))
    ap.add_argument("--tune-queries", type=int, default=0,
                    help="re-tune gare's stage 1 with `gare-index tune --from-bank` on this many queries (0: the gallery's own)")
    ap.add_argument("--prepare-only", action="store_true", help="build what both serve in --work, measure nothing")
    ap.add_argument("--keep", action="store_true", help="keep --work at the end (default: removed)")
    add_render_arg(ap, Path(str(OUT) + ".json"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        render_saved(args.render, markdown)
        return 0
    work, peer_venv = Path(args.work), Path(args.peer_venv)
    if args.prepare_only:
        print(json.dumps(prepare(work, args.n, peer_venv, args.tune_queries), indent=1))
        return 0
    if not in_private_netns():
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            raise SystemExit("clip-retrieval's server binds 0.0.0.0: run this as root (it re-executes itself in a "
                             "private network namespace with `unshare -n`)")
        return reexec_in_netns(argv)
    import faiss
    import torch
    import uvicorn

    from bench.serve_bench import resident_fraction, warm_file

    run = start(__name__, MEASURES, argv)
    d: dict[str, Any] = {
        "command": run.command, "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(), "cores": os.cpu_count(),
        "kernel": os.uname().release, "torch": torch.__version__, "faiss": faiss.__version__, "uvicorn": uvicorn.__version__,
        "load_start": loadavg(), "netns": in_private_netns(), "n": args.n, "duration_s": args.duration,
        "runs_requested": args.runs, "runs": [],
    }
    t_all = time.perf_counter()
    d["prepare"] = prepare(work, args.n, peer_venv, args.tune_queries)
    d["prepare_s"] = round(time.perf_counter() - t_all, 1)
    d["peer_versions"] = peer_versions(peer_venv)
    queries = distinct_queries(seed=1)
    warm, stream = queries[-500:], queries[:-500]
    d["tower_check"] = same_tower_check(work, queries[:64])
    print(json.dumps(d["tower_check"]), flush=True)
    index = work / "g" / "index"
    d["server_commands"], d["startup_s"], d["gare_stage_ms"] = {}, {}, {}
    frames = next(index.glob("versions/*/frames.npy"))
    try:
        for name in SERVERS:
            port = free_port()
            log = work / f"{name.split()[0]}-{port}.log"
            if name == "clip-retrieval":
                a, env, ready, req, gare = peer_args(peer_venv, work, port), peer_env(), "/indices-list", peer_request, False
            else:
                enc = TEXT_ENCODER[name]
                a, ready, req, gare = gare_args(index, port, enc), "/readyz", gare_request, True
                env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, "GARE_WORKER_HEALTHCHECK_S": "900"}
                env.pop("PROMETHEUS_MULTIPROC_DIR", None)
                # the peer holds its whole index in RAM; gare-serve maps its frames: read them into the page cache
                # first (both then answer from memory), recording the share that was cached before
                d.setdefault("frames_resident_before", {})[name] = resident_fraction(frames)
                d.setdefault("frames_warm_s", {})[name] = round(warm_file(frames), 1)
            d["server_commands"][name] = shlex.join([Path(a[0]).name if i == 0 else x for i, x in enumerate(a)])
            srv = Server(name, a, env, port, ready, log)
            try:
                d["startup_s"][name] = round(srv.wait_ready(), 1)
                print(f"{name}: ready in {d['startup_s'][name]} s, pids {srv.pids}", flush=True)
                d["runs"] += measure_server(srv, req, stream, warm, args.duration, args.runs, gare)
                if gare:
                    d["gare_stage_ms"][name] = gare_stage_times(srv.url, warm[:100])
            finally:
                srv.stop()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    d["load_end"] = loadavg()
    d["total_s"] = round(time.perf_counter() - t_all, 1)
    d["summary"] = summarize(d["runs"])
    d["targets"] = targets(d["summary"])
    out.parent.mkdir(parents=True, exist_ok=True)
    if plot(d, out.with_suffix(".png")):
        d["plot"] = out.with_suffix(".png").name
    d["run"] = run.record()
    print(write_report(out.with_suffix(".json"), d, markdown).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
