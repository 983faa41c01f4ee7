"""Retrieval datasets: MSR-VTT as distributed, your own caption manifests, and the synthetic corpus.

A `RetrievalSet` is a list of clips (a video file with an optional [start, end] window) and a list of
captions, each pointing at its clip. Training visits every caption once per epoch, as the authors' loaders
do (one example per caption: on MSR-VTT 9k ~20 per clip, so an epoch is ~20x the clips); the legacy
`epoch: clips` draws one caption per clip instead. Evaluation uses every caption.
"""

from __future__ import annotations

import csv
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .video import ClipDataset, DecodedClip, iter_decoded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Clip:
    key: str
    path: str
    start: float | None = None
    end: float | None = None


@dataclass
class RetrievalSet:
    clips: list[Clip]
    captions: list[str]
    caption_clip: np.ndarray  # (n_captions,) index into clips
    name: str = ""
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, reason) found while loading

    def __post_init__(self) -> None:
        self.caption_clip = np.asarray(self.caption_clip, dtype=np.int64)
        if len(self.captions) != len(self.caption_clip):
            raise ValueError("captions and caption_clip differ in length")
        if len(self.caption_clip) and (self.caption_clip.min() < 0 or self.caption_clip.max() >= len(self.clips)):
            raise ValueError("caption_clip points outside clips")

    def subset(self, clip_indices: list[int] | np.ndarray, name: str) -> RetrievalSet:
        clip_indices = list(clip_indices)
        remap = {old: new for new, old in enumerate(clip_indices)}
        caps, cc = [], []
        for c, ci in zip(self.captions, self.caption_clip, strict=True):
            if int(ci) in remap:
                caps.append(c)
                cc.append(remap[int(ci)])
        return RetrievalSet([self.clips[i] for i in clip_indices], caps, np.array(cc, dtype=np.int64), name)

    def captions_of(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.clips]
        for i, ci in enumerate(self.caption_clip):
            out[int(ci)].append(i)
        return out


def _from_pairs(pairs: list[tuple[Clip, list[str]]], name: str) -> RetrievalSet:
    clips, caps, cc = [], [], []
    for clip, texts in pairs:
        texts = [t.strip() for t in texts if t and t.strip()]
        if not texts:
            continue
        clips.append(clip)
        caps.extend(texts)
        cc.extend([len(clips) - 1] * len(texts))
    return RetrievalSet(clips, caps, np.array(cc, dtype=np.int64), name)


# ---------------------------------------------------------------- MSR-VTT
def load_msrvtt(
    anno_dir: str | Path,
    videos_dir: str | Path,
    split: str,
    *,
    data_json: str | Path | None = None,
    train_csv: str = "MSRVTT_train.9k.csv",
    test_csv: str = "MSRVTT_JSFUSION_test.csv",
) -> RetrievalSet:
    """split 'train': the ids of MSRVTT_train.9k.csv with all their captions from MSRVTT_data.json;
    split 'test': the 1k-A test pairs of MSRVTT_JSFUSION_test.csv (one caption per video)."""
    anno_dir, videos_dir = Path(anno_dir), Path(videos_dir)
    if split == "test":
        with open(anno_dir / test_csv, newline="") as fh:
            rows = list(csv.DictReader(fh))
        missing = {"video_id", "sentence"} - set(rows[0] if rows else {})
        if missing:
            raise ValueError(f"{anno_dir / test_csv}: missing columns {sorted(missing)}")
        pairs = [(Clip(r["video_id"], str(videos_dir / f"{r['video_id']}.mp4")), [r["sentence"]]) for r in rows]
        return _from_pairs(pairs, "msrvtt-test")
    if split != "train":
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    with open(anno_dir / train_csv, newline="") as fh:
        ids = [r["video_id"] for r in csv.DictReader(fh)]
    data_json = Path(data_json) if data_json else anno_dir / "MSRVTT_data.json"
    with open(data_json) as fh:
        data = json.load(fh)
    wanted = set(ids)
    caps: dict[str, list[str]] = {}
    for s in data["sentences"]:
        if s["video_id"] in wanted:
            caps.setdefault(s["video_id"], []).append(s["caption"])
    no_caption = [v for v in ids if v not in caps]
    if no_caption:
        log.warning("%d training videos have no caption in %s (e.g. %s)", len(no_caption), data_json, no_caption[:3])
    pairs = [(Clip(v, str(videos_dir / f"{v}.mp4")), caps[v]) for v in ids if v in caps]
    rs = _from_pairs(pairs, "msrvtt-train")
    rs.skipped = [(v, "no caption in MSRVTT_data.json") for v in no_caption]
    return rs


