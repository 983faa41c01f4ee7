"""Retrieval sets: MSR-VTT as distributed, your own caption manifests, and the synthetic corpus's layout.

A `RetrievalSet` is a list of clips (a video file with an optional [start, end] window) and a list of
captions, each pointing at its clip. The trainer, the builder (tuning, InvGC, compare) and the evaluation
read their captions through here.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
