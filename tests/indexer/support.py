"""Shared helpers for the indexer and robustness tests (holds no tests; the `ckpt`/`corpus` fixtures are in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from tests.checkout import CHECKOUT_PATH
from tests.psi_weights import randomize_psi

REPO = Path(__file__).resolve().parents[2]
N_VIDEOS = 12


def make_checkpoint(path: Path, *, queue: bool = True, seed: int = 0) -> Path:
    """A tiny GARE checkpoint with non-trivial psi weights and (optionally) a 256 x 64 text queue."""
    from gare.checkpoint import save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(seed)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    randomize_psi(model.psi)
    queues = {"text": torch.randn(256, 64, generator=torch.Generator().manual_seed(seed + 1))} if queue else None
    save_checkpoint(path, model, queues=queues)
    return path


def make_corpus(directory: Path, n: int = N_VIDEOS, seed: int = 0) -> Path:
    """n short real mp4 files (32x32, 2 s at 8 fps) under directory/videos; returns that folder."""
    from gare_train.synth import SynthConfig, generate_corpus

    generate_corpus(directory, SynthConfig(n_videos=n, seed=seed, width=32, height=32, duration=2.0, fps=8.0,
                                           captions_per_video=1), progress=False)
    return directory / "videos"


def make_long_video(path: Path, seconds: float = 12.0, fps: float = 4.0, size: int = 32, seed: int = 0) -> Path:
    from gare_train.synth import write_video

    rng = np.random.default_rng(seed)
    t = int(seconds * fps)
    # a slowly changing colour field, so every window of the video looks different
    base = rng.integers(0, 255, size=(1, 1, 1, 3))
    ramp = np.linspace(0, 200, t)[:, None, None, None]
    frames = ((base + ramp + rng.normal(0, 3, size=(t, size, size, 3))) % 255).astype(np.uint8)
    return write_video(path, frames, fps)


def copy_videos(src: Path, dst: Path, names: list[str] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*.mp4")):
        if names is None or p.name in names:
            shutil.copy2(p, dst / p.name)
    return dst


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = CHECKOUT_PATH + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("GARE_INDEX_TEST_PAUSE", None)
    return env


def reseal(vdir: Path) -> None:
    """Seal a version's manifest.json as it now is (gare_index.store.seal): a test that edits a manifest by hand, to
    make it say something another check must catch, keeps it sealed so that this other check is the one exercised."""
    from gare_index.store.seal import write_seal

    write_seal(vdir, (vdir / "manifest.json").read_bytes())
