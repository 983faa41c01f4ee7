"""The text towers a search can run instead of the model's own: int8 and packed fp32 on the CPU, fp16 on CUDA.

The query path needs only CLIP's text tower (token embedding, causal transformer, ln_final, projection at
the EOT token; :func:`gare.backbone.encode_text_tokens`). :class:`TextTower` is a stand-alone copy of
it whose attention projections are plain ``nn.Linear`` layers (PyTorch's ``nn.MultiheadAttention`` keeps
them as a raw ``in_proj_weight``), so that every matrix product of the blocks can be replaced.

Towers (:func:`build_text_encoder`, ``kind``), one per device, each the measured default there:
- ``"int8"`` (CPU): :class:`Int8TextTower`, the tower with every block Linear (q/k/v, out, c_fc, c_proj) an
  :class:`Int8Linear`: weights 7-bit int8 per output channel, activations quantised per token at run time,
  the products summed exactly in int32 (``torch._int_mm``) and rescaled in float32;
- ``"fp32-packed"`` (CPU): the float32 tower on packed rows (``gare.text_packed``): the model's weights and
  arithmetic, each text's rows in GEMMs over the whole batch (of 16 to 256 rows), so a batch of texts costs a
  fraction of the texts one at a time; it rounds like a 16+-row product, not like the model's own tower on one
  text (~1e-6 apart);
- ``"fp16"`` (CUDA): :class:`TextTower` with its weights stored in half precision on the model's GPU (no
  autocast casts per layer: at the service's batch sizes the tower is launch-bound, and autocast's casts made
  fp16 slower than fp32 there); the projection to t stays fp32.
The model's own tower (``GARE.encode_text``) is the exact reference and the search's ``"fp32"`` option: per text
(:func:`encode_each`) or at fixed shapes (:func:`model_encoder`), below. Asking for int8 on a CUDA model or fp16
on the CPU raises :class:`ValueError`.

Every encoder is a callable ``tokens (a, L) int64 -> t (a, d) float32`` on the model's device, L <= context
length; the embedding is un-normalised like ``GARE.encode_text`` (psi needs |t|).

Batch invariance: a text's embedding is the same bits whatever else is in its batch and however far
the batch is padded. A batched float GEMM's rounding may depend on the row count M (MKL/oneDNN/cuBLAS pick
their blocking and kernels by shape), attention and activations see the padded length, and a dynamic int8
scale taken over the batch depends on the other texts; so "alone" and "in a batch" are made the same
computation by construction (per text, packed rows) or the same kernel launches (fixed shapes, where a row's
independence of its place and neighbours is checked on the device at build). The scheme of each tower on each
device:
- the model's own tower (``"fp32"``, at the search precision) on CUDA, and the fp16 tower (CUDA only): fixed
  shapes (``gare.text_fixed.FixedShapeEncoder``, :func:`model_encoder`): tokens padded to the model's query
  context (``cfg.max_words``, what its tokenizer pads to) and texts in chunks of ``rows`` (default 32) padded
  with filler rows, so every forward has the one shape (rows, context) and a text alone runs the same kernels as
  beside 31 others; optionally replayed from a CUDA graph (same kernels, same bits). Why: a GPU forward at
  query sizes is launch-bound, so per text 32 texts cost ~32x one, and at a fixed shape ~1x. A row's bits not
  depending on its place and neighbours within one launch is checked when the encoder is built (probe texts);
  a device that fails runs each text alone instead, with a warning;
- the model's own tower on the CPU: each text alone at its own length (:func:`encode_each`, the shapes it has
  when sent alone), by default: a CPU forward is compute-bound, and padding to a fixed shape would multiply its
  work; the fixed-shape scheme is selectable there too (``scheme="fixed"``, the code the GPU runs);
- int8 and fp32-packed (CPU): the texts' tokens are packed back to back without padding (T rows); every op on
  the packed rows computes each row on its own, and what mixes rows runs per text (``gare.text_packed``). int8's
  products are exact integer sums, so its rows are independent by construction; fp32-packed's float GEMMs are
  checked for it on the machine when the tower is built, and a tower that fails the check runs each text alone
  instead, with a warning. This keeps the towers' batching, which a batch of one would lose.
Per text and fixed shapes give a text other bits (other shapes, other rounding; ~1e-6 apart at fp32), each
invariant on its own, so the scheme is part of what made an embedding (``gare_search.text_encoder``'s variant).
The guarantee is per machine and thread count (a different CPU or GPU, or ``torch.set_num_threads``, may
round differently, for a text alone as in a batch).
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gare.text_fixed import DEFAULT_ROWS, FixedShapeEncoder, autocast_tower, encode_each
from gare.text_packed import Fp32RowLinear, PackedTextTower, rows_independent, token_lengths

log = logging.getLogger(__name__)

TEXT_ENCODERS = ("int8", "fp32-packed", "fp16")  # the towers built here; "fp32" is the model's own tower
CUDA_TEXT_ENCODERS = ("fp16",)  # half-precision weights on the GPU; int8 runs on the CPU
# The measured defaults, each the winner of its device's rule (speed side by side, and R@1 within 0.5 point of the
# model's fp32 tower on every evaluated split); tests/test_evidence.py checks them against the committed
# measurements. The service's `text_encoder: auto` uses them at fp32 precision, the model's own tower otherwise.
DEFAULT_CPU_TEXT_ENCODER = "int8"
DEFAULT_CUDA_TEXT_ENCODER = "fp16"

# Quantised values |q| <= 63 (7 bits) for weights and activations. CPUs without VNNI (AVX2, AVX512 without
# VNNI) multiply u8 x s8 byte pairs into a saturating int16 (vpmaddubsw), and oneDNN feeds them s8 data shifted
# by +128; with full-range int8 a pair sum can pass 32767 and the "exact" int32 sum is then wrong (measured with
# ONEDNN_MAX_CPU_ISA=AVX2). With both operands <= 63 in magnitude a pair is at most 2 * (63 + 128) * 63 = 24066,
# so every x86 kernel sums exactly, and float32 holds the int32 sums exactly up to K = 2^24 / 63^2 = 4227.
QMAX = 63

# The texts a fixed-shape encoder checks its device with (FixedShapeEncoder.check): short, middling, and one that
# fills any query context, so that a row's place and its neighbours' lengths both vary.
PROBE_TEXTS = ("a", "a man plays the guitar on a stage at night",
               "a yellow square sits still, then a violet plus sign bounces quickly across a black screen while "
               "two small red circles move slowly to the left and a green line grows from the bottom to the top")

__all__ = ["TEXT_ENCODERS", "CUDA_TEXT_ENCODERS", "DEFAULT_CPU_TEXT_ENCODER", "DEFAULT_CUDA_TEXT_ENCODER", "QMAX", "half_tower", "TextTower",
           "Int8Linear", "Int8TextTower", "fp32_packed_encoder", "token_lengths", "encode_each", "build_text_encoder", "quantize_int8",
           "DEFAULT_ROWS", "PROBE_TEXTS", "query_context", "model_encoder", "describe"]


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
            f"text encoder {kind!r} is a CPU option; the model is on {dev}. On CUDA use fp16 or the model's "
            "own tower (fp32)"
        )


class Int8Linear(nn.Module):
    """``nn.Linear`` on the CPU in int8, row by row: (T, K) float32 -> (T, N) float32.

    Weights: symmetric int8 per output channel (|q| <= QMAX), fixed at build time. Activations: symmetric int8
    per row (token), scale = the row's max |x| / QMAX, so a row's codes depend on that row alone. The int8
    products are summed in int32 by ``torch._int_mm``, which is exact whatever order or blocking the kernel
    uses; the rescale (row scale, channel scale, bias) is one correctly rounded float op at a time, the same
    for an element wherever it sits. Row i of the output is therefore a function of row i of the input only.
    """

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        w = lin.weight.detach().float().cpu()  # (N, K)
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / QMAX  # (N,)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8))  # (N, K)
        self.register_buffer("weight_scale", scale)
        bias = lin.bias.detach().float().cpu().clone() if lin.bias is not None else torch.zeros(w.shape[0])
        self.register_buffer("bias", bias)  # (N,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (T, 1): the row's max |x| (exact) / QMAX; a zero row gets a tiny scale and codes 0
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(QMAX)
        q = torch.round(x / scale).to(torch.int8)  # (T, K); |x / scale| <= QMAX up to rounding, so |q| <= QMAX
        y = torch._int_mm(q, self.weight.t()).float()  # (T, N) exact int32 sums
        y *= scale
        y *= self.weight_scale
        y += self.bias
        return y


class Int8TextTower(PackedTextTower):
    """:class:`TextTower` with int8 block Linears on packed rows, batch-invariant by construction (module
    docstring; the packing is ``gare.text_packed``'s)."""

    def __init__(self, tower: TextTower) -> None:
        super().__init__(tower, Int8Linear)


def quantize_int8(tower: TextTower) -> Int8TextTower:
    """``tower`` with every block Linear in int8 (:class:`Int8Linear`), as :class:`Int8TextTower`."""
    return Int8TextTower(tower)


class _TorchEncoder:
    """A torch tower as an encoder. ``per_text``: run each text alone at its own length (:func:`encode_each`);
    off only for a tower that is batch-invariant itself (:class:`Int8TextTower`)."""

    def __init__(self, tower: nn.Module, kind: str, device: torch.device | str = "cpu", *, per_text: bool = True) -> None:
        self.tower = tower
        self.kind = kind
        self.device = torch.device(device)
        self.per_text = per_text

    @property
    def scheme(self) -> str:
        return "per text" if self.per_text else "packed rows"

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device)
        with torch.inference_mode():
            return (encode_each(self.tower, tokens) if self.per_text else self.tower(tokens)).float()


