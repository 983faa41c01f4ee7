"""InvGC on a sharded index (issue 26, must-have 2): `gare-index build --shards N --invgc` corrects the stage-1
vectors with LocalAdj means of the WHOLE gallery, so that with exact (flat) stage 1 the sharded answers equal a single
InvGC index's over the same videos (ids by file, scores to float tolerance) for 1, 2 and 3 shards; `add` / `remove`
on a sharded InvGC index keep that; every shard records the same correction; and a sharded change fits its NCL
biases once (the shard commands defer theirs to the global fit)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gare.checkpoint import file_sha256, load_model
from gare.invgc import invgc
from gare_build.build import BuildOptions, build, remove
from gare_build.cli import main
from gare_build.invgc_fit import invgc_means
from gare_build.shard_build import build_sharded, remove_sharded, verify_sharded
from gare_index.shards import current_generation, open_sharded, shard_of, shard_root
from gare_index.store import list_versions, open_index, open_version
from gare_search import by_example as E
from gare_search import search as S
from gare_search import shard_search as SH
from tests.indexer.postprocess_support import queues
from tests.indexer.support import reseal

TOL = 1e-5
R = dict(invgc=True, invgc_r_g=0.3, invgc_r_q=0.2, invgc_k=2.0)  # given r: no validation search, a strong correction
QUERIES = ["a red square moves to the left", "two green circles", "a blue triangle on a white background",
           "something fast", "a yellow cross that does not move", "many shapes"]
N_FIRST = 10  # the videos of the first build (of the corpus's 14); add brings the rest


def flat(**kw) -> BuildOptions:
    return BuildOptions(workers=0, progress=False, index_type="flat", ncl_stage1=True, **{**R, **kw})


def video_list(path: Path, videos: list[Path]) -> Path:
    path.write_text("video\n" + "".join(f"{p}\n" for p in videos))
    return path


def first_videos(vids: list[Path]) -> list[Path]:
    """The corpus ordered so that its first N_FIRST videos leave no shard empty for 2 and 3 shards (a sharded build
    refuses an empty shard): one video of every shard first."""
    where = {p: (shard_of(file_sha256(p), 2), shard_of(file_sha256(p), 3)) for p in vids}
    lead = [next(p for p in vids if where[p][1] == s) for s in range(3)]
    lead += [next(p for p in vids if where[p][0] == s and p not in lead) for s in range(2)]
    return lead + [p for p in vids if p not in lead]


@pytest.fixture(scope="module")
def env(postprocess_env, tmp_path_factory):
    """The single InvGC index and 1-, 2-, 3-shard InvGC indexes over the same 10 videos, the model, the checkpoint."""
    base = tmp_path_factory.mktemp("sharded-invgc")
    ckpt = postprocess_env["checkpoint"]
    vids = first_videos(sorted(postprocess_env["videos"].glob("*.mp4")))
    first = video_list(base / "first.csv", vids[:N_FIRST])
    build(str(ckpt), str(first), base / "single", flat())
    reports = {n: build_sharded(str(ckpt), str(first), base / f"n{n}", flat(), n_shards=n) for n in (1, 2, 3)}
    model, _ = load_model(ckpt, "cpu")
    return {"base": base, "ckpt": ckpt, "videos": vids, "first": first, "model": model, "reports": reports}


def by_name(version) -> dict[str, int]:
    return {Path(r["path"]).name: int(r["id"]) for r in version.all_metadata()}


def gid_names(sh) -> dict[int, str]:
    return {g: Path(r["path"]).name for s in range(sh.n_shards)
            for g, r in zip(sh.global_ids(s), sh.shards[s].all_metadata(), strict=True)}


def stage1_by_name(sh) -> dict[str, np.ndarray]:
    out = {}
    for v in sh.shards:
        for name, i in by_name(v).items():
            out[name] = np.asarray(v.ann_units)[v.rows(np.array([i]))[0]]
    return out


TEXT_OPTIONS = [S.SearchOptions(k=4, candidates=5, ncl=False),  # K < n: the InvGC stage 1 picks the candidates
                S.SearchOptions(k=4, candidates=5, ncl=True),
                S.SearchOptions(k=4, candidates=5, ncl=True, ncl_stage1=True),
                S.SearchOptions(k=5, candidates=6, rerank=False, ncl=False)]


def assert_answers_equal(model, single_root: Path, sharded_root: Path) -> None:
    """Text (NCL off / on / in stage 1, rerank off) and example queries: the same files in the same order, the
    same scores, stage-1 scores and biases."""
    with open_index(single_root, use_gpu=False) as single, open_sharded(sharded_root, use_gpu=False) as sh:
        names = gid_names(sh)
        single_names = {i: n for n, i in by_name(single).items()}
        assert sorted(names.values()) == sorted(single_names.values())
        for opts in TEXT_OPTIONS:
            want = S.search_batch(model, single, QUERIES, opts)
            got = SH.search_sharded(model, sh, QUERIES, opts)
            for w, g in zip(want, got, strict=True):
                assert [names[h.id] for h in g.hits] == [single_names[h.id] for h in w.hits]
                for a, b in zip(w.hits, g.hits, strict=True):
                    assert (b.score, b.ann_score, b.bias) == pytest.approx((a.score, a.ann_score, a.bias), abs=TOL)
        to_gid = {n: g for g, n in names.items()}
        for ex in (["video1.mp4"], ["video2.mp4", "video5.mp4"]):
            ex = [x for x in ex if x in to_gid]
            for opts in (S.SearchOptions(k=4, candidates=5), S.SearchOptions(k=4, candidates=5, rerank=False)):
                want = E.search_by_videos(single, [by_name(single)[x] for x in ex], opts)
                got = SH.search_sharded_by_videos(sh, [to_gid[x] for x in ex], opts)
                assert [names[h.id] for h in got.hits] == [single_names[h.id] for h in want.hits]
                assert [h.score for h in got.hits] == pytest.approx([h.score for h in want.hits], abs=TOL)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_sharded_invgc_answers_equal_one_invgc_index(env, n):
    base = env["base"]
    assert_answers_equal(env["model"], base / "single", base / f"n{n}")
    with open_index(base / "single", use_gpu=False) as single, open_sharded(base / f"n{n}", use_gpu=False) as sh:
        ref = {name: np.asarray(single.ann_units)[single.rows(np.array([i]))[0]] for name, i in by_name(single).items()}
        got = stage1_by_name(sh)
        for name in ref:  # every video's stage-1 vector is the single index's (the whole gallery's means)
            np.testing.assert_allclose(got[name], ref[name], atol=TOL)
        inv = single.manifest.invgc
        for v in sh.shards:  # one correction recorded on every shard: what `add` applies to new videos
            m = v.manifest.invgc
            assert (m["r_g"], m["r_q"], m["k_percent"]) == (0.3, 0.2, 2.0)
            assert (m["mean_g"], m["mean_q"]) == pytest.approx((inv["mean_g"], inv["mean_q"]), abs=1e-6)
            assert m["n_gallery_for_means"] == N_FIRST and m["scope"] == {"n_shards": n, "n_videos": N_FIRST}
            assert v.manifest.index_type == "flat" and v.manifest.stage1 and v.manifest.stage1.get("coverage")
        assert env["reports"][n].invgc["mean_g"] == pytest.approx(inv["mean_g"], abs=1e-6)
    assert verify_sharded(base / f"n{n}") == []


def test_the_check_can_tell_per_shard_invgc_apart(env):
    """The correction is not the identity, and InvGC computed shard by shard (each shard's own means, what a plain
    per-shard build would do) gives other stage-1 vectors: the equality above is not a coincidence."""
    Gh, Qh = queues(env["ckpt"])
    with open_sharded(env["base"] / "n3", use_gpu=False) as sh:
        v = sh.shards[0]
        units = np.array(v.units, dtype=np.float32)  # a writable copy (torch.from_numpy below)
        assert np.abs(np.asarray(v.ann_units) - units).max() > 2e-3
        own = invgc(torch.from_numpy(units), Gh, Qh, 0.3, 0.2, k_percent=2.0).numpy()
        assert np.abs(own - np.asarray(v.ann_units)).max() > 1e-4
        assert invgc_means(units, Gh, Qh, 2.0) != pytest.approx((v.manifest.invgc["mean_g"], v.manifest.invgc["mean_q"]),
                                                                abs=1e-6)


def test_add_and_remove_keep_the_single_index_answers(env, tmp_path):
    """`gare-index add` then `remove` on a 2-shard InvGC index and on one InvGC index over the same videos: equal
    answers after each (new videos corrected with the recorded whole-gallery means on their shard)."""
    ckpt, vids = env["ckpt"], env["videos"]
    single, out = tmp_path / "single", tmp_path / "INDEX"
    build(str(ckpt), str(env["first"]), single, flat())
    assert build_sharded(str(ckpt), str(env["first"]), out, flat(), n_shards=2).exit_code == 0
    whole = video_list(tmp_path / "all.csv", vids)
    build(str(ckpt), str(whole), single, BuildOptions(workers=0, progress=False), mode="add")
    assert main(["add", "--videos", str(whole), "--out", str(out), "--workers", "0", "--no-progress"]) == 0
    with open_sharded(out, use_gpu=False) as sh:
        assert sh.n == len(vids) and all(v.manifest.invgc["n_gallery_for_means"] == N_FIRST for v in sh.shards)
    assert_answers_equal(env["model"], single, out)

    gone = [str(vids[1]), str(vids[12])]
    remove(single, gone)
    rep = remove_sharded(out, gone)
    assert rep.exit_code == 0 and rep.removed == 2 and rep.biases["fits"] == {"global": 1, "shards": 0}
    assert_answers_equal(env["model"], single, out)
    assert main(["verify", "--out", str(out)]) == 0


def test_a_sharded_change_fits_the_biases_once(env):
    """The shard builds of step 1 write no fit of their own (their versions say "deferred"); the generation's
    versions hold the one global fit; the report counts the fits."""
    for n, rep in env["reports"].items():
        assert rep.exit_code == 0 and rep.biases["fits"] == {"global": 1, "shards": 0}
        root = env["base"] / f"n{n}"
        gen = current_generation(root)
        for s in range(n):
            versions = list_versions(shard_root(root, s))
            assert versions[-1] == gen.versions[s] and len(versions) == 2
            with open_version(shard_root(root, s), versions[0], use_gpu=False) as step1:
                assert step1.manifest.biases["source"] == "deferred" and not np.asarray(step1.biases).any()
                assert step1.manifest.stage1 is None  # tuned in step 2, with the global biases
            with open_version(shard_root(root, s), versions[1], use_gpu=False) as final:
                assert final.manifest.biases["scope"] == {"n_shards": n, "n_videos": N_FIRST}
                assert final.manifest.biases["source"] != "deferred" and np.asarray(final.biases).any()


def test_invgc_shards_refuse_a_mixed_correction(env, tmp_path):
    """verify names shards whose InvGC records differ (a correction that is not one for the whole gallery)."""
    import json
    import shutil

    out = tmp_path / "INDEX"
    shutil.copytree(env["base"] / "n2", out)
    gen = current_generation(out)
    mf = shard_root(out, 1) / "versions" / gen.versions[1] / "manifest.json"
    m = json.loads(mf.read_text())
    m["invgc"]["mean_g"] += 0.01
    mf.write_text(json.dumps(m))
    reseal(mf.parent)
    problems = verify_sharded(out, rehash=False)
    assert any("InvGC corrections differ" in p for p in problems), problems
