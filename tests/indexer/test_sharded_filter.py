"""A filtered search over a sharded index answers what it answers over one index of the same videos (fields from a
CSV manifest, both plans: every shard applies the filter to its own rows before its top K)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gare.checkpoint import load_model
from gare_build.build import BuildOptions
from gare_build.shard_build import build_sharded
from gare_index.shards import open_sharded
from gare_index.store import open_index
from gare_search import by_example as E
from gare_search import search as S
from gare_search import shard_search as SH
from tests.indexer.test_sharded_search import assert_same_hits
from tests.service.support import build_index

SHARDS = (2, 3)
FILTERS = [{"channel": "news"}, {"year": {"$gte": 2018}}, {"$or": [{"channel": "sport"}, {"tags": "b"}]},
           {"channel": {"$ne": "news"}, "year": {"$lt": 2025}}]


@pytest.fixture(scope="module")
def env(service_env, tmp_path_factory):
    base = tmp_path_factory.mktemp("shfilter")
    ckpt, videos = service_env["checkpoint"], Path(service_env["videos"])
    names = sorted(p.name for p in videos.glob("*.mp4"))
    lines = ["video,channel,year,tags"] + [f"{videos / n},{['news', 'sport', 'music', 'film'][i % 4]},{2010 + i},"
                                            f"{'a|b' if i % 3 == 0 else 'a'}" for i, n in enumerate(names)]
    manifest = base / "lib.csv"
    manifest.write_text("\n".join(lines) + "\n")
    fields = {"tags": "tags"}
    single = open_index(build_index(ckpt, manifest, base / "single", index_type="flat", fields=fields))
    sharded = {}
    for n in SHARDS:
        build_sharded(str(ckpt), str(manifest), base / f"n{n}",
                      BuildOptions(workers=0, progress=False, index_type="flat", fields=fields), n_shards=n)
        sharded[n] = open_sharded(base / f"n{n}")
    model, _ = load_model(ckpt, "cpu")
    yield model, single, sharded, service_env["captions"]
    single.close()
    for sh in sharded.values():
        sh.close()


@pytest.mark.parametrize("n", SHARDS)
def test_filtered_sharded_search_equals_one_index(env, n):
    model, single, shs, captions = env
    sharded = shs[n]
    for shard in sharded.shards:  # every shard holds the same fields
        assert shard.manifest.fields == single.manifest.fields == {"channel": "string", "tags": "tags", "year": "number"}
    texts = captions[:3]
    path_of = {int(r["id"]): r["path"] for r in single.all_metadata()}
    for j, spec in enumerate(FILTERS):
        f = single.compile_filter(spec)
        mask = single.filter_mask(f)
        passes = {path_of[int(i)] for i in single.ids[mask]}
        assert 0 < len(passes) < single.n
        for below in (1.0, 0.0):
            o = S.SearchOptions(k=5, candidates=6, ncl=bool(j % 2), filter_exact_below=below, filter=f)
            want = S.search_batch(model, single, texts, o)
            got = SH.search_sharded(model, sharded, texts, o)
            for w, g in zip(want, got, strict=True):
                assert len(g.hits) == len(w.hits) == min(o.k, len(passes))
                assert_same_hits(single, sharded, w.hits, g.hits)
                assert "filter" in g.timings
                assert {r["path"] for r in sharded.metadata([h.id for h in g.hits])} <= passes


@pytest.mark.parametrize("n", SHARDS)
def test_filtered_example_and_image_queries_equal_one_index(env, n):
    model, single, shs, _ = env
    sharded = shs[n]
    gid_of = {r["path"]: g for s in range(sharded.n_shards)
              for g, r in zip(sharded.global_ids(s), sharded.shards[s].all_metadata(), strict=True)}
    rows = single.all_metadata()
    image = Image.fromarray(np.random.default_rng(n).integers(0, 255, size=(40, 56, 3), dtype=np.uint8))
    for j, spec in enumerate(FILTERS):
        f = single.compile_filter(spec)
        for below in (1.0, 0.0):
            o = S.SearchOptions(k=4, candidates=6, filter=f, filter_exact_below=below)
            ex = [rows[j], rows[j + 5]]
            want = E.search_by_videos(single, [int(r["id"]) for r in ex], o)
            got = SH.search_sharded_by_videos(sharded, [gid_of[r["path"]] for r in ex], o)
            assert len(got.hits) == len(want.hits) > 0
            assert_same_hits(single, sharded, want.hits, got.hits)
            want = E.search_by_image(model, single, image, o)
            got = SH.search_sharded_by_image(model, sharded, image, o)
            assert len(got.hits) == len(want.hits) > 0
            assert_same_hits(single, sharded, want.hits, got.hits)
