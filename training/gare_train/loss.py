"""The four GARE losses (SPEC §3), each a pure function; `gare_loss` returns their named terms and total.

Shapes: s (a, b) pair scores (cosines) for a texts and b videos of one global batch, Δ (a, b, d).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gare.config import LossConfig


def info_nce(s: torch.Tensor, logit_scale: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE over s * exp(logit_scale): rows are t2v, columns v2t, averaged.

    targets (a,) gives each text's video column; by default text i belongs to video i (a == b). The
    reference takes the diagonal of the log-softmax, which is this cross-entropy.
    """
    logits = s * logit_scale.exp()
    if targets is None:
        if s.shape[0] != s.shape[1]:
            raise ValueError(f"info_nce needs targets for a non-square score matrix {tuple(s.shape)}")
        targets = torch.arange(s.shape[0], device=s.device)
    t2v = F.cross_entropy(logits, targets)
    # v2t: each video's positive is its text (one text per video in a training batch).
    v2t = F.cross_entropy(logits.t()[targets], torch.arange(s.shape[0], device=s.device))
    return (t2v + v2t) / 2


def ib_loss(delta: torch.Tensor) -> torch.Tensor:
    """Relaxed video-conditioned VIB: for each video j, μ_j = mean_i Δ_ij, σ_j = std_i Δ_ij + 1e-6 (unbiased std
    as torch computes it); KL(N(μ_j, diag σ_j²) || N(0, I)) summed over d, averaged over j."""
    mu = delta.mean(dim=0)  # (b, d)
    sigma = delta.std(dim=0) + 1e-6
    kl = 0.5 * (sigma.pow(2) + mu.pow(2) - 1.0) - sigma.log()  # per dimension
    return kl.sum(dim=-1).mean()


def dir_loss(delta: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    """Directional diversity: for each text, log(mean_{j,k} exp(-α (1 - cos(Δ_ij, Δ_ik))) + 1e-8), averaged."""
    z = F.normalize(delta, dim=-1)  # (a, b, d)
    sim = z @ z.transpose(1, 2)  # (a, b, b)
    return torch.log(torch.exp(-alpha * (1 - sim)).mean(dim=(1, 2)) + 1e-8).mean()


def eps_loss(delta: torch.Tensor, lambda_lower: float = 0.5) -> torch.Tensor:
    """Trust-region radii: -mean_i var_j ||Δ_ij|| (unbiased var), counted only while >= -λ_lower, else 0."""
    r = delta.norm(dim=-1)  # (a, b)
    loss = -r.var(dim=1).mean()
    return loss if loss >= -lambda_lower else loss * 0.0  # keep the graph (and device) but no gradient


def gare_loss(
    s: torch.Tensor,
    delta: torch.Tensor,
    logit_scale: torch.Tensor,
    cfg: LossConfig,
    targets: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """L = L_info + β L_IB + λ_ε L_ε + λ_dir L_dir; returns every term and `total`."""
    terms = {
        "info": info_nce(s, logit_scale, targets),
        "ib": ib_loss(delta),
        "dir": dir_loss(delta, cfg.alpha),
        "eps": eps_loss(delta, cfg.lambda_lower),
    }
    terms["total"] = terms["info"] + cfg.beta * terms["ib"] + cfg.lambda_eps * terms["eps"] + cfg.lambda_dir * terms["dir"]
    return terms
