"""Multi-rank training helpers: the all-gather whose backward keeps the local gradient, and gradient averaging.

Used by :mod:`gare_train.fit` under torchrun (gloo on CPU, nccl on GPU); with one rank they are no-ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GatherWithLocalGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own slice (the reference AllGather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def gather(x: torch.Tensor) -> torch.Tensor:
    """x from every rank, concatenated in rank order (x itself with one rank); gradients reach the local slice."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    if x.requires_grad:
        return GatherWithLocalGrad.apply(x)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average the gradients of `params` over the ranks in one all_reduce (a missing gradient counts as zero)."""
    world = dist.get_world_size()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[off:off + n].view_as(p).clone()
        off += n
