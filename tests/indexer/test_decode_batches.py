"""The builder's decode batches: a library smaller than DECODE_WAVES x batch_size x workers is split so that every
decode worker gets several batches (iter_decoded hands whole batches to workers), in order, with nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from gare.video_loader import DECODE_WAVES, decode_batch_size, iter_decoded

from .support import make_corpus


@pytest.mark.parametrize(("n", "batch", "workers", "want"), [
    (300, 64, 16, 4),  # the H100 run's library: 75 batches of <= 4 (4+ per worker), not 5 of 64
    (600, 64, 16, 9),  # the H200 run's: 67 of <= 9, not 16 of 38 (one wave: the encoder waited for all of them)
    (10_000, 64, 16, 64),  # a large library keeps the configured batch
    (1, 64, 16, 1),
    (5, 16, 2, 1),
    (64, 16, 2, 8),
    (200, 16, 2, 16),
    (6, 4, 0, 4),  # decoding in this process: the configured batch
])
def test_decode_batch_size(n, batch, workers, want):
    got = decode_batch_size(n, batch, workers)
    assert got == want
    assert got <= batch
    if workers and got < batch:  # split: every worker gets DECODE_WAVES batches (or one per video)
        assert -(-n // got) >= min(DECODE_WAVES * workers, n)


@pytest.mark.parametrize("bad", [(0, 16, 2), (5, 0, 2), (5, 16, -1)])
def test_decode_batch_size_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="must be >= 1 and workers >= 0"):
        decode_batch_size(*bad)


def test_small_library_reaches_every_worker_in_order(tmp_path: Path):
    videos = sorted(make_corpus(tmp_path, n=12).glob("*.mp4"))
    items = [(p.name, str(p), None, None) for p in videos]
    size = decode_batch_size(len(items), 16, 3)
    batches = list(iter_decoded(items, max_frames=4, framerate=1.0, image_size=32, batch_size=size, num_workers=3))
    assert size == 1 and len(batches) == 12  # 4 batches per worker instead of one batch for one worker
    assert [k for b in batches for k in b["keys"]] == [p.name for p in videos]
    assert not any(b["failed"] for b in batches)


def test_uint8_batches_encode_to_the_same_shard(tmp_path: Path):
    """The builder decodes with as_uint8 (a quarter of the bytes through the worker pipes) and encode_batch
    normalises on the encoder's device: the shard equals the one from float32 batches exactly."""
    import numpy as np
    import torch

    from gare.config import get_model_config
    from gare.model import GARE
    from gare_build.pipeline.encode import encode_batch

    torch.manual_seed(0)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    videos = sorted(make_corpus(tmp_path, n=5).glob("*.mp4"))
    items = [(p.name, str(p), None, None) for p in videos]
    cfg = model.cfg
    kw = {"max_frames": cfg.max_frames, "framerate": cfg.video_framerate, "image_size": cfg.image_size,
          "batch_size": 5, "num_workers": 2}
    (f32,) = list(iter_decoded(items, **kw))
    (u8,) = list(iter_decoded(items, **kw, as_uint8=True))
    assert u8["frames"].dtype == torch.uint8 and f32["frames"].dtype == torch.float32
    dev = torch.device("cpu")
    a, fa, na = encode_batch(model, dev, "fp32", f32)
    b, fb, nb = encode_batch(model, dev, "fp32", u8)
    assert a is not None and b is not None and fa == fb == {} and na == nb > 0
    assert a.keys == b.keys == [p.name for p in videos]
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.vbar, b.vbar) and np.array_equal(a.masks, b.masks)
