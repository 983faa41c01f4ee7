"""gare_serve.ray_serve.deployment on a real local Ray cluster of several nodes bound to 127.0.0.1, inside a private network
namespace with only loopback when run as root (``unshare -n`` + ``ip link set lo up``), over indexes built by
``gare-index build --shards N`` (NCL biases fitted over the whole gallery); every answer is compared over HTTP with a
single flat index over the same videos.

- fast (the CI suite; the suite's one Ray run, tests/serve_ray/one_cluster.py): 2 nodes, 2 shards: text answers with and without NCL equal the single index's; with every
  replica of shard 1 killed and ``allow_partial``, the answer is flagged partial, names shard 1, and holds exactly
  the full answer's shard-0 videos. The ingresses wrote the query bank (exactly the text queries they served) and
  the shards app's /metrics shows the recall watch's evaluation of its queries on every shard.
- slow: 3 shards x 2 replicas (one replica killed: the other serves; all killed without ``allow_partial``: a 503
  naming the shard, then Ray restarts it and the answers are right again); 4 shards switching generation under load
  (`gare-index add` while clients query: every answer equals the single-index answer of exactly the generation its
  ``index_version`` names).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from gare.checkpoint import load_model
from gare_search.query import encode_queries
from tests.serve_ray.one_cluster import BANKED_BEFORE_SHARDS, shard_requests
from tests.serve_ray.support import assert_same_record, build_sharded_cli, reference, run_ray, text_requests
from tests.service.support import build_index, free_port


@pytest.fixture
def env(shard_env):
    """The single flat index and the 2-shard index (tests/serve_ray/conftest.py: built once per session)."""
    return shard_env


def test_ray_serve_two_shards_equal_the_single_index_and_a_dead_shard_is_flagged(ray_cluster):
    """The suite's one Ray run, app ``shards`` (tests/serve_ray/one_cluster.py)."""
    want = ray_cluster["want"]
    steps = ray_cluster["apps"]["shards"]["steps"]
    for w, g in zip(want, steps["answers"]["answers"], strict=True):  # over HTTP through Ray: the single index's
        assert_same_record(w, g)
        assert g["partial"] is False and g["missing_shards"] == [] and g["index_version"] == "g000001"
    assert steps["kill"]["killed"], "no replica of shard 1 to kill"
    (a,) = steps["after_kill"]["answers"]
    # shard 1 has no live replica: flagged, naming it, never a silent drop; the answer is exactly the full answer's
    # shard-0 videos (k = K = every video, so no shard-0 video past the full top k can move in)
    assert a["status"] == 200 and a["partial"] is True and a["missing_shards"] == [1], a
    full = steps["answers"]["answers"][-1]["hits"]
    assert a["hits"] and all(h[1] % 2 == 0 for h in a["hits"])
    assert [(h[0], h[1], h[2]) for h in a["hits"]] == [(h[0], h[1], h[2]) for h in full if h[1] % 2 == 0]


def test_ray_ingress_records_the_query_bank_and_watches_stage1_recall(ray_cluster, shard_env):
    """The suite's one Ray run: every ingress recorded its text queries (GARE_QUERY_BANK_*), and the shards app's
    watch evaluated its 5 complete answers on both shard replicas (GARE_RECALL_SAMPLE_RATE=1)."""
    rec = ray_cluster["apps"]["shards"]["steps"]["recall"]
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in rec["lines"]}
    assert lines["gare_stage1_recall_window_queries"] == 5, rec
    # flat shards, each tuned at K = its 8 videos: every global top-10 is found; the target is the shards' 0.995
    assert lines["gare_stage1_recall_mean"] == 1.0 and lines["gare_stage1_recall_target"] == 0.995
    assert lines['gare_stage1_recall_evaluated_total{list="rerun"}'] == 5 and lines["gare_stage1_recall_alarm"] == 0
    reqs, everything = shard_requests(shard_env["captions"])
    # the bank, oldest first: each app's ingress loaded the file the one before wrote; the shards app's answers,
    # then its one answer after the kill (partial, but searched)
    texts = [*BANKED_BEFORE_SHARDS, *(r["query"] for r in reqs), everything["query"], everything["query"]]
    bank = np.load(ray_cluster["bank"], allow_pickle=False)
    model, _ = load_model(shard_env["checkpoint"], "cpu")
    np.testing.assert_allclose(bank, encode_queries(model, texts).numpy(), rtol=1e-5, atol=1e-5)  # t as served


