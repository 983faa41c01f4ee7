"""Encoding decoded batches into index features; shared by the local and the Dask engines."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from gare_build.work import Shard

log = logging.getLogger(__name__)

_MODELS: dict[tuple[str, str, str], Any] = {}
_MODELS_LOCK = threading.Lock()


def cached_model(checkpoint: str, sha256: str, device: str = "auto") -> tuple[Any, torch.device]:
    """Load a checkpoint once per process (Dask workers call this for every task).

    The file's sha256 must equal `sha256`: a worker that sees another file under the same path (no shared
    filesystem, a stale copy) fails instead of producing features of another model.
    """
    from gare.checkpoint import file_sha256, load_model
    from gare.model import resolve_device

    dev = resolve_device(device)
    key = (str(checkpoint), sha256, str(dev))
    with _MODELS_LOCK:
        hit = _MODELS.get(key)
        if hit is None:
            have = file_sha256(checkpoint)
            if have != sha256:
                raise RuntimeError(f"checkpoint {checkpoint} on this worker has sha256 {have}, expected {sha256}")
            model, _ = load_model(checkpoint, dev)
            hit = _MODELS[key] = model
    return hit, dev


@torch.no_grad()
def encode_batch(model: Any, device: torch.device, precision: str, batch: dict[str, Any]) -> tuple[Shard | None, dict[str, str], int]:
    """Encode one collate_clips batch -> (shard of good clips or None, {key: reason} failures, frames used).

    The padded rows are whatever `model.encode_video` returns: zero for models trained here, the encoder's
    features (and v̄ the mean over all rows) for a checkpoint with `cfg.reference_padding`; both are stored as is.
    """
    from gare.model import autocast

    keys = list(batch["keys"])
    if not keys:
        return None, {}, 0
    with autocast(device, precision):
        feats, vbar = model.encode_video(batch["frames"], batch["mask"])
    feats = feats.float().cpu().numpy()
    vbar = vbar.float().cpu().numpy()
    masks = batch["mask"].cpu().numpy().astype(np.uint8)
    norms = np.linalg.norm(vbar.astype(np.float64), axis=1)
    good = np.isfinite(feats).all(axis=(1, 2)) & np.isfinite(vbar).all(axis=1) & (norms > 1e-12)
    failed = {k: "the encoder produced a zero or non-finite embedding" for k, g in zip(keys, good, strict=True) if not g}
    if not good.any():
        return None, failed, 0
    f16 = feats[good].astype(np.float16)
    if not np.isfinite(f16).all():  # float16 overflow (|x| > 65504): a broken model, not a broken file
        raise RuntimeError("frame features overflow float16; the checkpoint produces values above 65504")
    shard = Shard([k for k, g in zip(keys, good, strict=True) if g], f16, vbar[good].astype(np.float32), masks[good])
    return shard, failed, int(masks[good].sum())
