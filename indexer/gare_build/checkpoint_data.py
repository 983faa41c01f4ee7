"""The training data a checkpoint names (``train_args["data"]``, the spec `gare-train fit` read), found again here.

The spec's paths were written relative to wherever training ran; InvGC's validation split
(:func:`gare_build.invgc_fit.load_validation`) and the fresh NCL queue's captions
(:func:`gare_build.ncl_queues.training_captions`) both read that data at build time, from another folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["resolve_data_root"]


def resolve_data_root(spec: Mapping[str, Any], ckpt_path: str | os.PathLike | None) -> dict[str, Any]:
    """A training data spec with relative paths resolved against the cwd, then the checkpoint's parents."""
    spec = dict(spec)
    keys = [k for k in ("root", "anno_dir", "videos_dir", "data_json", "train", "test") if spec.get(k)]
    bases = [Path.cwd()]
    if ckpt_path:
        bases += list(Path(ckpt_path).absolute().parents)[:4]
    for k in keys:
        p = Path(spec[k]).expanduser()
        if p.is_absolute():
            continue
        for b in bases:
            if (b / p).exists():
                spec[k] = str((b / p).absolute())
                break
    return spec
