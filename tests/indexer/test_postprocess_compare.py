"""`gare-index compare` on a tiny synthetic corpus: every row, the table / JSON / plot, and the search path it uses
(gare_search.search's stage functions: equal to gare_search.search.search_batch for the plain stage 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gare_build.cli import main
from gare_build.compare import BANK_COMBOS, COMBOS, Combo, final_ranks, two_stage
from tests.indexer.postprocess_support import D, unit


@pytest.fixture(scope="module")
def compared(postprocess_env, tmp_path_factory):
    sh = postprocess_env
    out = tmp_path_factory.mktemp("compare")
    np.save(out / "bank.npy", unit(np.random.default_rng(0).standard_normal((40, D))))
    rc = main(["compare", "--checkpoint", str(sh["checkpoint"]), "--synth", str(sh["corpus"]), "--gallery", "all",
               "--out", str(out / "result"), "--index-dir", str(out / "index"), "--candidates", "64",
               "--coverage-ks", "2,4,8", "--latency-queries", "2", "--invgc-grid", "0,0.2", "--workers", "0",
               "--no-progress", "--bank", str(out / "bank.npy"), "--bank-weight", "0.5"])
    assert rc == 0
    return out, json.loads((out / "result" / "result.json").read_text())


def test_compare_writes_every_row(compared):
    out, r = compared
    res = out / "result"
    assert (res / "result.md").is_file() and (res / "compare.png").stat().st_size > 1000
    assert list(r["rows"]) == [c.name for c in (*COMBOS, *BANK_COMBOS)]
    assert r["n_gallery"] == 14 and r["data"]["gallery"] == "all" and r["k_ge_gallery"]
    assert r["n_queries"] == r["data"]["n_test_captions"] > 0 and r["coverage_ks"] == [2, 4, 8, 64]
    md = (res / "result.md").read_text()
    for c in (*COMBOS, *BANK_COMBOS):
        assert f"| {c.name} |" in md
    for col in ("R@1", "MdR", "MnR", "norm err", "cov@64", "search ms/query"):
        assert col in md
    assert "every video is a candidate" in md  # K >= n is said
    sel = r["invgc"]["selection"]
    assert sel["method"] == "grid" and len(sel["tried"]) == 4 and r["ncl_stage1"]["c"] == 1.0
    for name, row in r["rows"].items():
        m = row["t2v"]
        assert 0 <= m["R1"] <= m["R5"] <= m["R10"] <= 100 and 1 <= m["MdR"] <= 14, name
        assert row["latency"]["n"] == 2 and row["latency"]["search_ms_mean"] > 0
        assert all(0 <= v <= 1 for v in row["coverage_psi_top10"].values())
        assert row["coverage_psi_top10"]["64"] == 1.0  # K >= n: everything is a candidate
        assert np.isfinite(row["norm_err_t2v"])
        # with every video a candidate, the two-stage ranks are the exhaustive ranks of the row's score
        assert m == pytest.approx(row["exhaustive_t2v"]), name
    rows = r["rows"]
    assert rows["+ psi"]["t2v"] == rows["+ InvGC + psi"]["t2v"]  # InvGC only moves stage 1
    assert rows["+ psi + NCL stage 2"]["t2v"] == rows["+ psi + NCL stage 1+2"]["t2v"]
    bank = r["ncl"]["bank"]["biases"]
    assert bank["source"] == "checkpoint-queue+traffic" and bank["traffic"]["traffic_queries"] == 40
    assert r["ncl"]["bias_source"] == "checkpoint-queue" and "Bank rows" in md
    # the index was kept (--index-dir) and holds the InvGC version last
    from gare_index.store import open_index

    v = open_index(out / "index")
    assert v.manifest["invgc"]["r_g"] == r["invgc"]["r_g"] and v.ann_ncl is not None


def test_two_stage_is_service_search(postprocess_env, compared):
    from gare.checkpoint import load_model
    from gare_search import search as S

    out, _ = compared
    from gare_index.store import open_index

    v = open_index(out / "index")
    sh = postprocess_env
    model, _ = load_model(sh["checkpoint"])
    texts = ["a red circle moves left", "two blue squares appear", "a green triangle"]
    t = S.encode_queries(model, texts)
    u = S.unit_rows(t)
    for rerank in (False, True):
        for ncl in (False, True):
            opts = S.SearchOptions(k=5, candidates=6, rerank=rerank, ncl=ncl)
            want = S.search_batch(model, v, texts, opts)
            got = two_stage(model, v, t, u, Combo("x", "invgc", "ann", rerank, ncl), 6, k=5)
            for w, g in zip(want, got, strict=True):
                assert [h.id for h in w.hits] == [h.id for h in g]
                assert [h.score for h in w.hits] == pytest.approx([h.score for h in g], abs=1e-6)
    # ranks past the shortlist continue in stage-1 order
    hits = two_stage(model, v, t, u, Combo("x", "plain", "ncl", True, True), 3)
    cand = {h.id for h in hits[0]}
    s1 = u[0] @ np.asarray(v.stage1_units).T + v.biases
    outside = [int(i) for i in v.ids[np.lexsort((v.ids, -s1))] if int(i) not in cand]
    gt = np.array([outside[1], next(iter(cand)), outside[0]], dtype=np.int64)
    ranks = final_ranks(hits[:1] * 3, v, np.repeat(u[:1], 3, 0), "ncl", gt)
    assert ranks[0] == 3 + 2 and ranks[2] == 3 + 1 and 1 <= ranks[1] <= 3
