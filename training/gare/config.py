"""Named, typed model configurations and their registry.

A `ModelConfig` fully describes the network (backbone, sizes, psi) so that a checkpoint can rebuild it
without any training code. `gare-test-tiny` is registered exactly like the real `gare-vit-b-32` so that
tests exercise the real entry points on CPU in seconds (timm's `test_vit` pattern).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from gare.strict_fields import strict_from_dict


@dataclass(frozen=True)
class ModelConfig:
    # open_clip model name (any name open_clip knows, or one registered in gare.backbone).
    backbone: str = "ViT-B-32"
    # "openai", another open_clip pretrained tag, a local file path, or "" / "none" for random weights.
    pretrained: str = "openai"
    # Use QuickGELU activations (OpenAI CLIP weights need it; open_clip appends "-quickgelu").
    quick_gelu: bool = True
    embed_dim: int = 512  # d: the joint embedding width
    max_words: int = 32  # text context length (tokens incl. SOT/EOT)
    max_frames: int = 12  # f
    video_framerate: float = 1.0  # frames decoded per second before thinning to max_frames
    image_size: int = 224
    temporal_layers: int = 4  # seqTransf blocks, initialised from CLIP's first text blocks
    temp: float = 3.0  # text-conditioned pooling temperature
    psi_heads: int = 1  # the reference psi uses a single head
    psi_dropout: float = 0.3
    # How padded frame rows (clips shorter than max_frames) enter the score. False (models trained here):
    # padded rows are zeroed and masked everywhere. True (checkpoints from the authors' code, set by
    # `gare-train import-official`): as they were trained, v̄ is the plain mean over all max_frames rows
    # and psi attends over all rows, padded ones included (their features are what the encoder makes of
    # a blank frame, so they must be kept, also in an index); pooling still ignores them.
    reference_padding: bool = False

    def __post_init__(self) -> None:
        if self.embed_dim <= 0 or self.embed_dim % self.psi_heads:
            raise ValueError(f"embed_dim={self.embed_dim} must be positive and divisible by psi_heads={self.psi_heads}")
        if self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {self.max_frames}")
        if self.max_words < 3:
            raise ValueError(f"max_words must be >= 3, got {self.max_words}")
        if self.temp <= 0:
            raise ValueError(f"temp must be > 0, got {self.temp}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return strict_from_dict(cls, d)

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def fingerprint(self) -> str:
        """A stable string that identifies the architecture (not the weights source)."""
        d = self.to_dict()
        d.pop("pretrained")
        return json.dumps(d, sort_keys=True)


@dataclass(frozen=True)
class LossConfig:
    beta: float = 1e-4  # L_IB weight (summed-KL convention)
    lambda_dir: float = 0.01
    alpha: float = 2.0  # L_dir sharpness
    lambda_eps: float = 0.01
    lambda_lower: float = 0.5  # L_eps truncation

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_MODEL_REGISTRY: dict[str, ModelConfig] = {}


def register_model(name: str, cfg: ModelConfig) -> ModelConfig:
    if name in _MODEL_REGISTRY:
        raise ValueError(f"model config {name!r} is already registered")
    _MODEL_REGISTRY[name] = cfg
    return cfg


def get_model_config(name: str, **overrides: Any) -> ModelConfig:
    try:
        cfg = _MODEL_REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model config {name!r}; known: {sorted(_MODEL_REGISTRY)}") from None
    return cfg.replace(**overrides) if overrides else cfg


def list_model_configs() -> list[str]:
    return sorted(_MODEL_REGISTRY)


# The reference setting (SPEC §1-3): ViT-B/32 with OpenAI weights.
register_model("gare-vit-b-32", ModelConfig())
register_model("gare-vit-b-16", ModelConfig(backbone="ViT-B-16"))
# A tiny open_clip config (registered in gare.backbone) that runs the same code path on CPU in seconds.
register_model(
    "gare-test-tiny",
    ModelConfig(
        backbone="gare-test-tiny",
        pretrained="none",
        embed_dim=64,
        max_words=16,
        max_frames=6,
        image_size=32,
        temporal_layers=2,
    ),
)
# Small but real: the tiny backbone widened, for the CPU demo and benchmark corpus.
register_model(
    "gare-cpu-small",
    ModelConfig(
        backbone="gare-cpu-small",
        pretrained="none",
        embed_dim=128,
        max_words=24,
        max_frames=8,
        image_size=64,
        temporal_layers=2,
        video_framerate=2.0,  # the synthetic clips are a few seconds long
    ),
)
# Trained from scratch on 2 CPU cores within the README demo's time to first search (the demo's model until
# gare-cpu-demo-cnn below; bench/compose_e2e's trainer still uses it). Smaller than
# gare-cpu-small where the synthetic clips allow it (32 px frames, 4 per clip, width 64, two blocks per
# tower, one temporal block), but with room for the whole caption (32 tokens: a third of the synthetic
# captions are longer than 20).
register_model(
    "gare-cpu-demo",
    ModelConfig(
        backbone="gare-cpu-demo",
        pretrained="none",
        embed_dim=64,
        max_words=32,
        max_frames=4,
        image_size=32,
        temporal_layers=1,
        video_framerate=2.0,
    ),
)
# The README demo's model since the convolutional image tower: gare-cpu-demo with open_clip's ModifiedResNet (one
# bottleneck block a stage, width 16, attention pooling; open_clip builds it when vision layers is a list) in place
# of the 2-block ViT. With ~600 training videos a from-scratch ViT missed shape and motion within the right colour
# and background; the convolutions' locality fixes most of that (measurements: gare_demo.demo).
register_model("gare-cpu-demo-cnn", get_model_config("gare-cpu-demo").replace(backbone="gare-cpu-demo-cnn"))
