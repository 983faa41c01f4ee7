"""The search's query text encoder: which text tower runs on a device, and the encoder that runs it.

``text_encoder="auto"`` resolves to the measured default of the device (``gare.text_quant``'s
``DEFAULT_CPU_TEXT_ENCODER`` / ``DEFAULT_CUDA_TEXT_ENCODER``) when the text encoder runs at fp32, else to the
model's own tower (``"fp32"``, run at the search precision: fp16/bf16 under autocast on CUDA). A tower that cannot
run where it is asked to raises :class:`TextEncoderError` naming the kind and what to use instead.

:class:`QueryEncoder` holds the model, the precision and the built tower, so a caller (the service's micro-batch
worker, an offline run) encodes with ``encoder.encode(texts)``: the same bits as
``gare_search.query.encode_queries(model, texts, precision, tower=...)``, whatever batch a text comes in. Nothing
here knows the service: arguments are plain values, not its settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gare.model import GARE
from gare.text_quant import (
    CUDA_TEXT_ENCODERS,
    DEFAULT_CPU_TEXT_ENCODER,
    DEFAULT_CUDA_TEXT_ENCODER,
    build_text_encoder,
)
from gare_search.query import encode_queries

log = logging.getLogger(__name__)

__all__ = ["TextEncoderError", "QueryEncoder", "choose_text_encoder", "load_query_encoder", "query_tokenizer"]


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


def query_tokenizer(model: GARE) -> Any:
    """The model's tokenizer (open_clip's, whose ``clean_fn`` is how it normalises a text), built if need be."""
    # gare.model.GARE builds its open_clip tokenizer lazily, on the first tokenize(), and keeps it there
    tok = getattr(model, "_tokenizer", None)
    if tok is None:
        model.tokenize(["warm up"])
        tok = getattr(model, "_tokenizer", None)
    return tok


class QueryEncoder:
    """Texts -> t (a, d) float32 on the model's device, by one tower (``kind``) at one precision."""

    def __init__(self, model: GARE, kind: str, precision: str,
                 tower: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model = model
        self.kind = kind
        self.precision = precision
        self.tower = tower  # a gare.text_quant encoder, or None: the model's own tower at `precision`

    @property
    def variant(self) -> str:
        """What made an embedding (a cache key part): the tower, or the precision of the model's own tower."""
        return self.kind if self.kind != "fp32" else self.precision

    def encode(self, texts: list[str]) -> torch.Tensor:
        """t (a, d) float32 for ``texts``; a text's bits do not depend on the batch it came in (the scheme is in gare.text_quant's docstring)."""
        return encode_queries(self.model, texts, self.precision, tower=self.tower)


def load_query_encoder(model: GARE, kind: str, device: torch.device | str, precision: str) -> QueryEncoder:
    """The encoder for ``kind`` (see :func:`choose_text_encoder`), its tower built now; :class:`TextEncoderError`
    when it cannot be chosen or built."""
    chosen = choose_text_encoder(kind, torch.device(device).type, precision)
    tower = None
    if chosen != "fp32":
        try:
            tower = build_text_encoder(model, chosen)
        except (ImportError, ValueError, RuntimeError) as e:
            raise TextEncoderError(f"cannot build the {chosen} text encoder: {e}") from None
    log.debug("query text encoder: %s (asked %s) at %s", chosen, kind, precision)
    return QueryEncoder(model, chosen, precision, tower)
