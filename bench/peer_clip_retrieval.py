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

Measured, one server at a time (each at most in memory: the peer holds its 2.3 GB HNSW in RAM, gare-serve maps
12 GB of frames), at matched recall:

1. Recall. ``--recall-queries`` held-out texts (not in the tuning bank, not in the timed streams): each server's
   exact top-10 is computed offline on the same vectors (gare: psi's exhaustive scores of every entry with the
   model's fp32 tower, ``gare_search.rerank.exhaustive_psi``; the peer: inner products of its own open_clip
   embedding with every unit vector), and each server's answers over HTTP are scored against it (recall@10 of
   the exact top-10). The peer's efSearch for the *matched* row is the smallest whose recall (FAISS on the peer's
   index file, its embeddings of the same texts) reaches gare-serve's served recall with its fp32 tower
   (``fp32-packed``); its autofaiss default (tuned by autofaiss for a latency, not a recall) is the other row.
   A copy of the peer's index file holds the matched efSearch (``faiss.ParameterSpace``, the parameter autofaiss
   itself sets and ``write_index`` keeps); clip-retrieval serves it as any index folder.
2. Speed. ``--runs`` rounds; each round starts every server in turn (the order alternates from round to round),
   fills the page cache with its files first (resident shares recorded), warms it with requests, then runs
   closed-loop clients (threads, one keep-alive HTTP/1.1 connection each, requests back to back, k = 10) for
   ``--duration`` s with 1 client and with ``--clients``; every request a distinct text, the same stream for every
   server of a round (a new stream each round). Each run records q/s, client-side p50/p99, the load average before
   it and each process's CPU seconds per second. gare-serve runs ``--workers 2 --worker-sockets reuseport`` with
   caches off and its int8 default tower, then its ``fp32-packed`` tower. The targets (issue 41) compare each
   round's gare-serve q/s with the matched peer's q/s of the same round.

Results: bench/results/peer_clip_retrieval.{json,md} (+ .png when matplotlib is there).
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

