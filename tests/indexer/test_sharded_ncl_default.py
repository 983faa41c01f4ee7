"""Issue 28, must-have 4 on a sharded index: `gare-index build --shards N --ncl-val CAPTIONS` (and add / remove /
biases on a sharded root) decides the NCL default once over the whole gallery in the global step and writes the
same `biases.default` record into every shard's new version; the decision equals the one a single index over the
same videos, checkpoint and captions records (build, remove, biases), add / remove / biases decide again on the
recorded captions, stage 1's K is tuned for the score served by default, and verify reports a generation whose
shards disagree.

The validation sets are those of tests/indexer/test_ncl_decision.py (tests/indexer/ncl_support.py): every
caption's true video is its psi top-1, which the biases move away (they lose), or its psi + b top-1 (they win),
computed on a single index whose biases the sharded global fit reproduces (tests/indexer/test_sharded_build.py)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from gare_build.cli import main
from gare_build.shard_build import verify_sharded
from gare_index.describe import index_ncl_default
from gare_index.shards import (
    agreed_ncl_default,
    current_generation,
    open_sharded,
    shard_root,
    write_generation,
)
from gare_index.store import IndexFormatError, open_index, open_version
from tests.indexer.ncl_support import flip_manifests

N_SHARDS = 3


def _build(out: Path, ckpt: Path, corpus: Path, *extra: str) -> None:
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(out), "--batch-size", "4",
               "--workers", "0", "--no-progress", *extra])
    assert rc == 0, f"gare-index build {extra} failed with {rc}"


def shard_manifests(root: Path) -> list[dict]:
    """Every shard's manifest (JSON) at the current generation, in shard order."""
    gen = current_generation(root)
    out = []
    for s, name in enumerate(gen.versions):
        with open_version(shard_root(root, s), name, use_gpu=False) as v:
            out.append(v.manifest.to_dict())
    return out


def the_default(root: Path) -> dict:
    """The one biases.default record every shard holds (asserted equal across shards)."""
    ms = shard_manifests(root)
    recs = [m["biases"].get("default") for m in ms]
    assert all(r == recs[0] for r in recs), recs
    assert recs[0] is not None, "no shard records a decision"
    assert all(m["biases"]["scope"]["n_shards"] == N_SHARDS for m in ms)
    return recs[0]


@pytest.fixture(scope="module")
def env(tmp_path_factory, ckpt, corpus):
    """The validation sets (from a plain single index) and the single and sharded builds deciding on them."""
    root = tmp_path_factory.mktemp("sharded-ncl")
    _build(root / "PLAIN", ckpt, corpus, "--no-tune")
    lose, win, n = flip_manifests(ckpt, root / "PLAIN", root / "val")
    # the checkpoint's gamma (--ncl-gammas 1, recorded: add, remove and biases keep it): the captions were built
    # against the plain build's biases; the choice of gamma has its own test (test_ncl_decision.py)
    one = ("--ncl-gammas", "1")
    _build(root / "SINGLE_LOSE", ckpt, corpus, "--ncl-val", str(lose), *one)
    _build(root / "SH_LOSE", ckpt, corpus, "--shards", str(N_SHARDS), "--ncl-val", str(lose), *one)
    _build(root / "SINGLE_WIN", ckpt, corpus, "--no-tune", "--ncl-val", str(win), *one)
    _build(root / "SH_WIN", ckpt, corpus, "--no-tune", "--shards", str(N_SHARDS), "--ncl-val", str(win), *one)
    return {"root": root, "lose": lose, "win": win, "n": n}


def test_sharded_build_decides_once_as_the_single_index(env, capsys):
    for name, on in (("LOSE", False), ("WIN", True)):
        single = open_index(env["root"] / f"SINGLE_{name}").manifest["biases"]["default"]
        d = the_default(env["root"] / f"SH_{name}")
        assert d["on"] is on and d["n_captions"] == env["n"] and d["source"] == str(env[name.lower()])
        # the whole record (rule, R@1/5/10 of both, intervals, reason, the captions left out): the single index's
        assert d == single
        assert (d["psi"]["R1"], d["psi_biases"]["R1"]) == ((100.0, 0.0) if not on else (0.0, 100.0))
        assert index_ncl_default(shard_manifests(env["root"] / f"SH_{name}")[1]) == (on, d["reason"])
        with open_sharded(env["root"] / f"SH_{name}", use_gpu=False) as sh:  # the in-process reader says the same
            assert sh.ncl_default() == (on, d["reason"])
        report = json.loads((env["root"] / f"SH_{name}" / "report.json").read_text())
        assert report["biases"]["default"] == d and report["biases"]["fits"] == {"global": 1, "shards": 0}


