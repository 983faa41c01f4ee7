"""gare_search.shard_search: a sharded index answers exactly what one index over the same videos answers (text, example
and image queries, 1-4 shards, exact flat stage 1), and a shard that does not answer makes a flagged partial
result naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gare.checkpoint import load_model
from gare_build.build import BuildOptions
from gare_build.shard_build import build_sharded
from gare_index.shards import open_sharded, split_id
from gare_index.store import open_index
from gare_search import by_example as E
from gare_search import query as Q
from gare_search import search as S
from gare_search import shard_search as SH
from tests.service.support import build_index

SHARD_COUNTS = (1, 2, 3, 4)
TOL = 1e-5


def flat(**kw) -> BuildOptions:
    """Exact stage 1 (flat), with the NCL fold (--ncl-stage1) so that ncl_stage1 queries compare too."""
    return BuildOptions(workers=0, progress=False, index_type="flat", ncl_stage1=True, **kw)


@pytest.fixture(scope="module")
def env(service_env, tmp_path_factory):
    """(model, the single flat index, {n: opened sharded index}, captions) over the service corpus's 16 videos;
    the sharded ones built by `gare-index build --shards n` (gare_build.shard_build: NCL biases fitted globally)."""
    base = tmp_path_factory.mktemp("sharded")
    ckpt, videos = service_env["checkpoint"], service_env["videos"]
    single = open_index(build_index(ckpt, videos, base / "single", index_type="flat", ncl_stage1=True))
    sharded = {}
    for n in SHARD_COUNTS:
        build_sharded(str(ckpt), str(videos), base / f"n{n}", flat(), n_shards=n)
        sharded[n] = open_sharded(base / f"n{n}")
    model, _ = load_model(ckpt, "cpu")
    yield model, single, sharded, service_env["captions"]
    single.close()
    for sh in sharded.values():
        sh.close()


def names_single(version, ids) -> list[str]:
    """The file names of a single index's ids (the videos both indexes share; their ids differ)."""
    return [Path(r["path"]).name for r in version.metadata(ids)]


def names_sharded(sharded, gids) -> list[str]:
    rows = sharded.metadata(gids)
    assert [r["id"] for r in rows] == [int(g) for g in gids]  # every global id is a video of the sharded index
    return [Path(r["path"]).name for r in rows]


def assert_same_hits(single, sharded, want: list[S.Hit], got: list[S.Hit]) -> None:
    """Same videos in the same order, same scores and NCL biases (float tolerance)."""
    assert names_sharded(sharded, [h.id for h in got]) == names_single(single, [h.id for h in want])
    for a, b in zip(want, got, strict=True):
        assert b.score == pytest.approx(a.score, abs=TOL)
        assert b.ann_score == pytest.approx(a.ann_score, abs=TOL)
        assert (a.psi_score is None) == (b.psi_score is None)
        if a.psi_score is not None:
            assert b.psi_score == pytest.approx(a.psi_score, abs=TOL)
        assert b.bias == pytest.approx(a.bias, abs=TOL)


TEXT_OPTIONS = [
    S.SearchOptions(k=5, candidates=6, ncl=False),  # K < n: the global top K must come from the union
    S.SearchOptions(k=5, candidates=6, ncl=True),  # + the global NCL biases
    S.SearchOptions(k=5, candidates=6, ncl=True, ncl_stage1=True),  # candidates chosen by cos + b
    S.SearchOptions(k=16, candidates=16, ncl=True),  # every video
    S.SearchOptions(k=4, candidates=7, rerank=False, ncl=False),  # stage-1 order only
    S.SearchOptions(k=4, candidates=7, rerank=False, ncl=True),
]


@pytest.mark.parametrize("n", SHARD_COUNTS)
def test_text_queries_equal_one_index(env, n):
    model, single, shs, captions = env
    sharded = shs[n]
    texts = captions[:6]
    for opts in TEXT_OPTIONS:
        want = S.search_batch(model, single, texts, opts)
        got = SH.search_sharded(model, sharded, texts, opts)
        for w, g in zip(want, got, strict=True):
            assert not g.partial and g.missing_shards == []
            assert len(g.hits) == len(w.hits) == min(opts.k, opts.candidates)
            assert_same_hits(single, sharded, w.hits, g.hits)


@pytest.mark.parametrize("n", SHARD_COUNTS)
def test_example_queries_equal_one_index(env, n):
    model, single, shs, _ = env
    sharded = shs[n]
    to_gid = {name: g for g, name in gid_names(sharded).items()}
    id_of = {Path(r["path"]).name: int(r["id"]) for r in single.all_metadata()}
    examples = [["video3.mp4"], ["video1.mp4", "video7.mp4", "video1.mp4"],
                ["video2.mp4", "video5.mp4", "video11.mp4", "video14.mp4"]]
    examples = [[name for name in ex if name in id_of] for ex in examples]
    assert all(examples), sorted(id_of)
    for ex in examples:
        for opts in (S.SearchOptions(k=5, candidates=6), S.SearchOptions(k=6, candidates=8, rerank=False),
                     S.SearchOptions(k=16, candidates=16), S.SearchOptions(k=5, candidates=6, ncl=True)):
            want = E.search_by_videos(single, [id_of[x] for x in ex], opts)
            got = SH.search_sharded_by_videos(sharded, [to_gid[x] for x in ex], opts)
            assert not got.partial
            assert len(got.hits) == len(want.hits) == min(opts.k, 16 - len(set(ex)))
            assert_same_hits(single, sharded, want.hits, got.hits)
            assert not set(names_sharded(sharded, [h.id for h in got.hits])) & set(ex)  # the examples never come back