import numpy as np

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
    from gare_search.query import encode_queries

    texts = distinct_queries(seed=1)[-(500 + n_queries):-500]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the packed tower batches at one thread (gare.text_packed's check)
    try:
        model, _ = load_model(ck, "cpu")
        bank = encode_queries(model, texts, tower=build_text_encoder(model, "fp32-packed")).numpy()  # t, as served
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
            "coverage_at_k": (st.get("coverage") or {}).get(str(st.get("default_candidates"))),
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


def _post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> Any:
    """POST `body` as JSON on a kept-alive connection -> the parsed answer, None when the status is not 200."""
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return json.loads(data) if r.status == 200 else None


def gare_ids(conn: http.client.HTTPConnection, q: str) -> list[int] | None:
    """gare-serve: two-stage text search (its defaults: ANN top-K, psi rerank), k = 10 -> the ids, best first."""
    got = _post(conn, "/v1/search", {"query": q, "k": 10})
    return None if got is None else [int(h["id"]) for h in got["results"]]


def peer_ids(conn: http.client.HTTPConnection, q: str) -> list[int] | None:
    """clip-retrieval: POST /knn-service as its front end sends a text query (image index, 10 results) -> the ids."""
    got = _post(conn, "/knn-service", {"text": q, "modality": "image", "num_images": 10, "indice_name": INDICE})
    return None if got is None else [int(h["id"]) for h in got]


def gare_request(conn: http.client.HTTPConnection, q: str) -> bool:
    ids = gare_ids(conn, q)
    return ids is not None and len(ids) == 10


def peer_request(conn: http.client.HTTPConnection, q: str) -> bool:
    ids = peer_ids(conn, q)
    return ids is not None and len(ids) == 10


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


# ------------------------------------------------------------------------------------------ recall
def recall_texts(n: int, tune_queries: int = 200) -> list[str]:
    """The texts recall is measured on: held out from the tuning bank (the ``tune_queries`` texts before the
    warm-up set) and from the timed streams (which stop before them)."""
    held = 500 + max(200, tune_queries)
    return distinct_queries(seed=1)[-(held + n):-held]


def top10(scores: np.ndarray) -> np.ndarray:
    """scores (a, n) -> the rows of each query's 10 best, best first (a, 10)."""
    part = np.argpartition(-scores, 9, axis=1)[:, :10]
    order = np.argsort(-np.take_along_axis(scores, part, 1), axis=1, kind="stable")
    return np.take_along_axis(part, order, 1)


def exact_answers(work: Path, index: Path, ck: Path, texts: list[str]) -> dict[str, Any]:
    """Each server's exact top-10 of `texts` over the same n vectors, computed offline (cached in `work`):
    gare: psi's exhaustive scores of every entry with the model's fp32 tower (what the served two-stage search
    approximates); the peer: inner products of its own tower's unit embedding (open_clip, 77 tokens, as its
    `compute_query`) with every unit vector (what its HNSW approximates). Also keeps the peer's embeddings
    (`peer_queries.npy`) for the choice of its efSearch."""
    import hashlib

    import open_clip
    import torch

    from gare.backbone import load_clip_weights
    from gare.checkpoint import load_model
    from gare_index.store import open_index
    from gare_search.query import encode_queries
    from gare_search.rerank import exhaustive_psi

    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    cache = work / f"exact-{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    t0 = time.perf_counter()
    ref = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None).eval()
    load_clip_weights(ref, str(work / WEIGHTS))
    with torch.no_grad():
        q = ref.encode_text(open_clip.get_tokenizer(OPEN_CLIP_ARCH)(texts)).float().numpy()
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    np.save(work / "peer_queries.npy", q.astype(np.float32))
    with open_index(index) as v:
        units = np.load(v.path / "units.npy", mmap_mode="r")  # (n, 512) float32, the peer's vectors too
        best = np.full((len(texts), 10), -np.inf, np.float32)
        rows = np.zeros((len(texts), 10), np.int64)
        for s0 in range(0, units.shape[0], 1 << 16):  # running top-10 of q · units, block by block
            sc = q @ np.asarray(units[s0 : s0 + (1 << 16)]).T
            both = np.concatenate([best, sc], 1)
            ids = np.concatenate([rows, np.arange(s0, s0 + sc.shape[1])[None].repeat(len(texts), 0)], 1)
            pick = top10(both)
            best, rows = np.take_along_axis(both, pick, 1), np.take_along_axis(ids, pick, 1)
        peer_exact = rows
        peer_s = round(time.perf_counter() - t0, 1)
        t1 = time.perf_counter()
        model, _ = load_model(ck, "cpu")
        t = encode_queries(model, texts)  # the model's own fp32 tower, as gare-serve's --text-encoder fp32
        psi = exhaustive_psi(model, v, t, progress=True)  # (a, n) in row order
        gare_exact = np.asarray(v.ids)[top10(psi)]
    out = {"texts": len(texts), "key": key, "gare": gare_exact.tolist(), "peer": peer_exact.tolist(),
           "peer_s": peer_s, "gare_s": round(time.perf_counter() - t1, 1)}
    cache.write_text(json.dumps(out))
    return out


def recall_at_10(got: list[list[int]], exact: list[list[int]]) -> float:
    """Mean share of each query's exact top-10 found among its 10 answers."""
    return round(float(np.mean([len(set(g) & set(e)) / 10 for g, e in zip(got, exact, strict=True)])), 4)


