"""Training examples: (clip, caption) pairs of an epoch, RandAugment on frames, decoding to memory.

Training visits every caption once per epoch, as the authors' loaders do (one example per caption: on
MSR-VTT 9k ~20 per clip, so an epoch is ~20x the clips); the legacy `epoch: clips` draws one caption per
clip instead. Evaluation uses every caption. The caption files themselves are read by gare.annotations.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from gare.annotations import RetrievalSet
from gare.video_loader import ClipDataset, DecodedClip, iter_decoded

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- training pairs
EPOCH_UNITS = ("captions", "clips")
AUGMENTS = ("none", "randaugment")
# The authors' setting: timm RandAugment, magnitude 7 (std 0.5), 4 ops, increasing-severity variants.
REFERENCE_RANDAUGMENT = "rand-m7-n4-mstd0.5-inc1"


class ClipRandAugment:
    """timm's RandAugment applied identically to every frame of a clip (PIL frames -> PIL frames).

    The ops, their order, whether each fires and its (noisy) magnitude are drawn once per clip: timm draws
    them from Python's `random` (probability, magnitude noise) and NumPy's global RNG (op choice), so both
    are re-seeded with the clip's seed before each frame, inside a saved/restored RNG state so nothing
    else (dropout, other workers) sees the draws. Like the authors, it runs on the decoded frames before
    the CLIP resize/crop, with translations up to 45% of the model's image size.
    """

    def __init__(self, spec: str, image_size: int) -> None:
        from timm.data.auto_augment import rand_augment_transform

        if not spec.startswith("rand"):
            raise ValueError(f"augment spec must be a timm RandAugment string like {REFERENCE_RANDAUGMENT!r}, got {spec!r}")
        mean = (0.48145466, 0.4578275, 0.40821073)
        hparams = {"translate_const": int(image_size * 0.45), "img_mean": tuple(round(255 * m) for m in mean)}
        self.spec = spec
        self.transform = rand_augment_transform(spec, hparams)

    def __call__(self, frames: list[Any], seed: int) -> list[Any]:
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            out = []
            for img in frames:
                random.seed(seed)
                np.random.seed(seed % 2**32)
                out.append(self.transform(img))
            return out
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class PairDataset(torch.utils.data.Dataset):
    """The training examples of one epoch, each a (clip, caption) pair.

    `epoch="captions"` (the authors' loaders): one example per caption, so every caption is seen exactly
    once per epoch and a clip with k captions is visited k times. `epoch="clips"` (legacy): one example
    per clip with a caption drawn from (seed, epoch, clip). Either way the data, the caption and the
    augmentation of example i in epoch e are pure functions of (seed, e, i), so a resumed run sees
    exactly the same batches.
    """

    def __init__(
        self,
        rs: RetrievalSet,
        *,
        max_frames: int,
        framerate: float,
        image_size: int,
        seed: int,
        epoch: str = "captions",
        augment: str = "none",
        augment_spec: str = REFERENCE_RANDAUGMENT,
    ) -> None:
        if epoch not in EPOCH_UNITS:
            raise ValueError(f"epoch must be one of {EPOCH_UNITS}, got {epoch!r}")
        if augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {AUGMENTS}, got {augment!r}")
        self.rs = rs
        self.caps = rs.captions_of()
        self.clips = ClipDataset(
            [(i, c.path, c.start, c.end) for i, c in enumerate(rs.clips)],
            max_frames=max_frames, framerate=framerate, image_size=image_size,
        )
        self.unit = epoch
        self.augment = ClipRandAugment(augment_spec, image_size) if augment == "randaugment" else None
        self.seed = seed
        self.epoch = 0
        self.cache: dict[int, DecodedClip] | None = None  # clip index -> decoded frames (cache_frames)

    def fill_cache(self, *, num_workers: int, progress: bool = False) -> list[tuple[int, str]]:
        """Decode every clip once; from now on examples take their frames from memory. Returns the clips that
        failed to decode (they stay failures, as they would be every epoch). No augmentation only."""
        if self.augment is not None:
            raise ValueError("cannot cache frames with augmentation: augmented frames differ every epoch")
        ds = self.clips
        self.cache = decode_to_memory(ds.items, max_frames=ds.max_frames, framerate=ds.framerate,
                                      image_size=ds.image_size, num_workers=num_workers,
                                      desc="decode training clips" if progress else None)
        return [(k, c.error or "") for k, c in self.cache.items() if c.error is not None]

    def __len__(self) -> int:
        return len(self.rs.captions) if self.unit == "captions" else len(self.rs.clips)

    def caption_for(self, clip: int, epoch: int) -> str:
        choices = self.caps[clip]
        return self.rs.captions[choices[random.Random(f"{self.seed}/{epoch}/{clip}").randrange(len(choices))]]

    def example(self, index: int, epoch: int) -> tuple[int, str]:
        """(clip index, caption) of example `index` in `epoch`."""
        if self.unit == "captions":
            return int(self.rs.caption_clip[index]), self.rs.captions[index]
        return index, self.caption_for(index, epoch)

    def __getitem__(self, index: int) -> tuple[DecodedClip, str]:
        clip, caption = self.example(index, self.epoch)
        if self.cache is not None:
            return self.cache[clip], caption
        aug = None
        if self.augment is not None:
            seed = int(np.random.default_rng([self.seed, self.epoch, index, 7]).integers(2**31))
            augment = self.augment

            def aug(frames: list[Any]) -> list[Any]:
                return augment(frames, seed)

        return self.clips.decode(clip, augment=aug), caption


def decode_to_memory(
    items: list[tuple[Any, Any, float | None, float | None]],
    *,
    max_frames: int,
    framerate: float,
    image_size: int,
    num_workers: int,
    desc: str | None = None,
) -> dict[Any, DecodedClip]:
    """Decode `(key, path, start, end)` items once (the crash-safe worker pool of `iter_decoded`): key ->
    DecodedClip, failures included with their reason. `desc` shows a progress bar with that label."""
    out: dict[Any, DecodedClip] = {}
    bar = None
    if desc:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=desc, unit="clip", dynamic_ncols=True)
    for b in iter_decoded(items, max_frames=max_frames, framerate=framerate, image_size=image_size,
                          batch_size=8, num_workers=num_workers):
        for n, k in enumerate(b["keys"]):
            out[k] = DecodedClip(k, b["frames"][n].clone(), b["mask"][n].clone(), None)
        for k, reason in b["failed"]:
            out[k] = DecodedClip(k, None, None, reason)
        if bar is not None:
            bar.update(len(b["keys"]) + len(b["failed"]))
    if bar is not None:
        bar.close()
    return out


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def collate_pairs(batch: list[tuple[DecodedClip, str]]) -> dict[str, Any]:
    ok = [(c, t) for c, t in batch if c.error is None]
    return {
        "clip": torch.tensor([c.key for c, _ in ok], dtype=torch.long),
        "frames": torch.stack([c.frames for c, _ in ok]) if ok else None,
        "mask": torch.stack([c.mask for c, _ in ok]) if ok else None,
        "captions": [t for _, t in ok],
        "failed": [(c.key, c.error) for c, _ in batch if c.error is not None],
    }
