"""What the search path reads of a model, as Protocols: :class:`PsiModel` (the psi rerank: psi's weights, the
config, the device) and :class:`SearchModel` (a text or example query: the towers too).

:class:`gare.model.GARE` is both; the Ray shard replica's psi-only model (``gare_serve.ray_serve.shard_replica``)
is a :class:`PsiModel`. Typing the search against these instead of ``Any`` names the few members it uses, so a
reader (and a type checker) sees what a stand-in must provide.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gare.config import ModelConfig
from gare.psi import Psi


class PsiModel(Protocol):
    """A model the psi rerank can fold: psi (its weights give the fold), the config (``temp``, sizes,
    ``reference_padding``) and the device psi is on."""

    @property
    def psi(self) -> Psi: ...

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def device(self) -> torch.device: ...


class SearchModel(PsiModel, Protocol):
    """A model a query is encoded with: the tokenizer, the text tower and the video tower (by example, by image)."""

    def tokenize(self, texts: list[str]) -> torch.Tensor: ...

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def encode_video(self, frames: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
