"""`gare-index compare --filter`: every side searches the passing videos only. The ranks equal a by-hand exhaustive
ranking among the passing videos (K >= n), the queries are the captions whose video passes, and the filtered
two-stage path equals the service's filtered search (gare_search.search.search_batch with the same filter)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gare_build.cli import main
from gare_build.compare import COMBOS, CompareOptions, run_compare, two_stage

PASS_IDS = [0, 2, 3, 5, 7, 8, 11]  # gallery ids are the gallery's clip order (compare's gallery manifest)
FILTER = {"id": {"$in": PASS_IDS}}


@pytest.fixture(scope="module")
def filtered(postprocess_env, tmp_path_factory):
    sh = postprocess_env
    out = tmp_path_factory.mktemp("compare_filter")
    plain = tuple(c for c in COMBOS if c.index == "plain")  # one build: the InvGC rows are not what is tested here
    r = run_compare(CompareOptions(checkpoint=str(sh["checkpoint"]), data={"kind": "synth", "root": str(sh["corpus"])},
                                   out=str(out / "result"), gallery="all", candidates=64, coverage_ks=(2, 4),
                                   latency_queries=2, latency_repeats=1, index_dir=str(out / "index"), workers=0,
                                   progress=False, combos=plain, filter=FILTER))
    return out, r


def test_filtered_compare_ranks_among_the_passing_videos(postprocess_env, filtered):
    from gare.annotations import load_dataset
    from gare.checkpoint import load_model
    from gare_index.store import open_index
    from gare_search.query import encode_queries, unit_rows
    from gare_search.rerank import exhaustive_psi

    out, r = filtered
    sh = postprocess_env
    assert r["filter"] == {"filter": FILTER, "passing": len(PASS_IDS), "n": r["n_gallery"]}
    assert any("filter" in n for n in r["notes"])
    test = load_dataset({"kind": "synth", "root": str(sh["corpus"])}, "test")
    keep = [i for i, c in enumerate(test.caption_clip) if int(c) in PASS_IDS]
    assert 0 < r["n_queries"] == len(keep) < len(test.captions)
    v = open_index(out / "index")
    model, _ = load_model(sh["checkpoint"])
    texts = [test.captions[i] for i in keep]
    gt = np.asarray([int(test.caption_clip[i]) for i in keep], dtype=np.int64)
    with torch.inference_mode():
        t = encode_queries(model, texts)
        psi = exhaustive_psi(model, v, t)  # (a, n) row order
    u = unit_rows(t)
    ids = np.asarray(v.ids)
    passing = np.isin(ids, PASS_IDS)
    for name, row in r["rows"].items():
        combo = next(c for c in COMBOS if c.name == name)
        score = psi if combo.rerank else u @ np.asarray(v.stage1_units, np.float32).T
        if combo.ncl:
            score = score + np.asarray(v.biases, np.float32)[None, :]
        ranks = []
        for q in range(len(texts)):  # the ground truth's place among the passing videos (score desc, id asc)
            rows = np.flatnonzero(passing)
            order = ids[rows][np.lexsort((ids[rows], -score[q, rows]))]
            ranks.append(int(np.flatnonzero(order == gt[q])[0]) + 1)
        ranks = np.asarray(ranks)
        m = row["t2v"]
        assert m["R1"] == pytest.approx(100 * float(np.mean(ranks <= 1))), name
        assert m["MdR"] == pytest.approx(float(np.median(ranks))) and m["MdR"] <= len(PASS_IDS), name
        assert m == pytest.approx(row["exhaustive_t2v"]), name  # every passing video is a candidate
        # fewer passing videos than the reference's top 10: the coverage counts passing ones only (all candidates)
        assert row["coverage_psi_top10"][64] == 1.0 and row["coverage_psi_b_top10"][64] == 1.0, name


def test_filtered_two_stage_is_the_service_filtered_search(postprocess_env, filtered):
    from gare.checkpoint import load_model
    from gare_index.store import open_index
    from gare_search import search as S

    out, _ = filtered
    v = open_index(out / "index")
    model, _ = load_model(postprocess_env["checkpoint"])
    texts = ["a red circle moves left", "two blue squares appear", "a green triangle"]
    t = S.encode_queries(model, texts)
    u = S.unit_rows(t)
    f = v.compile_filter({"id": {"$in": PASS_IDS[:5]}})
    for below in (0.0, 1.0):  # the ANN plan and the exact plan
        for combo in (c for c in COMBOS if c.index == "plain" and c.stage1 == "ann"):
            opts = S.SearchOptions(k=4, candidates=4, rerank=combo.rerank, ncl=combo.ncl, filter=f,
                                   filter_exact_below=below)
            want = S.search_batch(model, v, texts, opts)
            got = two_stage(model, v, t, u, combo, 4, k=4, flt=f, exact_below=below)
            for w, g in zip(want, got, strict=True):
                assert [h.id for h in g] == [h.id for h in w.hits] and {h.id for h in g} <= set(PASS_IDS[:5])
                assert [h.score for h in w.hits] == pytest.approx([h.score for h in g], abs=1e-6)


def test_cli_filter_must_be_a_json_object(capsys):
    for bad, word in (("{year", "not valid JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(SystemExit):
            main(["compare", "--checkpoint", "x.pt", "--synth", "d", "--out", "o", "--filter", bad])
        assert word in capsys.readouterr().err
    assert json.dumps(FILTER)  # the form the option takes
