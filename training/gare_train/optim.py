"""The trainer's optimizers and schedules: AdamW or the authors' BertAdam, their warmup_cosine or the project's.

BertAdam and the authors' warmup_cosine are here for exact reproduction; :func:`build_optimizer` and
:func:`build_scheduler` choose between them and AdamW with the project's warm-up cosine (:func:`warmup_cosine`).

The reference training (musicman217/GARE-text-video-retrieval, ``tvr/models/optimization.py`` with
``main_retrieval.py``'s ``prep_optimizer``; the pytorch-pretrained-bert optimizer that CLIP4Clip uses too)
does not use AdamW. `gare-train fit --optimizer bertadam` trains with this module instead of
``torch.optim.AdamW`` and the project's own warm-up cosine; the default stays AdamW.

BertAdam, for every parameter tensor p with a gradient g, at every step:

    g <- g * min(1, max_grad_norm / (||g||_2 + 1e-6))      per tensor (torch's clip_grad_norm_ on this tensor alone);
                                                            skipped when max_grad_norm <= 0
    m <- b1 * m + (1 - b1) * g                              m, v start at 0
    v <- b2 * v + (1 - b2) * g * g
    u <- m / (sqrt(v) + eps)                                no bias correction (Adam divides m, v by 1 - b^t)
    u <- u + weight_decay * p                               decoupled decay, scaled by the scheduled lr below
    p <- p - lr_t * u

The gradient used for the moments is the clipped one; ``p.grad`` itself is left as it was. The reference
training loop also clips the global gradient norm to 1.0 before ``step`` (the trainer does that with
``grad_clip``); after that clip no tensor's norm can exceed 1.0, so with the same threshold the per-tensor
clip only acts when called on its own (as in the tests).

Their schedule, ``warmup_cosine(x, warmup)`` with x = k / t_total, k the number of steps already taken
(0 on the first step) and warmup a proportion of t_total:

    s(x) = x / warmup                   if x < warmup
    s(x) = 0.5 * (1 + cos(pi * x))      otherwise

so the first step runs at lr 0, and the cosine is of the whole progress x, not of the progress after the
warm-up: when the warm-up ends the factor drops from just under 1 to 0.5 * (1 + cos(pi * warmup)) (0.976 for
0.1). Nothing clamps x (it never exceeds (T - 1) / T when t_total is the run's length).

Here the schedule is a ``LambdaLR`` factor (`bert_warmup_cosine_lambda`), and BertAdam steps at its groups'
current ``lr``: ``LambdaLR`` gives step k the factor of k, which is the reference's ``state['step']`` /
t_total. Two differences from the reference, both outside this module's formulas: it counts steps per tensor
(a tensor without a gradient on some step falls behind; here every step of the run advances every group) and
its ``t_total`` is the number of steps in 5 epochs whatever ``--epochs`` is (`main_retrieval.py`:
``_max_steps = len(train_dataloader) * 5``); the trainer uses the run's own length, the same number for the
reference recipe's 5 epochs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from gare.model import GARE

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
CLIP_EPS = 1e-6


def bert_warmup_cosine(x: float, warmup: float) -> float:
    """The reference's warmup_cosine: x / warmup during the warm-up, then 0.5 * (1 + cos(pi * x)); x is the
    progress k / t_total through the whole run."""
    if x < warmup:
        return x / warmup
    return 0.5 * (1.0 + math.cos(math.pi * x))


def bert_warmup_cosine_lambda(total_steps: int, warmup_proportion: float) -> Callable[[int], float]:
    """A LambdaLR factor: step k (0-based) gets bert_warmup_cosine(k / total_steps, warmup_proportion)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= warmup_proportion < 1.0:
        raise ValueError(f"warmup_proportion must be in [0, 1) for the reference schedule, got {warmup_proportion}")

    def factor(step: int) -> float:
        return bert_warmup_cosine(step / total_steps, warmup_proportion)

    return factor


class BertAdam(torch.optim.Optimizer):
    """Adam without bias correction, decoupled weight decay added to the update, and each parameter tensor's
    gradient clipped to ``max_grad_norm`` before the moments (see the module docstring for the formulas).

    The learning rate is used as it stands in each group (drive it with a scheduler such as
    ``LambdaLR(opt, bert_warmup_cosine_lambda(...))``). Defaults are the reference class's (b2 0.999, decay
    0.01); the reference training passes betas (0.9, 0.98), eps 1e-6 and per-group decay 0.2 / 0.
    State per tensor: ``step`` (updates applied), ``exp_avg`` (m), ``exp_avg_sq`` (v).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, max_grad_norm: float = 1.0) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "max_grad_norm": max_grad_norm}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd, max_norm = group["lr"], group["eps"], group["weight_decay"], group["max_grad_norm"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("BertAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if max_norm > 0:
                    # as torch.nn.utils.clip_grad_norm_(p, max_norm), on a copy (p.grad stays as it was)
                    g = g * torch.clamp(max_norm / (torch.linalg.vector_norm(g) + CLIP_EPS), max=1.0)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                update = m / (v.sqrt() + eps)
                if wd > 0.0:
                    update.add_(p, alpha=wd)
                p.add_(update, alpha=-lr)
                state["step"] += 1
        return loss


class OptimOptions(Protocol):
    """The training options the optimizer and the schedule read (gare_train.fit.TrainConfig has them)."""

    lr: float
    coef_lr: float
    weight_decay: float
    optimizer: str
    grad_clip: float
    warmup_proportion: float


def build_optimizer(model: GARE, cfg: OptimOptions) -> torch.optim.Optimizer:
    """AdamW, or BertAdam with cfg.optimizer "bertadam" (β .9/.98, eps 1e-6, each tensor's gradient clipped to
    grad_clip); decay 0.2 except biases and norms (1-D); CLIP at lr * coef_lr."""
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for group, named in model.param_groups().items():
        for _, p in named:
            if p.requires_grad:
                groups.setdefault((group, p.ndim >= 2), []).append(p)
    param_groups = []
    for (group, decay), params in sorted(groups.items()):
        param_groups.append({
            "params": params,
            "lr": cfg.lr * (cfg.coef_lr if group == "clip" else 1.0),
            "weight_decay": cfg.weight_decay if decay else 0.0,
            "name": f"{group}-{'decay' if decay else 'no_decay'}",
        })
    if cfg.optimizer == "bertadam":
        return BertAdam(param_groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6, max_grad_norm=cfg.grad_clip)
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.98), eps=1e-6)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimOptions, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The project's warm-up cosine for AdamW; the reference's warmup_cosine (this module) for BertAdam."""
    if cfg.optimizer == "bertadam":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, bert_warmup_cosine_lambda(total_steps, cfg.warmup_proportion))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, cfg.warmup_proportion))


def warmup_cosine(total_steps: int, warmup_proportion: float):
    warm = max(1, int(total_steps * warmup_proportion))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f
