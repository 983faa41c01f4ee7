"""Faster CPU text towers for serving: int8 dynamic quantisation and ONNX Runtime, as explicit options.

The query path needs only CLIP's text tower (token embedding, causal transformer, ln_final, projection at
the EOT token; :func:`training.backbone.encode_text_tokens`). :class:`TextTower` is a stand-alone copy of
it whose attention projections are plain ``nn.Linear`` layers (PyTorch's ``nn.MultiheadAttention`` keeps
them as a raw ``in_proj_weight`` and a ``NonDynamicallyQuantizableLinear``, which dynamic quantisation
skips), so that every matrix product of the blocks can be quantised and the graph exports cleanly.

Encoders (:func:`build_text_encoder`, ``kind``):
- ``"fp32"``: :class:`TextTower` in float32 (numerically the model's own encoder, up to summation order);
- ``"int8"``: the same with every block Linear (q/k/v, out, c_fc, c_proj) replaced by a dynamically
  quantised int8 Linear (weights int8 per tensor, activations quantised per batch at run time, fp32
  accumulate-and-rescale). Built with ``torch.ao.quantization.quantize_dynamic``; torch 2.14 marks that
  API deprecated in favour of torchao (``quantize_`` with ``Int8DynamicActivationInt8WeightConfig``),
  which is not a dependency and was not benchmarked here; the deprecation warning is silenced at this
  one call, and a torch release that drops the API makes ``kind="int8"`` fail when the encoder is built;
- ``"onnx"`` / ``"onnx-int8"``: the fp32 tower exported with ``torch.onnx.export`` and run by ONNX Runtime
  (optionally with ORT's own dynamic int8 quantisation of the MatMuls). Needs the ``onnx`` extra.

Those four are CPU-only: asking for int8/onnx on a CUDA model raises :class:`ValueError`. For CUDA:
- ``"fp16"`` / ``"bf16"``: :class:`TextTower` with its weights stored in half precision on the model's GPU
  (no autocast casts per layer: at the service's batch sizes the tower is launch-bound, and autocast's casts
  made fp16 slower than fp32 there; bench/results/gpu_bench.md measures both); the projection to t stays fp32.

Every encoder is a callable ``tokens (a, L) int64 -> t (a, d) float32`` on the model's device (the CPU for
the CPU kinds), L <= context length; the embedding is un-normalised like ``GARE.encode_text`` (psi needs |t|).

Fidelity and speed: ``bench/text_encoder.py`` -> ``bench/results/text_encoder.md``; the CPU default below
is chosen from those numbers.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

TEXT_ENCODERS = ("fp32", "int8", "onnx", "onnx-int8", "fp16", "bf16")
CUDA_TEXT_ENCODERS = ("fp16", "bf16")  # half-precision weights on the GPU; the others run on the CPU
# Chosen from bench/results/text_encoder.md (see the "Choice" section there; tests/service/test_serve_scale.py
# checks that this constant is the committed report's choice). The service's `text_encoder: auto` uses it on
# the CPU at fp32 precision and the model's own tower (fp32/fp16/bf16) everywhere else.
DEFAULT_CPU_TEXT_ENCODER = "int8"
# The same on CUDA, from bench/results/gpu_bench.md (tests/indexer/test_device_defaults.py checks it): the
# fastest of the model's own tower at fp32 and the half-precision towers at one query and at 32.
DEFAULT_CUDA_TEXT_ENCODER = "fp16"

__all__ = ["TEXT_ENCODERS", "CUDA_TEXT_ENCODERS", "DEFAULT_CPU_TEXT_ENCODER", "DEFAULT_CUDA_TEXT_ENCODER", "half_tower", "TextTower", "build_text_encoder", "quantize_int8", "OnnxTextEncoder"]


class _Attention(nn.Module):
    """Causal multi-head self-attention with q/k/v and output as nn.Linear (quantisable, exportable)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        if not mha._qkv_same_embed_dim or mha.in_proj_weight is None:
            raise ValueError("only self-attention with a packed in_proj is supported")
        w = mha.embed_dim
        self.heads = mha.num_heads
        self.qkv = nn.Linear(w, 3 * w, bias=mha.in_proj_bias is not None)
        self.out = nn.Linear(w, w, bias=mha.out_proj.bias is not None)
        with torch.no_grad():
            self.qkv.weight.copy_(mha.in_proj_weight)
            if mha.in_proj_bias is not None:
                self.qkv.bias.copy_(mha.in_proj_bias)
            self.out.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.out.bias.copy_(mha.out_proj.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (a, L, w), mask (L, L) additive -> (a, L, w)."""
        a, L, w = x.shape
        q, k, v = self.qkv(x).view(a, L, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (a, h, L, w/h)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (a, h, L, w/h)
        return self.out(y.transpose(1, 2).reshape(a, L, w))


class _Block(nn.Module):
    def __init__(self, blk: nn.Module) -> None:
        super().__init__()
        if not isinstance(blk.attn, nn.MultiheadAttention) or hasattr(blk, "ln_1_kv"):
            raise ValueError(f"unsupported text block {type(blk).__name__}")
        self.ln_1 = copy.deepcopy(blk.ln_1)
        self.attn = _Attention(blk.attn)
        self.ls_1 = copy.deepcopy(blk.ls_1)
        self.ln_2 = copy.deepcopy(blk.ln_2)
        self.mlp = copy.deepcopy(blk.mlp)  # c_fc (Linear), gelu, c_proj (Linear)
        self.ls_2 = copy.deepcopy(blk.ls_2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x), mask))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class TextTower(nn.Module):
    """CLIP's text tower alone, in float32 on the CPU: tokens (a, L) -> t (a, d), as encode_text_tokens."""

    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        self.token_embedding = copy.deepcopy(clip.token_embedding).float().cpu()
        self.register_buffer("positional_embedding", clip.positional_embedding.detach().float().cpu().clone())
        self.register_buffer("attn_mask", clip.attn_mask.detach().float().cpu().clone())  # (ctx, ctx), -inf above
        self.blocks = nn.ModuleList(_Block(b) for b in clip.transformer.resblocks).float().cpu()
        self.ln_final = copy.deepcopy(clip.ln_final).float().cpu()
        # kept as a plain fp32 matmul: one (w, d) product per query, negligible, and not worth its error
        self.register_buffer("text_projection", clip.text_projection.detach().float().cpu().clone())
        self.eval()

    @classmethod
    def from_model(cls, model: nn.Module) -> TextTower:
        """From a GARE model (``model.clip``) or an open_clip CLIP model."""
        return cls(getattr(model, "clip", model))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        L = tokens.shape[1]
        x = self.token_embedding(tokens) + self.positional_embedding[:L]  # (a, L, w)
        mask = self.attn_mask[:L, :L]
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.ln_final(x)
        # EOT has the largest token id; gather its feature (a, w)
        eot = tokens.argmax(dim=-1)
        x = x[torch.arange(x.shape[0], device=x.device), eot]
        return x.to(self.text_projection.dtype) @ self.text_projection  # (a, d), fp32 even for a half tower


def _check_cpu(model: nn.Module, kind: str) -> None:
    dev = getattr(model, "device", None)
    if dev is None:
        p = next(model.parameters(), None)
        dev = p.device if p is not None else torch.device("cpu")
    if torch.device(dev).type != "cpu":
        raise ValueError(
            f"text encoder {kind!r} is a CPU option (int8 / ONNX Runtime on CPU); the model is on {dev}. "
            "On CUDA use precision fp16 or bf16 (autocast) instead"
        )


def quantize_int8(tower: TextTower) -> TextTower:
    """A copy of ``tower`` with every block Linear dynamically quantised to int8 (weights per tensor)."""
    from torch.ao.quantization import quantize_dynamic

    q = copy.deepcopy(tower)
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao (see the module docstring for why it
        # is still used here); the warnings say nothing about this call's correctness.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        q.blocks = quantize_dynamic(q.blocks, {nn.Linear}, dtype=torch.qint8)
    return q.eval()


class _TorchEncoder:
    def __init__(self, tower: nn.Module, kind: str, device: torch.device | str = "cpu") -> None:
        self.tower = tower
        self.kind = kind
        self.device = torch.device(device)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.tower(tokens.to(self.device)).float()


def half_tower(model: nn.Module, kind: str) -> TextTower:
    """A :class:`TextTower` on the model's GPU with every weight but the final projection in fp16 or bf16."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    dev = torch.device(getattr(model, "device", None) or next(model.parameters()).device)
    if dev.type != "cuda":
        raise ValueError(f"text encoder {kind!r} (half-precision weights) is a CUDA option; the "
                         f"model is on {dev}. On the CPU use fp32, int8 or onnx")
    tower = TextTower.from_model(model).to(dev)
    for m in (tower.token_embedding, tower.blocks, tower.ln_final):
        m.to(dtype)
    tower.positional_embedding = tower.positional_embedding.to(dtype)
    tower.attn_mask = tower.attn_mask.to(dtype)
    return tower.eval()


class OnnxTextEncoder:
    """The fp32 :class:`TextTower` exported to ONNX and run by ONNX Runtime (optionally int8-quantised)."""

    def __init__(self, tower: TextTower, *, int8: bool = False, threads: int | None = None, path: str | os.PathLike | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError("the onnx text encoder needs onnxruntime: pip install 'gare-search[onnx]'") from e
        self.kind = "onnx-int8" if int8 else "onnx"
        tmp = None
        if path is None:
            tmp = tempfile.TemporaryDirectory(prefix="gare-onnx-")
            path = Path(tmp.name) / "text.onnx"
        path = Path(path)
        export_onnx(tower, path)
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            qpath = path.with_name(path.stem + ".int8.onnx")
            quantize_dynamic(str(path), str(qpath), weight_type=QuantType.QInt8)
            path = qpath
        so = ort.SessionOptions()
        if threads is not None:
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.path = path
        self._tmp = tmp  # keeps the files while the session lives

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {"tokens": tokens.cpu().numpy().astype("int64", copy=False)})[0]
        return torch.from_numpy(out).float()


def export_onnx(tower: TextTower, path: str | os.PathLike) -> Path:
    """Write ``tower`` as ONNX with dynamic batch and length (tokens (a, L) int64 -> t (a, d))."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.ones(2, 8, dtype=torch.int64)
    example[:, -1] = tower.token_embedding.num_embeddings - 1  # an EOT-like largest id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            tower,
            (example,),
            str(path),
            input_names=["tokens"],
            output_names=["t"],
            dynamic_axes={"tokens": {0: "a", 1: "L"}, "t": {0: "a"}},
            dynamo=False,
            opset_version=17,
        )
    return path


def build_text_encoder(model: nn.Module, kind: str = DEFAULT_CPU_TEXT_ENCODER, *, threads: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A CPU text encoder ``tokens (a, L) -> t (a, d) float32`` of the given kind for a GARE model.

    ``threads`` applies to ONNX Runtime sessions (torch uses ``torch.set_num_threads``).
    """
    if kind not in TEXT_ENCODERS:
        raise ValueError(f"unknown text encoder {kind!r}; choose one of {', '.join(TEXT_ENCODERS)}")
    if kind in CUDA_TEXT_ENCODERS:
        tower = half_tower(model, kind)
        return _TorchEncoder(tower, kind, tower.text_projection.device)
    _check_cpu(model, kind)
    tower = TextTower.from_model(model)
    if kind == "fp32":
        return _TorchEncoder(tower, kind)
    if kind == "int8":
        return _TorchEncoder(quantize_int8(tower), kind)
    return OnnxTextEncoder(tower, int8=kind == "onnx-int8", threads=threads)


def describe(encoder: Any) -> str:
    return getattr(encoder, "kind", type(encoder).__name__)
