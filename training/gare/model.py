"""The GARE model (SPEC §1-2): open_clip backbone, seqTransf temporal transformer, psi, block-wise scoring.

Public API used by the indexer and the service (a texts, b videos, f = cfg.max_frames, d = cfg.embed_dim):
- `GARE.build(cfg)` / `gare.checkpoint.load_model(path)`;
- `model.tokenize(list[str]) -> (a, L) int64`;
- `model.encode_text(tokens) -> t (a, d)`;
- `model.encode_video(frames (b, f, 3, H, W), mask (b, f)) -> (F (b, f, d), v̄ (b, d))`;
- `model.score(t, F, mask, vbar=None, kv=None, block=...) -> s (a, b)`; `return_delta=True` adds Δ (a, b, d);
- `model.video_kv(F) -> (K, V)`: psi's per-video projections, cacheable;
- `autocast(device, precision)`: bf16/fp16 autocast context for encoding.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from gare import backbone
from gare.config import ModelConfig
from gare.psi import Psi, masked_mean, pair_scores

log = logging.getLogger(__name__)

LOGIT_SCALE_MAX = 4.605170185988092  # ln(100): CLIP's clamp


class TemporalTransformer(nn.Module):
    """CLIP4Clip seqTransf: frame features + position embeddings -> CLIP residual blocks -> + input."""

    def __init__(self, width: int, layers: int, heads: int, num_positions: int, quick_gelu: bool) -> None:
        super().__init__()
        self.heads = heads
        self.frame_position_embeddings = nn.Embedding(num_positions, width)
        oc = backbone.open_clip_module()  # the CLIP blocks; open_clip is imported when a model is built, not before
        self.transformer = oc.transformer.Transformer(
            width, layers, heads, act_layer=oc.model.QuickGELU if quick_gelu else nn.GELU, batch_first=True
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (b, f, d), mask (b, f) -> (b, f, d)."""
        b, f, _ = x.shape
        if f > self.frame_position_embeddings.num_embeddings:
            raise ValueError(f"{f} frames exceed the {self.frame_position_embeddings.num_embeddings} positions")
        h = x + self.frame_position_embeddings.weight[:f].unsqueeze(0)
        # Additive key mask (b*heads, f, f) as the reference builds it: padded frames are never attended to.
        key_mask = (1.0 - mask.to(h.dtype))[:, None, :].expand(b, f, f) * -1e6
        key_mask = key_mask.repeat_interleave(self.heads, dim=0)
        return self.transformer(h, attn_mask=key_mask) + x


