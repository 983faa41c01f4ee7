"""Issue 15 training procedure: every caption once per epoch, RandAugment on whole clips, the frozen patch
embedding, presets and the warning for random initialisation."""

from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from gare.annotations import load_manifest
from gare_train.data import ClipRandAugment, PairDataset
from gare_train.fit import TrainConfig, Trainer, freeze_patch_embedding
from gare_train.optim import build_optimizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from gare_train.synth import SynthConfig, generate_corpus

    root = tmp_path_factory.mktemp("synth-epoch")
    generate_corpus(root, SynthConfig(n_videos=24, seed=5, width=64, height=64, duration=2.0, fps=6,
                                      captions_per_video=3), progress=False)
    return root


def _cfg(corpus: Path, tmp_path: Path, **kw) -> TrainConfig:
    base = {"model": "gare-test-tiny", "data": {"kind": "synth", "root": str(corpus)}, "out_dir": str(tmp_path / "run"),
            "epochs": 2, "batch_size": 4, "num_workers": 0, "lr": 1e-3, "seed": 1}
    return TrainConfig(**(base | kw))


def test_an_epoch_is_one_example_per_caption_on_a_manifest(tmp_path):
    rows = ["video,caption"] + [f"a.mp4,a{k}" for k in range(3)] + ["b.mp4,b0"] + [f"c.mp4,c{k}" for k in range(2)]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    rs = load_manifest(tmp_path / "m.csv")
    ds = PairDataset(rs, max_frames=4, framerate=1.0, image_size=32, seed=0)
    assert len(ds) == 6  # 3 + 1 + 2 captions, not 3 clips
    for epoch in (0, 1):
        seen = [ds.example(i, epoch) for i in range(len(ds))]
        assert sorted(c for _, c in seen) == sorted(rs.captions)  # each caption exactly once
        assert Counter(k for k, _ in seen) == Counter({0: 3, 1: 1, 2: 2})  # clip a visited three times
        assert all(c[0] == "abc"[k] for k, c in seen)  # with its own captions
    legacy = PairDataset(rs, max_frames=4, framerate=1.0, image_size=32, seed=0, epoch="clips")
    assert len(legacy) == 3
    with pytest.raises(ValueError, match="epoch must be"):
        PairDataset(rs, max_frames=4, framerate=1.0, image_size=32, seed=0, epoch="videos")


def test_steps_warmup_and_served_examples_follow_the_captions(corpus, tmp_path):
    tr = Trainer(_cfg(corpus, tmp_path, augment="none"), progress=False)
    n_caps, n_clips = len(tr.train_set.captions), len(tr.train_set.clips)
    assert n_caps == 3 * n_clips
    assert tr.steps_per_epoch == n_caps // 4 and tr.total_steps == 2 * (n_caps // 4)
    # the warm-up is 10% of the caption-based total: the lr multiplier reaches 1 only there
    warm = max(1, int(tr.total_steps * 0.1))
    f = tr.scheduler.lr_lambdas[0]
    assert f(warm - 1) == pytest.approx(1.0) and f(warm - 2) < 1.0 and f(tr.total_steps - 1) < 0.05
    served = []
    for batch in tr._loader(0, 0):
        served += list(zip(batch["clip"].tolist(), batch["captions"], strict=True))
    assert len(served) == tr.steps_per_epoch * 4 and len(set(served)) == len(served)
    assert Counter(k for k, _ in served).most_common(1)[0][1] <= 3
    legacy = Trainer(_cfg(corpus, tmp_path, augment="none", epoch="clips"), progress=False)
    assert legacy.steps_per_epoch == n_clips // 4


def test_randaugment_applies_the_same_ops_to_every_frame_of_a_clip():
    from PIL import Image

    g = np.random.default_rng(0)
    img = Image.fromarray(g.integers(0, 255, (48, 48, 3), dtype=np.uint8))
    aug = ClipRandAugment("rand-m7-n4-mstd0.5-inc1", image_size=48)
    random.seed(123)
    before = random.random(), np.random.get_state()[1][:4].copy()
    random.seed(123)
    outs = {}
    for seed in range(6):
        frames = aug([img, img.copy(), img.copy()], seed)
        arrs = [np.asarray(f) for f in frames]
        assert all(np.array_equal(arrs[0], a) for a in arrs[1:]), seed  # identical frames stay identical
        assert np.array_equal(np.asarray(aug([img], seed)[0]), arrs[0])  # a pure function of the seed
        outs[seed] = arrs[0]
    assert sum(not np.array_equal(o, np.asarray(img)) for o in outs.values()) >= 4  # it does augment
    assert len({o.tobytes() for o in outs.values()}) >= 4  # and differently per clip
    assert random.random() == before[0]  # the global RNGs are left where they were
    assert np.array_equal(np.random.get_state()[1][:4], before[1])


def test_training_pairs_are_augmented_per_epoch_and_reproducibly(corpus, tmp_path):
    tr = Trainer(_cfg(corpus, tmp_path), progress=False)  # the reference default: randaugment
    plain = Trainer(_cfg(corpus, tmp_path, augment="none"), progress=False)
    assert tr.pairs.augment is not None and plain.pairs.augment is None
    tr.pairs.epoch = plain.pairs.epoch = 0
    a0, b0, p0 = tr.pairs[0][0], tr.pairs[0][0], plain.pairs[0][0]
    tr.pairs.epoch = 1
    a1 = tr.pairs[0][0]
    n = int(a0.mask.sum())
    torch.testing.assert_close(a0.frames, b0.frames)  # same (seed, epoch, example): same augmentation
    assert not torch.equal(a0.frames[:n], p0.frames[:n])
    assert not torch.equal(a0.frames[:n], a1.frames[:n])  # a new draw each epoch
    assert torch.equal(a0.frames[n:], p0.frames[n:])  # padded frames stay zero


def test_patch_embedding_frozen_as_the_authors(tiny_model):
    cfg = TrainConfig(model="gare-test-tiny")
    names = freeze_patch_embedding(tiny_model)
    assert names and all(n.startswith("clip.visual.conv1") for n in names)
    conv = {id(p) for p in tiny_model.clip.visual.conv1.parameters()}
    opt = build_optimizer(tiny_model, cfg)
    assert not conv & {id(p) for g in opt.param_groups for p in g["params"]}
    assert cfg.freeze_patch_embed is True and cfg.augment == "randaugment" and cfg.epoch == "captions"


def test_presets_and_the_random_init_warning(corpus, tmp_path, caplog):
    s = TrainConfig.from_sources(None, {"preset": "scratch"})
    assert (s.lr, s.coef_lr, s.batch_size, s.augment, s.freeze_patch_embed) == (5e-4, 1.0, 64, "none", False)
    assert TrainConfig.from_sources(None, {"preset": "scratch", "lr": 1e-3}).lr == 1e-3  # flags win
    assert TrainConfig.from_sources(None, {"preset": "reference"}) == TrainConfig(preset="reference")
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig.from_sources(None, {"preset": "fast"})
    with caplog.at_level(logging.WARNING, logger="gare_train.fit"):
        Trainer(_cfg(corpus, tmp_path, coef_lr=1e-3), progress=False)
    assert "random initialisation" in caplog.text and "--preset scratch" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gare_train.fit"):
        Trainer(_cfg(corpus, tmp_path, coef_lr=1.0), progress=False)
    assert "random initialisation" not in caplog.text
