"""The search's query text encoder: which text tower runs on a device, and the encoder that runs it.

``text_encoder="auto"`` resolves to the measured default of the device (``gare.text_quant``'s
``DEFAULT_CPU_TEXT_ENCODER`` / ``DEFAULT_CUDA_TEXT_ENCODER``) when the text encoder runs at fp32, else to the
model's own tower (``"fp32"``, run at the search precision: fp16/bf16 under autocast on CUDA). A tower that cannot
run where it is asked to raises :class:`TextEncoderError` naming the kind and what to use instead.

:class:`QueryEncoder` holds the model, the precision and the built tower, so a caller (the service's micro-batch
worker, an offline run) encodes with ``encoder.encode(texts)``: the same bits as
``gare_search.query.encode_queries(model, texts, precision, tower=...)``, whatever batch a text comes in. Nothing
here knows the service: arguments are plain values, not its settings.

How a tower batches (``gare.text_quant``'s docstring has why): int8 and fp32-packed pack rows (CPU); fp16 (CUDA)
and the model's own tower on CUDA run at one fixed shape, ``rows`` texts x the model's query context per
forward, replayed from a CUDA graph (``cuda_graph``); the model's own tower on the CPU runs each text alone,
unless ``scheme="fixed"``. The fixed shape changes the bits (not the graph: same kernels), so it is part of
:attr:`QueryEncoder.variant`; :meth:`QueryEncoder.describe` names the scheme for logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gare.model import GARE
from gare.text_fixed import DEFAULT_ROWS, FixedShapeEncoder, resolve_scheme
from gare.text_quant import (
    CUDA_TEXT_ENCODERS,
    DEFAULT_CPU_TEXT_ENCODER,
    DEFAULT_CUDA_TEXT_ENCODER,
    build_text_encoder,
    model_encoder,
)
from gare_search.query import encode_queries, own_encoder, resolve_precision

log = logging.getLogger(__name__)

__all__ = ["TextEncoderError", "QueryEncoder", "choose_text_encoder", "resolve_encoder", "load_query_encoder",
           "query_tokenizer"]


class TextEncoderError(ValueError):
    """The text tower asked for cannot run here (the message names the kind and what to use instead)."""


def choose_text_encoder(kind: str, device_type: str, precision: str) -> str:
    """The tower that runs for ``kind`` on ``device_type`` ("cpu", "cuda") at ``precision`` (already resolved).

    "auto": the device's measured default at fp32, the model's own tower ("fp32") otherwise. Any other kind is
    checked: a CUDA tower on the CPU (or a CPU tower on CUDA), or a tower of its own arithmetic at a precision
    other than fp32, raises :class:`TextEncoderError`.
    """
    if kind == "auto":
        by_device = {"cpu": DEFAULT_CPU_TEXT_ENCODER, "cuda": DEFAULT_CUDA_TEXT_ENCODER}
        return by_device.get(device_type, "fp32") if precision == "fp32" else "fp32"
    if kind == "fp32":
        return kind
    needs = "cuda" if kind in CUDA_TEXT_ENCODERS else "cpu"
    if device_type != needs:
        use = "use fp16 or fp32 there" if device_type == "cuda" else "use int8 or fp32 there"
        raise TextEncoderError(f"text_encoder={kind!r} is a {needs.upper()} option; the search runs on {device_type} "
                               f"({use})")
    if precision != "fp32":
        raise TextEncoderError(f"text_encoder={kind!r} runs its own arithmetic; use it with precision fp32/auto, "
                               f"not {precision}")
    return kind


def resolve_encoder(kind: str, device: torch.device | str, precision: str) -> tuple[str, str]:
    """(tower, precision) for the settings ``text_encoder`` = ``kind`` and ``precision`` as given (either may be
    "auto") on ``device``; :class:`TextEncoderError` (a ValueError) when they cannot run there.

    A tower of its own arithmetic (int8, fp32-packed, fp16) chosen with precision "auto" runs at its own (fp32
    around it): so both "auto" give the device's measured default tower, whatever ``precision: auto`` resolves
    to for the model's own tower (gare_search.query.AUTO_PRECISION, a separate measured rule). An explicit
    precision keeps its meaning: fp32 with the default tower, a half precision with the model's own tower.
    """
    dev = torch.device(device)
    if precision == "auto":
        tower = choose_text_encoder(kind, dev.type, "fp32")
        if tower != "fp32":
            return tower, "fp32"
    resolved = resolve_precision(precision, dev)
    return choose_text_encoder(kind, dev.type, resolved), resolved


def query_tokenizer(model: GARE) -> Any:
    """The model's tokenizer (open_clip's, whose ``clean_fn`` is how it normalises a text), built if need be."""
    # gare.model.GARE builds its open_clip tokenizer lazily, on the first tokenize(), and keeps it there
    tok = getattr(model, "_tokenizer", None)
    if tok is None:
        model.tokenize(["warm up"])
        tok = getattr(model, "_tokenizer", None)
    return tok


class QueryEncoder:
    """Texts -> t (a, d) float32 on the model's device, by one tower (``kind``) at one precision.

    ``tower``: a gare.text_quant encoder, or None for the model's own tower as :func:`gare_search.query.own_encoder`
    runs it on the model's device by ``scheme`` ("auto": fixed shapes of ``DEFAULT_ROWS`` texts on CUDA, eager;
    each text alone on the CPU)."""

    def __init__(self, model: GARE, kind: str, precision: str,
                 tower: Callable[[torch.Tensor], torch.Tensor] | None = None, *, scheme: str = "auto") -> None:
        self.model = model
        self.kind = kind
        self.precision = precision
        if tower is None and kind == "fp32":
            tower = own_encoder(model, precision, scheme=scheme)  # None: each text alone
        self.tower = tower

    @property
    def rows(self) -> int | None:
        """Texts per forward of a fixed-shape tower, None for the per-text and packed schemes."""
        return self.tower.rows if isinstance(self.tower, FixedShapeEncoder) and self.tower.fixed else None

    @property
    def variant(self) -> str:
        """What made an embedding (a cache key part): the tower, or the precision of the model's own tower, and
        the fixed shape when one runs (it rounds a text other than per text), e.g. "int8", "bf16",
        "fp16@32x32" (the fp16 tower), "model-fp32@32x32" (the model's own tower at fixed shapes)."""
        base = self.kind if self.kind != "fp32" else self.precision
        shape = self.tower.shape_key if isinstance(self.tower, FixedShapeEncoder) else None
        if shape is None:
            return base
        return f"{self.kind}@{shape}" if self.kind != "fp32" else f"model-{self.precision}@{shape}"

    @property
    def scheme(self) -> str:
        """How texts are batched: "per text", "packed rows", "fixed 32x32, CUDA graph" ..."""
        if self.tower is None:
            return "per text"
        return getattr(self.tower, "scheme", "batched")

    def describe(self) -> str:
        """For logs: e.g. "fp32 (the model's own tower at bf16; fixed 32x32, CUDA graph)", "int8 (packed rows)"."""
        if self.kind == "fp32":
            return f"fp32 (the model's own tower at {self.precision}; {self.scheme})"
        return f"{self.kind} ({self.scheme})"

    def encode(self, texts: list[str]) -> torch.Tensor:
        """t (a, d) float32 for ``texts``; a text's bits do not depend on the batch it came in (the scheme is in gare.text_quant's docstring)."""
        # tower None: the model's own tower, each text alone (own_encoder gave None: per text on this device)
        return encode_queries(self.model, texts, self.precision, tower=self.tower, scheme="per-text")


def load_query_encoder(model: GARE, kind: str, device: torch.device | str, precision: str, *,
                       rows: int = DEFAULT_ROWS, scheme: str = "auto", cuda_graph: bool = True) -> QueryEncoder:
    """The encoder for ``kind`` (see :func:`choose_text_encoder`), its tower built now; :class:`TextEncoderError`
    when it cannot be chosen or built.

    ``rows``: texts per forward of a fixed-shape tower (the fp16 tower, and the model's own tower where it runs
    at fixed shapes); ``scheme`` (gare.text_fixed.SCHEMES): how the model's own tower runs ("auto": fixed shapes on
    CUDA, each text alone on the CPU); ``cuda_graph``: replay a fixed-shape forward from a CUDA graph (CUDA only;
    the same bits as eager)."""
    dev = torch.device(device)
    chosen = choose_text_encoder(kind, dev.type, precision)
    graph = cuda_graph and dev.type == "cuda"
    tower = None
    try:
        own_scheme = resolve_scheme(scheme, dev.type)
        if chosen != "fp32":
            tower = build_text_encoder(model, chosen, rows=rows, cuda_graph=graph)
        elif own_scheme == "fixed":
            tower = model_encoder(model, precision, rows=rows, cuda_graph=graph)
    except (ImportError, ValueError, RuntimeError) as e:
        raise TextEncoderError(f"cannot build the {chosen} text encoder: {e}") from None
    encoder = QueryEncoder(model, chosen, precision, tower, scheme=own_scheme)
    log.info("query text encoder: %s (asked %s)", encoder.describe(), kind)
    return encoder