# ---------------------------------------------------------------- own manifests
def _opt_float(v: Any) -> float | None:
    return None if v in (None, "") else float(v)


def load_manifest(path: str | Path, name: str | None = None) -> RetrievalSet:
    """CSV (columns video, caption[, start, end]; one row per caption) or JSONL
    ({"video": ..., "captions": [...] or "caption": ..., "start"?, "end"?} per line).
    Relative video paths are resolved against the manifest's folder."""
    path = Path(path)
    base = path.parent
    grouped: dict[tuple[str, float | None, float | None], list[str]] = {}

    def add(video: str, texts: list[str], start: Any, end: Any, where: str) -> None:
        if not video:
            raise ValueError(f"{where}: empty video path")
        vp = Path(video)
        vp = vp if vp.is_absolute() else base / vp
        key = (str(vp), _opt_float(start), _opt_float(end))
        grouped.setdefault(key, []).extend(texts)

    if path.suffix.lower() in (".jsonl", ".json"):
        with open(path) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
                texts = rec.get("captions") or ([rec["caption"]] if rec.get("caption") else [])
                add(rec.get("video", ""), list(texts), rec.get("start"), rec.get("end"), f"{path}:{n}")
    elif path.suffix.lower() == ".csv":
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or not {"video", "caption"} <= set(reader.fieldnames):
                raise ValueError(f"{path}: a caption CSV needs the columns video and caption, has {reader.fieldnames}")
            for n, r in enumerate(reader, 2):
                add(r["video"], [r["caption"]], r.get("start"), r.get("end"), f"{path}:{n}")
    else:
        raise ValueError(f"{path}: manifest must be .csv or .jsonl")
    pairs = []
    for (video, start, end), texts in grouped.items():
        key = Path(video).stem if start is None else f"{Path(video).stem}@{start:g}-{end:g}"
        pairs.append((Clip(key, video, start, end), texts))
    return _from_pairs(pairs, name or path.stem)


def load_dataset(spec: dict[str, Any], split: str) -> RetrievalSet:
    """spec: {"kind": "msrvtt", "anno_dir", "videos_dir", "data_json"?} | {"kind": "manifest", "train", "test"}
    | {"kind": "synth", "root"} (the output of `gare-train synth`)."""
    kind = spec.get("kind")
    if kind == "msrvtt":
        return load_msrvtt(spec["anno_dir"], spec["videos_dir"], split, data_json=spec.get("data_json"))
    if kind == "manifest":
        if split not in spec:
            raise ValueError(f"manifest dataset has no {split!r} file")
        return load_manifest(spec[split], name=f"manifest-{split}")
    if kind == "synth":
        root = Path(spec["root"])
        rs = load_msrvtt(root, root / "videos", split, data_json=root / "MSRVTT_data.json", train_csv="train.csv", test_csv="test.csv")
        rs.name = f"synth-{split}"
        return rs
    raise ValueError(f"unknown dataset kind {kind!r}; use msrvtt, manifest or synth")


def carve_validation(rs: RetrievalSet, fraction: float, seed: int) -> tuple[RetrievalSet, RetrievalSet]:
    """Split the training videos into train and validation (checkpoints are chosen on validation, never
    on the test set)."""
    n = len(rs.clips)
    n_val = max(1, int(round(n * fraction))) if fraction > 0 else 0
    order = np.random.default_rng(seed).permutation(n)
    val_idx, train_idx = sorted(order[:n_val].tolist()), sorted(order[n_val:].tolist())
    return rs.subset(train_idx, f"{rs.name}-train"), rs.subset(val_idx, f"{rs.name}-val")


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
