"""NCL's training-time score adjustment (NCL §3.3, Eq. 12): ``sim*_ij = a_i + b_j + s_ij`` with Sinkhorn-Knopp biases.

Two sources for the biases:

- ``batch`` (the paper: "NCL computes the optimal biases for the current batch of examples and uses the adjusted
  similarity score for learning"): Fig. 4 on the batch's own score matrix ``s`` (the pair scores the loss ranks
  by, psi's in GARE), both the text biases ``a`` and the video biases ``b`` added;
- ``queue`` (this project's earlier form, kept for comparison): video biases only, fitted to the dual-tower
  cosines of the text queue (past queries) plus the batch's texts against the batch's videos.

The biases are constants of the step (computed without gradient): the loss's gradient reaches the encoders through
``s`` alone, as for the paper's "optimal biases" of a fixed batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gare.sinkhorn import sinkhorn_biases, sinkhorn_blocks

__all__ = ["NCL_TRAIN_MODES", "batch_adjusted", "queue_adjusted"]

NCL_TRAIN_MODES = ("batch", "queue")


def batch_adjusted(s: Tensor, gamma: float, n_iters: int) -> Tensor:
    """``s`` (B_t, B_v) pair scores (before the logit scale) -> ``s + a[:, None] + b[None, :]``, with ``(a, b)`` NCL's
    Fig. 4 biases of ``s`` at temperature ``gamma`` (log domain; the iterates of the naive form)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    with torch.no_grad():
        logits = (s.detach().float() / gamma).contiguous()  # (B_t, B_v)
        a, b = sinkhorn_blocks(lambda lo, hi: logits[:, lo:hi], logits.shape[0], logits.shape[1], gamma, n_iters,
                               logits.shape[1], logits.device)
    return s + a.to(s)[:, None] + b.to(s)[None, :]


def queue_adjusted(s: Tensor, queue: Tensor, t: Tensor, vbar: Tensor, gamma: float, n_iters: int) -> Tensor:
    """``s`` (B, B) + the video biases fitted to the cosines of [queue (Q, d); t (B, d)] against ``vbar`` (B, d)."""
    with torch.no_grad():
        q = torch.cat([queue.to(t.device), t.detach()])
        _, b = sinkhorn_biases(F.normalize(q, dim=-1), F.normalize(vbar.detach(), dim=-1), gamma, n_iters)
    return s + b.to(s)[None, :]
