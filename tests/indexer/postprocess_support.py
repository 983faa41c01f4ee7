"""Shared helpers for tests/indexer/test_postprocess_*.py (holds no tests): a tiny checkpoint with both NCL queues
(text and video, what InvGC uses as Q̂ and Ĝ), a captioned synthetic corpus of real mp4 files, and a plain
index with the folded NCL stage 1 (:func:`make_postprocess_env`, built once per test run by the session fixture
``postprocess_env`` in tests/indexer/conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.psi_weights import randomize_psi

D = 64  # gare-test-tiny's embedding size


def make_checkpoint_with_queues(path: Path, *, seed: int = 0, video_queue: bool = True) -> Path:
    from gare.checkpoint import save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(seed)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    randomize_psi(model.psi)
    g = torch.Generator().manual_seed(seed + 1)
    queues = {"text": torch.randn(256, D, generator=g)}
    if video_queue:
        queues["video"] = torch.randn(300, D, generator=g) * 3.0  # un-normalised, like v̄
    save_checkpoint(path, model, queues=queues, train_args={"seed": 0, "val_fraction": 0.25})
    return path


def make_postprocess_env(root: Path) -> dict[str, Any]:
    """{root, checkpoint, corpus (synth folder with captions), videos, index (plain + --ncl-stage1)} under `root`;
    read-only for tests (copy what you change)."""
    from gare_build.build import BuildOptions, build
    from gare_train.synth import SynthConfig, generate_corpus

    ckpt = make_checkpoint_with_queues(root / "tiny.safetensors")
    info = generate_corpus(root / "corpus", SynthConfig(n_videos=14, seed=0, width=32, height=32, duration=2.0,
                                                        fps=8.0, captions_per_video=2), progress=False)
    index = root / "index"
    build(str(ckpt), info["videos_dir"], str(index), BuildOptions(workers=0, progress=False, ncl_stage1=True))
    return dict(root=root, checkpoint=ckpt, corpus=Path(info["out_dir"]), videos=Path(info["videos_dir"]), index=index)


def copy_index(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def queues(ckpt: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ĝ, Q̂) = the checkpoint's video and text queues, unit rows."""
    from gare.checkpoint import read_checkpoint

    ck = read_checkpoint(ckpt)
    return (torch.nn.functional.normalize(ck.queues["video"].float(), dim=1),
            torch.nn.functional.normalize(ck.queues["text"].float(), dim=1))
