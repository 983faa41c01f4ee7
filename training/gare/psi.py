"""The psi module (SPEC §2): a pair-specific increment Δ_ij from the semantic gap v̄_j - t_i, and the pair score.

Shapes: a texts, b videos, f frames, d embedding width.

psi works per pair, but its key/value projections depend only on the video, so `video_kv` computes them
once per video (b, f, d) and the pair stage costs O(a·b·(f+d)·d) instead of O(a·b·f·d²). Padded frames are
masked out of psi's attention and v̄ (the reference attends over them and averages them in; the two agree
when no frame is padded). `reference_padding=True` computes what the reference does, for imported checkpoints.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Psi(nn.Module):
    def __init__(self, dim: int, heads: int = 1, dropout: float = 0.3) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.dim, self.heads = dim, heads
        self.ln1 = nn.LayerNorm(dim)  # shared by the query (gap) and the context (frames)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ffn = nn.Linear(dim, dim)  # W1: no 4x expansion
        self.ln3 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.mu = nn.Linear(dim, dim)
        # Unused by every loss; kept so checkpoints from the reference code convert without loss.
        self.log_sigma = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def video_kv(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """frames F (b, f, d) -> K, V (b, f, d): the per-video part of psi (cacheable at index time)."""
        c = self.ln1(frames)
        return self.k(c), self.v(c)

    def delta(
        self,
        t: torch.Tensor,
        vbar: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """t (a, d), vbar (b, d), keys/values (b, f, d), mask (b, f) -> Δ (a, b, d)."""
        a, b, f, d, h = t.shape[0], vbar.shape[0], keys.shape[1], self.dim, self.heads
        hd = d // h
        q = self.q(self.ln1(vbar.unsqueeze(0) - t.unsqueeze(1)))  # (a, b, d): the semantic gap, projected
        qh = q.view(a, b, h, hd)
        kh = keys.view(b, f, h, hd)
        logits = torch.einsum("abhe,bfhe->abhf", qh, kh) / math.sqrt(hd)  # (a, b, h, f)
        if mask is not None:
            logits = logits.masked_fill(~mask.bool()[None, :, None, :], float("-inf"))
        w = logits.softmax(dim=-1)
        attn = torch.einsum("abhf,bfhe->abhe", w, values.view(b, f, h, hd)).reshape(a, b, d)
        x = self.ln2(self.o(attn))
        x = self.ln3(x + self.drop(self.ffn(x)))
        return self.mu(x)


def pool_frames(t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor | None, temp: float) -> torch.Tensor:
    """Text-conditioned pooling: t (a, d), F (b, f, d), mask (b, f) -> p (a, b, d).

    The reference multiplies the softmax by the mask without renormalising; that only rescales p_ij, and the
    score is a cosine, so renormalising over the real frames gives the same s_ij and keeps p well scaled.
    """
    logits = torch.einsum("ad,bfd->abf", t, frames) / temp
    if mask is not None:
        logits = logits.masked_fill(~mask.bool()[None], float("-inf"))
    return torch.einsum("abf,bfd->abd", logits.softmax(dim=-1), frames)


def masked_mean(frames: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """F (b, f, d), mask (b, f) -> v̄ (b, d), the mean over real frames."""
    if mask is None:
        return frames.mean(dim=1)
    m = mask.to(frames.dtype).unsqueeze(-1)
    return (frames * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def pair_scores(
    psi: Psi,
    t: torch.Tensor,
    frames: torch.Tensor,
    mask: torch.Tensor | None,
    temp: float,
    *,
    vbar: torch.Tensor | None = None,
    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_delta: bool = False,
    reference_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block: s (a, b) = cos(t_i + Δ_ij, p_ij), and Δ (a, b, d) when asked.

    `reference_padding`: the authors' semantics (v̄ over all rows, psi attends over all rows); `frames` must
    then hold the padded rows' encoder features, not zeros. The pooling masks padded rows either way (the
    reference multiplies its softmax by the mask; the cosine does not see the renormalisation).
    """
    if vbar is None:
        vbar = frames.mean(dim=1) if reference_padding else masked_mean(frames, mask)
    keys, values = kv if kv is not None else psi.video_kv(frames)
    delta = psi.delta(t, vbar, keys, values, None if reference_padding else mask)
    p = pool_frames(t, frames, mask, temp)
    s = F.cosine_similarity(t.unsqueeze(1) + delta, p, dim=-1, eps=1e-8)
    return s, (delta if return_delta else None)
