"""The open_clip backbone: creation by name, weight loading, and the two encoders GARE needs.

`pretrained` is one of:
- an open_clip pretrained tag such as "openai" (downloaded by open_clip where the network allows);
- a local file: an OpenAI TorchScript archive (ViT-B-32.pt), an OpenAI-layout state dict, or an
  open_clip-layout state dict / safetensors file;
- "" or "none": random initialisation (tests, or weights loaded afterwards from a GARE checkpoint).

Our tiny configs are registered through open_clip's own config mechanism (`add_model_config`), so the
tests build the backbone through exactly the same `open_clip.create_model` call as ViT-B-32.
"""

from __future__ import annotations

import functools
import logging
import os
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gare.config import ModelConfig

log = logging.getLogger(__name__)

_CONFIG_DIR = Path(__file__).parent / "model_configs"


@functools.cache
def open_clip_module() -> ModuleType:
    """open_clip, imported on first use with our configs registered. Importing it costs seconds of CPU (it pulls
    in torchvision and torch._dynamo): a process that never builds a backbone or a tokenizer (gare-serve's
    supervisor and HTTP workers, shard replicas, most gare-index commands) never pays it."""
    import open_clip  # on first use, not at import time (see above)

    open_clip.add_model_config(_CONFIG_DIR)
    return open_clip

NO_WEIGHTS = ("", "none", "None", None)


def _is_torchscript_archive(path: str) -> bool:
    # OpenAI's released .pt files are TorchScript zip archives holding a `code/` folder and `constants.pkl`.
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    return any(n.endswith("constants.pkl") for n in names) and any("/code/" in n for n in names)


def load_openai_torchscript_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read the weights of an OpenAI TorchScript archive. TorchScript loading does not run Python pickle
    reduce hooks (it deserialises TorchScript IR and tensors), so this stays within the no-pickle rule."""
    jit_model = torch.jit.load(path, map_location="cpu")
    sd = {k: v.detach().clone() for k, v in jit_model.state_dict().items()}
    for key in ("input_resolution", "context_length", "vocab_size"):
        sd.pop(key, None)
    return sd


class _DropRandomInitWarning(logging.Filter):
    """open_clip warns "No pretrained weights loaded ... initialized randomly" on the root logger; when we
    build an empty backbone on purpose (to load a GARE checkpoint into it) that warning is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()


def create_clip(cfg: ModelConfig, pretrained: str | None = None) -> torch.nn.Module:
    """Build the open_clip CLIP model for `cfg` and load `pretrained` (defaults to cfg.pretrained)."""
    open_clip = open_clip_module()
    pretrained = cfg.pretrained if pretrained is None else pretrained
    if cfg.backbone not in open_clip.list_models():
        raise ValueError(f"unknown open_clip model {cfg.backbone!r}; see open_clip.list_models()")
    kw = dict(force_quick_gelu=cfg.quick_gelu, force_image_size=cfg.image_size)
    if pretrained in NO_WEIGHTS or os.path.isfile(str(pretrained)):
        quiet = _DropRandomInitWarning()
        logging.getLogger().addFilter(quiet)
        try:
            model = open_clip.create_model(cfg.backbone, pretrained=None, **kw)
        finally:
            logging.getLogger().removeFilter(quiet)
        if pretrained not in NO_WEIGHTS:
            load_clip_weights(model, str(pretrained))
    else:
        # A tag such as "openai": open_clip resolves, downloads (weights_only loading) and checks it.
        model = open_clip.create_model(cfg.backbone, pretrained=pretrained, weights_only=True, **kw)
    embed_dim = model.text_projection.shape[1]
    if embed_dim != cfg.embed_dim:
        raise ValueError(f"backbone {cfg.backbone} has embed_dim {embed_dim}, config says {cfg.embed_dim}")
    if model.context_length < cfg.max_words:
        raise ValueError(f"max_words={cfg.max_words} exceeds the text context length {model.context_length}")
    return model


def load_clip_weights(model: torch.nn.Module, path: str) -> None:
    """Load CLIP weights from a local file in any of the supported layouts (strict: every key must match)."""
    if _is_torchscript_archive(path):
        sd = load_openai_torchscript_state_dict(path)
        if "logit_scale" in sd and sd["logit_scale"].ndim != model.logit_scale.ndim:
            sd["logit_scale"] = sd["logit_scale"].reshape(model.logit_scale.shape)
        model.load_state_dict(sd, strict=True)
    else:
        # open_clip's loader: torch.load(weights_only=True) or safetensors, OpenAI or open_clip layout.
        open_clip_module().factory.load_checkpoint(model, path, strict=True, weights_only=True)
    log.info("loaded CLIP weights from %s", path)


def clip_dims(model: torch.nn.Module) -> dict[str, int]:
    """Sizes the temporal transformer copies from the text tower."""
    return {
        "text_width": model.transformer.width,
        "text_layers": len(model.transformer.resblocks),
        "text_heads": model.transformer.resblocks[0].attn.num_heads,
        "context_length": model.positional_embedding.shape[0],
        "embed_dim": model.text_projection.shape[1],
    }


def encode_text_tokens(clip: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (a, L) int64, L <= context length -> t (a, d): the projected feature at the EOT token.

    open_clip's `encode_text` wants the full 77-token context; we run the same modules on L tokens with the
    positional embedding and causal mask sliced to L, which is what the reference does with 32 words. Under a
    causal mask the EOT feature does not depend on the padding after it, so this equals open_clip's result.
    """
    L = tokens.shape[1]
    cast_dtype = clip.transformer.get_cast_dtype()
    x = clip.token_embedding(tokens).to(cast_dtype)  # (a, L, w)
    x = x + clip.positional_embedding[:L].to(cast_dtype)
    x = clip.transformer(x, attn_mask=clip.attn_mask[:L, :L])
    x = clip.ln_final(x)
    x = x[torch.arange(x.shape[0], device=x.device), tokens.argmax(dim=-1)]  # EOT has the largest id
    return x @ clip.text_projection


def encode_images(clip: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """images (n, 3, H, W) normalised -> (n, d) projected CLS features."""
    return clip.encode_image(images)


def get_tokenizer(cfg: ModelConfig) -> Any:
    return open_clip_module().get_tokenizer(cfg.backbone, context_length=cfg.max_words)
