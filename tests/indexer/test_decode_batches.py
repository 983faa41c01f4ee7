"""The builder's decode batches: a library smaller than batch_size x workers is split so that every decode worker
gets a batch (iter_decoded hands whole batches to workers), in order, with nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from gare.video_loader import iter_decoded
from gare_build.pipeline.encode import decode_batch_size

from .support import make_corpus


@pytest.mark.parametrize(("n", "batch", "workers", "want"), [
    (300, 64, 16, 19),  # the GPU run's library: 16 batches of <= 19, not 5 of 64
    (10_000, 64, 16, 64),  # a large library keeps the configured batch
    (1, 64, 16, 1),
    (5, 16, 2, 3),
    (32, 16, 2, 16),
    (6, 4, 0, 4),  # decoding in this process: the configured batch
])
def test_decode_batch_size(n, batch, workers, want):
    got = decode_batch_size(n, batch, workers)
    assert got == want
    assert -(-n // got) >= min(workers, n)  # enough batches for every worker (or one per video)
    assert got <= batch


@pytest.mark.parametrize("bad", [(0, 16, 2), (5, 0, 2), (5, 16, -1)])
def test_decode_batch_size_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="must be >= 1 and workers >= 0"):
        decode_batch_size(*bad)


def test_small_library_reaches_every_worker_in_order(tmp_path: Path):
    videos = sorted(make_corpus(tmp_path, n=6).glob("*.mp4"))
    items = [(p.name, str(p), None, None) for p in videos]
    size = decode_batch_size(len(items), 16, 3)
    batches = list(iter_decoded(items, max_frames=4, framerate=1.0, image_size=32, batch_size=size, num_workers=3))
    assert size == 2 and len(batches) == 3  # one batch per worker instead of one batch for one worker
    assert [k for b in batches for k in b["keys"]] == [p.name for p in videos]
    assert not any(b["failed"] for b in batches)
