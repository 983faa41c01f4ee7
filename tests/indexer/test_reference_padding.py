"""An index of an imported checkpoint (`reference_padding`) scores short clips as the authors' code does.

End to end: a checkpoint in the authors' layout (tiny random weights, built as in tests/training/test_official.py)
-> `gare-train import-official` -> real mp4 files shorter than max_frames -> `gare-index build` -> every stage-2
path (fused, model, fold, exhaustive, `search`) against an independent restatement of the authors' forward pass
(`reference_encode` / `reference_pair_scores`, written on their key names). A checkpoint trained here (flag off)
still gets zeroed, masked padded rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gare.backbone import open_clip_module
from gare.checkpoint import load_model
from gare.video import load_frames
from gare_build.build import stats
from gare_build.cli import main as index_cli
from gare_index.store import open_index, verify_index
from gare_search import query as Q
from gare_search import rerank as R
from gare_search import search as S
from gare_train.cli import main as train_cli
from tests.indexer.support import make_checkpoint, make_long_video
from tests.psi_reference import REFERENCES
from tests.training.test_official import (
    FRAMES,
    WORDS,
    official_state_dict,
    reference_encode,
    reference_pair_scores,
)

# real frames per clip at 1 fps (the imported config's rate): 1..5 are padded to FRAMES = 6, 8 s fills it
SECONDS = (1, 2, 3, 4, 5, 8)
CAPTIONS = ["a dog jumps over a fence", "two people dance", "a red car turns left", "someone slices bread"]
# Stored frames are float16 (docs/index-format.md): scores from pixels through the index differ from the
# authors' fp32 forward pass by float16 rounding of F: measured 6e-5 here (tiny model), asserted below 1e-3.
FP16_TOL = 1e-3


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refpad")
    sd = official_state_dict(seed=2)
    src = tmp / "pytorch_model.bin.4"
    torch.save(sd, src)
    ckpt = tmp / "imported.safetensors"
    assert train_cli(["import-official", str(src), str(ckpt), "--max-frames", str(FRAMES), "--max-words", str(WORDS)]) == 0
    videos = tmp / "videos"
    videos.mkdir()
    for i, s in enumerate(SECONDS):
        make_long_video(videos / f"clip{i}_{s}s.mp4", seconds=float(s), fps=4.0, seed=i)
    out = tmp / "INDEX"
    assert index_cli(["build", "--checkpoint", str(ckpt), "--videos", str(videos), "--out", str(out),
                      "--workers", "0", "--no-progress"]) == 0
    model, _ = load_model(ckpt, "cpu")
    version = open_index(out)
    # the authors' pipeline from the same files: our decoder gives what their loader gives (zero pixel rows)
    rows = np.arange(version.n)
    paths = [m["path"] for m in version.metadata(version.ids[rows])]
    cfg = model.cfg
    dec = [load_frames(p, max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size) for p in paths]
    pixels = torch.stack([d[0] for d in dec])
    mask = torch.stack([d[1] for d in dec])
    tokens = open_clip_module().get_tokenizer("gare-test-tiny")(CAPTIONS)
    with torch.no_grad():
        t_ref, F_ref = reference_encode(sd, tokens, pixels, mask)
    yield dict(sd=sd, ckpt=ckpt, out=out, model=model, version=version, mask=mask, t_ref=t_ref, F_ref=F_ref)
    version.close()


def _stored(v):
    rows = np.arange(v.n)
    return (torch.from_numpy(np.asarray(v.frames[rows])), torch.from_numpy(np.asarray(v.masks[rows])),
            torch.from_numpy(v.vbar(rows)))


@torch.no_grad()
def test_index_stores_padded_rows_and_the_all_rows_mean(imported):
    v, F_ref, mask = imported["version"], imported["F_ref"], imported["mask"]
    frames, masks, vbar = _stored(v)
    assert v.reference_padding and v.manifest["checkpoint"]["model_config"]["reference_padding"] is True
    assert masks.sum(1).tolist() == [min(s, FRAMES) for s in SECONDS]  # clips really are shorter than max_frames
    assert torch.equal(masks.long(), mask)
    pad = masks == 0
    assert pad.any() and (frames[pad].abs().amax(-1) > 0).all()  # the padded rows' features are kept
    # stored frames are the authors' features in float16; stored v̄ (float32) is their mean over all rows
    assert (frames.float() - F_ref).abs().max() <= 2 ** -10 * F_ref.abs().max()
    torch.testing.assert_close(vbar, F_ref.mean(1), atol=1e-5, rtol=0)
    assert (vbar - (F_ref * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).abs().max() > 1e-2  # not the masked mean


@torch.no_grad()
def test_stage2_paths_equal_the_authors_on_the_stored_features(imported):
    """Given what the index stores (float16 F, float32 v̄), every psi path equals the authors' psi and pooling
    within 1e-5; the authors' restatement is fed the same stored numbers."""
    from gare import psi_fold as pf
    from gare import psi_fold_queries as pfq
    from gare import psi_fold_videos as pfv
    from gare import psi_fold_weights as pfw

    model, v, sd = imported["model"], imported["version"], imported["sd"]
    frames, masks, vbar = _stored(v)
    t = Q.encode_queries(model, CAPTIONS)
    torch.testing.assert_close(t, imported["t_ref"], atol=1e-5, rtol=0)
    ref = reference_pair_scores(sd, t, frames.float(), masks, vbar=vbar)
    assert (ref - ref.mean()).abs().max() > 1e-3
    ids = [np.asarray(v.ids)] * len(CAPTIONS)
    paths = {"fold": R.psi_scores, **REFERENCES}  # the served fold and the references it is checked against
    for impl, scores in paths.items():
        got = np.stack(scores(model, v, t, ids))
        np.testing.assert_allclose(got, ref.numpy(), atol=1e-5, rtol=0, err_msg=impl)
    np.testing.assert_allclose(R.exhaustive_psi(model, v, t), ref.numpy(), atol=1e-5, rtol=0)
    # the exact fold in its all-rows mode (what an index of psi constants must be folded with). It takes v̄ from
    # the stored float16 frames, not the stored float32 v̄ (the mean of the unrounded features): fed that mean,
    # the reference agrees to float32 rounding (1.4e-7 measured), while the two means alone move the scores by
    # float16 rounding (1.4e-6 measured), which a 1e-5 bound cannot tell apart from a wrong fold
    a, b = len(CAPTIONS), v.n
    ref_frames = reference_pair_scores(sd, t, frames.float(), masks, vbar=frames.float().mean(1))
    fold = pfw.fold_weights(model.psi)
    consts = pfv.fold_videos(frames, masks, fold, reference_padding=True)
    got = pf.pair_scores(pfq.fold_queries(t, fold, model.cfg.temp), consts)
    torch.testing.assert_close(got, ref_frames, atol=1e-6, rtol=0)
    pairs = pf.fold_pair_scores(model, t.repeat_interleave(b, 0), frames.repeat(a, 1, 1), masks.repeat(a, 1))
    torch.testing.assert_close(pairs.view(a, b), ref_frames, atol=1e-6, rtol=0)
    # mask=None is not the authors' padding: it would pool over the padded rows too
    wrong = pf.pair_scores(pfq.fold_queries(t, fold, model.cfg.temp), pfv.fold_videos(frames, None, fold))
    assert (wrong - ref)[:, masks.sum(1) < FRAMES].abs().max() > 1e-3


