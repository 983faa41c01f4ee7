"""Sharded indexes (issue 26, must-haves 1 and 2) on real mp4 files with the tiny model: the routing and the ids,
the generation files, `gare-index build --shards N` and add / remove / biases / verify / stats / gc on a sharded
root, the global NCL biases against a single index over the same videos, kill-safety between shards."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from gare_build import shard_build as sharded_mod
from gare_build.build import BuildOptions, build
from gare_build.cli import main
from gare_build.shard_build import RowConcat, build_sharded, remove_sharded
from gare_index.shards import (
    GENERATION_FILE,
    Generation,
    current_generation,
    global_id,
    is_sharded,
    list_generations,
    open_sharded,
    shard_of,
    shard_root,
    split_id,
    write_generation,
)
from gare_index.store import IndexFormatError, current_version_name, list_versions, open_index
from gare_serve.engine.traffic_bank import QueryBank
from tests.indexer.support import copy_videos


def opts(**kw) -> BuildOptions:
    base = dict(batch_size=4, workers=0, progress=False)
    base.update(kw)
    return BuildOptions(**base)


def by_path(sh) -> dict[str, tuple[int, int, float]]:
    """path -> (shard, global id, bias) of every video of an opened sharded index."""
    out = {}
    for s, v in enumerate(sh.shards):
        b = np.asarray(v.biases)
        for r in v.all_metadata():
            out[r["path"]] = (s, global_id(s, int(r["id"]), sh.n_shards), float(b[v.rows(np.array([r["id"]]))[0]]))
    return out


def single_biases(root) -> dict[str, float]:
    with open_index(root, use_gpu=False) as v:
        b = np.asarray(v.biases)
        return {r["path"]: float(b[v.rows(np.array([r["id"]]))[0]]) for r in v.all_metadata()}


@pytest.fixture(scope="module")
def single(tmp_path_factory, ckpt, corpus):
    """The reference: one index over the corpus."""
    out = tmp_path_factory.mktemp("single") / "INDEX"
    build(ckpt, corpus, out, opts())
    return out


@pytest.fixture(scope="module")
def sharded3(tmp_path_factory, ckpt, corpus):
    out = tmp_path_factory.mktemp("sharded3") / "INDEX"
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(out), "--shards", "3",
               "--batch-size", "4", "--workers", "0", "--no-progress"])
    assert rc == 0
    return out


# ------------------------------------------------------------------------------------------ routing and ids
def test_shard_of_ids_and_bad_input():
    import hashlib

    cs = hashlib.sha256(b"a video").hexdigest()
    for n in (1, 2, 3, 7):  # the contract's formula, computed here independently
        assert shard_of(cs, n) == int(hashlib.sha256(cs.encode()).hexdigest(), 16) % n
    assert shard_of(cs, 1) == 0
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5):
        g = rng.integers(0, 10**9, 1000)
        s, lo = split_id(g, n)
        np.testing.assert_array_equal(global_id(s, lo, n), g)
        assert all(split_id(int(x), n) == (int(x) % n, int(x) // n) for x in g[:20])
    assert global_id(2, 5, 3) == 17 and split_id(17, 3) == (2, 5)
    with pytest.raises(ValueError, match="got 0"):
        shard_of(cs, 0)
    with pytest.raises(ValueError, match="non-empty"):
        shard_of("", 2)
    with pytest.raises(ValueError, match=r"shard 3 is not in \[0, 3\)"):
        global_id(3, 0, 3)
    with pytest.raises(ValueError, match="-1"):
        split_id(-1, 2)


def test_row_concat_gathers_like_concatenate():
    rng = np.random.default_rng(1)
    parts = [rng.normal(size=(n, 3, 2)).astype(np.float16) for n in (4, 0, 5, 1)]
    whole = np.concatenate(parts)
    rc = RowConcat(parts)
    assert rc.shape == whole.shape and rc.dtype == whole.dtype
    rows = rng.integers(0, len(whole), 30)
    np.testing.assert_array_equal(rc[rows], whole[rows])
    np.testing.assert_array_equal(rc[rows.reshape(5, 6)], whole[rows.reshape(5, 6)])
    with pytest.raises(IndexError):
        rc[np.array([10])]


# ------------------------------------------------------------------------------------------ generations
def test_generation_switch_is_atomic(tmp_path):
    root = tmp_path / "INDEX"
    for s in range(2):  # two shards with two (empty-bodied) complete versions each
        for name in ("v000001", "v000002"):
            d = shard_root(root, s) / "versions" / name
            d.mkdir(parents=True)
            (d / "manifest.json").write_text("{}")
    assert current_generation(root) is None and not is_sharded(tmp_path)
    g1 = write_generation(root, ["v000001", "v000001"])
    assert is_sharded(root) and current_generation(root) == g1 == Generation(1, 2, ("v000001", "v000001"))
    assert (root / GENERATION_FILE).read_text().strip() == "g000001.json"
    raw = json.loads((root / "generations" / "g000001.json").read_text())
    assert raw["generation"] == 1 and raw["n_shards"] == 2 and raw["versions"] == ["v000001", "v000001"] and raw["created"]

    # readers polling while generations are switched see a complete generation each time, never a torn one
    seen, errors, stop = set(), [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                g = current_generation(root)
                seen.add(g.versions)
                assert g.versions in {("v000001", "v000001"), ("v000002", "v000002")}
            except Exception as e:  # noqa: BLE001 - collected and asserted on below
                errors.append(e)

    th = threading.Thread(target=reader)
    th.start()
    for i in range(150):
        write_generation(root, ["v000002", "v000002"] if i % 2 == 0 else ["v000001", "v000001"])
    stop.set()
    th.join()
    assert not errors and len(seen) == 2
    assert list_generations(root) == list(range(1, 152))

    with pytest.raises(IndexFormatError, match="no complete version v000009"):
        write_generation(root, ["v000001", "v000009"])
    with pytest.raises(ValueError, match="has 2 shards, got 3"):
        write_generation(root, ["v000001"] * 3)
    (root / GENERATION_FILE).write_text("nonsense\n")
    with pytest.raises(IndexFormatError, match="'nonsense' is not a generation file name"):
        current_generation(root)
    (root / GENERATION_FILE).write_text("g000002.json\n")
    (root / "generations" / "g000002.json").write_text('{"generation": 2, "n_shards": 2, "versions": ["v1"]}')
    with pytest.raises(IndexFormatError, match="one version per shard"):
        current_generation(root)


# ------------------------------------------------------------------------------------------ build
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_video_in_exactly_one_shard(n, tmp_path, ckpt, corpus, sharded3):
    if n == 3:
        out = sharded3
    else:
        out = tmp_path / "INDEX"
        rep = build_sharded(ckpt, corpus, out, opts(), n_shards=n)
        assert rep.exit_code == 0 and rep.version == "g000001" and rep.n_videos == 12
    gen = current_generation(out)
    assert gen.n_shards == n and len(gen.versions) == n
    paths = sorted(str(p) for p in corpus.glob("*.mp4"))
    with open_sharded(out, use_gpu=False) as sh:
        assert sh.n == 12 and [v.name for v in sh.shards] == list(gen.versions)
        rows = [(s, r) for s, v in enumerate(sh.shards) for r in v.all_metadata()]
        assert sorted(r["path"] for _, r in rows) == paths  # every video once
        assert all(shard_of(r["checksum"], n) == s for s, r in rows)  # in the shard its content names
        gids = np.concatenate([sh.global_ids(s) for s in range(n)])
        assert np.unique(gids).size == 12
        md = sh.metadata(gids[::-1])
        assert [m["id"] for m in md] == gids[::-1].tolist()
        for v in sh.shards:  # each shard a normal index: its own stage-1 tuning and psi coverage
            assert v.manifest.stage1 and v.manifest.stage1.get("coverage")
            assert v.manifest.biases["scope"] == {"n_shards": n, "n_videos": 12}
    assert main(["verify", "--out", str(out)]) == 0


def test_biases_are_the_single_index_biases(sharded3, single, ckpt):
    """The NCL biases are fitted over the whole gallery: each video's equals the single index's."""
    ref = single_biases(single)
    with open_sharded(sharded3, use_gpu=False) as sh:
        got = by_path(sh)
        assert sh.shards[0].manifest.biases["score"] == "served"
    assert sorted(got) == sorted(ref)
    p = sorted(ref)
    np.testing.assert_allclose([got[x][2] for x in p], [ref[x] for x in p], atol=1e-5)
    # and not what each shard alone would give: the test can tell the two apart (the single-index fitter on one
    # shard's gallery alone)
    from gare.checkpoint import read_checkpoint
    from gare_build.pipeline.biases import checkpoint_gamma_and_queue, compute_biases

    gamma, queue = checkpoint_gamma_and_queue(read_checkpoint(ckpt), raw=True)
    with open_sharded(sharded3, use_gpu=False) as sh:
        first = sh.shards[0]
        own, _ = compute_biases(np.asarray(first.units), gamma, queue, 4)
        glob, _ = compute_biases(np.concatenate([np.asarray(v.units) for v in sh.shards]), gamma, queue, 4)
        assert not np.allclose(own, glob[:first.n], atol=1e-5)


def test_a_sharded_change_fits_the_biases_once(sharded3, tmp_path, ckpt, corpus):
    """Step 1's shard builds defer their NCL fit (their versions hold zeros recorded "deferred", and no stage-1
    tuning); the generation's versions hold the one global fit and the tuning made with it; the report counts one
    fit per change (build, add, remove)."""
    from gare_index.store import open_version

    gen = current_generation(sharded3)
    for s in range(3):
        versions = list_versions(shard_root(sharded3, s))
        assert versions[-1] == gen.versions[s] and len(versions) == 2
        with open_version(shard_root(sharded3, s), versions[0], use_gpu=False) as step1:
            assert step1.manifest.biases["source"] == "deferred" and not np.asarray(step1.biases).any()
            assert step1.manifest.stage1 is None
        with open_version(shard_root(sharded3, s), versions[1], use_gpu=False) as final:
            assert final.manifest.biases["scope"] == {"n_shards": 3, "n_videos": 12}
            assert final.manifest.stage1["coverage"] and np.asarray(final.biases).any()
    # add and remove: one fit each too
    lib = copy_videos(corpus, tmp_path / "lib", names=sorted(p.name for p in corpus.glob("*.mp4"))[:8])
    out = tmp_path / "INDEX"
    assert build_sharded(ckpt, lib, out, opts(), n_shards=2).biases["fits"] == {"global": 1, "shards": 0}
    copy_videos(corpus, lib)
    assert build_sharded(ckpt, lib, out, opts(), mode="add").biases["fits"] == {"global": 1, "shards": 0}
    some = sorted(str(p) for p in lib.glob("*.mp4"))[:3]
    assert remove_sharded(out, some).biases["fits"] == {"global": 1, "shards": 0}


def test_verify_and_stats_on_every_shard(sharded3, capsys):
    capsys.readouterr()
    assert main(["verify", "--out", str(sharded3), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["ok"] and v["problems"] == [] and len(v["versions"]) == 3
    assert main(["stats", "--out", str(sharded3), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["n"] == 12 and st["n_shards"] == 3 and len(st["shards"]) == 3 and sum(s["n"] for s in st["shards"]) == 12


def test_bad_sharded_requests(tmp_path, ckpt, corpus, single, sharded3, capsys):
    capsys.readouterr()
    assert main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(sharded3),
                 "--shards", "2", "--no-progress"]) == 1
    assert "has 3 shards; --shards 2" in capsys.readouterr().err
    assert main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(single),
                 "--shards", "2", "--no-progress"]) == 1
    assert "is a single index" in capsys.readouterr().err
    assert main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(tmp_path / "Y"),
                 "--shards", "40", "--no-progress"]) == 1
    assert "would hold no video" in capsys.readouterr().err
    assert main(["remove", "--out", str(sharded3), "99999"]) == 1
    assert "99999" in capsys.readouterr().err
    before = [current_version_name(shard_root(sharded3, s)) for s in range(3)]
    assert main(["tune", "--out", str(sharded3), "--from-bank", str(tmp_path / "no-such-bank.npy")]) == 1
    assert "no-such-bank.npy" in capsys.readouterr().err
    assert current_generation(sharded3).number == 1  # nothing changed
    assert [current_version_name(shard_root(sharded3, s)) for s in range(3)] == before


def test_tune_on_a_sharded_index_writes_one_new_generation(tmp_path, ckpt, corpus, capsys):
    """`gare-index tune --from-bank` on a sharded root: every shard tuned on the bank's queries as a new shard
    version (its arrays and biases unchanged), one new generation naming them; a bank that cannot tune (one
    distinct query) changes nothing, shards included."""
    lib = copy_videos(corpus, tmp_path / "lib", names=sorted(p.name for p in corpus.glob("*.mp4"))[:8])
    out = tmp_path / "INDEX"
    assert build_sharded(ckpt, lib, out, opts(keep=3), n_shards=2).exit_code == 0
    g1 = current_generation(out)
    old = {}
    for s, name in enumerate(g1.versions):
        with open_index(shard_root(out, s)) as v:
            assert v.name == name
            old[s] = (np.asarray(v.ids).copy(), np.asarray(v.units).copy(), np.asarray(v.biases).copy(), v.dim)
    rng = np.random.default_rng(0)
    units = np.concatenate([old[s][1] for s in old])
    q = units[rng.integers(0, len(units), 20)] + 0.3 * rng.standard_normal((20, old[0][3])).astype(np.float32)
    bank = QueryBank(100, old[0][3], tmp_path / "bank.npy")
    bank.push((q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32))
    bank.flush()
    capsys.readouterr()
    assert main(["tune", "--out", str(out), "--from-bank", str(tmp_path / "bank.npy"), "--recall-target", "0.9"]) == 0
    printed = capsys.readouterr().out
    g2 = current_generation(out)
    assert g2.number == g1.number + 1 and f"g{g2.number:06d}" in printed and "stage 1: recall@" in printed
    for s, name in enumerate(g2.versions):
        assert name != g1.versions[s] and current_version_name(shard_root(out, s)) == name
        with open_index(shard_root(out, s)) as v:
            assert v.manifest["builder"]["command"] == "tune"
            assert v.manifest["stage1"]["query_source"].startswith("query-bank (")
            for a, b in zip(old[s][:3], (v.ids, v.units, v.biases), strict=True):
                np.testing.assert_array_equal(a, np.asarray(b))  # only stage 1 changed
    assert json.loads((out / "report.json").read_text())["version"] == f"g{g2.number:06d}"
    one = QueryBank(100, old[0][3], tmp_path / "one.npy")  # one query served three times
    one.push(np.repeat((q[:1] / np.linalg.norm(q[:1])).astype(np.float32), 3, axis=0))
    one.flush()
    assert main(["tune", "--out", str(out), "--from-bank", str(tmp_path / "one.npy")]) == 1
    assert "distinct" in capsys.readouterr().err
    assert current_generation(out).number == g2.number
    assert [current_version_name(shard_root(out, s)) for s in range(2)] == list(g2.versions)


# ------------------------------------------------------------------------------------------ add / remove / gc
def test_add_remove_route_to_the_right_shard(tmp_path, ckpt, corpus):
    lib = copy_videos(corpus, tmp_path / "lib", names=sorted(p.name for p in corpus.glob("*.mp4"))[:8])
    out = tmp_path / "INDEX"
    assert build_sharded(ckpt, lib, out, opts(keep=1), n_shards=2).exit_code == 0
    g1 = current_generation(out)
    # add: four more files; each lands in the shard its content names, the others are reused
    copy_videos(corpus, lib)
    rc = main(["add", "--videos", str(lib), "--out", str(out), "--workers", "0", "--batch-size", "4",
               "--no-progress", "--keep", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["added"] == 4 and rep["unchanged"] == 8 and rep["encoded"] == 4 and rep["version"] == "g000002"
    with open_sharded(out, use_gpu=False) as sh:
        got = by_path(sh)
        assert len(got) == 12
        for v in sh.shards:
            for r in v.all_metadata():
                assert shard_of(r["checksum"], 2) == got[r["path"]][0]
    # the biases after add are still the whole gallery's: equal to a single index over the same 12 videos
    single = tmp_path / "SINGLE"
    build(ckpt, lib, single, opts())
    ref = single_biases(single)
    np.testing.assert_allclose([got[p][2] for p in sorted(ref)], [ref[p] for p in sorted(ref)], atol=1e-5)

    # remove one video by global id and one by path: each from its own shard
    p_id, p_path = sorted(got)[0], sorted(got)[5]
    rep = remove_sharded(out, [str(got[p_id][1]), p_path], keep=1)
    assert rep.exit_code == 0 and rep.removed == 2 and rep.n_videos == 10
    with open_sharded(out, use_gpu=False) as sh:
        left = by_path(sh)
    assert set(left) == set(got) - {p_id, p_path}
    assert all(left[p][1] == got[p][1] for p in left)  # the others keep their global ids
    assert main(["verify", "--out", str(out)]) == 0

    # gc with keep=1 never removed a version that the current or the previous generation names
    cur, prev = current_generation(out), None
    gens = [g for g in list_generations(out) if g < cur.number]
    from gare_index.shards import read_generation

    prev = read_generation(out, gens[-1])
    for s in range(2):
        have = set(list_versions(shard_root(out, s)))
        assert {cur.versions[s], prev.versions[s]} <= have
        assert g1.versions[s] not in have or g1.number == prev.number  # older generations' versions do go
    assert main(["gc", "--out", str(out), "--keep", "1"]) == 0
    for s in range(2):
        assert {cur.versions[s], prev.versions[s]} <= set(list_versions(shard_root(out, s)))


def test_crash_between_shards_keeps_the_old_generation(tmp_path, ckpt, corpus, monkeypatch):
    out = tmp_path / "INDEX"
    assert build_sharded(ckpt, corpus, out, opts(keep=1), n_shards=2).exit_code == 0
    g1 = current_generation(out)
    with open_sharded(out, use_gpu=False) as sh:
        before = by_path(sh)

    real_build, calls = sharded_mod.build, []

    def build_then_die(checkpoint, videos, sroot, o, *, mode):
        calls.append(sroot.name)
        if len(calls) == 2:  # shard 0 has written its new version; die before shard 1 and the generation
            raise RuntimeError("killed between shards")
        return real_build(checkpoint, videos, sroot, o, mode=mode)

    monkeypatch.setattr(sharded_mod, "build", build_then_die)
    with pytest.raises(RuntimeError, match="killed between shards"):
        build_sharded(ckpt, corpus, out, opts(keep=1))
    assert calls == ["s000", "s001"]
    # shard 0 moved on, but the generation is the old one, and everything it names is still there and served
    assert current_version_name(shard_root(out, 0)) != g1.versions[0]
    assert current_generation(out) == g1
    with open_sharded(out, use_gpu=False) as sh:
        assert [v.name for v in sh.shards] == list(g1.versions) and by_path(sh) == before
    assert main(["verify", "--out", str(out)]) == 0
    assert main(["gc", "--out", str(out), "--keep", "1"]) == 0
    with open_sharded(out, use_gpu=False) as sh:
        assert by_path(sh) == before
    # the next run starts from the generation (shard 0's orphan version is not built upon) and commits
    monkeypatch.setattr(sharded_mod, "build", real_build)
    rep = build_sharded(ckpt, corpus, out, opts(keep=1))
    assert rep.exit_code == 0 and current_generation(out).number == g1.number + 1
    with open_sharded(out, use_gpu=False) as sh:
        after = by_path(sh)
    assert {p: x[:2] for p, x in after.items()} == {p: x[:2] for p, x in before.items()}
    np.testing.assert_allclose([after[p][2] for p in sorted(before)], [before[p][2] for p in sorted(before)], atol=1e-5)


def test_biases_command_on_a_sharded_root(tmp_path, ckpt, sharded3, capsys):
    import shutil

    out = tmp_path / "INDEX"
    shutil.copytree(sharded3, out)
    with open_sharded(out, use_gpu=False) as sh:
        before = by_path(sh)
    capsys.readouterr()
    assert main(["biases", "--out", str(out), "--bias-score", "dual"]) == 0
    with open_sharded(out, use_gpu=False) as sh:
        after = by_path(sh)
        assert all(v.manifest.biases["score"] == "dual" for v in sh.shards)
    assert current_generation(out).number == 2
    assert {p: x[:2] for p, x in after.items()} == {p: x[:2] for p, x in before.items()}
    # the dual-score fit of the whole gallery: the single-index code on the concatenated units
    from gare.checkpoint import read_checkpoint
    from gare_build.pipeline.biases import checkpoint_gamma_and_queue, compute_biases

    with open_sharded(out, use_gpu=False) as sh:
        units = np.concatenate([np.asarray(v.units) for v in sh.shards])
        paths = [r["path"] for v in sh.shards for r in (v.metadata(v.ids))]
    gamma, queue = checkpoint_gamma_and_queue(read_checkpoint(ckpt), raw=True)
    b, _ = compute_biases(units, gamma, queue, 4)
    np.testing.assert_allclose([after[p][2] for p in paths], b, atol=1e-5)


def test_shards_build_on_the_dask_engine(tmp_path, ckpt, corpus, single):
    """`--engine dask` applies to every shard's build (one loopback-only LocalCluster serves them all)."""
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(host="127.0.0.1", n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=None, protocol="tcp") as cluster:
        rep = build_sharded(ckpt, corpus, tmp_path / "INDEX", opts(engine="dask", scheduler=cluster.scheduler_address,
                                                                   shard_size=3), n_shards=2)
    assert rep.exit_code == 0 and rep.engine == "dask" and rep.encoded == 12
    with open_sharded(tmp_path / "INDEX", use_gpu=False) as sh:
        assert all(v.manifest["builder"]["engine"] == "dask" for v in sh.shards)
        got = by_path(sh)
        with open_index(single, use_gpu=False) as ref:  # same features as the local engine's single index
            for v in sh.shards:
                for r in v.all_metadata():
                    rr = [m for m in ref.all_metadata() if m["path"] == r["path"]][0]
                    np.testing.assert_allclose(v.units[v.rows(np.array([r["id"]]))],
                                               ref.units[ref.rows(np.array([rr["id"]]))], atol=1e-5)
    ref_b = single_biases(single)
    np.testing.assert_allclose([got[p][2] for p in sorted(ref_b)], [ref_b[p] for p in sorted(ref_b)], atol=1e-5)
    assert main(["verify", "--out", str(tmp_path / "INDEX")]) == 0


