"""`gare-train fit`'s options: :class:`TrainConfig` (defaults < preset < YAML < flags), the named
:data:`PRESETS` and the optimizers it may name; which fields may change when a run resumes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from gare.strict_fields import strict_from_dict
from gare_train.data import REFERENCE_RANDAUGMENT
from gare_train.ncl_logits import NCL_TRAIN_MODES


@dataclass
class TrainConfig:
    model: str = "gare-vit-b-32"  # a registered ModelConfig name
    model_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {"pretrained": "/path/ViT-B-32.pt"}
    init_checkpoint: str | None = None  # start from a GARE checkpoint's weights (fine-tuning)
    data: dict[str, Any] = field(default_factory=dict)  # see gare_train.data.load_dataset
    out_dir: str = "runs/gare"
    epochs: int = 5
    max_steps: int | None = None  # stop early (smoke tests, time-boxed benchmarks)
    batch_size: int = 128  # global batch
    lr: float = 1e-4
    coef_lr: float = 1e-3  # CLIP parameters train at lr * coef_lr
    warmup_proportion: float = 0.1
    weight_decay: float = 0.2
    grad_clip: float = 1.0  # global gradient norm; with bertadam also each tensor's (the reference: 1.0 and 1.0)
    # "adamw": torch AdamW with the project's warm-up cosine; "bertadam": the authors' optimizer and schedule
    # (gare_train.optim: no bias correction, per-tensor clipping, their warmup_cosine), for exact reproduction.
    optimizer: str = "adamw"
    loss: dict[str, float] = field(default_factory=dict)  # LossConfig overrides
    queue_size: int = 16384
    ncl_train: bool = False  # train with Sinkhorn-adjusted logits (NCL §3.3)
    ncl_iters: int = 4
    ncl_train_mode: str = "batch"  # "batch": the paper's biases of the current batch; "queue": the earlier form
    precision: str = "fp32"  # fp32 | bf16 | fp16 (CUDA)
    device: str = "auto"
    num_workers: int = 2
    seed: int = 42
    val_fraction: float = 0.1
    save_every: int = 0  # steps; 0: only at epoch ends
    log_every: int = 10
    # "captions": one example per caption per epoch (the authors' loaders); "clips": one per clip (legacy).
    epoch: str = "captions"
    # Training-frame augmentation: "randaugment" (the authors' rand-m7-n4, same ops on every frame of a clip)
    # or "none". Evaluation and indexing never augment.
    augment: str = "randaugment"
    augment_spec: str = REFERENCE_RANDAUGMENT
    # The authors keep CLIP's patch-embedding conv frozen while fine-tuning.
    freeze_patch_embed: bool = True
    # Decode every training and validation clip once and keep its frames in memory (float32,
    # clips x max_frames x 3 x image_size^2; 160 clips of 4 x 32^2 frames: 8 MB) instead of decoding each clip
    # again every epoch. Only without augmentation (augmented frames differ every epoch). Small corpora only.
    cache_frames: bool = False
    # Stop when the validation t2v R@1 (the value that picks best.safetensors) has not improved for this
    # many epochs in a row; 0: never stop early. The cosine schedule still spans `epochs`.
    early_stop_patience: int = 0
    preset: str | None = None  # a PRESETS name whose values sit under the YAML and the flags

    # Fields that may change on resume without changing the run.
    RESUMABLE_CHANGES = ("out_dir", "num_workers", "device", "save_every", "log_every", "max_steps", "epochs",
                         "cache_frames", "early_stop_patience")

    def __post_init__(self) -> None:
        if self.cache_frames and self.augment != "none":
            raise ValueError(f"cache_frames needs augment 'none' (augmented frames differ every epoch), got augment {self.augment!r}")
        if self.early_stop_patience < 0:
            raise ValueError(f"early_stop_patience must be >= 0 (0: off), got {self.early_stop_patience}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.ncl_train_mode not in NCL_TRAIN_MODES:
            raise ValueError(f"ncl_train_mode must be one of {', '.join(NCL_TRAIN_MODES)}, got {self.ncl_train_mode!r}")

    def fingerprint(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in self.RESUMABLE_CHANGES:
            d.pop(k, None)
        if d.get("optimizer") == "adamw":
            del d["optimizer"]  # states saved before the field existed trained with AdamW and still resume
        return d

    @classmethod
    def from_sources(cls, yaml_path: str | None, overrides: dict[str, Any]) -> TrainConfig:
        d: dict[str, Any] = {}
        if yaml_path:
            with open(yaml_path) as fh:
                d = yaml.safe_load(fh) or {}
        d.update({k: v for k, v in overrides.items() if v is not None})
        preset = d.get("preset")
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
            d = {**PRESETS[preset], **d}
        return strict_from_dict(cls, d, "training options")


OPTIMIZERS = ("adamw", "bertadam")

# Named bundles of TrainConfig values (defaults < preset < YAML < flags).
PRESETS: dict[str, dict[str, Any]] = {
    # The TrainConfig defaults: the authors' MSR-VTT recipe, which assumes OpenAI CLIP weights.
    "reference": {},
    # From random initialisation (no CLIP weights): the whole network at one learning rate, no augmentation,
    # patch embedding trainable. These values were measured to learn on the synthetic corpus of
    # `gare-train synth`; the reference lr x 1e-3 for the backbone barely moves
    # a random backbone.
    "scratch": {"lr": 5e-4, "coef_lr": 1.0, "batch_size": 64, "warmup_proportion": 0.1,
                "augment": "none", "freeze_patch_embed": False},
}
