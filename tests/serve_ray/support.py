"""Shared helpers for the Ray Serve tests (no tests here): a sharded index next to a single one over the same
videos, the answers compared by video file (the two number their videos differently), and a run of
tests.serve_ray.ray_run (a real Ray cluster in a child process) with its answers compared to the single index's."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gare_build.cli import main as gare_index
from gare_index.shards import shard_of, shard_root, write_generation
from gare_index.store import current_version_name, open_index
from gare_serve.app import create_app
from tests.checkout import CHECKOUT_PATH
from tests.conftest import require
from tests.service.support import REPO, build_index, running_app, settings

K, CANDIDATES = 5, 8
TOL = 1e-5


def build_sharded_by_hand(ckpt: Path, videos: Path, checksums: dict[str, str], root: Path, n: int) -> Path:
    """A sharded root built as N normal flat indexes over the partition by shard_of(file sha256, N), then one
    generation naming their versions (what `gare-index build --shards N` writes, NCL biases fitted per shard)."""
    parts: dict[int, list[str]] = {}
    for name, sha in checksums.items():
        parts.setdefault(shard_of(sha, n), []).append(name)
    assert sorted(parts) == list(range(n)), f"an empty shard for n={n}: {parts}"
    versions = []
    for s in range(n):
        src = root / "videos" / f"s{s}"
        src.mkdir(parents=True)
        for name in parts[s]:
            shutil.copy2(videos / name, src / name)
        build_index(ckpt, src, shard_root(root, s), index_type="flat")
        versions.append(current_version_name(shard_root(root, s)))
    write_generation(root, versions)
    return root


def make_sharded_env(service_env: dict[str, Any], base: Path, counts: tuple[int, ...]) -> dict[str, Any]:
    """{single: a flat index over the service corpus, sharded: {n: root}, checkpoint, captions}."""
    ckpt, videos = service_env["checkpoint"], service_env["videos"]
    single = build_index(ckpt, videos, base / "single", index_type="flat")
    with open_index(single) as v:
        checksums = {Path(r["path"]).name: r["checksum"] for r in v.all_metadata()}
    sharded = {n: build_sharded_by_hand(ckpt, videos, checksums, base / f"n{n}", n) for n in counts}
    return dict(single=single, sharded=sharded, checkpoint=ckpt, captions=service_env["captions"], videos=videos)


def by_name(results: list[dict[str, Any]]) -> list[tuple[str, float, float, float | None, float]]:
    """A response's hits as (file name, score, ann_score, psi_score, bias): comparable across numberings."""
    return [(h["metadata"]["name"], h["score"], h["ann_score"], h["psi_score"], h["bias"]) for h in results]


def assert_same(want: list[dict[str, Any]], got: list[dict[str, Any]], *, bias: bool = False, tol: float = 1e-5) -> None:
    """Same videos in the same order with the same scores; ``bias``: the NCL biases too (hand-built shards fit
    their biases per shard, the builder over the whole gallery)."""
    a, b = by_name(want), by_name(got)
    assert [x[0] for x in a] == [x[0] for x in b], (a, b)
    for x, y in zip(a, b, strict=True):
        for i in (1, 2, 4) if bias else (1, 2):
            assert abs(x[i] - y[i]) <= tol, (x, y)
        assert (x[3] is None) == (y[3] is None) and (x[3] is None or abs(x[3] - y[3]) <= tol), (x, y)


def build_sharded_cli(ckpt: Path, videos: Path, out: Path, n: int) -> Path:
    rc = gare_index(["build", "--checkpoint", str(ckpt), "--videos", str(videos), "--out", str(out), "--shards", str(n),
                     "--index-type", "flat", "--batch-size", "4", "--workers", "0", "--no-progress"])
    assert rc == 0, f"gare-index build --shards {n} failed with {rc}"
    return out


def text_requests(captions: list[str], n: int) -> list[dict]:
    """n captions, each with and without NCL (the NCL biases are the global part the shards must agree on)."""
    return [{"query": q, "k": K, "candidates": CANDIDATES, "ncl": ncl} for q in captions[:n] for ncl in (False, True)]


def reference(index: Path, requests: list[dict]) -> list[dict]:
    """The single index's answers to ``requests``, in process (the naive reference)."""
    async def go():
        async with running_app(create_app(settings(index))) as c:
            out = []
            for body in requests:
                r = await c.post("/v1/search", json=body)
                assert r.status_code == 200, r.text
                out.append(r.json())
            return out
    return asyncio.run(go())


def assert_same_record(want: dict, got: dict) -> None:
    """An answer over Ray (ray_run's record) equals the single index's: the same files in the same order with the
    same score, stage-1 score, psi score and NCL bias (the two number their videos differently)."""
    assert got["status"] == 200, got
    w = [(h["metadata"]["name"], h["score"], h["ann_score"], h["psi_score"], h["bias"]) for h in want["results"]]
    g = [(name, score, ann, psi, bias) for name, _gid, score, ann, psi, bias in got["hits"]]
    assert [x[0] for x in w] == [x[0] for x in g], (w, g)
    for a, b in zip(w, g, strict=True):
        for i in (1, 2, 4):
            assert abs(a[i] - b[i]) <= TOL, (a, b)
        assert (a[3] is None) == (b[3] is None) and (a[3] is None or abs(a[3] - b[3]) <= TOL), (a, b)


def run_ray(tmp_path: Path, cfg: dict, extra_env: dict | None = None, meanwhile: Any = None) -> tuple[dict, Any]:
    """tests.serve_ray.ray_run in a child process: in a private network namespace (loopback only) when root; its
    record, and what ``meanwhile()`` returned (run here while the cluster starts: the single index's answers)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        require(False, "ray[serve] is not installed (pip install -e '.[ray]')")
    cfg_path, out_path = tmp_path / "cfg.json", tmp_path / "out.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "tests.serve_ray.ray_run", str(cfg_path), str(out_path)]
    if os.geteuid() == 0:
        require(shutil.which("unshare") and shutil.which("ip"), "unshare and ip (util-linux, iproute2) are needed to "
                "run Ray in a private network namespace")
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1", "GARE_TEXT_ENCODER": "fp32",
           "GARE_RESULT_CACHE_ENTRIES": "0", "GARE_BATCH_MAX_WAIT_MS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": CHECKOUT_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {})}
    t0 = time.time()
    logs = tmp_path / "ray_run.log"
    with open(logs, "w") as log, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT) as p:
        try:
            during = meanwhile() if meanwhile is not None else None
            rc = p.wait(timeout=cfg.get("timeout_s", 900))
        finally:
            if p.poll() is None:
                p.kill()
    assert rc == 0, f"the Ray run failed ({rc}):\n{logs.read_text(errors='replace')[-10000:]}"
    out = json.loads(out_path.read_text())
    out["imports_s"], out["exit_s"] = out["started_at"] - t0, time.time() - out["ended_at"]
    assert out["nodes"] == cfg["nodes"] and out["node_ips"] == ["127.0.0.1"], out["node_ips"]  # loopback only
    apps = {name: {"ready": round(a["ready_s"], 1), "delete": round(a.get("delete_s", 0.0), 1),
                   "steps": {k: round(v["step_s"], 1) for k, v in a["steps"].items()}} for name, a in out["apps"].items()}
    print(f"Ray run: cluster {out['cluster_s']:.1f} s, apps {apps}, shutdown {out['shutdown_s']:.1f} s, "
          f"total {out['total_s']:.1f} s; the child's imports {out['imports_s']:.1f} s, its exit {out['exit_s']:.1f} s")
    return out, during