# ------------------------------------------------------------------------------------------ sealed manifests
def _sealed(root) -> dict[str, str]:
    """version -> its seal state (gare_index.store.seal_status) of every version under `root`."""
    from gare_index.store import seal_status

    return {v: seal_status(root / "versions" / v).state for v in list_versions(root)}


def test_every_writer_path_seals_its_version(tmp_path, ckpt, corpus, sharded3, capsys):
    """build, add, biases (a version derived from the current one, its other files hard-linked) and a sharded build
    each write a sealed version; `seal` on a sharded root seals the shards' versions written before seals."""
    import shutil

    from gare_build.build import recompute_biases
    from gare_index.store import SEAL_FILE

    lib = copy_videos(corpus, tmp_path / "lib", names=sorted(p.name for p in corpus.glob("*.mp4"))[:8])
    out = tmp_path / "INDEX"
    build(ckpt, lib, out, opts(keep=5))
    copy_videos(corpus, lib)
    assert main(["add", "--videos", str(lib), "--out", str(out), "--workers", "0", "--batch-size", "4",
                 "--no-progress", "--keep", "5"]) == 0
    recompute_biases(out, keep=5)
    assert _sealed(out) == {"v000001": "sealed", "v000002": "sealed", "v000003": "sealed"}
    gen = current_generation(sharded3)
    for s, name in enumerate(gen.versions):
        assert _sealed(shard_root(sharded3, s))[name] == "sealed"

    root = tmp_path / "SHARDED"
    shutil.copytree(sharded3, root)
    for s, name in enumerate(gen.versions):  # as if written before seals
        (shard_root(root, s) / "versions" / name / SEAL_FILE).unlink()
    capsys.readouterr()
    assert main(["verify", "--out", str(root), "--quick"]) == 0
    assert "shard 0 (" in capsys.readouterr().out.split(" OK ")[1]
    assert main(["seal", "--out", str(root)]) == 0
    assert capsys.readouterr().out.count(" sealed\n") == 3
    for s, name in enumerate(gen.versions):
        assert _sealed(shard_root(root, s))[name] == "sealed"
