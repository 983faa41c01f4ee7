"""Fixtures of the Ray Serve tests: the sharded indexes they serve and the suite's one Ray cluster run
(tests/serve_ray/one_cluster.py), built once per session and only read."""

from __future__ import annotations

import shutil

import pytest

from gare_build.cli import main as gare_index
from gare_index.shards import current_generation, write_generation
from tests.indexer.ncl_support import flip_manifests
from tests.serve_ray.one_cluster import cluster_config, shard_requests
from tests.serve_ray.support import build_sharded_cli, reference, run_ray
from tests.service.support import build_index


@pytest.fixture(scope="session")
def shard_env(service_env, tmp_path_factory):
    """The single flat index (the reference) and a 2-shard index over the service corpus's 16 videos."""
    base = tmp_path_factory.mktemp("ray-serve")
    ckpt, videos = service_env["checkpoint"], service_env["videos"]
    return dict(single=build_index(ckpt, videos, base / "single", index_type="flat"),
                n2=build_sharded_cli(ckpt, videos, base / "n2", 2), checkpoint=ckpt, videos=videos,
                captions=service_env["captions"], base=base)


@pytest.fixture(scope="session")
def decided(service_env, tmp_path_factory):
    """{"on": a 2-shard root whose recorded NCL default is on, "off": one recorded off, "mixed": a generation naming
    shard 0 of the "on" decision and shard 1 of the "off" one}, each decided by the real decide path
    (`gare-index build --shards 2 --ncl-val`, then `gare-index biases --ncl-val` on a copy)."""
    root = tmp_path_factory.mktemp("sharded-ncl-serve")
    lose, win, _ = flip_manifests(service_env["checkpoint"], service_env["index"], root / "val")
    on = root / "on"
    rc = gare_index(["build", "--checkpoint", str(service_env["checkpoint"]), "--videos", str(service_env["videos"]),
                     "--out", str(on), "--shards", "2", "--index-type", "flat", "--batch-size", "4", "--workers", "0",
                     "--no-progress", "--ncl-val", str(win)])
    assert rc == 0
    off = shutil.copytree(on, root / "off", symlinks=True)
    assert gare_index(["biases", "--out", str(off), "--ncl-val", str(lose)]) == 0
    mixed = shutil.copytree(off, root / "mixed", symlinks=True)
    g_off = current_generation(mixed)
    # the "on" decision's shard 0 version is the off root's previous generation's (gc keeps it)
    g_on = current_generation(on)
    write_generation(mixed, [g_on.versions[0], g_off.versions[1]])
    return {"on": on, "off": off, "mixed": mixed, "checkpoint": service_env["checkpoint"]}


@pytest.fixture(scope="session")
def ray_cluster(service_env, shard_env, decided, tmp_path_factory):
    """The one Ray run (tests/serve_ray/one_cluster.py): {"apps": {name: {"steps": ...}}, ...}, "want": the
    single index's answers to the shards app's requests (computed here while the cluster starts), and "bank": the
    query bank file the ingresses wrote."""
    base = tmp_path_factory.mktemp("ray-cluster")
    n1 = build_sharded_cli(service_env["checkpoint"], service_env["videos"], base / "n1", 1)
    bank = base / "bank" / "queries.npy"
    n2 = shutil.copytree(shard_env["n2"], base / "n2", symlinks=True)  # the run hides one of its shards
    cfg, env = cluster_config(n1, decided["on"], n2, shard_env["captions"], bank)
    reqs, everything = shard_requests(shard_env["captions"])
    out, want = run_ray(base, cfg, env, meanwhile=lambda: reference(shard_env["single"], [*reqs, everything]))
    return {**out, "want": want, "bank": bank}