class GARE(nn.Module):
    def __init__(self, cfg: ModelConfig, clip: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.clip = clip
        dims = backbone.clip_dims(clip)
        if cfg.temporal_layers > dims["text_layers"]:
            raise ValueError(f"temporal_layers={cfg.temporal_layers} > text layers {dims['text_layers']}")
        if dims["text_width"] != cfg.embed_dim:
            # seqTransf runs on projected features; it can only start from the text blocks if widths match.
            raise ValueError(
                f"{cfg.backbone}: text width {dims['text_width']} != embed_dim {cfg.embed_dim}; "
                "the temporal transformer is initialised from the text blocks and needs equal widths"
            )
        self.temporal = TemporalTransformer(
            cfg.embed_dim, cfg.temporal_layers, dims["text_heads"], dims["context_length"], cfg.quick_gelu
        )
        self.psi = Psi(cfg.embed_dim, cfg.psi_heads, cfg.psi_dropout)
        self._init_temporal_from_text()
        self._tokenizer = None

    @classmethod
    def build(cls, cfg: ModelConfig, pretrained: str | None = None) -> GARE:
        """Create the model; `pretrained` overrides cfg.pretrained (use "none" before loading a checkpoint)."""
        return cls(cfg, backbone.create_clip(cfg, pretrained))

    def _init_temporal_from_text(self) -> None:
        # The initialisation trick that makes fine-tuning from CLIP work: position embeddings from the text
        # positional embedding, the blocks from the first text blocks.
        with torch.no_grad():
            self.temporal.frame_position_embeddings.weight.copy_(self.clip.positional_embedding)
            for dst, src in zip(self.temporal.transformer.resblocks, self.clip.transformer.resblocks, strict=False):
                dst.load_state_dict(src.state_dict())

    # ---------------------------------------------------------------- encoders
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        if self._tokenizer is None:
            self._tokenizer = backbone.get_tokenizer(self.cfg)
        return self._tokenizer(texts)

    @property
    def device(self) -> torch.device:
        return self.clip.logit_scale.device

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (a, L) -> t (a, d) float32."""
        return backbone.encode_text_tokens(self.clip, tokens.to(self.device)).float()

    def encode_video(self, frames: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """frames (b, f, 3, H, W), mask (b, f) -> F (b, f, d) with padded rows zeroed, v̄ (b, d), float32."""
        b, f = frames.shape[:2]
        mask = mask.to(self.device)
        x = backbone.encode_images(self.clip, frames.to(self.device).flatten(0, 1)).view(b, f, -1)
        x = self.temporal(x, mask).float()
        if self.cfg.reference_padding:
            # Imported checkpoints were trained on the padded rows' features (what the encoder makes of a
            # blank frame) and the plain mean over all rows; keep both so their scores are reproduced.
            return x, x.mean(dim=1)
        # Padded rows carry only what the encoder made of blank frames; zero them so nothing downstream
        # (pooling, psi, storage) can depend on them.
        x = x * mask.to(x.dtype).unsqueeze(-1)
        return x, masked_mean(x, mask)

    # ---------------------------------------------------------------- scoring
    def video_kv(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.psi.video_kv(frames)

    def pair_logits(
        self, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor, vbar: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training path over one (global) batch: s (a, b) and Δ (a, b, d), which the losses need."""
        s, delta = pair_scores(self.psi, t, frames, mask, self.cfg.temp, vbar=vbar, return_delta=True,
                               reference_padding=self.cfg.reference_padding)
        assert delta is not None
        return s, delta

    def score(
        self,
        t: torch.Tensor,
        frames: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        vbar: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        block_texts: int = 128,
        block_videos: int = 128,
        return_delta: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """s (a, b) for every text against every video, block by block.

        Δ is never materialised beyond one (block_texts, block_videos, d) block unless `return_delta`
        asks for it (for the deviation figures on small inputs). Inputs may be fp16/bf16 (stored features);
        the computation runs in float32 on `t`'s device.
        """
        dev = t.device
        a, b = t.shape[0], frames.shape[0]
        out = torch.empty(a, b, device=dev)
        deltas = torch.empty(a, b, t.shape[1], device=dev) if return_delta else None
        for j0 in range(0, b, block_videos):
            j1 = min(j0 + block_videos, b)
            fr = frames[j0:j1].to(dev, torch.float32)
            mk = None if mask is None else mask[j0:j1].to(dev)
            if vbar is not None:
                vb = vbar[j0:j1].to(dev, torch.float32)
            else:
                vb = fr.mean(dim=1) if self.cfg.reference_padding else masked_mean(fr, mk)
            kvb = self.psi.video_kv(fr) if kv is None else (kv[0][j0:j1].to(dev, torch.float32), kv[1][j0:j1].to(dev, torch.float32))
            for i0 in range(0, a, block_texts):
                i1 = min(i0 + block_texts, a)
                s, d = pair_scores(
                    self.psi, t[i0:i1], fr, mk, self.cfg.temp, vbar=vb, kv=kvb, return_delta=return_delta,
                    reference_padding=self.cfg.reference_padding,
                )
                out[i0:i1, j0:j1] = s
                if deltas is not None:
                    deltas[i0:i1, j0:j1] = d
        return (out, deltas) if return_delta else out

    def clamp_logit_scale(self) -> None:
        with torch.no_grad():
            self.clip.logit_scale.clamp_(0, LOGIT_SCALE_MAX)

    def param_groups(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """Named parameters split into the CLIP backbone and the new modules (they get different lrs)."""
        groups: dict[str, list[tuple[str, nn.Parameter]]] = {"clip": [], "new": []}
        for name, p in self.named_parameters():
            groups["clip" if name.startswith("clip.") else "new"].append((name, p))
        return groups


@contextlib.contextmanager
def autocast(device: torch.device | str, precision: str = "fp32") -> Iterator[None]:
    """precision: fp32 | bf16 | fp16. bf16 is fast on CPUs with AVX512-bf16; fp16 is for CUDA only."""
    device = torch.device(device)
    if precision == "fp32":
        yield
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if dtype is torch.float16 and device.type != "cuda":
        raise ValueError("fp16 autocast is only supported on CUDA; use bf16 on CPU")
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def resolve_device(name: str | None = None) -> torch.device:
    """'auto' / None -> cuda when present, else cpu."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
