"""The psi coverage of stage-1 tuning reads the index's stored psi constants instead of folding every video again
(issue 29: `gare-index tune` at 1M spent most of its time re-folding constants the index already holds).

The stored-constants scorer is checked against the unfolded psi (model.score with the served v̄ = norm * unit),
against the folding scorer, and for what it must refuse (constants of other psi weights); a real build and
`gare-index tune` are checked to take that path. Tiny model, real mp4 files for the index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare.checkpoint import load_model
from gare.psi import masked_mean
from gare_build.cli import main
from gare_build.tuning import coverage
from gare_build.tuning.coverage import StoredConsts, psi_fold_scorer
from gare_build.tuning.version_tuning import stored_consts
from gare_index import psi_consts
from gare_index.frame_quant import QuantFrames, dequantize, quantize
from gare_index.store import open_index
from tests.indexer.support import copy_videos, make_checkpoint


@pytest.fixture(scope="module")
def model_and_gallery(tmp_path_factory):
    """The tiny model with non-trivial psi weights and a gallery of 150 videos of 1-4 valid frames, with the
    arrays an index stores: float16 frames, masks, unit vectors and norms of the masked mean, psi constants."""
    root = tmp_path_factory.mktemp("cov")
    model, _ = load_model(make_checkpoint(root / "ck.safetensors", queue=False, seed=5), "cpu")
    g = torch.Generator().manual_seed(0)
    n, f, d = 150, model.cfg.max_frames, model.cfg.embed_dim
    frames = torch.randn(n, f, d, generator=g).to(torch.float16)
    masks = torch.zeros(n, f, dtype=torch.long)
    for i in range(n):
        masks[i, : 1 + i % min(f, 4)] = 1
    vbar = masked_mean(frames.float(), masks)  # (n, d) as the builder computes it, from the float32 features
    norms = vbar.norm(dim=1)
    units = vbar / norms[:, None]
    consts = np.empty((n, psi_consts.packed_width(f)), np.float32)
    fold = psi_consts.fold_of(model)
    psi_consts.compute_rows(fold, frames.numpy(), masks.numpy(), units.numpy(), norms.numpy(), consts, device="cpu")
    biases = torch.randn(n, generator=g).numpy().astype(np.float32) * 0.05
    raw = (torch.randn(12, d, generator=g) * 3.0).numpy()  # un-normalised caption-like rows: psi needs |t|
    unit_q = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    ids = np.arange(1000, 1000 + n, dtype=np.int64)
    return dict(model=model, frames=frames.numpy(), masks=masks.numpy(), units=units.numpy(), norms=norms.numpy(),
                consts=consts, biases=biases, raw=raw, unit_q=unit_q, ids=ids, fold=fold)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_stored_scorer_equals_the_unfolded_psi_with_the_served_vbar(model_and_gallery, monkeypatch, path):
    """Both ways of scoring stored constants (the compiled kernel over runs of videos; the torch ops where numba or
    a numpy frame array is missing) equal the unfolded psi with v̄ = norm * unit, plus the biases."""
    m = model_and_gallery
    stored = StoredConsts(m["consts"], m["units"], m["norms"], m["fold"].fingerprint)

    def no_fold(*a, **k):  # the point of the stored path: no video is folded again
        raise AssertionError("the stored-constants scorer folded videos")

    monkeypatch.setattr(coverage, "fold_videos", no_fold)
    calls = []
    real_scores = coverage.psi_fold_cpu.scores
    monkeypatch.setattr(coverage.psi_fold_cpu, "scores", lambda *a, **k: calls.append(a[2].shape) or real_scores(*a, **k))
    if path == "torch":
        monkeypatch.setattr(coverage, "_stored_kernel_arrays", lambda *a: None)
    scorer = psi_fold_scorer(m["model"], m["frames"], m["masks"], m["biases"], m["ids"], m["unit_q"], m["raw"],
                             stored=stored)
    gids = m["ids"][::-1][:97].copy()  # any order, any subset: rows are looked up by id
    got = scorer(m["unit_q"][1:11], gids)  # 10 queries: gare.psi_fold.exhaustive takes its torch ops from 8 up
    # the kernel takes runs of at most _KERNEL_VIDEOS videos x all 10 queries
    assert calls == ([(10, coverage._KERNEL_VIDEOS), (10, 97 - coverage._KERNEL_VIDEOS)] if path == "kernel" else [])
    rows = gids - 1000
    vb = torch.from_numpy(m["units"][rows] * m["norms"][rows][:, None])
    with torch.no_grad():
        want = m["model"].score(torch.from_numpy(m["raw"][1:11]), torch.from_numpy(m["frames"][rows]).float(),
                                torch.from_numpy(m["masks"][rows]), vbar=vb).numpy() + m["biases"][rows][None, :]
    assert got.shape == (10, 97)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_int8_frames_are_scored_as_the_served_rerank_reads_them(model_and_gallery):
    """An index with --frames-dtype int8: the kernel reads the int8 frames with their per-frame scales, the same
    scores as the torch ops over the dequantised frames."""
    m = model_and_gallery
    q8, scales = quantize(m["frames"])
    qf = QuantFrames(q8, scales)
    deq = dequantize(q8, scales)
    consts = np.empty_like(m["consts"])
    psi_consts.compute_rows(m["fold"], deq, m["masks"], m["units"], m["norms"], consts, device="cpu")
    stored = StoredConsts(consts, m["units"], m["norms"], m["fold"].fingerprint)
    assert coverage._stored_kernel_arrays(qf, stored).fr.dtype == np.int8
    got = psi_fold_scorer(m["model"], qf, m["masks"], m["biases"], m["ids"], m["unit_q"], m["raw"], stored=stored)(
        m["unit_q"], m["ids"])
    vb = torch.from_numpy(m["units"] * m["norms"][:, None])
    with torch.no_grad():
        want = m["model"].score(torch.from_numpy(m["raw"]), torch.from_numpy(deq).float(), torch.from_numpy(m["masks"]),
                                vbar=vb).numpy() + m["biases"][None, :]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_stored_and_folding_scorers_agree_and_rank_alike(model_and_gallery):
    """The folding path (v̄ the masked mean of the float16 frames) and the stored path (v̄ = norm * unit of the
    float32 mean) differ only by rounding: the same scores to 1e-4 and the same exhaustive top-10."""
    m = model_and_gallery
    args = (m["model"], m["frames"], m["masks"], m["biases"], m["ids"], m["unit_q"], m["raw"])
    a = psi_fold_scorer(*args, stored=StoredConsts(m["consts"], m["units"], m["norms"], m["fold"].fingerprint))(
        m["unit_q"], m["ids"])
    b = psi_fold_scorer(*args)(m["unit_q"], m["ids"])
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert np.abs(a - b).max() > 0  # really two computations
    np.testing.assert_array_equal(np.argsort(-a, axis=1, kind="stable")[:, :10], np.argsort(-b, axis=1, kind="stable")[:, :10])


def test_constants_of_other_psi_weights_are_refused(model_and_gallery):
    m = model_and_gallery
    with pytest.raises(ValueError, match="stored psi constants were folded with psi 0123456789ab"):
        psi_fold_scorer(m["model"], m["frames"], m["masks"], m["biases"], m["ids"], m["unit_q"], m["raw"],
                        stored=StoredConsts(m["consts"], m["units"], m["norms"], "0123456789ab" * 4))


def test_build_and_tune_score_the_coverage_with_the_stored_constants(tmp_path, corpus):
    """A real build, then `gare-index tune`, both record the stored-constants scorer; stored_consts declines a
    version whose constants belong to other psi weights (the scorer then folds, as before)."""
    ck = make_checkpoint(tmp_path / "ck.safetensors", queue=True, seed=1)
    videos = copy_videos(corpus, tmp_path / "videos", [f"video{i}.mp4" for i in range(6)])
    out = tmp_path / "IDX"
    assert main(["build", "--checkpoint", str(ck), "--videos", str(videos), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    v = open_index(out)
    assert v.manifest["stage1"]["coverage_scorer"].startswith("exhaustive psi (the index's stored psi constants")
    model, _ = load_model(ck, "cpu")
    s = stored_consts(v, model)
    assert s is not None and s.fingerprint == v.manifest.psi_fold["fingerprint"]
    other, _ = load_model(make_checkpoint(tmp_path / "other.safetensors", queue=False, seed=9), "cpu")
    assert stored_consts(v, other) is None
    v.close()
    assert main(["tune", "--index", str(out), "--no-progress"]) == 0
    st = open_index(out).manifest["stage1"]
    assert st["coverage_scorer"].startswith("exhaustive psi (the index's stored psi constants")


def test_coverage_shows_its_progress_and_the_same_figures(capsys):
    """`progress=True` (gare-index tune / build with progress on): a bar over the gallery's blocks on stderr,
    the same coverage as without it."""
    from gare_build.tuning.coverage import cosine_scorer, coverage_at_k
    from gare_index.ann import AnnIndex, build_index
    from gare_index.ann_params import AnnParams

    g = np.random.default_rng(3)
    units = g.standard_normal((500, 16)).astype(np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    ids = np.arange(500, dtype=np.int64)
    ann = AnnIndex(build_index(units, ids, AnnParams("hnsw", hnsw_m=4, ef_search=8, ef_construction=8), use_gpu=False))
    q = units[:20] + 0.3 * g.standard_normal((20, 16)).astype(np.float32)
    quiet = coverage_at_k(ann, q, cosine_scorer(units), ids, (4, 16), block=128)
    assert capsys.readouterr().err == ""
    shown = coverage_at_k(ann, q, cosine_scorer(units), ids, (4, 16), block=128, progress=True)
    err = capsys.readouterr().err
    assert "psi coverage" in err and "4/4" in err  # 500 videos in blocks of 128
    assert shown.coverage == quiet.coverage and quiet.coverage[4] < 1.0