def fp32_packed_encoder(tower: PackedTextTower) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fp32-packed encoder of a packed float32 tower: batched when this machine's GEMM passes
    ``rows_independent``, else one text at a time (``encoder.per_text``), invariant either way."""
    failures = rows_independent(tower)
    if failures:  # this machine's GEMM rounds a row by its batch: one text at a time keeps the guarantee
        log.warning("text encoder fp32-packed: this CPU's float GEMM is not row-independent (%s); encoding one "
                    "text at a time (the same bits, without the batching's speed)", failures[0])
    return _TorchEncoder(tower, "fp32-packed", per_text=bool(failures))


def query_context(model: nn.Module) -> int:
    """The token length a query is tokenized to: a GARE model's ``cfg.max_words`` (its tokenizer pads to it),
    else the CLIP text context (``context_length``, what open_clip's tokenizer pads to)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "max_words", None):
        return int(cfg.max_words)
    clip = getattr(model, "clip", model)
    return int(getattr(clip, "context_length", clip.positional_embedding.shape[0]))


def _model_device(model: nn.Module) -> torch.device:
    dev = getattr(model, "device", None)
    return torch.device(dev) if dev is not None else next(model.parameters()).device


def _probe(model: nn.Module) -> torch.Tensor | None:
    """PROBE_TEXTS tokenized by the model (None for a model without a tokenizer: no device check)."""
    tokenize = getattr(model, "tokenize", None)
    if tokenize is None:
        log.info("text encoder: %s has no tokenize(); the fixed-shape device check is skipped", type(model).__name__)
        return None
    return tokenize(list(PROBE_TEXTS))


def model_encoder(model: nn.Module, precision: str = "fp32", *, rows: int = DEFAULT_ROWS, cuda_graph: bool = False,
                  check: bool = True) -> FixedShapeEncoder:
    """The model's own tower (``model.encode_text`` under ``precision``'s autocast) at the fixed shape
    (rows, :func:`query_context`) on the model's device (``gare.text_fixed``). ``check``: probe the device at
    build (PROBE_TEXTS). The encoder refers to the model weakly (a cache of encoders must not keep models alive);
    with ``cuda_graph`` it reads the weights where they were at capture (moving the model afterwards makes a call
    raise)."""
    dev = _model_device(model)
    ref = weakref.ref(model)

    def encode(tokens: torch.Tensor) -> torch.Tensor:  # (rows, L) -> (rows, d) float32
        m = ref()
        if m is None:
            raise RuntimeError("the model of this text encoder is gone")
        return m.encode_text(tokens)

    # what the text tower reads (not the video tower, temporal transformer or psi): checked before each replay
    clip = getattr(model, "clip", model)
    weights = [t for n, t in [*clip.named_parameters(), *clip.named_buffers()] if not n.startswith("visual.")]
    return FixedShapeEncoder(autocast_tower(encode, dev, precision), rows, query_context(model), dev,
                             cuda_graph=cuda_graph, probe=_probe(model) if check else None,
                             weights=weights if cuda_graph else (),
                             kind=f"model-{precision}")


def half_tower(model: nn.Module, kind: str) -> TextTower:
    """A :class:`TextTower` on the model's GPU with every weight but the final projection in fp16."""
    dtype = {"fp16": torch.float16}[kind]
    dev = torch.device(getattr(model, "device", None) or next(model.parameters()).device)
    if dev.type != "cuda":
        raise ValueError(f"text encoder {kind!r} (half-precision weights) is a CUDA option; the "
                         f"model is on {dev}. On the CPU use int8 or the model's own tower (fp32)")
    tower = TextTower.from_model(model).to(dev)
    for m in (tower.token_embedding, tower.blocks, tower.ln_final):
        m.to(dtype)
    tower.positional_embedding = tower.positional_embedding.to(dtype)
    tower.attn_mask = tower.attn_mask.to(dtype)
    return tower.eval()


def build_text_encoder(model: nn.Module, kind: str = DEFAULT_CPU_TEXT_ENCODER, *, rows: int = DEFAULT_ROWS,
                       cuda_graph: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """The text tower ``kind`` of a GARE model: ``tokens (a, L) -> t (a, d) float32`` on its device.

    ``rows``, ``cuda_graph``: the CUDA towers' fixed shape (rows texts per forward) and whether its forward is
    replayed from a CUDA graph (module docstring); the CPU towers pack rows and ignore both."""
    if kind not in TEXT_ENCODERS:
        raise ValueError(f"unknown text encoder {kind!r}; choose one of {', '.join(TEXT_ENCODERS)} "
                         "(or the model's own tower)")
    if kind in CUDA_TEXT_ENCODERS:
        tower = half_tower(model, kind)
        # the encoder owns the tower (its own copy of the weights): nothing can move them under a graph
        return FixedShapeEncoder(tower, rows, query_context(model), tower.text_projection.device,
                                 cuda_graph=cuda_graph, probe=_probe(model), kind=kind)
    _check_cpu(model, kind)
    if kind == "fp32-packed":
        return fp32_packed_encoder(PackedTextTower(TextTower.from_model(model), Fp32RowLinear))
    return _TorchEncoder(quantize_int8(TextTower.from_model(model)), kind, per_text=False)


def describe(encoder: Any) -> str:
    """An encoder's kind and scheme, for logs: e.g. "int8 (packed rows)", "fp16 (fixed 32x32, CUDA graph)"."""
    kind = getattr(encoder, "kind", None) or type(encoder).__name__
    scheme = getattr(encoder, "scheme", None)
    return f"{kind} ({scheme})" if scheme else kind