@pytest.mark.slow  # ~3 min on 2 cores: 3 nodes, 3 shards x 2 replicas + the ingress, each loading torch
def test_ray_serve_replicas_per_shard_a_503_and_a_restart(env, tmp_path):
    n3 = build_sharded_cli(env["checkpoint"], env["videos"], env["base"] / "n3", 3)
    reqs = text_requests(env["captions"], 2)
    cfg = {"port": free_port(), "nodes": 3, "num_cpus": 3,
           "app": {"index": str(n3), "shard_replicas": 2, "allow_partial": False, "shard_timeout_s": 5},
           "steps": [{"do": "ask", "name": "answers", "requests": reqs},
                     {"do": "kill", "name": "kill_one", "shard": 2, "count": 1},
                     {"do": "ask", "name": "one_left", "requests": reqs},
                     {"do": "kill", "name": "kill_rest", "shard": 2},
                     {"do": "ask", "name": "none_left", "requests": reqs[:1]},
                     {"do": "until_restarted", "name": "restart", "shard": 2, "requests": reqs, "timeout_s": 120}]}
    out, want = run_ray(tmp_path, cfg, meanwhile=lambda: reference(env["single"], reqs))
    steps = out["steps"]
    for w, g in zip(want, steps["answers"]["answers"], strict=True):
        assert_same_record(w, g)
    assert len(steps["kill_one"]["before"]) == 2 and len(steps["kill_one"]["killed"]) == 1
    # one replica of shard 2 left: it serves; a request routed to the dead one before Ray noticed may be a 503
    # naming shard 2 (bounded: at most one per request in flight), never a wrong answer
    one_left = steps["one_left"]["answers"]
    errors = [a for a in one_left if a["status"] != 200]
    assert len(errors) <= 1 and all(a["status"] == 503 and "shards [2]" in a["detail"] for a in errors), errors
    for a in one_left:
        if a["status"] == 200:
            assert a["partial"] is False
            assert_same_record(want[a["qi"]], a)
    # no replica left and no allow_partial: a 503 naming the shard
    (dead,) = steps["none_left"]["answers"]
    assert dead["status"] == 503 and "shards [2]" in dead["detail"], dead
    restart = steps["restart"]
    assert restart["restarted_at_s"] is not None, f"Ray did not restart shard 2: {restart}"
    assert not set(restart["replicas_after"]) & set(steps["kill_one"]["before"])
    for a in restart["answers"]:
        assert a["status"] in (200, 503), a
        if a["status"] == 503:
            assert "shards [2]" in a["detail"], a
        else:
            assert_same_record(want[a["qi"]], a)
    assert restart["answers"][-1]["status"] == 200


@pytest.mark.slow  # ~3 min on 2 cores: 2 nodes, 4 shards, a `gare-index add` under 4 closed-loop clients
def test_ray_serve_generation_switch_under_load_answers_from_one_generation(env, tmp_path):
    videos = sorted(p.name for p in Path(env["videos"]).iterdir() if p.suffix == ".mp4")
    first, later = videos[:12], videos[12:]
    src = tmp_path / "videos"
    src.mkdir()
    for name in first:
        shutil.copy2(Path(env["videos"]) / name, src / name)
    single12 = build_index(env["checkpoint"], src, tmp_path / "single12", index_type="flat")
    n4 = build_sharded_cli(env["checkpoint"], src, tmp_path / "n4", 4)
    for name in later:  # what `gare-index add` will find (the first 12 are known by path and checksum)
        shutil.copy2(Path(env["videos"]) / name, src / name)
    reqs = text_requests(env["captions"], 3)
    add = [sys.executable, "-m", "gare_build.cli", "add", "--checkpoint", str(env["checkpoint"]), "--videos", str(src),
           "--out", str(n4), "--batch-size", "4", "--workers", "0", "--no-progress"]
    cfg = {"port": free_port(), "nodes": 2, "num_cpus": 3,
           "app": {"index": str(n4), "shard_replicas": 1, "allow_partial": False, "shard_timeout_s": 30},
           "steps": [{"do": "load_while", "name": "switch", "requests": reqs, "clients": 4, "command": add,
                      "before_s": 3, "until_version": "g000002", "after": 12, "timeout_s": 240}]}
    out, want = run_ray(tmp_path, cfg, {"GARE_INDEX_POLL_S": "0.5"}, meanwhile=lambda: {
        "g000001": reference(single12, reqs), "g000002": reference(env["single"], reqs)})
    sw = out["steps"]["switch"]
    assert sw["command_rc"] == 0, sw["command_output"]
    answers = sw["answers"]
    versions = [a["index_version"] for a in answers]
    assert "g000001" in versions and "g000002" in versions, sorted(set(map(str, versions)))
    assert all(a["status"] == 200 for a in answers), [a for a in answers if a["status"] != 200][:3]
    new_names = set(later)
    for a in answers:  # each answer: exactly its generation's single-index answer (videos, scores, biases)
        assert a["partial"] is False and a["index_version"] in want, a
        if a["index_version"] == "g000001":
            assert not {h[0] for h in a["hits"]} & new_names, a  # no video of the next generation
        assert_same_record(want[a["index_version"]][a["qi"]], a)
    print(f"{len(answers)} answers: {versions.count('g000001')} from g000001, {versions.count('g000002')} from g000002")
