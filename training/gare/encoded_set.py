"""A retrieval set encoded by a model: caption embeddings, frame features, masks and pooled video vectors.

The trainer's validation, `gare-train eval` and the builder's InvGC selection all encode a set this way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gare.annotations import RetrievalSet
from gare.model import GARE, autocast
from gare.video_loader import iter_decoded

log = logging.getLogger(__name__)


@dataclass
class EncodedSet:
    t: torch.Tensor  # (n_captions, d)
    frames: torch.Tensor  # (n_clips, f, d)
    mask: torch.Tensor  # (n_clips, f)
    vbar: torch.Tensor  # (n_clips, d)
    caption_clip: np.ndarray  # (n_captions,) into the kept clips
    failed: list[tuple[str, str]] = field(default_factory=list)  # clips that could not be decoded


@torch.no_grad()
def encode_set(
    model: GARE, rs: RetrievalSet, *, batch_size: int = 32, num_workers: int = 2, precision: str = "fp32",
    progress: bool = False, decoded: list[dict[str, Any]] | None = None,
) -> EncodedSet:
    """Encode every caption and clip. Undecodable clips are dropped with their captions and reported.

    `decoded`: the clips already decoded, as `iter_decoded` batches keyed by clip index (the trainer's
    frame cache); otherwise they are decoded here."""
    cfg, dev = model.cfg, model.device
    items = [(i, c.path, c.start, c.end) for i, c in enumerate(rs.clips)]
    feats: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    failed: list[tuple[str, str]] = []
    it = iter(decoded) if decoded is not None else iter_decoded(
        items, max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size,
        batch_size=batch_size, num_workers=num_workers)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=(len(items) + batch_size - 1) // batch_size, desc=f"encode {rs.name} videos", unit="batch")
    for batch in it:
        failed += [(rs.clips[k].key, reason) for k, reason in batch["failed"]]
        if batch["frames"] is None:
            continue
        with autocast(dev, precision):
            Fv, vbar = model.encode_video(batch["frames"], batch["mask"])
        for n, k in enumerate(batch["keys"]):
            feats[k] = (Fv[n].float().cpu(), batch["mask"][n], vbar[n].float().cpu())
    for key, reason in failed:
        log.warning("skipped clip %s: %s", key, reason)
    kept = sorted(feats)
    new_index = {old: new for new, old in enumerate(kept)}
    cap_keep = [i for i, c in enumerate(rs.caption_clip) if int(c) in new_index]
    ts = []
    for s in range(0, len(cap_keep), 256):
        texts = [rs.captions[i] for i in cap_keep[s:s + 256]]
        with autocast(dev, precision):
            ts.append(model.encode_text(model.tokenize(texts)).float().cpu())
    d = cfg.embed_dim
    return EncodedSet(
        t=torch.cat(ts) if ts else torch.empty(0, d),
        frames=torch.stack([feats[k][0] for k in kept]) if kept else torch.empty(0, cfg.max_frames, d),
        mask=torch.stack([feats[k][1] for k in kept]) if kept else torch.empty(0, cfg.max_frames, dtype=torch.long),
        vbar=torch.stack([feats[k][2] for k in kept]) if kept else torch.empty(0, d),
        caption_clip=np.array([new_index[int(rs.caption_clip[i])] for i in cap_keep], dtype=np.int64),
        failed=failed,
    )
