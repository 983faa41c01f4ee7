"""Query encoding for the search: texts -> un-normalised text embeddings t and their unit rows (stage 0).

psi needs |t| (the gap v̄ - t and the pooling softmax(t·F / temp) depend on it), so :func:`encode_queries`
returns t as the text tower gives it; stage 1 uses the unit rows (:func:`unit_rows`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from gare.model import autocast
from gare.model_protocols import SearchModel
from gare.text_fixed import DEFAULT_ROWS, FixedShapeEncoder, resolve_scheme
from gare.text_quant import encode_each, model_encoder

log = logging.getLogger(__name__)

# The "auto" precision of the model's own text tower: fp32 on the CPU (fp16 is CUDA-only; bf16 is slow on AVX2);
# on CUDA fp32, the exact one, unless a half precision measures faster at both 1 and 32 queries per call, then the
# fastest of those (tests/test_evidence.py holds the rule against bench/results/gpu_bench.md): bf16, since the
# fixed-shape tower is replayed as a CUDA graph. The service's default tower on CUDA is the fp16 tower whatever
# this says (gare_search.text_encoder.resolve_encoder): a precision left "auto" does not displace it.
AUTO_PRECISION = {"cpu": "fp32", "cuda": "bf16"}


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """'auto' -> AUTO_PRECISION for the device type (as measured); fp16 only on CUDA."""
    dev = torch.device(device)
    if precision == "auto":
        return AUTO_PRECISION.get(dev.type, "fp32")
    if precision == "fp16" and dev.type != "cuda":
        raise ValueError(f"precision fp16 is only supported on CUDA, not on {dev.type!r}; use bf16 or fp32 there")
    return precision


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a stage's wall time includes it (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trim_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Drop the padding columns after the longest text of the batch.

    CLIP's text transformer is causal and t is read at the EOT token, so nothing after a text's EOT can
    change its embedding (gare.backbone.encode_text_tokens makes the same argument for L < 77):
    a 10-word query then costs ~14 token positions instead of max_words (32).
    """
    nonzero = (tokens != 0).any(dim=0)
    if not bool(nonzero.any()):
        return tokens
    last = int(torch.nonzero(nonzero).max()) + 1
    return tokens[:, :last]


# model -> {(device, precision, rows): its own tower at fixed shapes}, built (and its device checked) once per
# model; weak keys, and the encoders refer to their model weakly, so a model's entry goes with it
_FIXED: weakref.WeakKeyDictionary[SearchModel, dict[tuple[str, str, int], FixedShapeEncoder]] = weakref.WeakKeyDictionary()


def own_encoder(model: SearchModel, precision: str = "fp32", *, scheme: str = "auto",
                rows: int = DEFAULT_ROWS) -> FixedShapeEncoder | None:
    """The model's own tower as ``scheme`` runs it on the model's device (gare.text_fixed.SCHEMES; "auto": fixed
    shapes on CUDA, per text elsewhere): a fixed-shape encoder (eager, built once per model, device, precision
    and rows), or None for per text (:func:`encode_queries` runs :func:`gare.text_quant.encode_each`)."""
    if resolve_scheme(scheme, model.device.type) == "per-text":
        return None
    key = (str(model.device), precision, int(rows))
    built = _FIXED.setdefault(model, {})
    if key not in built:
        built[key] = model_encoder(model, precision, rows=rows)
    return built[key]


def encode_queries(
    model: SearchModel,
    texts: Sequence[str],
    precision: str = "fp32",
    *,
    trim: bool = True,
    tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scheme: str = "auto",
    rows: int = DEFAULT_ROWS,
) -> torch.Tensor:
    """Texts -> t (a, d) float32 on the model's device (un-normalised: psi needs |t|).

    Batch-invariant: a text's embedding is the same bits alone or in any batch (the schemes are in
    gare.text_quant's docstring), so the service's micro-batches, its query cache and this offline path
    agree. `tower`: a gare.text_quant encoder (int8, fp32-packed, fp16, or the model's own at fixed shapes:
    batch-invariant themselves) instead of the model's own encoder under `precision`'s autocast, which runs as
    `scheme` says (:func:`own_encoder`: on CUDA at fixed shapes of `rows` texts, on the CPU each text alone at its
    own length, unless `scheme` says otherwise).
    `trim=False` (the model's own encoder only): the whole batch in one call at the full context length,
    what training computes; not batch-invariant, a reference for comparisons.
    """
    if not texts:
        return torch.zeros(0, model.cfg.embed_dim, device=model.device)
    tokens = model.tokenize(list(texts))
    if tower is None and trim:
        tower = own_encoder(model, precision, scheme=scheme, rows=rows)
    if tower is not None:
        return tower(tokens).to(model.device).float()
    with torch.inference_mode(), autocast(model.device, precision):
        t = encode_each(model.encode_text, tokens) if trim else model.encode_text(tokens)
    return t.float()


def unit_rows(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """Rows of t scaled to unit length, float32 numpy (the stage-1 query vectors)."""
    x = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    x = x.astype(np.float32, copy=False)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