def gid_names(sharded) -> dict[int, str]:
    return {g: Path(r["path"]).name for s in range(sharded.n_shards)
            for g, r in zip(sharded.global_ids(s), sharded.shards[s].all_metadata(), strict=True)}


@pytest.mark.parametrize("n", SHARD_COUNTS)
def test_image_queries_equal_one_index(env, n):
    model, single, shs, _ = env
    rng = np.random.default_rng(n)
    for seed in range(2):
        arr = rng.integers(0, 255, size=(40 + 8 * seed, 56, 3), dtype=np.uint8)
        image = Image.fromarray(arr)
        for opts in (S.SearchOptions(k=5, candidates=6), S.SearchOptions(k=16, candidates=16),
                     S.SearchOptions(k=5, candidates=6, ncl=True)):
            want = E.search_by_image(model, single, image, opts)
            got = SH.search_sharded_by_image(model, shs[n], image, opts)
            assert not got.partial and len(got.hits) == len(want.hits) == opts.k
            assert_same_hits(single, shs[n], want.hits, got.hits)


def test_global_ids_name_the_shard_that_holds_the_video(env):
    _, single, shs, _ = env
    for n, sharded in shs.items():
        names = gid_names(sharded)
        assert sorted(names.values()) == sorted(Path(r["path"]).name for r in single.all_metadata())
        for g in names:
            s, local = split_id(g, n)
            assert local in set(np.asarray(sharded.shards[s].ids).tolist())


def test_unknown_example_names_the_global_id(env):
    _, _, shs, _ = env
    sharded = shs[3]
    top = max(gid_names(sharded))
    with pytest.raises(E.UnknownExample, match=str(top + 3)):
        SH.search_sharded_by_videos(sharded, [top + 3], S.SearchOptions(k=3, candidates=4))
    with pytest.raises(E.UnknownExample, match=r"\[-1\]"):
        SH.search_sharded_by_videos(sharded, [-1], S.SearchOptions(k=3, candidates=4))


# ------------------------------------------------------------------------------------------ partial answers
@pytest.mark.parametrize("gone", [[1], [0, 2]])
def test_missing_shard_gives_a_flagged_partial_answer(env, gone):
    """A None part (a shard that did not answer): partial=True naming it; the hits are the merge of the shards
    that answered, i.e. the full answer without the missing shards' videos (never silently dropped)."""
    model, single, shs, captions = env
    sharded = shs[3]
    texts = captions[:3]
    opts = S.SearchOptions(k=16, candidates=16, ncl=False)
    t = Q.encode_queries(model, texts)
    parts = [SH.shard_candidates(model, v, t, opts) for v in sharded.shards]
    full = SH.merge(parts, 3, opts)
    part = SH.merge([None if s in gone else p for s, p in enumerate(parts)], 3, opts)
    for f, p in zip(full, part, strict=True):
        assert not f.partial and f.missing_shards == []
        assert p.partial and p.missing_shards == gone
        kept = [h for h in f.hits if split_id(h.id, 3)[0] not in gone]
        assert [h.id for h in p.hits] == [h.id for h in kept] and kept
        assert [h.score for h in p.hits] == [h.score for h in kept]


def test_no_shard_answering_is_partial_and_empty():
    opts = S.SearchOptions(k=3, candidates=4)
    res = SH.merge([None, None], 2, opts, n_queries=2)
    assert [(r.hits, r.partial, r.missing_shards) for r in res] == [([], True, [0, 1])] * 2
    with pytest.raises(ValueError, match="n_queries"):
        SH.merge([None, None], 2, opts)


def test_merge_refuses_bad_parts():
    opts = S.SearchOptions(k=2, candidates=2)
    c = SH.ShardCandidates(ids=np.array([0], np.int64), ann=np.array([0.5], np.float32), psi=None,
                           bias=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="3 shard parts for n_shards=2"):
        SH.merge([[c], [c], [c]], 2, opts)
    with pytest.raises(ValueError, match="shard 1 answered 2 queries, expected 1"):
        SH.merge([[c], [c, c]], 2, opts)
    with pytest.raises(ValueError, match="kind"):
        SH.merge([[c], [c]], 2, opts, kind="video")


def test_merge_keeps_the_global_top_k_by_stage1_then_ranks():
    """A hand-made case: the union's top K by (stage-1 desc, global id asc), then rank by psi (+ biases)."""
    o = S.SearchOptions(k=2, candidates=3, ncl=True)

    def cand(ids, ann, psi, bias):
        return SH.ShardCandidates(ids=np.array(ids, np.int64), ann=np.array(ann, np.float32),
                                  psi=np.array(psi, np.float32), bias=np.array(bias, np.float32))

    # global ids (N=2): shard 0 local 0,1 -> 0,2; shard 1 local 0,1 -> 1,3
    p0 = [cand([0, 1], [0.9, 0.5], [0.1, 0.9], [0.0, 0.0])]
    p1 = [cand([0, 1], [0.7, 0.5], [0.3, 0.2], [0.25, 0.0])]
    # stage-1 top 3 of {0: .9, 2: .5, 1: .7, 3: .5} = 0, 1, 2 (tie .5: gid 2 before 3); final = psi + b
    hits = SH.merge([p0, p1], 2, o)[0].hits
    assert [h.id for h in hits] == [2, 1]
    assert hits[1].score == pytest.approx(0.55) and hits[1].bias == pytest.approx(0.25)
    # with ncl_stage1 the shards chose by cos + b, and so does the merge: 0 (.9), 1 (.95), then 2 (.5)
    o1 = S.SearchOptions(k=2, candidates=2, ncl=True, ncl_stage1=True)
    assert [h.id for h in SH.merge([p0, p1], 2, o1)[0].hits] == [1, 0]