def test_stage1_is_tuned_for_the_default_score(env):
    """As a single build: K chosen for psi alone when the decision is off (the lose build is tuned; the win
    builds ran with --no-tune, so they record none)."""
    for m in shard_manifests(env["root"] / "SH_LOSE"):
        assert m["stage1"]["ncl_default"] is False
    assert open_index(env["root"] / "SINGLE_LOSE").manifest["stage1"]["ncl_default"] is False
    assert all(not m.get("stage1") for m in shard_manifests(env["root"] / "SH_WIN"))


def test_remove_add_and_biases_decide_again_over_the_whole_gallery(env, tmp_path, corpus):
    sh = shutil.copytree(env["root"] / "SH_WIN", tmp_path / "SH")
    single = shutil.copytree(env["root"] / "SINGLE_WIN", tmp_path / "SINGLE")
    # remove: decided again on the recorded captions, over the videos left (the removed one's captions drop out)
    gone = next(csv.DictReader(open(env["win"])))["video"]
    n_gone = sum(1 for row in csv.DictReader(open(env["win"])) if row["video"] == gone)
    assert main(["remove", "--out", str(sh), gone]) == 0
    assert main(["remove", "--out", str(single), gone]) == 0
    d = the_default(sh)
    assert d["n_captions"] == env["n"] - n_gone > 0 and d["source"] == str(env["win"])
    assert d == open_index(single).manifest["biases"]["default"]  # the single index's remove decides the same
    # add it back: decided again on the same captions, all of them matched again, as the single index's add
    for out in (sh, single):
        assert main(["add", "--videos", str(corpus), "--out", str(out), "--workers", "0", "--batch-size", "4",
                     "--no-progress", "--no-tune"]) == 0
        assert json.loads((out / "report.json").read_text())["added"] == 1
    d = the_default(sh)
    assert d["n_captions"] == env["n"] and d["on"] is True and d["source"] == str(env["win"])
    assert d == open_index(single).manifest["biases"]["default"]
    # biases --ncl-val: new captions decide (off here), in every shard; a plain `biases` keeps deciding on them
    assert main(["biases", "--out", str(sh), "--ncl-val", str(env["lose"])]) == 0
    d = the_default(sh)
    assert d["on"] is False and d["source"] == str(env["lose"])
    assert main(["biases", "--out", str(single), "--ncl-val", str(env["lose"])]) == 0
    assert d == open_index(single).manifest["biases"]["default"]
    assert main(["biases", "--out", str(sh)]) == 0
    assert the_default(sh)["source"] == str(env["lose"]) and the_default(sh)["on"] is False
    assert verify_sharded(sh, rehash=False) == []


def test_verify_reports_shards_that_disagree(env, tmp_path):
    """A generation naming shard versions of two decisions (both written by the real decide path: the win build's
    generation, then `gare-index biases --ncl-val` lose), put together by hand with write_generation."""
    sh = shutil.copytree(env["root"] / "SH_WIN", tmp_path / "SH")
    on = current_generation(sh).versions
    assert main(["biases", "--out", str(sh), "--ncl-val", str(env["lose"])]) == 0
    off = current_generation(sh).versions
    assert agreed_ncl_default(shard_manifests(sh))["on"] is False
    write_generation(sh, [on[0], *off[1:]])
    problems = verify_sharded(sh, rehash=False)
    assert len(problems) == 1 and "NCL defaults (biases.default) differ" in problems[0], problems
    assert "shards [0]: on=True" in problems[0] and "shards [1, 2]: on=False" in problems[0]
    with pytest.raises(IndexFormatError, match="differ"):
        agreed_ncl_default(shard_manifests(sh))
    with open_sharded(sh, use_gpu=False) as opened, pytest.raises(IndexFormatError, match="differ"):
        opened.ncl_default()
    # a generation without any decision agrees on none
    assert agreed_ncl_default([{"biases": {"source": "checkpoint-queue"}}] * 2) is None
