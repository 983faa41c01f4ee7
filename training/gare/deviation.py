"""SPEC §4's deviation figure as the authors' rebuttal defines it: the effect of Δ alone.

|cos(t_i + Δ_ij, v̄_j) − cos(t_i, v̄_j)| over (text, video) pairs, with the same video vector v̄ on both sides
(the text-conditioned pooling is not part of it). `gare-train eval` reports it over the test pairs and
`gare-index build` over a sample of its stage-1 queries and videos (manifest ``stage1.deviation``).
Light: the model's own scoring only, no training loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# The authors' figure (rebuttal, MSR-VTT 1k test, CLIP ViT-B/32): mean 0.084, 95th percentile below 0.17.
REBUTTAL_DELTA = {"mean": 0.084, "p95_below": 0.17, "text": "MSR-VTT 1k: mean 0.084, 95th percentile < 0.17"}


@torch.no_grad()
def delta_deviation(
    model: Any, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor, vbar: torch.Tensor, *, block: int = 128
) -> torch.Tensor:
    """|cos(t_i + Δ_ij, v̄_j) - cos(t_i, v̄_j)| (a, b) on the CPU: Δ's effect with the video vector fixed.

    t (a, d) un-normalised texts, frames (b, f, d), mask (b, f), vbar (b, d). Δ is computed one block of videos
    at a time (a x block x d), never for the whole gallery.
    """
    dev = t.device
    out = torch.empty(t.shape[0], vbar.shape[0])
    for j0 in range(0, vbar.shape[0], block):
        j1 = min(j0 + block, vbar.shape[0])
        vb = vbar[j0:j1].to(dev)
        _, delta = model.score(t, frames[j0:j1].to(dev), mask[j0:j1].to(dev), vbar=vb,
                               block_texts=block, block_videos=block, return_delta=True)
        with_delta = F.cosine_similarity(t[:, None] + delta, vb[None], dim=-1)
        without = F.normalize(t, dim=-1) @ F.normalize(vb, dim=-1).T
        out[:, j0:j1] = (with_delta - without).abs().cpu()
    return out


def deviation_summary(dev_abs: torch.Tensor) -> dict[str, Any]:
    """Mean and 95th percentile of the per-pair figures, next to the authors'."""
    x = dev_abs.flatten().double().numpy()  # numpy: torch.quantile refuses inputs above 16M elements
    return {"delta_mean_abs": float(x.mean()), "delta_p95_abs": float(np.percentile(x, 95)), "pairs": int(x.size),
            "authors": REBUTTAL_DELTA["text"]}
