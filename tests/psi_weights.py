"""The one psi test-weight setup: psi starts at N(0, 0.02), so Δ would be ~0 and every psi test would pass
trivially; tests give it real weights with :func:`randomize_psi`."""

from __future__ import annotations

import torch


def randomize_psi(psi: torch.nn.Module, *, wstd: float = 0.3, ln_std: float = 0.2, other_std: float = 0.1,
                  generator: torch.Generator | None = None) -> torch.nn.Module:
    """In place: matrices ~ N(0, wstd), LayerNorm gamma ~ N(1, ln_std) and beta ~ N(0, ln_std), every other
    parameter (biases, gates) ~ N(0, other_std). Draws in parameter order from `generator` (default: torch's
    global generator, so `torch.manual_seed` makes it reproducible). Returns psi."""
    with torch.no_grad():
        for name, p in psi.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            if name.startswith("ln"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + ln_std * noise)
            elif p.ndim == 2:
                p.copy_(wstd * noise)
            else:
                p.copy_(other_std * noise)
    return psi
