"""gare_search: the two-stage search as pure functions, against model.score, exhaustive psi and the fused reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare import psi_fold as pf
from gare_index import psi_consts
from gare_search import query as Q
from gare_search import rerank as R
from gare_search import search as S
from tests.psi_reference import REFERENCES, fused_pair_scores
from tests.psi_weights import randomize_psi
from tests.service.support import build_index


def _psi_model_score(model, version, text):
    """Reference: model.score over the whole gallery, + biases."""
    t = Q.encode_queries(model, [text])
    rows = np.arange(version.n)
    with torch.inference_mode():
        s = model.score(
            t, torch.from_numpy(np.asarray(version.frames[rows])), torch.from_numpy(np.asarray(version.masks[rows])),
            vbar=torch.from_numpy(version.vbar(rows)),
        )[0].numpy()
    return s, np.asarray(version.ids)


@pytest.mark.parametrize("heads", [1, 4])
def test_fused_equals_model_score(tiny_cfg, heads):
    from gare.model import GARE

    torch.manual_seed(1)
    model = GARE.build(tiny_cfg.replace(psi_heads=heads)).eval()
    randomize_psi(model.psi)
    d, f = tiny_cfg.embed_dim, tiny_cfg.max_frames
    a, b = 3, 11
    t = torch.randn(a, d)
    mask = torch.ones(b, f, dtype=torch.uint8)
    mask[::3, 2:] = 0
    frames = torch.randn(b, f, d) * mask[..., None]
    vbar = frames.sum(1) / mask.sum(1, keepdim=True)
    with torch.inference_mode():
        ref = model.score(t, frames.half(), mask, vbar=vbar)
        got = fused_pair_scores(
            model, t.repeat_interleave(b, 0), frames.half().float().repeat(a, 1, 1), mask.repeat(a, 1), vbar.repeat(a, 1)
        ).view(a, b)
    assert ref.std() > 0.01  # psi is not trivial
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_two_stage_with_full_shortlist_equals_exhaustive(model_and_index):
    model, version, sh = model_and_index
    for text in sh["captions"][:4]:
        s, ids = _psi_model_score(model, version, text)
        final = s + np.asarray(version.biases)
        want = ids[np.lexsort((ids, -final))][:5]
        res = S.search(model, version, text, S.SearchOptions(k=5, candidates=version.n, ncl=True))
        assert [h.id for h in res.hits] == want.tolist()
        got = {h.id: h for h in res.hits}
        for j, i in enumerate(ids):
            if i in got:
                assert got[i].psi_score == pytest.approx(float(s[j]), abs=1e-5)
                assert got[i].score == pytest.approx(float(final[j]), abs=1e-5)
        assert set(res.timings) >= {"encode", "ann", "rerank", "total"}


def test_modes(model_and_index):
    model, version, sh = model_and_index
    text = sh["captions"][0]
    t = Q.encode_queries(model, [text])
    unit = Q.unit_rows(t)[0]
    cos = np.asarray(version.units) @ unit
    biases = np.asarray(version.biases)
    ids = np.asarray(version.ids)

    ann_only = S.search(model, version, text, S.SearchOptions(k=6, candidates=16, rerank=False, ncl=False))
    assert [h.id for h in ann_only.hits] == ids[np.lexsort((ids, -cos))][:6].tolist()
    assert all(h.psi_score is None for h in ann_only.hits)
    for h in ann_only.hits:
        assert h.score == pytest.approx(h.ann_score, abs=1e-6)

    ann_ncl = S.search(model, version, text, S.SearchOptions(k=6, candidates=16, rerank=False, ncl=True))
    assert [h.id for h in ann_ncl.hits] == ids[np.lexsort((ids, -(cos + biases)))][:6].tolist()
    for h in ann_ncl.hits:
        assert h.score == pytest.approx(h.ann_score + h.bias, abs=1e-6)

    psi_only = S.search(model, version, text, S.SearchOptions(k=6, candidates=16, rerank=True, ncl=False))
    for h in psi_only.hits:
        assert h.score == pytest.approx(h.psi_score, abs=1e-7)
    assert psi_only.timings["rerank"] > 0
    # the rerank changes the order (psi has real weights)
    assert [h.id for h in psi_only.hits] != [h.id for h in ann_only.hits]


def test_rerank_off_runs_no_psi_pass(model_and_index, monkeypatch):
    """rerank=False must not score anything with psi (its cost is the point of turning it off): a psi pass that
    fails loudly shows whether one ran, without a clock."""
    model, version, sh = model_and_index
    texts = sh["captions"][:3]

    def psi_pass(*a, **k):
        raise AssertionError("psi pass ran")

    monkeypatch.setattr(R, "psi_scores", psi_pass)
    off = S.SearchOptions(k=4, candidates=8, rerank=False)
    assert all(h.psi_score is None for h in S.search(model, version, texts[0], off).hits)
    assert len(S.search_batch(model, version, texts, [off] * 3)) == 3
    with pytest.raises(AssertionError, match="psi pass ran"):  # the guard is live: one reranked query runs it
        S.search_batch(model, version, texts, [off, S.SearchOptions(k=4, candidates=8), off])


def test_shortlist_limits_the_candidates(model_and_index):
    model, version, sh = model_and_index
    text = sh["captions"][1]
    res = S.search(model, version, text, S.SearchOptions(k=3, candidates=4))
    ann = S.search(model, version, text, S.SearchOptions(k=4, candidates=4, rerank=False, ncl=False))
    assert {h.id for h in res.hits} <= {h.id for h in ann.hits}
    big = S.search(model, version, text, S.SearchOptions(k=50, candidates=100))  # more than the gallery
    assert len(big.hits) == version.n and len({h.id for h in big.hits}) == version.n


def test_fold_equals_the_references_and_batch_equals_single(model_and_index):
    model, version, sh = model_and_index
    texts = sh["captions"][:5]
    opts = [S.SearchOptions(k=4, candidates=8), S.SearchOptions(k=3, candidates=16, ncl=False),
            S.SearchOptions(k=5, candidates=8, rerank=False), S.SearchOptions(k=2, candidates=2),
            S.SearchOptions(k=4, candidates=8)]
    assert R.fold_usable(model, version)  # the built index stores valid psi constants: the fold reads them
    folded = S.search_batch(model, version, texts, opts)
    singles = [S.search(model, version, t, o) for t, o in zip(texts, opts, strict=True)]
    t = Q.encode_queries(model, texts)
    for i, (a, c) in enumerate(zip(folded, singles, strict=True)):
        assert [h.id for h in a.hits] == [h.id for h in c.hits]
        np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in c.hits], atol=1e-5)
        if not opts[i].rerank:
            continue
        ids = np.asarray([h.id for h in a.hits])
        for name, ref in REFERENCES.items():  # the same hits scored by the fused and the model paths
            want = ref(model, version, t[i : i + 1], [ids])[0]
            np.testing.assert_allclose([h.psi_score for h in a.hits], want, atol=1e-5, err_msg=name)


def test_stored_kv_index(model_and_index, tmp_path):
    """An index built with --store-kv: the model reference uses the stored K/V and still agrees with the fold."""
    from gare_index.store import open_index

    model, version, sh = model_and_index
    idx = build_index(sh["checkpoint"], sh["videos"], tmp_path / "kv", store_kv=True)
    with open_index(idx) as v2:
        assert v2.kv is not None
        for text in sh["captions"][:3]:
            b = S.search(model, version, text, S.SearchOptions(k=5, candidates=10))
            ids = np.asarray([h.id for h in b.hits])
            a = REFERENCES["model"](model, v2, Q.encode_queries(model, [text]), [ids])[0]
            np.testing.assert_allclose(a, [h.psi_score for h in b.hits], atol=1e-3)  # K/V kept in fp16


def test_exhaustive_psi_matches_model(model_and_index):
    model, version, sh = model_and_index
    text = sh["captions"][2]
    s, _ = _psi_model_score(model, version, text)
    ex = R.exhaustive_psi(model, version, Q.encode_queries(model, [text]), block=5)
    np.testing.assert_allclose(ex[0], s, atol=1e-5)


def test_options_validation_and_precision():
    with pytest.raises(ValueError, match="k must be"):
        S.SearchOptions(k=0)
    with pytest.raises(ValueError, match="candidates"):
        S.SearchOptions(k=10, candidates=5)
    assert Q.resolve_precision("auto", "cpu") == "fp32"
    assert Q.resolve_precision("auto", "cuda") == Q.AUTO_PRECISION["cuda"]
    with pytest.raises(ValueError, match="fp16"):
        Q.resolve_precision("fp16", "cpu")


def test_empty_batch(model_and_index):
    model, version, _ = model_and_index
    assert S.search_batch(model, version, []) == []


def test_trimmed_tokens_give_the_same_embedding(model_and_index):
    model, _, sh = model_and_index
    texts = [sh["captions"][0], "a dog", "x"]
    tokens = model.tokenize(texts)
    short = Q.trim_tokens(model.tokenize(["a dog", "x"]))
    assert short.shape[1] == 4  # SOT a dog EOT
    assert Q.trim_tokens(tokens).shape[1] <= tokens.shape[1]
    with torch.inference_mode():
        full = model.encode_text(tokens)
    torch.testing.assert_close(Q.encode_queries(model, texts), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(Q.encode_queries(model, texts, trim=False), full)


def test_folded_weights_follow_parameter_changes(tiny_model):
    """The one cache of folded psi weights (gare_index.psi_consts.fold_of) refolds when psi's parameters change."""
    d, f = tiny_model.cfg.embed_dim, tiny_model.cfg.max_frames
    t, frames = torch.randn(4, d), torch.randn(4, f, d)
    vbar = frames.mean(1)
    with torch.inference_mode():
        before = pf.fold_pair_scores(tiny_model, t, frames, None, fold=psi_consts.fold_of(tiny_model))
    with torch.no_grad():
        tiny_model.psi.q.weight.mul_(-1.5)
    with torch.inference_mode():
        after = pf.fold_pair_scores(tiny_model, t, frames, None, fold=psi_consts.fold_of(tiny_model))
        ref = torch.diagonal(tiny_model.score(t, frames, None, vbar=vbar))
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, ref, atol=1e-5, rtol=1e-5)