@torch.no_grad()
def test_search_equals_the_authors_forward_pass_from_pixels(imported):
    """mp4 -> index -> search: the psi scores of the hits equal the authors' scores computed from the decoded
    pixels, within the float16 storage tolerance; masked padding would miss it on the short clips."""
    model, v, sd, mask = imported["model"], imported["version"], imported["sd"], imported["mask"]
    ref = reference_pair_scores(sd, imported["t_ref"], imported["F_ref"], mask)  # (a, n) in row order
    opts = S.SearchOptions(k=v.n, candidates=v.n, ncl=False)
    for i, r in enumerate(S.search_batch(model, v, CAPTIONS, opts)):
        got = np.array([h.psi_score for h in r.hits])
        want = ref[i, v.rows(np.array([h.id for h in r.hits]))].numpy()
        np.testing.assert_allclose(got, want, atol=FP16_TOL, rtol=0)
    # the same weights scored with masked padding (a model trained here) are off by more on the short clips
    from gare.model import GARE

    masked = GARE.build(model.cfg.replace(reference_padding=False), pretrained="none").eval()
    masked.load_state_dict(model.state_dict())
    frames, masks, vbar = _stored(v)
    t = Q.encode_queries(masked, CAPTIONS)
    fm = frames.float() * masks[..., None]
    sm = masked.score(t, fm, masks)
    short = masks.sum(1) < FRAMES
    assert (sm - ref)[:, short].abs().max() > 10 * FP16_TOL


def test_verify_and_stats_show_the_flag_and_catch_zeroed_rows(imported, capsys):
    out = imported["out"]
    assert verify_index(out) == []
    assert stats(out)["reference_padding"] is True
    assert index_cli(["verify", "--out", str(out)]) == 0
    assert "reference_padding" in capsys.readouterr().out
    # an index whose padded rows were zeroed (what a masked build writes) lost what these scores need
    bad = Path(str(out) + "-zeroed")
    import shutil

    shutil.copytree(out, bad)
    v = imported["version"]
    fr = np.load(bad / "versions" / v.name / "frames.npy", mmap_mode="r+")
    fr[np.asarray(v.masks) == 0] = 0
    fr.flush()
    del fr
    problems = verify_index(bad, rehash=False)
    assert any("reference_padding" in p for p in problems), problems


@torch.no_grad()
def test_a_model_trained_here_still_masks(imported, tmp_path):
    ckpt = make_checkpoint(tmp_path / "here.safetensors", queue=False, seed=3)
    videos = Path(imported["out"]).parent / "videos"
    out = tmp_path / "INDEX"
    assert index_cli(["build", "--checkpoint", str(ckpt), "--videos", str(videos), "--out", str(out), "--workers", "0",
                      "--no-progress"]) == 0
    model, _ = load_model(ckpt, "cpu")
    assert model.cfg.reference_padding is False
    with open_index(out) as v:
        frames, masks, vbar = _stored(v)
        assert not v.reference_padding and stats(out)["reference_padding"] is False and verify_index(out) == []
        assert (masks == 0).any() and frames[masks == 0].abs().max() == 0  # padded rows zeroed
        f32 = frames.float()
        torch.testing.assert_close(vbar, f32.sum(1) / masks.sum(1, keepdim=True), atol=2e-3, rtol=0)
        t = Q.encode_queries(model, CAPTIONS)
        want = model.score(t, frames, masks, vbar=vbar)
        got = np.stack(R.psi_scores(model, v, t, [np.asarray(v.ids)] * len(CAPTIONS)))
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)
        # and the masking matters: attending over the (zero) padded rows would change the short clips' scores
        allrows = GARE_all_rows(model)
        s_all = allrows.score(t, frames, masks, vbar=vbar)
        assert (s_all - want)[:, masks.sum(1) < model.cfg.max_frames].abs().max() > 1e-4


def GARE_all_rows(model):
    from gare.model import GARE

    m = GARE.build(model.cfg.replace(reference_padding=True), pretrained="none").eval()
    m.load_state_dict(model.state_dict())
    return m
