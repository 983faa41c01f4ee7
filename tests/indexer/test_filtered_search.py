"""Search under a filter (gare_search.filtered): the results equal an exhaustive filtered search (the exact stage-1
score of every passing row, its top K, psi, biases, top k) at several selectivities, on both plans; the ANN plan with
the filter inside the ANN returns only passing rows, as many as pass, on every index type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare.checkpoint import file_sha256, load_model
from gare_index.ann_params import INDEX_TYPES
from gare_index.store import open_index, write_version
from gare_search import filtered as F
from gare_search import search as S
from gare_search.query import encode_queries, unit_rows

N = 600
CHANNELS = ["news", "sport", "music", "film", "misc"]
TEXTS = ["a red ball", "people dancing on a stage", "a cat"]


def _gallery(root, ckpt, index_type: str, *, ids_are_rows: bool = False):
    """A synthetic version of N videos for the tiny model (f=6, d=64) with fields: channel (skewed), year, tags;
    ids 5, 7, 9, ... (a version after removals: the ANN's id bitmap is built from the ids) or 0..N-1."""
    model, _ = load_model(ckpt, "cpu")
    f, d = model.cfg.max_frames, model.cfg.embed_dim
    rng = np.random.default_rng(3)
    masks = np.zeros((N, f), np.uint8)
    used = rng.integers(2, f + 1, N)
    for i, u in enumerate(used):
        masks[i, :u] = 1
    frames = (rng.standard_normal((N, f, d)) * masks[:, :, None]).astype(np.float16)
    vbar = frames.astype(np.float32).sum(1) / used[:, None]
    norms = np.linalg.norm(vbar, axis=1).astype(np.float32)
    ids = np.arange(N, dtype=np.int64) if ids_are_rows else np.arange(N, dtype=np.int64) * 2 + 5
    arrays = {"ids": ids, "norms": norms, "units": (vbar / norms[:, None]).astype(np.float32), "frames": frames,
              "masks": masks, "biases": (rng.standard_normal(N) * 0.05).astype(np.float32)}
    chan = rng.choice(CHANNELS, N, p=[0.02, 0.08, 0.3, 0.5, 0.1])
    rows = [{"id": int(i), "path": f"/lib/{c}/{i}.mp4", "size": 1, "mtime": 1.0e9 + int(i), "checksum": f"c{i}",
             "duration": float(1 + i % 30), "fps": 8.0, "frames_used": int(u), "start": None, "end": None,
             "channel": str(c), "year": float(2000 + i % 25), "tags": '["a", "b"]' if i % 3 == 0 else '["b"]'}
            for i, u, c in zip(ids, used, chan, strict=True)]
    extra = {"checkpoint": {"path": str(ckpt), "sha256": file_sha256(ckpt), "model_config": model.cfg.to_dict()},
             "index_type": index_type, "ann_params": {"index_type": index_type, "nlist": 16, "nprobe": 1, "ef_search": 16},
             "biases": {"gamma": 0.01, "n_iters": 4, "n_queries": 0, "source": "none"},
             "fields": {"channel": "string", "tags": "tags", "year": "number"}}
    write_version(root, arrays, rows, extra)
    return model, open_index(root)


# filters from ~2% of the gallery to ~90%
FILTERS = [{"channel": "news"}, {"channel": {"$in": ["news", "sport"]}}, {"channel": "music", "year": {"$gte": 2010}},
           {"$or": [{"channel": "film"}, {"tags": "a"}]}, {"channel": {"$ne": "news"}, "duration": {"$gt": 2}}]


def exhaustive(model, version, text: str, spec, opts: S.SearchOptions) -> list[tuple[int, float]]:
    """The reference: every passing row's exact stage-1 cosine, the top K by (cosine desc, id asc), psi
    (model.score) on those, + biases when ncl, top k by (score desc, id asc)."""
    f = version.compile_filter(spec)
    rows = np.flatnonzero(version.filter_mask(f))
    t = encode_queries(model, [text])
    u = unit_rows(t)[0]
    cos = np.asarray(version.stage1_units[rows], np.float32) @ u
    ids = version.ids[rows]
    top = np.lexsort((ids, -cos))[: opts.candidates]
    r = rows[top]
    with torch.inference_mode():
        psi = model.score(t, torch.from_numpy(np.asarray(version.frames[r])), torch.from_numpy(np.asarray(version.masks[r])),
                          vbar=torch.from_numpy(version.vbar(r)))[0].numpy()
    final = psi + (np.asarray(version.biases)[r] if opts.ncl else 0)
    order = np.lexsort((ids[top], -final))[: opts.k]
    return [(int(ids[top][j]), float(final[j])) for j in order]


@pytest.fixture(scope="module", params=[False, True], ids=["ids-not-rows", "ids-are-rows"])
def flat_env(tmp_path_factory, ckpt, request):
    model, v = _gallery(tmp_path_factory.mktemp("flt") / "INDEX", ckpt, "flat", ids_are_rows=request.param)
    assert v._ids_are_rows is request.param  # the bitmap's fast path (the mask is the bitmap) and the general one
    yield model, v
    v.close()


@pytest.mark.parametrize("below", [1.0, 0.0])  # 1.0: always the exact plan; 0.0: the ANN plan unless passing <= K
def test_filtered_search_equals_exhaustive(flat_env, below):
    model, v = flat_env
    plans = set()
    for spec in FILTERS:
        passing = int(v.filter_mask(v.compile_filter(spec)).sum())
        assert 0 < passing < N
        for opts in (S.SearchOptions(k=10, candidates=20), S.SearchOptions(k=5, candidates=40, ncl=True)):
            o = S.SearchOptions(k=opts.k, candidates=opts.candidates, ncl=opts.ncl, filter=v.compile_filter(spec),
                                filter_exact_below=below)
            res = S.search_batch(model, v, TEXTS, o)
            for text, r in zip(TEXTS, res, strict=True):
                want = exhaustive(model, v, text, spec, o)
                assert [h.id for h in r.hits] == [w[0] for w in want], (spec, text)
                np.testing.assert_allclose([h.score for h in r.hits], [w[1] for w in want], atol=1e-4)
                assert len(r.hits) == min(o.k, passing)
                assert r.plan.passing == passing and r.timings["filter"] >= 0
                plans.add(r.plan.plan)
                assert r.plan.plan == ("exact" if below == 1.0 or passing <= o.candidates else "ann")
    assert plans == ({"exact"} if below == 1.0 else {"exact", "ann"})


def test_no_row_passes_and_no_filter(flat_env):
    model, v = flat_env
    r = S.search(model, v, "x", S.SearchOptions(filter=v.compile_filter({"channel": "nope"})))
    assert r.hits == [] and r.plan.plan == "empty"
    # a filter every row passes answers what no filter answers
    a = S.search(model, v, "a cat", S.SearchOptions(k=10, candidates=30))
    b = S.search(model, v, "a cat", S.SearchOptions(k=10, candidates=30, filter=v.compile_filter({"year": {"$gte": 0}}),
                                                    filter_exact_below=0.0))
    assert [h.id for h in a.hits] == [h.id for h in b.hits] and b.plan.plan == "ann" and a.plan is None


@pytest.mark.parametrize("index_type", [t for t in INDEX_TYPES if t != "flat"])
def test_ann_plan_returns_only_passing_rows_on_every_index_type(tmp_path, ckpt, index_type):
    model, v = _gallery(tmp_path / "INDEX", ckpt, index_type)
    rounds = []
    try:
        for spec in FILTERS[1:]:
            f = v.compile_filter(spec)
            mask = v.filter_mask(f)
            ok_ids = set(v.ids[mask].tolist())
            o = S.SearchOptions(k=10, candidates=30, filter=f, filter_exact_below=0.0)
            for r in S.search_batch(model, v, TEXTS, o):
                assert {h.id for h in r.hits} <= ok_ids
                assert len(r.hits) == min(10, len(ok_ids))
                assert r.plan.plan in ("ann", "ann+exact")
                rounds.append(r.plan.widen)
    finally:
        v.close()
    if index_type != "hnsw":  # one cell of 16 holds too few rows of a selective filter: the search was widened
        assert max(rounds) > 1


def test_the_first_ivf_breadth_by_hand():
    # 1M rows, nprobe / nlist = 1/32 (31,250 rows a search), K = 256: a breadth whose cells hold ~4 x 256 passing
    assert F.first_widen(1 / 32, 10_000, 256) == 4  # 10,000 / 32 = 312.5 passing a breadth; 1,024 / 312.5 -> 4
    assert F.first_widen(1 / 32, 30_000, 256) == 2  # 937.5 a breadth: ceil(1.09)
    assert F.first_widen(1 / 32, 1_000, 256) == 32  # 31.25 a breadth: 33, at most every cell (32 breadths)
    assert F.first_widen(1 / 32, 500_000, 256) == 1
    assert F.first_widen(1 / 32, 1_000, 10) == 2  # fewer candidates wanted: 40 / 31.25
    assert F.first_widen(None, 1_000, 256) == 1 and F.first_widen(1.0, 1_000, 256) == 1  # HNSW, flat


@pytest.mark.parametrize("index_type", ["ivf", "hnsw"])
def test_the_default_plan_and_the_first_breadth_on_a_version(tmp_path, ckpt, index_type):
    model, v = _gallery(tmp_path / "INDEX", ckpt, index_type)
    try:
        share = v.scan_fraction()
        assert share == (1 / 16 if index_type == "ivf" else None)  # nprobe 1 of 16 cells; HNSW: no fixed share
        seen = set()
        # 12 rows pass the first: more than K = 8, at most the default 2% of 600 (exact); the others more
        for spec in [{"year": 2000, "channel": {"$ne": "film"}}, *FILTERS]:
            f = v.compile_filter(spec)
            passing = int(v.filter_mask(f).sum())
            o = S.SearchOptions(k=5, candidates=8, filter=f)  # the default filter_exact_below, 2%
            w0 = F.first_widen(share, passing, min(8, passing))
            want = "exact" if passing <= 8 or passing <= 0.02 * N else "ann"
            for r in S.search_batch(model, v, TEXTS, o):
                assert r.plan.plan in ((want,) if want == "exact" else ("ann", "ann+exact")), (spec, r.plan)
                if r.plan.plan == "ann" and r.plan.rounds == 1:
                    assert r.plan.widen == w0  # the first round at the estimated breadth, not at 1
                assert {h.id for h in r.hits} <= set(v.ids[v.filter_mask(f)].tolist())
                assert len(r.hits) == min(5, passing)
                seen.add((r.plan.plan, r.plan.passing > 8))
        assert ("exact", True) in seen and ("ann", True) in seen, seen
    finally:
        v.close()
