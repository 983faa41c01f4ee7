"""Import a checkpoint saved by the authors' public GARE training code.

Their `pytorch_model.bin.N` is `torch.save(model.state_dict())` of a model holding:
`clip.*` (OpenAI CLIP layout), `frame_position_embeddings.weight`, `transformerClip.resblocks.*`,
`psi.*` (a `layers` list of cross-attention blocks, `mean_proj`, `log_std_proj`), the same psi again under
`agent.psi.*`, and heads no forward pass uses (`weight_fc.*`, each block's `linear2` and `mlp`).
We load it with `weights_only=True` (tensors only), infer every size from the tensors, map each tensor to
our layout or report it as deliberately dropped, and refuse anything we do not recognise.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gare.backbone import open_clip_module
from gare.checkpoint import save_checkpoint
from gare.config import ModelConfig
from gare.model import GARE

log = logging.getLogger(__name__)

_PSI_LAYER_MAP = {
    "layer_norm1": "ln1",
    "cross_attn.q_proj": "q",
    "cross_attn.k_proj": "k",
    "cross_attn.v_proj": "v",
    "cross_attn.out_proj": "o",
    "layer_norm2": "ln2",
    "linear1": "ffn",
    "layer_norm3": "ln3",
}
_PSI_UNUSED = ("linear2", "mlp")  # defined in each reference block, never called in its forward
_CLIP_META = ("input_resolution", "context_length", "vocab_size")


@dataclass
class ImportReport:
    config: ModelConfig
    mapped: dict[str, str] = field(default_factory=dict)  # official key -> our key
    dropped: dict[str, str] = field(default_factory=dict)  # official key -> reason

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for r in self.dropped.values():
            reasons[r] = reasons.get(r, 0) + 1
        lines = [f"mapped {len(self.mapped)} tensors; dropped {len(self.dropped)}:"]
        lines += [f"  {n:4d} x {r}" for r, n in sorted(reasons.items())]
        return "\n".join(lines)


def load_official_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = str(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        sd = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
    if not isinstance(sd, dict) or not sd:
        raise ValueError(f"{path}: expected a non-empty state dict, got {type(sd).__name__}")
    if all(k.startswith("module.") for k in sd):  # saved from a DDP wrapper
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def _count_blocks(sd: dict[str, torch.Tensor], prefix: str) -> int:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    idx = {int(m.group(1)) for k in sd if (m := pat.match(k))}
    return max(idx) + 1 if idx else 0


def infer_clip_dims(sd: dict[str, torch.Tensor]) -> dict[str, int]:
    """Sizes of an OpenAI-layout CLIP state dict (keys without the `clip.` prefix)."""
    try:
        patch = sd["visual.conv1.weight"].shape[-1]
        grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        return {
            "embed_dim": sd["text_projection"].shape[1],
            "image_size": patch * grid,
            "vision_layers": _count_blocks(sd, "visual.transformer.resblocks."),
            "vision_width": sd["visual.conv1.weight"].shape[0],
            "patch_size": patch,
            "context_length": sd["positional_embedding"].shape[0],
            "vocab_size": sd["token_embedding.weight"].shape[0],
            "text_width": sd["ln_final.weight"].shape[0],
            "text_layers": _count_blocks(sd, "transformer.resblocks."),
        }
    except KeyError as e:
        raise ValueError(f"not an OpenAI-layout ViT CLIP state dict: missing {e}") from None


def match_open_clip_model(dims: dict[str, int]) -> str:
    """The open_clip config whose sizes equal `dims` (heads follow OpenAI's width // 64 convention)."""
    open_clip = open_clip_module()  # with our configs registered: the matcher searches them too
    candidates = []
    for name in open_clip.list_models():
        cfg = open_clip.get_model_config(name)
        if not cfg:
            continue
        v, t = cfg.get("vision_cfg", {}), cfg.get("text_cfg", {})
        if "timm_model_name" in v or "hf_model_name" in t or cfg.get("custom_text"):
            continue
        if not isinstance(v.get("layers"), int) or isinstance(v.get("image_size"), (list, tuple)):
            continue
        same = (
            cfg.get("embed_dim") == dims["embed_dim"]
            and v.get("image_size") == dims["image_size"]
            and v.get("layers") == dims["vision_layers"]
            and v.get("width") == dims["vision_width"]
            and v.get("patch_size") == dims["patch_size"]
            and v.get("head_width", 64) == 64
            and t.get("context_length", 77) == dims["context_length"]
            and t.get("vocab_size", 49408) == dims["vocab_size"]
            and t.get("width", 512) == dims["text_width"]
            and t.get("heads", 8) == dims["text_width"] // 64
            and t.get("layers", 12) == dims["text_layers"]
            and not any(k in v for k in ("ls_init_value", "no_ln_pre", "attentional_pool", "pool_type", "final_ln_after_pool", "global_average_pool"))
        )
        if same:
            candidates.append(name)
    if not candidates:
        raise ValueError(f"no open_clip config has these sizes: {dims}")
    # Prefer the plain name (ViT-B-32 over ViT-B-32-quickgelu); QuickGELU is set through the ModelConfig.
    candidates.sort(key=lambda n: ("quickgelu" in n, len(n), n))
    return candidates[0]


def convert_official_state_dict(
    sd: dict[str, torch.Tensor],
    *,
    max_frames: int = 12,
    max_words: int = 32,
    temp: float = 3.0,
    video_framerate: float = 1.0,
    backbone: str | None = None,
) -> tuple[dict[str, torch.Tensor], ImportReport]:
    clip_sd = {k[len("clip."):]: v for k, v in sd.items() if k.startswith("clip.")}
    dims = infer_clip_dims(clip_sd)
    n_temporal = _count_blocks(sd, "transformerClip.resblocks.")
    if n_temporal == 0:
        raise ValueError("no transformerClip.resblocks.*: only the seqTransf variant is supported")
    psi_layers = _count_blocks(sd, "psi.layers.")
    if psi_layers == 0:
        raise ValueError("no psi.layers.*: this does not look like a GARE checkpoint")
    cfg = ModelConfig(
        backbone=backbone or match_open_clip_model(dims),
        pretrained="none",
        quick_gelu=True,  # OpenAI CLIP and the reference temporal blocks use QuickGELU
        embed_dim=dims["embed_dim"],
        max_words=max_words,
        max_frames=max_frames,
        video_framerate=video_framerate,
        image_size=dims["image_size"],
        temporal_layers=n_temporal,
        temp=temp,
        psi_heads=1,
        reference_padding=True,  # score short clips as the authors' code trained and scored them
    )
    report = ImportReport(cfg)
    out: dict[str, torch.Tensor] = {}
    # The reference psi feeds the original gap to every layer and keeps the last layer's output only.
    last = psi_layers - 1

    def put(src: str, dst: str) -> None:
        out[dst] = sd[src].detach().clone().float()
        report.mapped[src] = dst

    for k in sd:
        if k.startswith("clip."):
            name = k[len("clip."):]
            if name in _CLIP_META:
                report.dropped[k] = "CLIP metadata, not a weight"
            else:
                put(k, f"clip.{name}")
        elif k == "frame_position_embeddings.weight":
            put(k, "temporal.frame_position_embeddings.weight")
        elif k.startswith("transformerClip.resblocks."):
            put(k, "temporal.transformer." + k[len("transformerClip."):])
        elif k.startswith("agent.psi."):
            twin = k[len("agent."):]
            if twin in sd and not torch.equal(sd[twin], sd[k]):
                raise ValueError(f"{k} differs from {twin}; the reference shares one psi")
            report.dropped[k] = "duplicate of psi.* (agent.psi is the same module)"
        elif k.startswith("psi.layers."):
            m = re.match(r"psi\.layers\.(\d+)\.(.+)\.(weight|bias)$", k)
            if not m:
                raise ValueError(f"unrecognised psi tensor {k}")
            layer, sub, kind = int(m.group(1)), m.group(2), m.group(3)
            if sub.split(".")[0] in _PSI_UNUSED:
                report.dropped[k] = "psi block head never used in the forward pass"
            elif layer != last:
                report.dropped[k] = "psi layer whose output the reference discards"
            elif sub in _PSI_LAYER_MAP:
                put(k, f"psi.{_PSI_LAYER_MAP[sub]}.{kind}")
            else:
                raise ValueError(f"unrecognised psi tensor {k}")
        elif k.startswith("psi.mean_proj."):
            put(k, "psi.mu." + k.rsplit(".", 1)[1])
        elif k.startswith("psi.log_std_proj."):
            put(k, "psi.log_sigma." + k.rsplit(".", 1)[1])
        elif k.startswith("weight_fc."):
            report.dropped[k] = "unused head (weight_fc)"
        else:
            raise ValueError(f"unrecognised tensor {k!r} in the official checkpoint")
    if "clip.logit_scale" in out and out["clip.logit_scale"].ndim == 1:
        out["clip.logit_scale"] = out["clip.logit_scale"].reshape(())
    return out, report


def import_official(src: str | Path, out: str | Path, **kw) -> ImportReport:
    """Convert the authors' checkpoint at `src` into a GARE checkpoint at `out`."""
    sd = load_official_state_dict(src)
    new_sd, report = convert_official_state_dict(sd, **kw)
    model = GARE.build(report.config, pretrained="none")
    missing, unexpected = model.load_state_dict(new_sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"converted weights do not fit: missing={missing} unexpected={unexpected}")
    save_checkpoint(
        out,
        model,
        train_args={},
        info={"imported_from": str(src), "dropped": report.dropped},
    )
    return report