def choose_ef(work: Path, exact_peer: list[list[int]], target: float) -> dict[str, Any]:
    """The smallest efSearch of the peer's HNSW whose recall@10 (FAISS on its index file, its own embeddings of
    the recall texts) reaches `target`, and the index file's own (autofaiss's) efSearch with its recall; writes the
    matched copy of the index (`peer_index_matched/`, metadata linked) that clip-retrieval then serves."""
    import faiss

    index = faiss.read_index(str(work / "peer_index" / "image.index"))
    hnsw = faiss.downcast_index(index.index if isinstance(index, faiss.IndexPreTransform) else index)
    default = int(hnsw.hnsw.efSearch)
    q = np.load(work / "peer_queries.npy")
    ps = faiss.ParameterSpace()
    seen: dict[int, float] = {}

    def rec(ef: int) -> float:
        if ef not in seen:
            ps.set_index_parameters(index, f"efSearch={ef}")
            _, ids = index.search(q, 10)
            seen[ef] = recall_at_10(ids.tolist(), exact_peer)
        return seen[ef]

    grid = sorted({e for e in (10, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
                   if e < default} | {default})
    lo, hi = 0, None  # lo: largest tried below the target; hi: smallest tried reaching it
    for ef in grid:
        if rec(ef) >= target:
            hi = ef
            break
        lo = ef
    if hi is None:  # not even the default reaches it: go past it
        ef = default
        while hi is None and ef < 16 * default:
            ef *= 2
            if rec(ef) >= target:
                hi = ef
    if hi is not None:
        while hi - lo > 1:  # bisection between a miss and a hit (recall rises with efSearch, nearly always)
            mid = (lo + hi) // 2
            if rec(mid) >= target:
                hi = mid
            else:
                lo = mid
    matched = hi if hi is not None else max(seen)
    folder = work / "peer_index_matched"
    folder.mkdir(exist_ok=True)
    ps.set_index_parameters(index, f"efSearch={matched}")
    tmp = folder / "image.index.tmp"
    faiss.write_index(index, str(tmp))
    os.replace(tmp, folder / "image.index")
    meta = folder / "metadata"
    if not meta.exists():
        meta.symlink_to(work / "peer_index" / "metadata", target_is_directory=True)
    return {"target": target, "default_ef": default, "default_recall": rec(default), "matched_ef": matched,
            "matched_recall": seen[matched], "reached": hi is not None,
            "curve": [[e, seen[e]] for e in sorted(seen)]}


def served_answers(port: int, ask: Callable[[http.client.HTTPConnection, str], list[int] | None],
                   texts: list[str]) -> list[list[int]]:
    """One client's answers (ids, best first) to `texts`, over HTTP; a failed request fails the run."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        out = []
        for t in texts:
            ids = ask(conn, t)
            if ids is None:
                raise RuntimeError(f"no answer to {t!r} on port {port}")
            out.append(ids)
        return out
    finally:
        conn.close()


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


def peer_args(peer_venv: Path, work: Path, port: int, indices: str = "indices_paths.json") -> list[str]:
    """`clip-retrieval back` with its defaults except the three offline options (see the module docstring)."""
    return [str(peer_venv / "bin" / "clip-retrieval"), "back", "--port", str(port),
            "--indices_paths", str(work / indices),
            "--clip_model", f"open_clip:{OPEN_CLIP_ARCH}/{work / WEIGHTS}",
            "--enable_mclip_option", "False", "--provide_aesthetic_embeddings", "False"]


def gare_args(index: Path, port: int, text_encoder: str) -> list[str]:
    return [sys.executable, "-m", "gare_serve.cli", "--index", str(index), "--host", "127.0.0.1", "--port", str(port),
            "--workers", "2", "--worker-sockets", "reuseport", "--query-cache-entries", "0", "--result-cache-entries", "0",
            "--text-encoder", text_encoder, "--log-level", "warning"]


def worker_requests(url: str) -> dict[int, float]:
    from bench.support import worker_requests as wr

    return wr(url)


def measure_server(srv: Server, request: Request, stream: list[str], warm: list[str], duration: float, clients: int,
                   gare: bool, rnd: int) -> list[dict[str, Any]]:
    """A warm-up (not counted), then 1 client and `clients` clients for `duration` s each, on `stream` from its
    start (the same stream for every server of round `rnd`)."""
    closed_loop(srv.port, request, warm, 2, min(5.0, duration))  # first requests of each worker, not counted
    out: list[dict[str, Any]] = []
    pos = 0
    for c in (1, clients):
        load = loadavg()
        before = worker_requests(srv.url) if gare else {}
        c0 = {p: cpu_seconds(p) for p in srv.pids}
        t0 = time.perf_counter()
        r = closed_loop(srv.port, request, stream[pos:], c, duration)
        dt = time.perf_counter() - t0
        pos += r["queries_used"]
        r.update(server=srv.name, run=rnd, load_before=load,
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
PEER_MATCHED, PEER_DEFAULT = "clip-retrieval matched", "clip-retrieval default"
GARE_INT8, GARE_PACKED = "gare-serve int8 (default)", "gare-serve fp32-packed"
SERVERS = (PEER_MATCHED, PEER_DEFAULT, GARE_INT8, GARE_PACKED)
TEXT_ENCODER = {GARE_INT8: "auto", GARE_PACKED: "fp32-packed"}
PEER_INDICES = {PEER_MATCHED: "indices_paths_matched.json", PEER_DEFAULT: "indices_paths.json"}
# issue 41's targets: gare-serve's q/s over the matched peer's, in every round: (32 clients, 1 client)
TARGETS = {GARE_INT8: (5.0, 2.0), GARE_PACKED: (3.0, 1.2)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server and client count: q/s per round, min / median / max, median p50 and p99, errors."""
    out: dict[str, Any] = {}
    for name in SERVERS:
        s: dict[str, Any] = {}
        for key, many in (("one", False), ("many", True)):
            rs = sorted((r for r in runs if r["server"] == name and (r["clients"] > 1) == many), key=lambda r: r["run"])
            if not rs:
                continue
            q = [r["qps"] for r in rs]
            s[key] = {"clients": rs[0]["clients"], "runs": len(rs), "qps": q, "qps_min": min(q),
                      "qps_median": round(statistics.median(q), 2), "qps_max": max(q),
                      "p50_ms_median": round(statistics.median(r["p50_ms"] for r in rs), 1),
                      "p99_ms_median": round(statistics.median(r["p99_ms"] for r in rs), 1),
                      "errors": sum(r["errors"] for r in rs)}
            shares = [min(r["requests_per_worker"]) / max(1, sum(r["requests_per_worker"])) for r in rs
                      if r.get("requests_per_worker")]
            if shares:
                s[key]["smallest_worker_share"] = [round(x, 3) for x in shares]
        if s:
            out[name] = s
    return out


def paired_ratios(runs: list[dict[str, Any]], name: str, peer: str, many: bool) -> list[float]:
    """gare-serve's q/s over the peer's, round by round (the two ran in the same round)."""
    def by_round(n: str) -> dict[int, float]:
        return {r["run"]: r["qps"] for r in runs if r["server"] == n and (r["clients"] > 1) == many}

    g, p = by_round(name), by_round(peer)
    return [round(g[k] / p[k], 2) for k in sorted(g) if k in p and p[k] > 0]


def targets(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 41's targets from this run: each round's ratio to the matched peer, every round at or above the
    target (met None = the run lacks the figure); and the recall match they rest on."""
    runs, rounds = d["runs"], d["runs_requested"]
    out: list[dict[str, Any]] = []
    rc = d.get("recall", {})
    pk, pm = rc.get(GARE_PACKED), rc.get(PEER_MATCHED)
    out.append({"target": "the matched peer's served recall@10 of its exact top-10 >= gare-serve fp32-packed's",
                "measured": f"{pm} vs {pk}" if pm is not None and pk is not None else "-",
                "met": None if pm is None or pk is None else pm >= pk})
    for name, (t_many, t_one) in TARGETS.items():
        for many, t in ((True, t_many), (False, t_one)):
            ratios = paired_ratios(runs, name, PEER_MATCHED, many)
            clients = d["clients"] if many else 1
            out.append({"target": f"{name}, {clients} client{'s' if clients > 1 else ''}: q/s >= {t}x the matched "
                                  f"peer's in every one of {rounds} rounds",
                        "measured": ("round by round x" + ", x".join(map(str, ratios))) if ratios else "-",
                        "met": None if len(ratios) < rounds else all(x >= t for x in ratios)})
    return out


def ratio_lines(d: dict[str, Any]) -> list[str]:
    L = []
    for name in (GARE_INT8, GARE_PACKED):
        for peer in (PEER_MATCHED, PEER_DEFAULT):
            for many in (False, True):
                r = paired_ratios(d["runs"], name, peer, many)
                if r:
                    L.append(f"- {name} / {peer}, {d['clients'] if many else 1} client{'s' if many else ''}: q/s "
                             f"x{statistics.median(r):.2f} median (round by round {', '.join(f'x{x}' for x in r)})")
    return L


@with_provenance
def markdown(d: dict[str, Any]) -> str:
    prep, pv, ef = d["prepare"], d["peer_versions"], d["peer_ef"]
    g = prep.get("gallery", {})
    ai = prep.get("peer_index", {}).get("autofaiss_infos", {})
    tune = prep.get("gare_tune")
    L = ["# A peer at matched recall: clip-retrieval's back end vs gare-serve two-stage over HTTP", "",
         f"CPU: {d['cpu']} ({d['cores']} cores); Linux {d['kernel']}. Load average (1/5/15 min) at the start: "
         f"{d['load_start']}, at the end: {d['load_end']}; before each run: in the table. Run inside a private network "
         f"namespace with only loopback: {d['netns']}.", "",
         f"Index: {d['n']:,} entries, the same unit vectors (d = 512) in both. gare-serve: its index format "
         f"(`bench/serve_bench.write_gallery`: 12 fp16 frames per entry, psi fold constants), stage 1 "
         f"`{json.dumps(prep.get('gare_ann_params', {}))}`; written in {g.get('total_s', '-')} s"
         + (f", then tuned by `{tune['command']}` in {tune['s']} s ({tune['setting']}: the tuner's held-out recall "
            f"{tune['recall']} of the exact cosine top-10 at p50 {tune['p50_ms']} ms"
            + (f"; default K {tune['default_candidates']}, holding {tune['coverage_at_k']} of psi's exact top-10 on the "
               "tuning queries" if tune.get("coverage_at_k") is not None else "")
            + f", met {tune['met']})" if tune else "")
         + ". clip-retrieval: "
         f"`{prep.get('peer_index', {}).get('command', '-')}` (autofaiss with its defaults), index "
         f"`{ai.get('index_key', '-')}`, search parameters `{ai.get('index_param', '-')}`; built in "
         f"{prep.get('peer_index', {}).get('build_s', '-')} s.", "",
         f"Text tower: one open_clip {OPEN_CLIP_ARCH} weights file with random weights (`{WEIGHTS}`); the GARE checkpoint "
         f"was built from it. The same embedding from both towers on {d['tower_check']['texts']} query texts: max |diff| "
         f"{d['tower_check']['max_abs_diff']:.2e}, min cosine {d['tower_check']['min_cosine']:.6f}; gare's fp32-packed "
         f"tower vs the peer's: max |diff| {d['tower_check']['packed_max_abs_diff']:.2e}, min cosine "
         f"{d['tower_check']['packed_min_cosine']:.6f}.", "",
         f"Peer: clip-retrieval {pv.get('clip-retrieval')} (open_clip_torch {pv.get('open_clip_torch')}, torch {pv.get('torch')}, "
         f"faiss-cpu {pv.get('faiss-cpu')}, flask {pv.get('flask')}, numpy {pv.get('numpy')}) in its own venv; project: torch "
         f"{d['torch']}, faiss {d['faiss']}, uvicorn {d['uvicorn']}.", "",
         "## Recall of the exact top-10", "",
         f"{d['exact']['texts']} held-out texts (in neither the tuning bank nor the timed streams). Exact answers offline "
         f"on the same vectors: gare, psi's exhaustive scores of all {d['n']:,} entries with the model's fp32 tower "
         f"({d['exact']['gare_s']} s); the peer, its own embedding's inner products with every unit vector "
         f"({d['exact']['peer_s']} s). Served answers over HTTP, k = 10, one client, after the warm-up of round 0.", "",
         "| server | setting | recall@10 of its exact top-10 (served) |", "|---|---|---:|"]
    for name in SERVERS:
        setting = (f"efSearch={ef['matched_ef']}" if name == PEER_MATCHED else f"efSearch={ef['default_ef']} (autofaiss)"
                   if name == PEER_DEFAULT else f"--text-encoder {TEXT_ENCODER[name]}")
        L.append(f"| {name} | {setting} | {d['recall'].get(name, '-')} |")
    L += ["", f"The matched efSearch: the smallest whose recall (FAISS on the peer's index file, its embeddings of the "
          f"same texts) reaches gare-serve fp32-packed's served recall ({ef['target']}): efSearch {ef['matched_ef']} "
          f"gives {ef['matched_recall']}{'' if ef['reached'] else ' (NOT reached: the largest tried)'}; the file's own "
          f"{ef['default_ef']} gives {ef['default_recall']}. gare-serve int8's recall is against the fp32 tower's exact "
          "answer, so it also counts the int8 tower's own deviation. Recall by efSearch (FAISS, offline): "
          + ", ".join(f"{e}: {r}" for e, r in ef["curve"]) + ".", "",
          "## Speed", "",
          "Commands (one server at a time; caches off on gare-serve so that every request runs every stage):", ""]
    for name, cmd in d["server_commands"].items():
        L.append(f"- {name}: `{cmd}`")
    L += ["", f"{d['runs_requested']} rounds; in each every server starts, its files are read into the page cache, a "
          f"warm-up of 5 s runs, then 1 client and {d['clients']} clients for {d['duration_s']} s each, on the round's "
          "stream of distinct texts (the same for every server of a round); the server order alternates from round to "
          "round. Each client holds one keep-alive HTTP/1.1 connection and sends requests back to back, k = 10; q/s = "
          "answers / wall time; latency client side.", "",
          "| round | server | clients | load before | q/s | p50 ms | p99 ms | errors | CPU/s per process | requests per worker |",
          "|---:|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in d["runs"]:
        L.append(f"| {r['run']} | {r['server']} | {r['clients']} | {', '.join(map(str, r['load_before']))} | {r['qps']} | "
                 f"{r['p50_ms']} | {r['p99_ms']} | {r['errors']} | {', '.join(map(str, r['worker_cpu']))} | "
                 f"{' / '.join(map(str, r.get('requests_per_worker', []))) or '-'} |")
    L += ["", "Server order by round: " + "; ".join(f"{i}: {', '.join(o)}" for i, o in enumerate(d["orders"])) + ".", "",
          f"| server | 1 client q/s min / median / max | p50 ms | p99 ms | {d['clients']} clients q/s min / median / max "
          "| median p50 ms | median p99 ms |", "|---|---|---:|---:|---|---:|---:|"]
    for name, s in d["summary"].items():
        o, m = s.get("one", {}), s.get("many", {})
        L.append(f"| {name} | {o.get('qps_min', '-')} / {o.get('qps_median', '-')} / {o.get('qps_max', '-')} | "
                 f"{o.get('p50_ms_median', '-')} | {o.get('p99_ms_median', '-')} | "
                 f"{m.get('qps_min', '-')} / {m.get('qps_median', '-')} / {m.get('qps_max', '-')} | "
                 f"{m.get('p50_ms_median', '-')} | {m.get('p99_ms_median', '-')} |")
    L += ["", "Ratios (this run, paired by round):", "", *ratio_lines(d), ""]
    L += ["Page cache before each server's runs (share of the file resident before the script read it; the read's "
          "seconds): " + "; ".join(f"{k}: {v}" for k, v in d["warm"].items()) + ".", ""]
    if d.get("gare_stage_ms"):
        first = next(iter(d["gare_stage_ms"].values()))
        L += ["gare-serve's own stage timings (`timings_ms`, median over one client's requests after round 0's runs, ms):",
              "", "| server | " + " | ".join(k for k in first if k != "n") + " | n |", "|---|" + "---:|" * len(first)]
        for name, st in d["gare_stage_ms"].items():
            L.append(f"| {name} | " + " | ".join(str(v) for k, v in st.items() if k != "n") + f" | {st['n']} |")
        L.append("")
    L += ["## Targets (issue 41), from this run", "", "| target | measured | met |", "|---|---|---|"]
    for t in d["targets"]:
        L.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO' if t['met'] is not None else 'not measured'} |")
    if d["n"] < 1_000_000:
        L += ["", f"Size: {d['n']:,} entries, not the 1M issue 41 asks for."]
    if d.get("plot"):
        L += ["", f"![q/s per server]({d['plot']})"]
    L += ["", NOTES.strip(), ""]  # the renderer's prose (a JSON written before a change of it may hold older words)
    return "\n".join(L)


NOTES = """
## What was adapted for clip-retrieval to run offline

Nothing of its code was patched; three of its own options, a local weights file, and (the matched row) a copy of its
index file with another efSearch:

- `--clip_model open_clip:ViT-B-32-quickgelu/<path of the weights file>`: all_clip (its model loader) passes what
  follows the model name's first `/` to open_clip as `pretrained`, and open_clip loads a local file (by default it
  would download ViT-B/32's OpenAI weights). QuickGELU because GARE's ViT-B/32 uses it (as OpenAI's weights do).
- `--enable_mclip_option False`: by default it loads M-CLIP (multilingual) from the Hugging Face hub at start.
- `--provide_aesthetic_embeddings False`: by default it downloads aesthetic embeddings from GitHub at start.
- efSearch: clip-retrieval has no option for it; it serves the index file as autofaiss wrote it, with the efSearch
  autofaiss chose for a query time. The matched row serves a copy of that file whose efSearch was set by
  `faiss.ParameterSpace` (what autofaiss itself calls) and written by `faiss.write_index`, which keeps it.
- Its Flask server listens on 0.0.0.0 (`app.run(host="0.0.0.0")`, no option), so the script runs every server and
  client in a private network namespace with only loopback (`unshare -n`), which also shows that nothing was
  downloaded during the run. Its index is built by its own `clip-retrieval index` from the gallery's unit vectors
  (`img_emb/img_emb_0.npy`, a link to gare's `units.npy`) and a parquet file of paths (`metadata/`).
- Installed in its own venv: `pip install clip-retrieval==2.45.0 torch==2.14.1 torchvision==0.29.1` (pip chose
  the rest within clip-retrieval's pins: numpy < 2, open-clip-torch < 3, ...), then `pip install "setuptools<81"`:
  its dependency clip-anytorch imports `pkg_resources`, which the newest setuptools no longer ships.

## What differs in the work each does

- **Rerank.** clip-retrieval answers from the ANN alone (its `/knn-service`: encode, FAISS `search_and_reconstruct`
  of the 10 nearest, metadata of each hit); gare-serve runs stage 1 for K candidates and psi's rerank of them
  (reading their 12 fp16 frames each) before ranking the top 10: more work per query, and each is scored against
  its own exact answer (above).
- **Token length.** clip-retrieval's open_clip tokenizer pads every text to 77 tokens and the tower runs all 77
  positions; gare-serve trims the padding after the longest text of a micro-batch, which is exact for CLIP's causal
  text tower (the tower check above).
- **Precision.** The peer and gare-serve fp32-packed run fp32 towers; gare-serve's default is its int8 (dynamic
  quantization) tower, whose recall above counts its deviation from the fp32 answer.
- **Batching.** gare-serve gathers concurrent requests into micro-batches; `fp32-packed` and the int8 tower pack a
  batch's texts into shared GEMMs (each text's rows computed on their own). clip-retrieval encodes each request
  alone (torch using every core inside one process).
- **Web server and processes.** clip-retrieval runs Flask's development server (werkzeug, one process, a thread per
  request); gare-serve runs uvicorn with 2 worker processes (a SO_REUSEPORT socket each, 1 torch thread each).
  Neither is tuned beyond its defaults here.
- **Same machine.** The clients (Python threads) share the 2 cores with the servers: compare the servers within this
  run only.
"""


def plot(d: dict[str, Any], path: Path) -> bool:
    """q/s per server at 1 and many clients (each round a dot, the median a bar); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(d["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "one", "1 client"), (axes[1], "many", f"{d['clients']} clients")):
        vals = [d["summary"][n].get(key, {}).get("qps_median", 0) for n in names]
        ax.bar(range(len(names)), vals, color=["#999999", "#cccccc", "#2ca02c", "#ff7f0e"][: len(names)])
        for i, n in enumerate(names):
            qs = d["summary"][n].get(key, {}).get("qps", [])
            ax.plot([i] * len(qs), qs, "k.", ms=5)
        ax.set_xticks(range(len(names)), [n.replace(" (default)", "\n(default)").replace(" ", "\n", 1) for n in names],
                      fontsize=8)
        ax.set_ylabel("q/s")
        ax.set_title(title)
    fig.suptitle(f"{d['n']:,} entries at matched recall, ViT-B/32 text tower, HTTP on loopback ({d['cpu']}, "
                 f"{d['cores']} cores)", fontsize=9)
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
    ap.add_argument("--runs", type=int, default=5, help="rounds (each: every server, 1 client then --clients)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--recall-queries", type=int, default=100, help="held-out texts recall is measured on")
    ap.add_argument("--work", default="/tmp/gare-peer", help="weights, checkpoint, gallery and peer index (reused when there)")
    ap.add_argument("--peer-venv", default=str(Path.home() / ".cache" / "gare" / "peer-venv"))
    ap.add_argument("--tune-queries", type=int, default=200,
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
        "runs_requested": args.runs, "clients": args.clients, "runs": [], "orders": [], "recall": {}, "warm": {},
    }
    t_all = time.perf_counter()
    d["prepare"] = prepare(work, args.n, peer_venv, args.tune_queries)
    d["prepare_s"] = round(time.perf_counter() - t_all, 1)
    d["peer_versions"] = peer_versions(peer_venv)
    queries = distinct_queries(seed=1)
    warm = queries[-500:]
    rtexts = recall_texts(args.recall_queries, args.tune_queries)
    held = len(queries) - 500 - max(200, args.tune_queries) - len(rtexts)  # the timed streams stop before these
    per_round = held // args.runs
    d["tower_check"] = same_tower_check(work, queries[:64])
    print(json.dumps(d["tower_check"]), flush=True)
    index = work / "g" / "index"
    ck = work / "gare-vit-b-32-from-weights.safetensors"
    print(f"exact answers of {len(rtexts)} recall texts (psi over every entry: minutes at 1M)", flush=True)
    d["exact"] = exact_answers(work, index, ck, rtexts)
    (work / "indices_paths.json").write_text(json.dumps({INDICE: str(work / "peer_index")}))
    (work / "indices_paths_matched.json").write_text(json.dumps({INDICE: str(work / "peer_index_matched")}))
    d["server_commands"], d["startup_s"], d["gare_stage_ms"] = {}, {}, {}
    frames = next(index.glob("versions/*/frames.npy"))
    gare_files = [frames, *(f for f in frames.parent.iterdir() if f.name in ("units.npy", "ann.faiss", "psi_consts.npy"))]

    def serve(name: str, rnd: int, stream: list[str] | None) -> None:
        """Start `name`, fill the page cache with its files, measure (round `rnd`; recall when `stream` is None)."""
        port = free_port()
        log = work / f"{name.split()[0]}-{rnd}-{port}.log"
        if name in PEER_INDICES:
            a, env, ready, gare = peer_args(peer_venv, work, port, PEER_INDICES[name]), peer_env(), "/indices-list", False
            folder = work / ("peer_index_matched" if name == PEER_MATCHED else "peer_index")
            files = [folder / "image.index"]
        else:
            a, ready, gare = gare_args(index, port, TEXT_ENCODER[name]), "/readyz", True
            env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, "GARE_WORKER_HEALTHCHECK_S": "900"}
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            files = gare_files
        # both answer from memory: the peer reads its whole index into RAM, gare-serve maps its files; read them
        # into the page cache first, recording the share that was cached before
        d["warm"].setdefault(name, []).append(
            {f.name: [resident_fraction(f), round(warm_file(f), 1)] for f in files})
        d["server_commands"][name] = shlex.join([Path(a[0]).name if i == 0 else x for i, x in enumerate(a)])
        srv = Server(name, a, env, port, ready, log)
        try:
            d["startup_s"].setdefault(name, []).append(round(srv.wait_ready(), 1))
            print(f"{name} (round {rnd}): ready in {d['startup_s'][name][-1]} s, pids {srv.pids}", flush=True)
            if stream is None:
                closed_loop(srv.port, gare_request if gare else peer_request, warm, 2, 5.0)
                got = served_answers(port, gare_ids if gare else peer_ids, rtexts)
                d["recall"][name] = recall_at_10(got, d["exact"]["gare" if gare else "peer"])
                print(f"{name}: served recall@10 {d['recall'][name]}", flush=True)
            else:
                d["runs"] += measure_server(srv, gare_request if gare else peer_request, stream, warm, args.duration,
                                            args.clients, gare, rnd)
                if gare and rnd == 0:
                    d["gare_stage_ms"][name] = gare_stage_times(srv.url, warm[:100])
        finally:
            srv.stop()

    try:
        # recall first: gare-serve's served recall sets the peer's matched efSearch
        for name in (GARE_PACKED, GARE_INT8):
            serve(name, 0, None)
        d["peer_ef"] = choose_ef(work, d["exact"]["peer"], d["recall"][GARE_PACKED])
        print(json.dumps(d["peer_ef"]), flush=True)
        for name in (PEER_MATCHED, PEER_DEFAULT):
            serve(name, 0, None)
        for rnd in range(args.runs):
            order = list(SERVERS) if rnd % 2 == 0 else list(reversed(SERVERS))
            d["orders"].append(order)
            stream = queries[rnd * per_round : (rnd + 1) * per_round]
            for name in order:
                serve(name, rnd, stream)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    d["load_end"] = loadavg()
    d["total_s"] = round(time.perf_counter() - t_all, 1)
    d["summary"] = summarize(d["runs"])
    d["targets"] = targets(d)
    out.parent.mkdir(parents=True, exist_ok=True)
    if plot(d, out.with_suffix(".png")):
        d["plot"] = out.with_suffix(".png").name
    d["run"] = run.record()
    print(write_report(out.with_suffix(".json"), d, markdown).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
